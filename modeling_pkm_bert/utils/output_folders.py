"""The output-folder contract of every command that writes a folder (the scripts, the memory report and explorer, the
conversion, the benchmarks): it writes into a new or empty folder, or into a folder it wrote itself before (it marks
its output with a file `.<tool>`, e.g. `.memory_explorer`), or, given `--overwrite_output_dir`, into any other folder;
never, not even with the flag, into a folder it reads (the model folder; a folder containing it), the current directory
or a folder containing it, the home folder or a folder containing it, or `/`; and a file is never taken for a folder.
Across the flags of one command (`COMMAND_PATHS`, one declaration per command): no path it writes is, contains or lies
inside a path it reads or another path it writes (`check_command_paths`), whatever its flags.
Standard library only: the scripts check their folders while parsing their flags, before any work."""

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .input_errors import InputError


OVERWRITE_FLAG = "--overwrite_output_dir"


class OutputFolderError(InputError):
    """A folder a command may not write (`output_folder_problem` says why)."""


def output_marker(tool: str) -> str:
    """The name of the file that marks a folder as `tool`'s output (`.memory_report`, `.run_mlm`, ...)."""
    return f".{tool}"


def mark_output_folder(folder: str | os.PathLike, tool: str) -> None:
    """Writes `tool`'s marker into `folder` (hidden: never uploaded to the Hub, see `hub.upload.PUSH_IGNORE_PATTERNS`)."""
    text = f"written by {tool}: its next run may replace this folder without {OVERWRITE_FLAG}\n"
    (Path(folder) / output_marker(tool)).write_text(text, encoding="utf-8")


def model_folder(model) -> str | None:
    """The folder (or Hub id) `model` was loaded from (`from_pretrained` records it in its config), or None."""
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def _contains(folder: Path, path: Path) -> bool:
    return folder == path or folder in path.parents


def output_folder_problem(
    output_dir: str | os.PathLike,
    tool: str,
    *,
    overwrite: bool = False,
    reads: Mapping[str, str | os.PathLike | None] | Iterable[tuple[str, str | os.PathLike | None]] = (),
    option: str = "--output_dir",
    overwrite_option: str = OVERWRITE_FLAG,
) -> str | None:
    """Why `tool` may not write `output_dir` (one line naming the folder and the flag), or None. Creates nothing.

    Args:
        tool: The command's name, as in its marker (`memory_explorer`).
        overwrite: The command was given `--overwrite_output_dir`: a non-empty folder it did not write is allowed.
        reads: What the command reads, `{option: path}` or `(option, path)` pairs (`{"--model_name_or_path":
            "out/resm"}`): `output_dir` may neither be nor contain one of them. A Hub id that is no local path, or
            None, never matches.
        option, overwrite_option: The names in the message (a library function names its arguments).
    """
    given = f"{option} {str(output_dir)!r}"
    never = f"never written, not even with {overwrite_option}: give another folder"
    path = Path(os.path.realpath(output_dir))
    if os.path.lexists(output_dir) and not path.is_dir():
        return f"{given} is a file, not a folder: {never}"
    under = next((p for p in Path(os.path.abspath(output_dir)).parents if os.path.lexists(p) and not p.is_dir()), None)
    if under is not None:  # makedirs would fail with FileExistsError, after the command's work
        return f"{given} lies under {str(under)!r}, which is a file, not a folder: {never}"
    if path == Path(path.anchor):
        return f"{given} is the root of the file system: {never}"
    home = Path(os.path.realpath(Path.home()))
    if _contains(path, home):
        return f"{given} {'is the home folder' if path == home else f'contains the home folder {home}'}: {never}"
    cwd = Path(os.path.realpath(os.getcwd()))
    if _contains(path, cwd):
        return f"{given} {'is' if path == cwd else 'contains'} the current directory: {never}"
    for read_option, read in reads.items() if isinstance(reads, Mapping) else reads:
        if read is not None and os.path.exists(read) and _contains(path, Path(os.path.realpath(read))):
            what = "is" if path == Path(os.path.realpath(read)) else "contains"
            return f"{given} {what} {read_option} {str(read)!r}, which {tool} reads: {never}"
    if not path.is_dir() or overwrite or (path / output_marker(tool)).is_file() or not any(path.iterdir()):
        return None
    return (
        f"{given} is not empty and {tool} did not write it (no {output_marker(tool)} file in it): give {overwrite_option}"
        " to overwrite it, or another folder"
    )


