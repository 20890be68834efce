"""The output-folder contract of every command that writes a folder (issue 44, item 1; DESIGN.md "Output folders"): a
new or empty folder, the command's own earlier output (its `.<tool>` marker) or, with `--overwrite_output_dir`, any
other folder; never, not even with the flag, the model folder it reads or a folder containing it, the current
directory or a parent of it, the home folder, `/`, nor a file. Each refusal is one usage-error line naming the folder
and the flag, and leaves everything as it was."""

import json
import os
import sys

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertTokenizer

from helpers import REPO_ROOT, BertPkmModelTester, load_script, tiny_config, usage_error
from modeling_pkm_bert import BertPkmForMaskedLM
from modeling_pkm_bert.utils.output_folders import (
    OutputFolderError,
    check_output_folder,
    mark_output_folder,
    output_folder_problem,
    output_marker,
)


TEXT = (REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_validation.txt").read_text(encoding="utf-8")
SHORT = ["--max_seq_length", "32"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny BertPkm folder and a tiny BERT folder, each with a tokenizer."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = BertPkmModelTester().get_tokenizer("validation", 200)  # of TEXT's words
    torch.manual_seed(0)
    BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[0, 2])).save_pretrained(root / "pkm")
    bert = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                      max_position_embeddings=64)  # fmt: skip
    BertForMaskedLM(bert).save_pretrained(root / "bert")
    for name in ("pkm", "bert"):
        tokenizer.save_pretrained(root / name)
    return root


