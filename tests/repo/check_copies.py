"""Checks, and with `--fix_and_overwrite` restores, the `# Copied from` blocks of the shipped files (dev-only: not in
the package; the standard library, transformers and ruff; a command beside the test that runs it, as
tests/compat/write_folders.py), in the spirit of transformers' `utils/check_copies.py`.

Each block marked `# Copied from transformers.<module>.<Name> [with A->B, C->D]` in a shipped file equals its source
in the installed transformers (pinned in constraints.txt), and each block marked `# Copied from
modeling_pkm_bert.<module>.<Name> [with ...]` equals that block of our own file, after the marker's replacements
(`re.sub(A, B)` in order, as check_copies does). Both sides are formatted by ruff and the object's own name in the
first line is ignored; comments and docstrings count.

A block that differs from its source on purpose records each difference on a line of its own between the marker and
the block, as literal text of the source (after the replacements, formatted by ruff) and ours:

    # Copied from transformers.models.bert.modeling_bert.eager_attention_forward
    # Differs: `attn_weights + attention_mask` -> `attn_weights + _mask_for(query, attention_mask)`
    # Differs: `    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")` -> ``

Each source text is replaced wherever it occurs (`\n` stands for a line break); an empty replacement removes the whole
lines the text covers. A recorded difference whose source text is no longer in the source is reported (the source
changed there: look again). So every block that repeats code is checked, and what differs is written down beside it.

    python tests/repo/check_copies.py                      # names each drifted block, exit status 1 if any
    python tests/repo/check_copies.py --fix_and_overwrite  # rewrites each drifted block with the expected code

The fix keeps the marker line, the block's indentation and its own name, and writes the source after the
replacements as ruff formats it; a file without drift is left byte for byte as it is (`make fix-copies`;
tests/repo/test_copies.py)."""

import argparse
import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "modeling_pkm_bert"
MARKER = re.compile(r"^\s*#\s*Copied from\s+(?P<source>(?:transformers|modeling_pkm_bert)\.\S+)(?P<rest>.*)$")
REPLACEMENT = re.compile(r"^\s*(\S+)->(\S+)\s*$")
# a recorded difference: `source text` -> `our text`, right below the marker (or below another recorded difference)
DIFFERENCE = re.compile(r"^\s*#\s*Differs:\s*`(?P<old>.*?)`\s*->\s*`(?P<new>.*)`\s*$")
# the first line of a definition: its own name is expected to differ from the source's
DEFINITION = re.compile(r"^(\s*(?:async\s+def|class|def)\s+)\w+")


def pinned_transformers() -> str:
    (version,) = re.findall(r"^transformers==(\S+)$", (REPO_ROOT / "constraints.txt").read_text(), re.MULTILINE)
    return version


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def _marked(path: Path) -> list[dict]:
    """Every `# Copied from` of `path`: the marker's line (1-based), the source's dotted name, the replacements, the
    recorded differences, the block's first and last line (the definition after the marker and its `# Differs:`
    lines, decorators included), its name and indentation."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    definitions = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            definitions[first] = node
    blocks = []
    for number, line in enumerate(lines, start=1):
        match = MARKER.match(line)
        if match is None:
            continue
        differences = []
        while number + len(differences) < len(lines):
            found = DIFFERENCE.match(lines[number + len(differences)])
            if found is None:
                break
            differences.append(tuple(found[side].replace("\\n", "\n") for side in ("old", "new")))
        first = number + len(differences)  # the marker's and the recorded differences' lines stay as they are
        node = definitions.get(first + 1)
        if node is None:
            raise ValueError(
                f"{path.name}:{number}: a `# Copied from` marker (and its `# Differs:` lines) must stand right above a"
                " def or class"
            )
        rest = match.group("rest").strip()
        replacements = []
        if rest:
            if not rest.startswith("with "):
                raise ValueError(f"{path.name}:{number}: after the source only `with A->B, ...` may follow")
            for pair in rest[len("with ") :].split(","):
                found = REPLACEMENT.match(pair)
                if not found:
                    raise ValueError(f"{path.name}:{number}: {pair.strip()!r} is not a replacement `A->B`")
                replacements.append(found.groups())
        blocks.append({
            "line": number, "source": match.group("source"), "replacements": replacements,
            "differences": differences, "first": first, "code": "".join(lines[first : node.end_lineno]),
            "end": node.end_lineno, "name": node.name, "indent": " " * node.col_offset,
        })  # fmt: skip
    return blocks


def marked_blocks(path: Path) -> list[tuple[int, str, list[tuple[str, str]], str]]:
    """(line of the marker, the source's dotted name, its replacements, the marked block's code) of every
    `# Copied from` in `path`. The block is the definition that follows the marker (its decorators included)."""
    return [(b["line"], b["source"], b["replacements"], b["code"]) for b in _marked(path)]


def source_of(dotted: str) -> str:
    """The code of `dotted` (module path, then the object's, e.g. `transformers.models.bert.modeling_bert.BertPooler`
    or `modeling_pkm_bert.modeling_bert_pkm.BertPkmForQuestionAnswering`) from the installed module object."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return inspect.getsource(target)
    raise LookupError(f"{dotted}: no module of it imports")


class StaleDifference(ValueError):
    """A recorded difference whose source text is not in the source (any more)."""


