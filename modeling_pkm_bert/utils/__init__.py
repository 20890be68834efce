"""Small helpers every other subpackage shares, at the bottom of the import graph (only the shipped files lie below):
`lazy_imports` (the one lazy-import helper of every package's `__init__`, standard library only), `memories`
(finding a model's product key memories: `memory_modules`, `is_product_key_memory`), `input_errors` (input a command
cannot use, and its usage-error form in every script), `output_folders` (which folders a command may write) and
`positions` (how many tokens a model's sequences may hold)."""

from .lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".input_errors": ("InputError", "exits_with_usage_errors", "one_line", "usage_errors"),
        ".lazy_imports": ("lazy_exports",),
        ".memories": ("is_product_key_memory", "memory_modules", "readable_name", "unwrap_model"),
        ".output_folders": (
            "COMMAND_PATHS",
            "CommandPaths",
            "OVERWRITE_FLAG",
            "OutputFolderError",
            "check_command_paths",
            "check_output_folder",
            "command_paths_problem",
            "mark_output_folder",
            "model_folder",
            "output_folder_problem",
            "output_marker",
        ),
        ".positions": ("ROBERTA_FAMILY_MODEL_TYPES", "fitting_length", "sequence_length", "usable_positions"),
    },
)
