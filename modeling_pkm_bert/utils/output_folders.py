"""The output-folder contract of every command that writes a folder (the scripts, the memory report and explorer, the
conversion, the benchmarks): it writes into a new or empty folder, or into a folder it wrote itself before (it marks
its output with a file `.<tool>`, e.g. `.memory_explorer`), or, given `--overwrite_output_dir`, into any other folder;
never, not even with the flag, into a folder it reads (the model folder; a folder containing it), the current directory
or a folder containing it, the home folder or a folder containing it, or `/`; and a file is never taken for a folder.
Standard library only: the scripts check their folder while parsing their flags."""

import os
from collections.abc import Iterable, Mapping
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


__all__ = [
    "OVERWRITE_FLAG",
    "OutputFolderError",
    "check_output_folder",
    "mark_output_folder",
    "model_folder",
    "output_folder_problem",
    "output_marker",
]