def check_output_folder(output_dir: str | os.PathLike, tool: str, **kwargs) -> None:
    """`output_folder_problem`, raised as OutputFolderError."""
    problem = output_folder_problem(output_dir, tool, **kwargs)
    if problem is not None:
        raise OutputFolderError(problem)


# ---- what each command reads and writes ----


@dataclass(frozen=True)
class CommandPaths:
    """How a command uses the flags that name paths (its parser's destinations, or attributes its `parse_args` derives
    from them): `reads` (files or folders; a Hub id that is no local path never matches), `writes` (folders or files),
    `not_paths` (text flags that name no local path: ids, names, numbers as text). `inside`: (inner, outer) pairs where
    the inner path lies strictly inside the outer one by design (never equal to it), each with its reason in
    `COMMAND_PATHS`. `labels` name the derived attributes in messages."""

    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    not_paths: tuple[str, ...] = ()
    inside: tuple[tuple[str, str], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


# the flags the four training scripts share (run_mlm, run_clm, run_glue, run_squad; each has a subset)
_TRAINING = CommandPaths(
    reads=("dataset_name", "train_file", "validation_file", "validation_files", "validation_mismatched_file",
           "model_name_or_path", "config_name", "tokenizer_name", "resume_from_checkpoint", "smf_background_file",
           "smf_background_dataset"),  # fmt: skip
    writes=("output_dir",),
    not_paths=("dataset_config_name", "text_column_name", "model_type", "task_name", "checkpointing_steps", "report_to",
               "hub_model_id", "hub_token", "config_overrides", "pkm_code_version", "pkm_values_quantization", "license",
               "span_column"),  # fmt: skip
    # a resume from the run's own step_<N> / epoch_<E> folder
    inside=(("resume_from_checkpoint", "output_dir"),),
)

COMMAND_PATHS: dict[str, CommandPaths] = {
    "run_mlm": _TRAINING,
    "run_clm": _TRAINING,
    "run_glue": _TRAINING,
    "run_squad": _TRAINING,
    "convert_to_pkm": CommandPaths(
        reads=("model_name_or_path",),
        writes=("output_dir",),
        not_paths=("max_shard_size", "hub_model_id", "hub_token", "base_model", "license", "pkm_code_version",
                   "pkm_values_quantization"),  # fmt: skip
    ),
    "memory_explorer": CommandPaths(
        reads=("model_name_or_path", "text_file", "dataset_name"),
        writes=("output_dir",),
        not_paths=("dataset_config_name", "dataset_split", "text_column"),
    ),
    "memory_report": CommandPaths(
        reads=("model_name_or_path", "validation_file", "train_file", "run_dir"),
        writes=("output_dir",),
        not_paths=("task_name",),
        # the report beside the training run it reads (it reads the run's metrics files, not its own folder)
        inside=(("output_dir", "run_dir"),),
    ),
    # --refresh_code rewrites the code files of --model_dir in place: that is its purpose, not an output folder
    "push_to_hub": CommandPaths(
        reads=("model_dir",),
        writes=("quantized_dir",),
        not_paths=("hub_model_id", "hub_token", "commit_message", "base_model", "license"),
    ),
    "seed_sweep": CommandPaths(writes=("output_dir",), not_paths=("metrics",)),
    "demo": CommandPaths(reads=("model_name_or_path", "base_model"), writes=("output_dir",)),
    "reproduce_paper": CommandPaths(
        reads=("data_dir", "model"),
        writes=("work_dir", "stage0_dir", "mlm_dir", "glue_dir", "report", "figures_dir"),
        not_paths=("note",),
        # each stage's runs are a folder of --work_dir; the figures may be one too (the report stage replaces only
        # them, and never one of the stages' folders: those pairs are checked)
        inside=(("stage0_dir", "work_dir"), ("mlm_dir", "work_dir"), ("glue_dir", "work_dir"),
                ("figures_dir", "work_dir")),  # fmt: skip
        labels={"stage0_dir": "--work_dir's stage-0 runs", "mlm_dir": "--work_dir's MLM runs",
                "glue_dir": "--work_dir's GLUE runs"},  # fmt: skip
    ),
    "knowledge_capacity": CommandPaths(
        reads=("measure", "kb"),
        writes=("output_dir", "results", "report", "save_models", "write_kb"),
        not_paths=("minilm_set",),
        # --quick keeps its results and report in --output_dir; --measure (a worker of this benchmark) reads one of
        # its run folders and its knowledge base there, and writes nothing
        inside=(("results", "output_dir"), ("report", "output_dir"), ("measure", "output_dir"), ("kb", "output_dir")),
    ),
    "knowledge_editing": CommandPaths(
        reads=("measure", "data", "train_lora"),
        writes=("output_dir", "results", "report"),
        not_paths=("set", "lora_args"),
        # as knowledge_capacity; --train_lora (a worker) trains a run folder of this benchmark's --output_dir
        inside=(("results", "output_dir"), ("report", "output_dir"), ("measure", "output_dir"), ("data", "output_dir"),
                ("train_lora", "output_dir")),  # fmt: skip
    ),
    "continual_learning": CommandPaths(
        reads=("report_from",),
        writes=("output_dir",),
        not_paths=("methods", "tag"),
        # the json files of earlier runs are kept beside the report they are merged into
        inside=(("report_from", "output_dir"),),
    ),
    "ngram_memory": CommandPaths(
        reads=("model_name_or_path",),
        writes=("output_dir", "report", "results"),
        inside=(("results", "output_dir"),),  # --tiny keeps its results in --output_dir
    ),
    "memory_plus": CommandPaths(reads=("model_name_or_path",), writes=("output_dir", "report")),
    "trime_lm": CommandPaths(writes=("work_dir", "output")),
    "memory_parallel": CommandPaths(reads=("from_json",), writes=("output",)),
    "quantized_accuracy": CommandPaths(
        reads=("mlm_model", "glue_model", "eval_file", "sst2_dev"), writes=("output",), not_paths=("command",)
    ),
    "run_benchmarks": CommandPaths(writes=("output",), not_paths=("device", "worker", "impl", "kinds")),
    # its table goes beside the code it measures (benchmarks/BEFORE_AFTER.md of the --after checkout)
    "before_after": CommandPaths(reads=("before", "after"), writes=("output",), inside=(("output", "after"),)),
    "gpu_mixed_precision": CommandPaths(writes=("output_dir",)),
    "gpu_layer_compile": CommandPaths(not_paths=("device", "dtypes", "modes")),
    "gpu_train_step": CommandPaths(not_paths=("device", "precisions")),
    "input_checks_cost": CommandPaths(),
}


def _given(args, names: Iterable[str]) -> list[tuple[str, str, Path]]:
    """(name, value as given, real path) of each path `args` holds under `names` (a list flag gives each item)."""
    found = []
    for name in names:
        value = getattr(args, name, None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and str(item) != "":
                found.append((name, str(item), Path(os.path.realpath(item))))
    return found


def _relation(path: Path, other: Path) -> str | None:
    if path == other:
        return "is"
    if path in other.parents:
        return "contains"
    return "is inside" if other in path.parents else None


def command_paths_problem(command: str, args) -> str | None:
    """Why `command` may not run with the paths of its parsed `args` (one line naming both flags), or None: a path it
    writes that is, contains or lies inside a path it reads (one that exists) or another path it writes, symlinks
    resolved, unless `COMMAND_PATHS[command].inside` allows that nesting. Creates nothing; reads no file."""
    declared = COMMAND_PATHS[command]

    def label(name: str) -> str:
        return declared.labels.get(name, f"--{name}")

    def allowed(relation: str, name: str, other: str) -> bool:
        return (relation == "is inside" and (name, other) in declared.inside) or (
            relation == "contains" and (other, name) in declared.inside
        )

    never = f"never written, not even with {OVERWRITE_FLAG}" if hasattr(args, "overwrite_output_dir") else "never written"
    writes = _given(args, declared.writes)
    reads = [(name, value, path) for name, value, path in _given(args, declared.reads) if os.path.lexists(value)]
    for index, (name, value, path) in enumerate(writes):
        for other, other_value, other_path in writes[index + 1 :]:
            relation = _relation(path, other_path)
            if relation and not allowed(relation, name, other):
                return (
                    f"{label(name)} {value!r} {relation} {label(other)} {other_value!r}, which {command} also writes: "
                    "give each its own path"
                )
        for other, other_value, other_path in reads:
            relation = _relation(path, other_path)
            if relation and not allowed(relation, name, other):
                return (
                    f"{label(name)} {value!r} {relation} {label(other)} {other_value!r}, which {command} reads: {never}: "
                    "give another path"
                )
    return None


def check_command_paths(parser: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> None:
    """`command_paths_problem` as `parser.error` (exit 2, one line), before any work."""
    problem = command_paths_problem(command, args)
    if problem is not None:
        parser.error(problem)


__all__ = [
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
]