def expected_code(dotted: str, replacements: list[tuple[str, str]], differences: list[tuple[str, str]] = ()) -> str:
    """The source of `dotted` after the replacements (`re.sub` in order), then, formatted by ruff, after the recorded
    differences (literal text, every occurrence; an empty replacement removes the whole lines its text covers)."""
    expected = source_of(dotted)
    for old, new in replacements:
        expected = re.sub(old, new, expected)
    if not differences:
        return expected
    expected = formatted(expected)
    for old, new in differences:
        if old not in expected:
            raise StaleDifference(f"the recorded difference `{old}` is not in {dotted} (after the replacements)")
        if new:
            expected = expected.replace(old, new)
        else:
            expected = re.sub(rf"^[ \t]*{re.escape(old)}[ \t]*\n", "", expected, flags=re.MULTILINE)
            if old in expected:  # not whole lines: the text alone
                expected = expected.replace(old, "")
    return expected


def formatted(code: str) -> str:
    """`code` dedented and formatted by ruff (one style for both sides: line breaks and quotes do not count)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--isolated", "--line-length", "119", "-"],
        input=textwrap.dedent(code), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout


def _first_difference(block: str, expected: str) -> tuple[int, str, str] | None:
    """(index, our line, the source's line) of the first line where the formatted block and the formatted expected code
    differ, the definition's own name ignored; None where they are equal."""
    ours, theirs = formatted(block).splitlines(), formatted(expected).splitlines()
    if ours and theirs:
        ours[0], theirs[0] = DEFINITION.sub(r"\1_", ours[0]), DEFINITION.sub(r"\1_", theirs[0])
    if ours == theirs:
        return None
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    mine = ours[index].strip() if index < len(ours) else "<end>"
    source = theirs[index].strip() if index < len(theirs) else "<end>"
    return index, mine, source


def copy_differences(path: Path) -> list[str]:
    """One line per marked block of `path` that differs from its source after the replacements: where, and the first
    differing line of each side."""
    differences = []
    for block in _marked(path):
        try:
            expected = expected_code(block["source"], block["replacements"], block["differences"])
        except StaleDifference as stale:
            differences.append(f"{path.name}:{block['line']} `# Copied from {block['source']}`: {stale}")
            continue
        found = _first_difference(block["code"], expected)
        if found is not None:
            index, mine, source = found
            differences.append(
                f"{path.name}:{block['line']} `# Copied from {block['source']}` differs at its line {index + 1}: ours"
                f" {mine!r}, the source's {source!r} (make it equal, or record the difference below the marker:"
                " `# Differs: `source text` -> `ours``)"
            )
    return differences


def fix_copies(path: Path) -> list[int]:
    """Rewrites each marked block of `path` that differs from its source with the source after the replacements, as
    ruff formats it, at the block's indentation and under the block's own name (the marker line and the recorded
    differences stay, and are applied); returns the markers' lines of the blocks it rewrote. A file without a drifted
    block is not written; a stale recorded difference is an error (StaleDifference: the source changed there)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    fixed = []
    for block in reversed(_marked(path)):  # from the bottom up: the lines above a rewritten block keep their numbers
        expected = expected_code(block["source"], block["replacements"], block["differences"])
        if _first_difference(block["code"], expected) is None:
            continue
        new = formatted(expected).splitlines()
        for index, line in enumerate(new):  # the first definition line (after any decorators) keeps our name
            if DEFINITION.match(line):
                new[index] = DEFINITION.sub(lambda m: m.group(1) + block["name"], line, count=1)
                break
        lines[block["first"] : block["end"]] = [block["indent"] + line + "\n" if line else "\n" for line in new]
        fixed.append(block["line"])
    if fixed:
        path.write_text("".join(lines), encoding="utf-8")
    return sorted(fixed)


def marked_files(folder: Path = PACKAGE) -> list[Path]:
    """The shipped files with a `# Copied from` marker."""
    return sorted(path for path in folder.glob("*.py") if "# Copied from" in path.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="the files to check (default: the marked shipped files)")
    parser.add_argument("--fix_and_overwrite", action="store_true", help="rewrite each drifted block in place")
    args = parser.parse_args(argv)
    if installed_transformers() != pinned_transformers():
        print(
            f"the markers name the code of transformers=={pinned_transformers()} (constraints.txt), this is"
            f" {installed_transformers()}: install the pinned version first",
            file=sys.stderr,
        )
        return 2
    files = args.files or marked_files()
    if not args.fix_and_overwrite:
        differences = [line for path in files for line in copy_differences(path)]
        print("\n".join(differences) if differences else f"{len(files)} files: every `# Copied from` block matches")
        return 1 if differences else 0
    changed = False
    for path in files:
        try:
            fixed = fix_copies(path)
        except StaleDifference as stale:
            print(f"{path.name}: {stale}: the source changed there; edit the block and its `# Differs:` line by hand")
            return 1
        for line in fixed:
            changed = True
            print(f"{path.name}:{line}: rewritten from its source")
    # a block copied from one of ours that was rewritten above was compared with the module as imported before: check
    # again in a fresh process until nothing changes (each round fixes at least one block, so this ends)
    if changed and int(os.environ.get("PKM_FIX_COPIES_ROUND", "0")) < 5:
        env = {**os.environ, "PKM_FIX_COPIES_ROUND": str(int(os.environ.get("PKM_FIX_COPIES_ROUND", "0")) + 1)}
        return subprocess.run([sys.executable, __file__, "--fix_and_overwrite", *map(str, files)], env=env).returncode
    if not changed:
        print(f"{len(files)} files: nothing to fix")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # `modeling_pkm_bert.<module>` sources: this checkout's, not an installed one
    sys.exit(main())