def model_copy(saved, tmp_path, name="pkm"):
    """A copy of a saved folder with a file of the user's own in it."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(saved / name, folder)
    (folder / "notes.txt").write_text("the user's own notes")
    return folder


def listing(folder):
    return sorted((str(p.relative_to(folder)), p.read_bytes()) for p in folder.rglob("*") if p.is_file())


# ---- the rule ----


def test_the_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert output_folder_problem(tmp_path / "new" / "deeper", "tool") is None
    (tmp_path / "empty").mkdir()
    assert output_folder_problem(tmp_path / "empty", "tool") is None
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    problem = output_folder_problem(foreign, "tool")
    assert f"--output_dir '{foreign}' is not empty and tool did not write it (no .tool file in it)" in problem
    assert "give --overwrite_output_dir to overwrite it" in problem
    assert output_folder_problem(foreign, "tool", overwrite=True) is None
    own = tmp_path / "own"
    own.mkdir()
    (own / "result.json").write_text("{}")
    mark_output_folder(own, "tool")
    assert (own / output_marker("tool")).is_file() and output_marker("tool") == ".tool"
    assert output_folder_problem(own, "tool") is None
    assert "other did not write it" in output_folder_problem(own, "other")  # another tool's output is foreign
    with pytest.raises(OutputFolderError, match="tool did not write it"):
        check_output_folder(foreign, "tool")
    assert isinstance(OutputFolderError("x"), ValueError)


@pytest.mark.parametrize("case", ["file", "under a file", "cwd", "parent of cwd", "home", "parent of home", "root", "model",
                                  "parent of model", "model by symlink"])  # fmt: skip
def test_never_even_with_the_flag(case, tmp_path, monkeypatch):
    home, work = tmp_path / "h" / "home" / "me", tmp_path / "w" / "work"
    home.mkdir(parents=True)
    (work / "model").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (work / "a_file").write_text("not a folder")
    os.symlink(work / "model", work / "link")
    target, message = {
        "file": (work / "a_file", "is a file, not a folder"),
        "under a file": (work / "a_file" / "out", f"lies under {str(work / 'a_file')!r}, which is a file"),
        "cwd": (".", "is the current directory"),
        "parent of cwd": ("..", "contains the current directory"),
        "home": (str(home), "is the home folder"),
        "parent of home": (home.parent, f"contains the home folder {home}"),
        "root": ("/", "is the root of the file system"),
        "model": (work / "model", "is --model_name_or_path"),
        "parent of model": (work, "contains --model_name_or_path"),
        "model by symlink": (work / "link", "is --model_name_or_path"),
    }[case]
    if case == "parent of model":
        monkeypatch.chdir(tmp_path)
    problem = output_folder_problem(target, "tool", overwrite=True, reads={"--model_name_or_path": str(work / "model")})
    assert problem is not None and message in problem, problem
    assert problem.startswith(f"--output_dir {str(target)!r} ")
    assert problem.endswith("never written, not even with --overwrite_output_dir: give another folder")
    assert output_folder_problem(work / "model" / "explorer", "tool", reads={"m": str(work / "model")}) is None


# ---- memory_explorer.py ----


def test_explorer_on_its_own_model_folder_leaves_it_intact(saved, tmp_path, capsys):
    """The reproduction of the issue: --output_dir equal to the model folder (and --overwrite_output_dir does not
    change that); the weights, config, tokenizer and the user's file stay."""
    folder = model_copy(saved, tmp_path)
    before = listing(folder)
    script = load_script("memory_explorer")
    for extra in ([], ["--overwrite_output_dir"]):
        line = usage_error(capsys, lambda: script.main(["--model_name_or_path", str(folder), "--output_dir", str(folder),
                                                        *SHORT, *extra]))  # fmt: skip
        assert f"--output_dir '{folder}' is --model_name_or_path '{folder}', which memory_explorer reads" in line
        assert "--overwrite_output_dir" in line
    assert listing(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkm"]  # no staging folder left beside it


def test_explorer_replaces_its_own_output_and_needs_the_flag_for_a_foreign_folder(saved, tmp_path, capsys):
    script = load_script("memory_explorer")
    out = tmp_path / "explorer"
    argv = ["--model_name_or_path", str(saved / "pkm"), "--output_dir", str(out), *SHORT, "--max_tokens", "64"]
    script.main(argv)
    assert (out / ".memory_explorer").is_file() and (out / "index.html").is_file()
    (out / "stale.txt").write_text("left by the first run")
    script.main(argv)  # its own output: replaced without the flag
    assert not (out / "stale.txt").exists() and (out / "index.html").is_file()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    argv[3] = str(foreign)
    line = usage_error(capsys, lambda: script.main(argv))
    assert f"--output_dir '{foreign}' is not empty and memory_explorer did not write it" in line
    assert "give --overwrite_output_dir" in line and (foreign / "thesis.tex").is_file()
    script.main([*argv, "--overwrite_output_dir"])
    assert (foreign / "index.html").is_file() and not (foreign / "thesis.tex").exists()


def test_explorer_library_refuses_the_folder_of_the_model_it_was_given(saved, tmp_path):
    from modeling_pkm_bert.analysis.explorer import build_memory_explorer

    folder = model_copy(saved, tmp_path)
    before = listing(folder)
    model = BertPkmForMaskedLM.from_pretrained(folder)
    tokenizer = BertTokenizer.from_pretrained(folder)
    for overwrite in (False, True):
        with pytest.raises(OutputFolderError, match=r"output_dir '.*' is the model's folder .*, which memory_explorer"):
            build_memory_explorer(model, tokenizer, folder, [TEXT], max_seq_length=32, overwrite=overwrite)
    assert listing(folder) == before


# ---- memory_report.py ----


def test_report_into_the_current_directory_is_refused(saved, tmp_path, capsys, monkeypatch):
    """The reproduction of the issue: `memory_report.py --output_dir .` inside a project folder."""
    project = tmp_path / "project"
    project.mkdir()
    model_copy(saved, project)
    (project / "README.md").write_text("my project")
    before = listing(project)
    monkeypatch.chdir(project)
    script = load_script("memory_report")
    for extra in ([], ["--overwrite_output_dir"]):
        line = usage_error(capsys, lambda: script.main(["--model_name_or_path", "pkm", "--output_dir", ".", *SHORT, *extra]))
        assert "--output_dir '.' is the current directory: never written, not even with --overwrite_output_dir" in line
    assert listing(project) == before and sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_report_refuses_a_file_and_replaces_its_own_output(saved, tmp_path, capsys):
    script = load_script("memory_report")
    (tmp_path / "notes.txt").write_text("a file")
    argv = ["--model_name_or_path", str(saved / "pkm"), *SHORT, "--max_sequences", "2"]
    for extra in ([], ["--overwrite_output_dir"]):
        line = usage_error(capsys, lambda: script.main([*argv, "--output_dir", str(tmp_path / "notes.txt"), *extra]))
        assert f"--output_dir '{tmp_path / 'notes.txt'}' is a file, not a folder" in line
    assert (tmp_path / "notes.txt").read_text() == "a file"

    out = tmp_path / "report"
    script.main([*argv, "--output_dir", str(out)])
    assert (out / ".memory_report").is_file() and (out / "memory_report.md").is_file()
    (out / "stale.png").write_text("old figure")
    script.main([*argv, "--output_dir", str(out)])
    assert not (out / "stale.png").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("a,b")
    line = usage_error(capsys, lambda: script.main([*argv, "--output_dir", str(foreign)]))
    assert "is not empty and memory_report did not write it" in line and (foreign / "data.csv").is_file()
    # the run folder it reads: never, even with the flag (and a folder inside it is fine)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 2.0}) + "\n")
    line = usage_error(capsys, lambda: script.main([*argv, "--run_dir", str(run), "--output_dir", str(run),
                                                    "--overwrite_output_dir"]))  # fmt: skip
    assert f"is --run_dir '{run}', which memory_report reads" in line
    script.main([*argv, "--run_dir", str(run), "--output_dir", str(run / "memory_report")])
    assert (run / "metrics.jsonl").is_file() and (run / "memory_report" / "memory_report.md").is_file()


def test_report_library_refuses_the_model_folder(saved, tmp_path):
    from modeling_pkm_bert.analysis import write_memory_report
    from modeling_pkm_bert import BertPkmModel

    folder = model_copy(saved, tmp_path)
    before = listing(folder)
    model = BertPkmModel.from_pretrained(folder)
    with pytest.raises(OutputFolderError, match="is the model's folder"):
        write_memory_report(model, BertTokenizer.from_pretrained(folder), folder, texts=[TEXT], max_seq_length=32,
                            overwrite=True)  # fmt: skip
    assert listing(folder) == before


# ---- convert_to_pkm.py ----


def test_convert_contract(saved, tmp_path, capsys):
    script = load_script("convert_to_pkm")
    source = model_copy(saved, tmp_path, "bert")
    before = listing(source)
    pkm = ["--pkm_layers", "1", "--pkm_n_keys", "8", "--pkm_heads", "2", "--pkm_knn", "4", "--pkm_k_dim", "16"]
    for extra in ([], ["--overwrite_output_dir"]):
        line = usage_error(capsys, lambda: script.main(["--model_name_or_path", str(source), "--output_dir", str(source),
                                                        *pkm, *extra]))  # fmt: skip
        assert f"--output_dir '{source}' is --model_name_or_path '{source}', which convert_to_pkm reads" in line
    assert listing(source) == before
    out = tmp_path / "converted"
    argv = ["--model_name_or_path", str(source), "--output_dir", str(out), *pkm]
    script.main(argv)
    assert (out / ".convert_to_pkm").is_file()
    script.main(argv)  # its own output: replaced without the flag
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    argv[3] = str(foreign)
    line = usage_error(capsys, lambda: script.main(argv))
    assert "is not empty and convert_to_pkm did not write it" in line and "--overwrite_output_dir" in line
    assert (foreign / "keep.txt").is_file()


def test_the_marker_is_never_uploaded(tmp_path):
    from modeling_pkm_bert.hub.upload import files_to_upload

    BertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path / "m")
    mark_output_folder(tmp_path / "m", "convert_to_pkm")
    assert ".convert_to_pkm" not in files_to_upload(tmp_path / "m")


