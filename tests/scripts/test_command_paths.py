"""No command loses a path it did not write, in any combination of its flags (issue 60, item 1): every command declares
which of its flags it reads and which it writes (`utils.output_folders.COMMAND_PATHS`), and refuses, before any work
and even with --overwrite_output_dir, a written path that is, contains or lies inside a read path or another written
path (symlinks resolved). The walk below takes each command's flags from its own parser, so a new path flag that is not
declared fails it; the reproductions of the issue run the real commands."""

import argparse
import importlib
import itertools
import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT, load_script, make_tiny_folder, reset_accelerate_state, usage_error
from modeling_pkm_bert import BertPkmForMaskedLM
from modeling_pkm_bert.utils.output_folders import COMMAND_PATHS, command_paths_problem, output_marker


FOLDERS = ("run_scripts", "benchmarks")


def command_name(script: Path) -> str:
    """A command's name in COMMAND_PATHS: its script's, or the entry's that runs it (benchmarks/<study>.py runs
    benchmarks/studies/<study>/runner.py, benchmarks/run_benchmarks.py benchmarks/speed/__main__.py)."""
    if script.name == "runner.py":
        return script.parent.name
    return "run_benchmarks" if script.name == "__main__.py" else script.stem


COMMANDS = sorted(
    (command_name(path), str(path.relative_to(REPO_ROOT)))
    for folder in FOLDERS
    for path in (REPO_ROOT / folder).glob("*.py" if folder == "run_scripts" else "**/*.py")  # the package's modules
    if "ArgumentParser(" in path.read_text(encoding="utf-8")
)
TEXT = (REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_validation.txt").read_text(encoding="utf-8")


class _Parsed(Exception):
    """Raised in place of parsing: carries the command's parser out before any of its work."""


def command_parser(name: str, script: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser of `script` (a file of run_scripts/, or a module of the benchmarks package): its `parse_args` (or
    `main`) runs up to its first `parser.parse_args`."""

    def capture(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    path = Path(script)
    if path.parts[0] == "benchmarks":  # a module of the package (imported: `__main__.py` must not run as a script)
        module = importlib.import_module(".".join(path.with_suffix("").parts))
    else:
        module = load_script(path.stem, path.parent)
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(_Parsed) as parsed:
        entry()
    return parsed.value.args[0]


def path_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The destinations that may hold a path: free text (no choices, no number or flag type)."""
    skipped = (argparse._HelpAction, argparse._StoreConstAction, argparse._CountAction, argparse._VersionAction)
    return {
        action.dest
        for action in parser._actions
        if not isinstance(action, skipped) and action.choices is None and action.type in (None, str, os.fspath)
        or getattr(action.type, "__name__", None) == "Path"
    }


@pytest.mark.parametrize("name,script", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_path_flag_is_declared(name, script, monkeypatch):
    """Each flag that may name a path is read, written or declared no path; each declared flag exists."""
    assert name in COMMAND_PATHS, f"{script} parses flags: declare its paths in COMMAND_PATHS"
    declared = COMMAND_PATHS[name]
    flags = path_flags(command_parser(name, script, monkeypatch))
    undeclared = flags - {*declared.reads, *declared.writes, *declared.not_paths}
    assert not undeclared, f"{name}: declare {sorted(undeclared)} as read, written or not a path"
    dests = {action.dest for action in command_parser(name, script, monkeypatch)._actions}
    shared = name in ("run_mlm", "run_clm", "run_glue", "run_squad")  # one declaration for the four
    unknown = {*declared.reads, *declared.writes, *declared.not_paths} - dests - set(declared.labels)
    assert shared or not unknown, f"{name}: {sorted(unknown)} are no flags of its parser"
    if declared.writes:  # checked while its flags are parsed
        source = (REPO_ROOT / script).read_text(encoding="utf-8")
        assert "check_command_paths(parser, args" in source or (shared and "validate_training_arguments" in source)


def arrangements(tmp_path, kind: str):
    """(written path, other path): the other one exists (a read must, to count), arranged as `kind`."""
    other = tmp_path / "other"
    if kind == "equal":
        return other, other
    if kind == "written inside":
        return other / "sub", other
    if kind == "written contains":
        return tmp_path / "outer", tmp_path / "outer" / "other"
    if kind == "symlink":
        os.symlink(other, tmp_path / "link")
        return tmp_path / "link", other
    if kind == "inside a symlink":
        os.symlink(other, tmp_path / "link")
        return tmp_path / "link" / "sub", other
    raise ValueError(kind)


KINDS = ("equal", "written inside", "written contains", "symlink", "inside a symlink")
PAIRS = [
    (name, written, other, "writes" if other in declared.writes else "reads")
    for name, declared in sorted(COMMAND_PATHS.items())
    for written, other in [
        *itertools.product(declared.writes, declared.reads),
        *itertools.combinations(declared.writes, 2),
    ]
]


def tree(folder):
    return sorted((str(p.relative_to(folder)), os.path.islink(p)) for p in folder.rglob("*"))


@pytest.mark.parametrize("name,written,other,how", PAIRS, ids=[f"{n}:{w}-{o}" for n, w, o, _ in PAIRS])
def test_every_pair_of_paths(name, written, other, how, tmp_path):
    """Equal, nested either way and symlinked: refused in one line naming both flags (but a nesting the declaration
    allows by design), and the check creates and deletes nothing."""
    declared = COMMAND_PATHS[name]
    label = {n: declared.labels.get(n, f"--{n}") for n in (written, other)}
    for kind in KINDS:
        root = tmp_path / kind.replace(" ", "_")
        root.mkdir()
        written_path, other_path = arrangements(root, kind)
        other_path.mkdir(parents=True, exist_ok=True)
        values = {flag: None for flag in (*declared.reads, *declared.writes)}
        values[written], values[other] = str(written_path), str(other_path)
        if other in ("validation_files", "text_file", "report_from"):  # lists of paths
            values[other] = [str(other_path)]
        before = tree(root)
        problem = command_paths_problem(name, argparse.Namespace(**values))
        assert tree(root) == before
        inner_outer = {"written inside": (written, other), "written contains": (other, written)}.get(kind)
        inner_outer = inner_outer or ((written, other) if kind == "inside a symlink" else None)
        if inner_outer in declared.inside:
            assert problem is None, problem
            continue
        assert problem is not None, f"{name}: {written} {kind} {other} was not refused"
        assert "\n" not in problem and problem.startswith((f"{label[written]} ", f"{label[other]} ")), problem
        assert label[written] in problem and label[other] in problem, problem
        assert f"which {name} {'also writes' if how == 'writes' else 'reads'}" in problem, problem


def test_a_hub_id_or_a_missing_read_never_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(model_name_or_path="bert-base-uncased", output_dir="bert-base-uncased/explorer",
                              text_file=None, dataset_name="wikitext")  # fmt: skip
    assert command_paths_problem("memory_explorer", args) is None
    (tmp_path / "wikitext").mkdir()
    args.output_dir = "wikitext"
    assert "--output_dir 'wikitext' is --dataset_name 'wikitext'" in command_paths_problem("memory_explorer", args)


# ---- the reproductions of the issue, with the real commands ----


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny BertPkm folder with weights and a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("models") / "pkm"
    make_tiny_folder(folder, BertPkmForMaskedLM, seed=0)
    return folder


def snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.read_bytes()) for p in folder.rglob("*") if p.is_file())


def test_a_failed_resume_marks_no_foreign_folder(tiny_model, tmp_path, capsys):
    """`run_mlm.py --output_dir <a user's folder> --resume_from_checkpoint latest` fails before writing anything, and
    does not make the plain command (refused) run into the folder afterwards."""
    module = load_script("run_mlm")
    (tmp_path / "train.txt").write_text(TEXT[:4000])
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text('{"the": "user\'s"}')
    (user / "model-00001-of-00002.safetensors").write_bytes(b"the user's weights")
    before = snapshot(user)
    argv = ["--model_name_or_path", str(tiny_model), "--train_file", str(tmp_path / "train.txt"), "--validation_file",
            str(tmp_path / "train.txt"), "--max_seq_length", "32", "--max_train_steps", "1", "--per_device_train_batch_size",
            "2", "--output_dir", str(user)]  # fmt: skip
    try:
        line = usage_error(capsys, lambda: module.main([*argv, "--resume_from_checkpoint", "latest"]))
        assert f"--resume_from_checkpoint latest: no step_<N>/epoch_<E> folder in --output_dir '{user}'" in line
        line = usage_error(capsys, lambda: module.main(argv))
        assert "is not empty and run_mlm did not write it (no .run_mlm file in it)" in line
    finally:
        reset_accelerate_state()
    assert snapshot(user) == before and not (user / output_marker("run_mlm")).exists()
    new = tmp_path / "new"
    usage_error(capsys, lambda: module.parse_args([*argv[:-1], str(new), "--resume_from_checkpoint", "latest"]))
    assert not new.exists()


def test_a_run_that_fails_its_resume_check_marks_nothing(tiny_model, tmp_path, capsys):
    """The marker is written once every check has passed: a resume whose settings differ stops, and a folder holding
    only a checkpoint (from a release that wrote no marker) stays unmarked."""
    module = load_script("run_mlm")
    (tmp_path / "train.txt").write_text(TEXT[:4000])
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model), "--train_file", str(tmp_path / "train.txt"), "--validation_file",
            str(tmp_path / "train.txt"), "--max_seq_length", "32", "--max_train_steps", "1", "--per_device_train_batch_size",
            "2", "--output_dir", str(out), "--checkpointing_steps", "1", "--seed", "1"]  # fmt: skip
    try:
        module.main(argv)
        assert (out / output_marker("run_mlm")).is_file() and (out / "step_1").is_dir()
        for name in os.listdir(out):  # the checkpoint alone, as an older release left it
            if name != "step_1":
                (shutil.rmtree if (out / name).is_dir() else os.remove)(out / name)
        before = snapshot(out)
        resume = ["--resume_from_checkpoint", "latest", "--max_train_steps", "2"]
        line = usage_error(capsys, lambda: module.main([*argv, *resume, "--per_device_train_batch_size", "4"]))
        assert "per_device_train_batch_size" in line  # another batch size: the resume stops
    finally:
        reset_accelerate_state()
    assert not (out / output_marker("run_mlm")).exists()
    assert snapshot(out) == before


