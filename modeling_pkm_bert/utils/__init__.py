"""Small helpers every other subpackage shares, at the bottom of the import graph (only the shipped files lie below):
`lazy_imports` (the one lazy-import helper of every package's `__init__`, standard library only) and `memories`
(finding a model's product key memories: `memory_modules`, `is_product_key_memory`)."""

from .lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".lazy_imports": ("lazy_exports", "moved_names"),
        ".memories": ("is_product_key_memory", "memory_modules", "readable_name", "unwrap_model"),
    },
)
