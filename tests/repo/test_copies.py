"""`# Copied from` markers are checked claims, in the spirit of transformers' `utils/check_copies.py`: each block
marked `# Copied from transformers.<module>.<Name> [with A->B, C->D]` in a shipped file equals its source in the
installed transformers (pinned in constraints.txt), and each block marked `# Copied from
modeling_pkm_bert.<module>.<Name> [with ...]` equals that block of our own file, after the marker's replacements. The
mechanism (finding the blocks, the expected code, ruff on both sides) and the fixer are tests/repo/check_copies.py
(`make fix-copies`); these tests check the shipped files with it, and that its fix restores a corrupted block and
leaves a clean file byte for byte as it is."""

import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from helpers import REPO_ROOT, load_script


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff formats both sides (it is in the dev extras)"
)
check_copies = load_script("check_copies", "tests/repo")
PACKAGE = check_copies.PACKAGE
pinned_transformers = check_copies.pinned_transformers
marked_blocks = check_copies.marked_blocks
formatted = check_copies.formatted
copy_differences = check_copies.copy_differences


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


def test_the_task_heads_are_written_once():
    """Every RobertaPkm task head and ModernBertPkm's sequence classification, token classification and question
    answering heads are checked copies of their BertPkm namesakes (checked above), so the heads' common code (return_dict,
    losses, outputs) is written once; ModernBertPkm's masked LM and multiple choice heads are its own (as copies of
    transformers' ModernBERT heads they would need more recorded differences than lines worth checking)."""
    copied_from = {
        block_name: dotted
        for name in ("modeling_roberta_pkm.py", "modeling_modernbert_pkm.py")
        for _, dotted, _, block in marked_blocks(PACKAGE / name)
        for block_name in re.findall(r"^class\s+(\w+For\w+)\(", block, re.MULTILINE)[:1]
    }
    heads = ["ForMaskedLM", "ForCausalLM", "ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification",
             "ForQuestionAnswering"]  # fmt: skip
    bert = "modeling_pkm_bert.modeling_bert_pkm.BertPkm"
    expected = {f"RobertaPkm{head}": bert + head for head in heads}
    expected |= {f"ModernBertPkm{head}": bert + head for head in heads[2:] if head != "ForMultipleChoice"}
    assert copied_from == expected


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


@PINNED
def test_the_fix_restores_corrupted_blocks(tmp_path):
    """`fix_copies` rewrites each drifted block (a changed line, an added line: the lines below move) with its
    source after the replacements, and gets the shipped file back byte for byte; the check then passes."""
    original = (PACKAGE / "modeling_bert_pkm.py").read_text(encoding="utf-8")
    path = planted(tmp_path, "modeling_bert_pkm.py", "dense(hidden_states)", "dense(2 * hidden_states)")
    text = path.read_text(encoding="utf-8")
    block = next(block for _, _, _, block in marked_blocks(path) if "# to the first token." in block)
    path.write_text(text.replace(block, block.replace("# to the first token.", "# to the first token.\n        x = 1")))
    assert len(copy_differences(path)) == 2
    assert len(check_copies.fix_copies(path)) == 2
    assert path.read_text(encoding="utf-8") == original
    assert copy_differences(path) == []


def test_the_fix_restores_a_block_copied_from_ours(tmp_path):
    original = (PACKAGE / "modeling_roberta_pkm.py").read_text(encoding="utf-8")
    path = planted(tmp_path, "modeling_roberta_pkm.py", "/ 2", "/ 3")
    assert [line for line, _, _, block in marked_blocks(path) if "/ 3" in block] == check_copies.fix_copies(path)
    assert path.read_text(encoding="utf-8") == original


