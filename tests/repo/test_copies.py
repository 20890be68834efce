"""`# Copied from` markers are checked claims, in the spirit of transformers' `utils/check_copies.py` (our own code):
each block marked `# Copied from transformers.<module>.<Name> [with A->B, C->D]` in a shipped file equals its source in
the installed transformers (pinned in constraints.txt), and each block marked `# Copied from
modeling_pkm_bert.<module>.<Name> [with ...]` equals that block of our own file, after the marker's replacements
(`re.sub(A, B)` in order, as check_copies does). Both sides are formatted by ruff and the object's own name in the
first line is ignored; comments and docstrings count. A block changed on purpose is marked `# Adapted from`, which
claims nothing."""

import ast
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers
from helpers import REPO_ROOT


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff formats both sides (it is in the dev extras)"
)
PACKAGE = REPO_ROOT / "modeling_pkm_bert"
MARKER = re.compile(r"^\s*#\s*Copied from\s+(?P<source>(?:transformers|modeling_pkm_bert)\.\S+)(?P<rest>.*)$")
REPLACEMENT = re.compile(r"^\s*(\S+)->(\S+)\s*$")


def pinned_transformers() -> str:
    (version,) = re.findall(r"^transformers==(\S+)$", (REPO_ROOT / "constraints.txt").read_text(), re.MULTILINE)
    return version


def marked_blocks(path: Path) -> list[tuple[int, str, list[tuple[str, str]], str]]:
    """(line of the marker, the source's dotted name, its replacements, the marked block's code) of every
    `# Copied from` in `path`. The block is the definition that follows the marker (its decorators included)."""
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
        node = definitions.get(number + 1)
        assert node is not None, f"{path.name}:{number}: a `# Copied from` marker must stand right above a def or class"
        rest = match.group("rest").strip()
        replacements = []
        if rest:
            assert rest.startswith("with "), f"{path.name}:{number}: after the source only `with A->B, ...` may follow"
            for pair in rest[len("with ") :].split(","):
                found = REPLACEMENT.match(pair)
                assert found, f"{path.name}:{number}: {pair.strip()!r} is not a replacement `A->B`"
                replacements.append(found.groups())
        blocks.append((number, match.group("source"), replacements, "".join(lines[number : node.end_lineno])))
    return blocks


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
    raise AssertionError(f"{dotted}: no module of it imports")


def formatted(code: str) -> str:
    """`code` dedented and formatted by ruff (one style for both sides: line breaks and quotes do not count)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--isolated", "--line-length", "119", "-"],
        input=textwrap.dedent(code), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout


def copy_differences(path: Path) -> list[str]:
    """One line per marked block of `path` that differs from its source after the replacements: where, and the first
    differing line of each side."""
    differences = []
    for number, dotted, replacements, block in marked_blocks(path):
        expected = source_of(dotted)
        for old, new in replacements:
            expected = re.sub(old, new, expected)
        ours, theirs = formatted(block).splitlines(), formatted(expected).splitlines()
        name = re.compile(r"^(\s*(?:class|def)\s+)\w+")  # the copy's own name is expected to differ
        if ours and theirs:
            ours[0], theirs[0] = name.sub(r"\1_", ours[0]), name.sub(r"\1_", theirs[0])
        if ours != theirs:
            index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            mine = ours[index].strip() if index < len(ours) else "<end>"
            source = theirs[index].strip() if index < len(theirs) else "<end>"
            differences.append(
                f"{path.name}:{number} `# Copied from {dotted}` differs at its line {index + 1}: ours {mine!r}, the"
                f" source's {source!r} (make it equal, or mark it `# Adapted from` if it was changed on purpose)"
            )
    return differences


MARKED_FILES = sorted(path for path in PACKAGE.rglob("*.py") if "# Copied from" in path.read_text(encoding="utf-8"))
PINNED = pytest.mark.skipif(
    transformers.__version__ != pinned_transformers(),
    reason=f"the markers name the code of transformers=={pinned_transformers()} (constraints.txt)",
)


@PINNED
@pytest.mark.parametrize("path", MARKED_FILES, ids=[path.name for path in MARKED_FILES])
def test_copied_blocks_equal_their_source(path):
    assert copy_differences(path) == []


def test_the_roberta_classes_that_repeat_a_bert_class_are_marked():
    """A RobertaPkm class that is its BertPkm namesake with the model renamed carries the marker that says so (and
    is checked above), so a change to the BERT class shows in the RoBERTa one; today the token classification and
    question answering heads."""
    from modeling_pkm_bert import modeling_bert_pkm, modeling_roberta_pkm

    def repeats(name, cls):
        bert = getattr(modeling_bert_pkm, name.replace("RobertaPkm", "BertPkm"), None)
        if not inspect.isclass(cls) or cls.__module__ != modeling_roberta_pkm.__name__ or not inspect.isclass(bert):
            return False
        renamed = re.sub("BertPkm", "RobertaPkm", re.sub("bert", "roberta", inspect.getsource(bert)))
        return formatted(renamed) == formatted(inspect.getsource(cls))

    repeating = {name for name, cls in vars(modeling_roberta_pkm).items() if repeats(name, cls)}
    marked = {
        re.search(r"(?:class|def)\s+(\w+)", block).group(1)
        for _, dotted, _, block in marked_blocks(PACKAGE / "modeling_roberta_pkm.py")
        if dotted.startswith("modeling_pkm_bert.")
    }
    assert repeating == {"RobertaPkmForTokenClassification", "RobertaPkmForQuestionAnswering"}
    assert repeating <= marked


def planted(tmp_path, name: str, old: str, new: str) -> Path:
    """A copy of the shipped file `name` in `tmp_path` with the first `old` in a marked block made `new`."""
    text = (PACKAGE / name).read_text(encoding="utf-8")
    block = next(block for _, _, _, block in marked_blocks(PACKAGE / name) if old in block)
    path = tmp_path / name
    path.write_text(text.replace(block, block.replace(old, new, 1)), encoding="utf-8")
    return path


@PINNED
def test_a_difference_from_transformers_is_found(tmp_path):
    assert copy_differences(PACKAGE / "modeling_bert_pkm.py") == []
    path = planted(tmp_path, "modeling_bert_pkm.py", "dense(hidden_states)", "dense(2 * hidden_states)")
    found = copy_differences(path)
    assert len(found) == 1 and "2 * hidden_states" in found[0] and "transformers.models.bert" in found[0]
    # a renaming the marker does not state, a comment changed
    assert copy_differences(planted(tmp_path, "modeling_bert_pkm.py", "input_tensor", "residual"))
    assert copy_differences(planted(tmp_path, "modeling_bert_pkm.py", "# to the first token.", "# to the CLS token."))


def test_a_difference_from_our_own_block_is_found(tmp_path):
    found = copy_differences(planted(tmp_path, "modeling_roberta_pkm.py", "/ 2", "/ 3"))
    assert len(found) == 1 and "BertPkmForQuestionAnswering" in found[0] and "/ 3" in found[0]