# ---- the training scripts ----


@pytest.mark.parametrize("script", ["run_mlm", "run_clm", "run_glue", "run_squad"])
def test_training_scripts_contract(script, saved, tmp_path, capsys, monkeypatch):
    """Checked while the flags are parsed (before any work): a foreign folder needs the flag, the script's own earlier
    output (a resume, a rerun) does not, the model folder never."""
    module = load_script(script)
    (tmp_path / "train.txt").write_text("some text\n")
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"version": "1.1", "data": []}))
    base = {
        "run_mlm": ["--train_file", str(tmp_path / "train.txt")],
        "run_clm": ["--train_file", str(tmp_path / "train.txt")],
        "run_glue": ["--task_name", "sst2"],
        "run_squad": ["--validation_file", str(squad)],
    }[script]
    model = str(saved / "pkm")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("my project")
    argv = ["--model_name_or_path", model, *base, "--output_dir", str(foreign)]
    line = usage_error(capsys, lambda: module.parse_args(argv))
    assert f"--output_dir '{foreign}' is not empty and {script} did not write it (no .{script} file in it)" in line
    assert module.parse_args([*argv, "--overwrite_output_dir"]).overwrite_output_dir
    copied = tmp_path / "copied"
    (copied / "step_2").mkdir(parents=True)  # a checkpoint copied here, or left by an older release: a resume of it
    module.parse_args([*argv[:-1], str(copied), "--resume_from_checkpoint", "latest"])
    mark_output_folder(foreign, script)
    module.parse_args(argv)  # its own output
    line = usage_error(capsys, lambda: module.parse_args(
        ["--model_name_or_path", model, *base, "--output_dir", model, "--overwrite_output_dir"]))
    assert f"is --model_name_or_path '{model}', which {script} reads" in line
    monkeypatch.chdir(tmp_path)
    line = usage_error(capsys, lambda: module.parse_args(
        ["--model_name_or_path", model, *base, "--output_dir", ".", "--overwrite_output_dir"]))
    assert "--output_dir '.' is the current directory" in line