@PINNED
def test_the_command_checks_and_fixes_and_a_clean_file_is_left_as_it_is(tmp_path):
    """`python tests/repo/check_copies.py` names a drifted block (exit status 1); `--fix_and_overwrite` rewrites it and
    leaves the clean files untouched (the shipped files, copied: the command never writes a file without drift)."""
    corrupted = planted(tmp_path, "modeling_bert_pkm.py", "dense(hidden_states)", "dense(2 * hidden_states)")
    clean = []
    for name in ("modeling_roberta_pkm.py", "modeling_modernbert_pkm.py"):
        clean.append(tmp_path / name)
        shutil.copy2(PACKAGE / name, clean[-1])
    stamps = [path.stat().st_mtime_ns for path in clean]
    command = [sys.executable, str(REPO_ROOT / "tests" / "repo" / "check_copies.py")]
    done = subprocess.run([*command, str(corrupted)], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 1 and "modeling_bert_pkm.py:" in done.stdout and "2 * hidden_states" in done.stdout
    files = [str(corrupted), *map(str, clean)]
    done = subprocess.run([*command, "--fix_and_overwrite", *files], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "modeling_bert_pkm.py:" in done.stdout and "nothing to fix" in done.stdout
    for path in (corrupted, *clean):
        assert path.read_bytes() == (PACKAGE / path.name).read_bytes()
    assert [path.stat().st_mtime_ns for path in clean] == stamps


def test_the_command_refuses_another_transformers(monkeypatch, capsys):
    """The markers name the pinned release's code: under another transformers the fix would write that release's
    code into the shipped files, so the command stops (exit status 2) and says which version to install."""
    monkeypatch.setattr(check_copies, "installed_transformers", lambda: "0.0.1")
    assert check_copies.main(["--fix_and_overwrite"]) == 2
    assert f"transformers=={pinned_transformers()}" in capsys.readouterr().err


def test_no_block_claims_an_unchecked_origin():
    """Every block that repeats code is a checked `# Copied from` (its differences recorded below the marker): no
    shipped file carries the unchecked `# Adapted from` any more."""
    assert [path.name for path in PACKAGE.glob("*.py") if "# Adapted from" in path.read_text(encoding="utf-8")] == []


@PINNED
def test_recorded_differences_are_checked_and_kept_by_the_fix(tmp_path):
    """A block with `# Differs:` lines equals its source with those differences: a change elsewhere in it is found and
    the fix restores the block with the differences applied (byte for byte); a change of a recorded line is found."""
    name = "modeling_bert_pkm.py"
    original = (PACKAGE / name).read_text(encoding="utf-8")
    assert "# Differs: `attn_weights + attention_mask`" in original
    path = planted(tmp_path, name, "attn_weights = nn.functional.softmax(attn_weights, dim=-1)",
                   "attn_weights = nn.functional.softmax(attn_weights, dim=-2)")  # fmt: skip
    found = copy_differences(path)
    assert len(found) == 1 and "eager_attention_forward" in found[0] and "dim=-2" in found[0]
    assert len(check_copies.fix_copies(path)) == 1
    assert path.read_text(encoding="utf-8") == original
    # the recorded difference itself: ours must say what the line records
    path = planted(tmp_path, name, "_mask_for(query, attention_mask)", "attention_mask")
    assert len(copy_differences(path)) == 1


@PINNED
def test_a_stale_recorded_difference_is_reported(tmp_path):
    """A recorded difference whose source text is no longer in the source (transformers changed the line) is reported,
    and the fix refuses to guess (the command's exit status 1)."""
    name = "modeling_bert_pkm.py"
    text = (PACKAGE / name).read_text(encoding="utf-8")
    stale = "# Differs: `attn_weights + attention_mask` -> "
    assert text.count(stale) == 1
    path = tmp_path / name
    path.write_text(text.replace(stale, "# Differs: `attn_weights * attention_mask` -> "), encoding="utf-8")
    found = copy_differences(path)
    assert len(found) == 1 and "attn_weights * attention_mask" in found[0] and "is not in" in found[0]
    with pytest.raises(check_copies.StaleDifference):
        check_copies.fix_copies(path)
    command = [sys.executable, str(REPO_ROOT / "tests" / "repo" / "check_copies.py"), "--fix_and_overwrite", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 1 and "the source changed there" in done.stdout


@PINNED
def test_make_fix_copies_restores_a_deliberately_broken_copy_of_each_kind(tmp_path):
    """The command `make fix-copies` runs restores, in one run, a broken block copied from transformers, one copied from
    our own code, and one with recorded differences, each file byte for byte."""
    broken = {
        "modeling_bert_pkm.py": ("dense(hidden_states)", "dense(2 * hidden_states)"),
        "modeling_roberta_pkm.py": ("/ 2", "/ 3"),
        "modeling_modernbert_pkm.py": ("scaling=self.head_dim**-0.5", "scaling=self.head_dim**-0.25"),
    }
    paths = [planted(tmp_path, name, old, new) for name, (old, new) in broken.items()]
    assert all(copy_differences(path) for path in paths)
    command = [sys.executable, str(REPO_ROOT / "tests" / "repo" / "check_copies.py"), "--fix_and_overwrite"]
    done = subprocess.run([*command, *map(str, paths)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in paths:
        assert path.read_bytes() == (PACKAGE / path.name).read_bytes(), path.name