def test_explorer_over_its_own_dataset_folder_is_refused(tiny_model, tmp_path, capsys):
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "train.txt").write_text(TEXT[:2000])
    (dataset / "NOTES.md").write_text("where the text comes from")
    before = snapshot(dataset)
    script = load_script("memory_explorer")
    for output in (dataset, dataset / "explorer"):
        line = usage_error(capsys, lambda: script.main(["--model_name_or_path", str(tiny_model), "--dataset_name",
                                                        str(dataset), "--output_dir", str(output),
                                                        "--overwrite_output_dir"]))  # fmt: skip
        assert f"--output_dir '{output}' " in line and f"--dataset_name '{dataset}', which memory_explorer reads" in line
    assert snapshot(dataset) == before


def test_reproduce_paper_refuses_one_folder_for_runs_and_figures(tmp_path, capsys):
    script = load_script("runner", folder=REPO_ROOT / "benchmarks/studies/reproduce_paper")
    data = tmp_path / "data"
    (data / "glue" / "SST-2").mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv"):
        (data / "glue" / "SST-2" / name).write_text("sentence\tlabel\n")
    (data / "wikitext-2-raw").mkdir()
    (data / "wikitext-2-raw" / "wiki.test.raw").write_text("text\n")
    shared = tmp_path / "shared"
    (tmp_path / "model").mkdir()
    base = ["--model", str(tmp_path / "model"), "--data_dir", str(data), "--tasks", "sst2", "--report",
            str(tmp_path / "R.md"), "--quick"]  # fmt: skip
    line = usage_error(capsys, lambda: script.parse_args([*base, "--work_dir", str(shared), "--figures_dir", str(shared)]))
    assert f"--work_dir '{shared}' is --figures_dir '{shared}', which reproduce_paper also writes" in line
    mlm = script.parse_args([*base, "--work_dir", str(shared), "--figures_dir", str(shared / "figures")]).mlm_dir
    line = usage_error(capsys, lambda: script.parse_args([*base, "--work_dir", str(shared), "--figures_dir", str(mlm)]))
    assert f"--work_dir's MLM runs '{mlm}' is --figures_dir '{mlm}', which reproduce_paper also writes" in line
    line = usage_error(capsys, lambda: script.parse_args([*base, "--work_dir", str(tmp_path / "w"), "--report",
                                                          str(data / "R.md")]))  # fmt: skip
    assert f"--report '{data / 'R.md'}' is inside --data_dir '{data}', which reproduce_paper reads" in line
    assert not shared.exists() and not (tmp_path / "w").exists()


def test_a_resume_from_the_runs_own_checkpoint_is_allowed(tiny_model, tmp_path, capsys):
    """The nesting the training scripts declare: `--resume_from_checkpoint out/step_<N>` inside `--output_dir out`;
    the output folder inside the checkpoint it resumes stays refused."""
    module = load_script("run_mlm")
    (tmp_path / "train.txt").write_text(TEXT[:4000])
    out = tmp_path / "out"
    (out / "step_2").mkdir(parents=True)
    argv = ["--model_name_or_path", str(tiny_model), "--train_file", str(tmp_path / "train.txt"), "--validation_file",
            str(tmp_path / "train.txt"), "--max_seq_length", "32"]  # fmt: skip
    module.parse_args([*argv, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "step_2")])
    line = usage_error(capsys, lambda: module.parse_args([*argv, "--output_dir", str(out / "step_2" / "again"),
                                                          "--resume_from_checkpoint", str(out / "step_2")]))  # fmt: skip
    assert f"is inside --resume_from_checkpoint '{out / 'step_2'}', which run_mlm reads" in line