def test_a_training_run_marks_its_folder_and_runs_again_into_it(saved, tmp_path):
    from helpers import reset_accelerate_state

    module = load_script("run_mlm")
    (tmp_path / "train.txt").write_text(TEXT[:4000])
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(saved / "pkm"), "--train_file", str(tmp_path / "train.txt"), "--validation_file",
            str(tmp_path / "train.txt"), "--max_seq_length", "32", "--max_train_steps", "1", "--per_device_train_batch_size",
            "2", "--output_dir", str(out), "--seed", "1"]  # fmt: skip
    for _ in range(2):  # the second run writes into its own output without the flag
        try:
            module.main(argv)
        finally:
            reset_accelerate_state()
        assert (out / ".run_mlm").is_file() and (out / "model.safetensors").is_file()


# ---- seed_sweep.py, demo.py, the benchmark ----


def test_seed_sweep_contract(tmp_path, capsys):
    script = load_script("seed_sweep")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.csv").write_text("mine")
    command = ["--", sys.executable, "-c", "pass"]
    line = usage_error(capsys, lambda: script.parse_args(["--seeds", "1", "--output_dir", str(foreign), *command]))
    assert "is not empty and seed_sweep did not write it" in line
    script.parse_args(["--seeds", "1", "--output_dir", str(foreign), "--overwrite_output_dir", *command])
    mark_output_folder(foreign, "seed_sweep")
    script.parse_args(["--seeds", "1", "--output_dir", str(foreign), *command])


def test_demo_contract(tmp_path, capsys, monkeypatch):
    script = load_script("demo")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    monkeypatch.setattr(sys, "argv", ["demo.py", "--output_dir", str(foreign)])
    line = usage_error(capsys, script.parse_args)
    assert "is not empty and demo did not write it" in line
    monkeypatch.setattr(sys, "argv", ["demo.py", "--output_dir", str(foreign), "--overwrite_output_dir"])
    assert script.parse_args().overwrite_output_dir
    monkeypatch.chdir(foreign)
    monkeypatch.setattr(sys, "argv", ["demo.py", "--output_dir", ".", "--overwrite_output_dir"])
    assert "is the current directory" in usage_error(capsys, script.parse_args)


def test_reproduce_paper_contract(tmp_path, capsys):
    script = load_script("runner", folder=REPO_ROOT / "benchmarks/studies/reproduce_paper")
    data = tmp_path / "data"
    for task in ("SST-2",):
        (data / "glue" / task).mkdir(parents=True)
        for name in ("train.tsv", "dev.tsv"):
            (data / "glue" / task / name).write_text("sentence\tlabel\n")
    (data / "wikitext-2-raw").mkdir()
    (data / "wikitext-2-raw" / "wiki.test.raw").write_text("text\n")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    (tmp_path / "model").mkdir()  # a folder of its own: no output may lie inside the model folder it reads
    base = ["--model", str(tmp_path / "model"), "--data_dir", str(data), "--tasks", "sst2", "--report",
            str(tmp_path / "R.md")]  # fmt: skip
    line = usage_error(capsys, lambda: script.parse_args([*base, "--work_dir", str(foreign)]))
    assert f"--work_dir '{foreign}' is not empty and reproduce_paper did not write it" in line
    line = usage_error(capsys, lambda: script.parse_args([*base, "--work_dir", str(tmp_path / "w"), "--figures_dir",
                                                          str(foreign)]))  # fmt: skip
    assert f"--figures_dir '{foreign}' is not empty and reproduce_paper did not write it" in line
    script.parse_args([*base, "--work_dir", str(foreign), "--figures_dir", str(foreign / "f"), "--overwrite_output_dir"])
    assert (foreign / "keep.txt").is_file()


# ---- export ----


def test_export_onnx_does_not_overwrite_a_file_it_was_not_asked_to(tmp_path):
    pytest.importorskip("onnxscript")
    from modeling_pkm_bert.integrations.export import export_onnx

    path = tmp_path / "model.onnx"
    path.write_text("someone's model")
    with pytest.raises(ValueError, match=r"model\.onnx' exists: give overwrite=True to replace it"):
        export_onnx(BertPkmForMaskedLM(tiny_config()).eval(), path, {"input_ids": torch.ones(2, 4, dtype=torch.long)})
    assert path.read_text() == "someone's model"
