"""Security and reliability (issue 13): secrets never reach a tracker, a log or the results; uploads send an
allow-list (symlinks refused, a dry run changes nothing); the native kernel loads only a library this user built and
hashed; resume state is never unpickled, unreadable random states and changed settings stop a resume; a run killed
during a checkpoint save resumes exactly."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO_ROOT,
    BertPkmModelTester,
    bert_pkm_code_files,
    load_script,
    make_tiny_folder,
    reset_accelerate_state,
    tiny_config,
    usage_error,
)
from safetensors.torch import load_file

from modeling_pkm_bert import BertPkmForMaskedLM
from modeling_pkm_bert.hub import upload
from modeling_pkm_bert.kernels import cpu as cpu_kernels
from modeling_pkm_bert.kernels.cpu import PORTABLE_FLAGS
from modeling_pkm_bert.hub.card_command import redact_secrets
from modeling_pkm_bert.training import save_final_outputs, tracker_config


SCRIPTS = REPO_ROOT / "run_scripts"
TOKEN = "hf_" + "Zq8wLx3TnVb5Rk2Jm7Yc9Pd4Hs6Gf1Ae"  # token-shaped, not a real one


run_mlm = load_script("run_mlm")


def run(args):
    """One run of run_mlm.py; the next one (often in the same test) starts with a fresh accelerate state."""
    try:
        return run_mlm.main(args)
    finally:
        reset_accelerate_state()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny BertPkm config (dropout on: an exact resume must restore the RNG) and a word-level tokenizer."""
    return make_tiny_folder(tmp_path_factory.mktemp("tiny"))


def mlm_args(tiny, output_dir, options=""):
    return [
        *("--config_name", tiny, "--tokenizer_name", tiny, "--output_dir", str(output_dir)),
        *"--max_seq_length 32 --per_device_train_batch_size 4 --max_eval_samples 4 --seed 3".split(),
        *options.split(),
    ]


def tree_digest(folder: Path) -> dict[str, str]:
    """Every entry under `folder` with its content hash (files), link target (symlinks) or mode (folders)."""
    digest = {}
    for path in sorted(folder.rglob("*")):
        key = path.relative_to(folder).as_posix()
        if path.is_symlink():
            digest[key] = "link:" + os.readlink(path)
        elif path.is_file():
            digest[key] = hashlib.sha256(path.read_bytes()).hexdigest() + f":{path.stat().st_mtime_ns}"
        else:
            digest[key] = f"dir:{path.stat().st_mode:o}"
    return digest


# ---------------------------------------------------------------- secrets


def test_redact_secrets_by_name_and_by_value():
    settings = {"hub_token": TOKEN, "wandb_api_key": "abc", "tokenizer_name": "bert", "note": f"token {TOKEN} here",
                "files": [TOKEN, "x"], "nested": {"password": "p", "lr": 1}, "use_slow_tokenizer": True}  # fmt: skip
    clean = redact_secrets(settings)
    assert clean == {"tokenizer_name": "bert", "note": "token <redacted> here", "files": ["<redacted>", "x"],
                     "nested": {"lr": 1}, "use_slow_tokenizer": True}  # fmt: skip


def test_hub_token_reaches_no_tracker_log_or_results(tiny, tmp_path, caplog, capsys, monkeypatch):
    """A real tensorboard tracker run (hparams.yml and the event file) with --hub_token: the token is in no file the
    run writes except the model card, whose "Produced by" line is issue 15's, and in no log line."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the real tracker this test runs)")
    monkeypatch.setattr("modeling_pkm_bert.hub.upload.push_folder_to_hub", lambda *a, **k: None)
    output_dir = tmp_path / "out"
    options = f"--max_train_steps 2 --max_train_samples 8 --with_tracking --report_to tensorboard --hub_token {TOKEN}"
    options += " --checkpointing_steps 1"
    options += " --hub_model_id me/tiny --push_to_hub"  # a token needs --push_to_hub
    with caplog.at_level("DEBUG"):
        run(mlm_args(tiny, output_dir, options))
    written = [p for p in output_dir.rglob("*") if p.is_file()]
    trackers = [p for p in written if p.name == "hparams.yml" or p.name.startswith("events.out.tfevents")]
    assert {p.name for p in trackers} >= {"hparams.yml"} and len(trackers) >= 2  # the tracker really ran
    hparams = next(p for p in trackers if p.name == "hparams.yml").read_text()
    assert "learning_rate:" in hparams and "hub_model_id:" in hparams and "hub_token:" not in hparams
    leaking = [str(p.relative_to(output_dir)) for p in written if TOKEN.encode() in p.read_bytes()]
    assert [p for p in leaking if p != "README.md"] == []  # README.md: the card's "Produced by" line (issue 15)
    assert TOKEN not in caplog.text and TOKEN not in "".join(capsys.readouterr())
    settings = json.loads((output_dir / "step_1" / "run_settings.json").read_text())
    assert settings["learning_rate"] == 5e-5 and not any("token" in key for key in settings)


def test_every_parser_refuses_abbreviations():
    """Issue 60: argparse would take `--hub_tok X` for `--hub_token X`, a spelling no redaction by name knows; every
    parser of the scripts, benchmarks and package is made with allow_abbrev=False."""
    import ast

    calls = []
    for folder in ("run_scripts", "benchmarks", "modeling_pkm_bert"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser":
                    refused = any(k.arg == "allow_abbrev" and getattr(k.value, "value", None) is False for k in node.keywords)
                    calls.append((f"{path.relative_to(REPO_ROOT)}:{node.lineno}", refused))
    assert len(calls) >= 20 and [where for where, refused in calls if not refused] == []
    assert run_mlm.build_parser().allow_abbrev is False


def test_card_drops_a_secret_by_its_destination():
    """A flag whose destination holds a secret is dropped from the card whatever its spelling: another name, an
    abbreviation where a parser takes one, `--flag=value`."""
    import argparse

    from modeling_pkm_bert.hub.card_command import card_command, secret_options

    parser = argparse.ArgumentParser()  # abbreviations allowed: the worst case
    parser.add_argument("--hub_token")
    parser.add_argument("--hf", dest="api_key")
    parser.add_argument("--seed")
    assert secret_options(parser) == ("--hub_token", "--hf")
    for argv in (["--hub_tok", "MySecretToken_12345"], ["--hf", "MySecretToken_12345"], ["--hf=MySecretToken_12345"]):
        assert vars(parser.parse_args(argv + ["--seed", "1"]))["seed"] == "1"  # argparse takes each spelling
        command = card_command("run_mlm.py", argv + ["--seed", "1"], parser=parser)
        assert command == "python run_scripts/run_mlm.py --seed 1", command
    assert "MySecretToken_12345" in card_command("run_mlm.py", ["--hf", "MySecretToken_12345"])  # what the parser adds


def test_redact_command():
    from modeling_pkm_bert.hub.card_command import redact_argv as redact_command

    argv = ["--hub_token", TOKEN, "--hub_token=abc", "--tokenizer_name", "bert", "--note", f"x{TOKEN}", "--seed", "1"]
    assert redact_command(argv) == ["--hub_token", "<redacted>", "--hub_token=<redacted>", "--tokenizer_name", "bert",
                                    "--note", "x" + TOKEN, "--seed", "1"]  # fmt: skip
    assert redact_command(["--note", f"use {TOKEN}"]) == ["--note", "use <redacted>"]


def test_tracker_config_keeps_the_values_trackers_take():
    import argparse

    from transformers import SchedulerType

    args = argparse.Namespace(hub_token=TOKEN, lr_scheduler_type=SchedulerType("linear"), pkm_layers=[1, 2],
                              output_dir=Path("out"), seed=None, learning_rate=1e-4)  # fmt: skip
    assert tracker_config(args) == {"lr_scheduler_type": "linear", "pkm_layers": "[1, 2]", "output_dir": "out",
                                    "seed": None, "learning_rate": 1e-4}  # fmt: skip


# ---------------------------------------------------------------- uploads


@pytest.fixture
def run_folder(tmp_path):
    """A training output folder with everything a run leaves, wanted or not."""
    folder = tmp_path / "run"
    BertPkmForMaskedLM(tiny_config()).save_pretrained(folder)
    BertPkmModelTester().get_placeholder_tokenizer().save_pretrained(folder)
    wanted = {"all_results.json": "{}", "eval_results.json": "{}", "staleness.safetensors": "x", "modules.json": "[]",
              "sentence_bert_config.json": "{}", "config_sentence_transformers.json": "{}",
              "1_Pooling/config.json": "{}", "2_Normalize/placeholder.json": "{}", "memory_report/usage.png": "png",
              "memory_report/usage.json": "{}"}  # fmt: skip
    unwanted = {".env": f"HF_TOKEN={TOKEN}", "1_Pooling/.env": "x", "memory_report/.secret.json": "x",
                "train.log": TOKEN, "mlm_no_trainer/hparams.yml": f"hub_token: {TOKEN}",
                "mlm_no_trainer/events.out.tfevents.1.host": "x", "runs/x/events.out.tfevents": "x",
                "step_3/model.safetensors": "x", "step_3/random_states_0.pkl": "x", "epoch_0/config.json": "{}",
                "training_args.bin": "x", ".final.tmp/model.safetensors": "x", "nested/deeper/config.json": "{}",
                "1_Pooling/sub/config.json": "{}", "optimizer.pt": "x", "notes.txt": "x", ".git/config": "x",
                "wandb/run/config.yaml": TOKEN, "step_3/model.py": "import os"}  # fmt: skip
    for name, text in {**wanted, **unwanted}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder, set(wanted)


def test_upload_sends_the_allow_list_only(run_folder, monkeypatch):
    folder, wanted = run_folder
    model_files = {"config.json", "model.safetensors", *bert_pkm_code_files(), "tokenizer.json", "tokenizer_config.json"}
    assert set(upload.files_to_upload(folder)) == model_files | wanted

    calls = []

    class RecordingApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, **kwargs):  # what huggingface_hub's own filter selects with these patterns
            from huggingface_hub.utils import filter_repo_objects

            files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
            calls.append(set(filter_repo_objects(files, allow_patterns=kwargs["allow_patterns"])))

    monkeypatch.setattr(upload, "HfApi", RecordingApi)
    (folder / "weird[1].json").write_text("{}")  # glob characters in a name: escaped, matched literally
    (folder / "weird1_results.json").write_text("{}")
    upload.push_folder_to_hub(folder, "me/x")
    assert calls == [model_files | wanted | {"weird1_results.json"}]


@pytest.mark.parametrize(
    "link, target",
    [
        ("README.md", "/etc/passwd"),  # an allowed name pointing outside
        ("1_Pooling", "/etc"),  # a module folder that is a link
        ("memory_report", ".."),
        ("extra_results.json", "all_results.json"),  # even inside the folder: a link is refused, not followed
    ],
)
def test_symlinks_are_refused(run_folder, link, target, monkeypatch):
    folder, _ = run_folder
    path = folder / link
    if path.is_dir():
        shutil.rmtree(path)
    path.unlink(missing_ok=True)
    path.symlink_to(target)
    with pytest.raises(ValueError, match=rf"refusing to upload symlinks .*{re.escape(link)} -> {re.escape(target)}"):
        upload.files_to_upload(folder)
    monkeypatch.setattr(upload, "HfApi", lambda **kw: pytest.fail("contacted the Hub"))
    with pytest.raises(ValueError, match="refusing to upload symlinks"):
        upload.push_folder_to_hub(folder, "me/x")


def test_links_outside_the_allow_list_are_neither_sent_nor_followed(run_folder):
    folder, wanted = run_folder
    (folder / "step_9").symlink_to("/etc")
    (folder / "debug.log").symlink_to("/etc/passwd")
    assert "debug.log" not in upload.files_to_upload(folder)


def test_push_script_dry_run_changes_nothing(run_folder, monkeypatch, capsys):
    folder, _ = run_folder
    monkeypatch.setattr(upload, "HfApi", lambda **kw: pytest.fail("a dry run contacted the Hub"))
    before = tree_digest(folder)
    assert not (folder / "README.md").exists()  # the script would write a card: a dry run must not
    load_script("push_to_hub").main(["--model_dir", str(folder), "--hub_model_id", "me/x", "--dry_run"])
    assert tree_digest(folder) == before
    printed = capsys.readouterr().out
    assert "README.md (a model card, written at upload)" in printed
    assert "step_3" not in printed and ".env" not in printed and "train.log" not in printed


def test_an_index_naming_shards_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "m"
    BertPkmForMaskedLM(tiny_config()).save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../../secret.safetensors", "b": "model.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"shard '\.\./\.\./secret\.safetensors' is not a \.safetensors file name"):
        upload.check_hub_folder(folder)


# ---------------------------------------------------------------- native kernel cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh kernel cache and no library loaded in this process yet (restored afterwards)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler: the torch selection is always used")
    folder = tmp_path / "cache"
    monkeypatch.setenv("PKM_BERT_CACHE", str(folder))
    monkeypatch.setattr(cpu_kernels, "_libraries", {})
    return folder


def built(folder):
    (library,) = folder.glob("product_key_select-*.so")
    return library, library.with_suffix(".json")


def works(library):
    scores = torch.randn(4, 5, 16)
    first, second = cpu_kernels._pair_tensors(4)
    out_scores, out_indices = torch.empty(5, 2, 4), torch.empty(5, 2, 4, dtype=torch.int64)
    status = library.pkm_select_product_keys(scores.data_ptr(), 2, 5, 16, 4, first.data_ptr(), second.data_ptr(),
                                             first.numel(), out_scores.data_ptr(), out_indices.data_ptr(), 0, 5)  # fmt: skip
    reference = cpu_kernels._torch_selection(scores, 4)
    return status == 0 and torch.equal(out_scores, reference[0])


def test_cache_is_private_and_records_the_hash(cache):
    old = os.umask(0o000)  # the laxest umask: the cache must still be private
    try:
        library = cpu_kernels.build_library(PORTABLE_FLAGS)
    finally:
        os.umask(old)
    assert library is not None and works(library)
    assert cache.stat().st_mode & 0o777 == 0o700
    so, sidecar = built(cache)
    assert json.loads(sidecar.read_text())["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert so.stat().st_mode & 0o022 == 0 and sidecar.stat().st_mode & 0o022 == 0
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []  # no scratch folder left


def test_a_lax_cache_folder_of_ours_is_made_private(cache):
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    assert cpu_kernels.build_library(PORTABLE_FLAGS) is not None
    assert cache.stat().st_mode & 0o777 == 0o700


def test_a_cache_folder_of_another_user_is_not_used(cache, caplog):
    if os.geteuid() != 0:
        pytest.skip("giving the folder to another user needs root")
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, -1)
    with caplog.at_level("WARNING", logger="modeling_pkm_bert.kernels.cpu"):
        assert cpu_kernels.build_library(PORTABLE_FLAGS) is None
    assert "not a folder owned by this user" in caplog.text and not list(cache.iterdir())


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
int pkm_select_product_keys(void) { return 0; }
"""


def plant(path: Path, marker: Path):
    """A library whose constructor writes `marker`: it ran iff the marker exists."""
    source = path.with_name("planted.c")
    source.write_text(PLANTED % marker)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()


@pytest.mark.parametrize("how", ["no-record", "other-content", "group-writable", "other-owner"])
def test_a_planted_library_never_runs(cache, tmp_path, caplog, how):
    assert cpu_kernels.build_library(PORTABLE_FLAGS) is not None
    cpu_kernels._libraries.clear()
    so, sidecar = built(cache)
    marker = tmp_path / "planted-code-ran"
    plant(so, marker)
    if how == "no-record":
        sidecar.unlink()
    elif how == "group-writable":  # even with its hash recorded, a file others may write is not trusted
        sidecar.write_text(json.dumps({"sha256": hashlib.sha256(so.read_bytes()).hexdigest()}))
        so.chmod(0o775)
    elif how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("giving the file to another user needs root")
        sidecar.write_text(json.dumps({"sha256": hashlib.sha256(so.read_bytes()).hexdigest()}))
        os.chown(so, 65534, -1)
    with caplog.at_level("WARNING", logger="modeling_pkm_bert.kernels.cpu"):
        library = cpu_kernels.build_library(PORTABLE_FLAGS)
    assert not marker.exists()
    assert library is not None and works(library)  # rebuilt
    assert "ignoring" in caplog.text and "rebuilding" in caplog.text
    so, sidecar = built(cache)
    assert json.loads(sidecar.read_text())["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()


def test_a_corrupt_recorded_library_is_rebuilt_once(cache, caplog):
    """A library whose recorded hash matches but that does not load (disk corruption after the record): rebuilt."""
    assert cpu_kernels.build_library(PORTABLE_FLAGS) is not None
    cpu_kernels._libraries.clear()
    so, sidecar = built(cache)
    so.unlink()  # a new file: the loaded library keeps its own pages
    so.write_bytes(b"\x7fELF garbage")
    sidecar.write_text(json.dumps({"sha256": hashlib.sha256(so.read_bytes()).hexdigest()}))
    with caplog.at_level("WARNING", logger="modeling_pkm_bert.kernels.cpu"):
        library = cpu_kernels.build_library(PORTABLE_FLAGS)
    assert library is not None and works(library)
    assert "could not load" in caplog.text


def test_a_compiler_that_makes_unloadable_libraries_leaves_torch_in_charge(cache, tmp_path, monkeypatch, caplog):
    fake_cc = tmp_path / "fake-cc"
    fake_cc.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho garbage > "$2"\n')
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    with caplog.at_level("WARNING", logger="modeling_pkm_bert.kernels.cpu"):
        assert cpu_kernels.select_product_keys_native(torch.randn(2, 3, 16), 4, ("-O1", "-fPIC", "-shared")) is None
    assert "does not load: product-key selection stays on torch" in caplog.text
    # the op itself then answers with the torch selection
    monkeypatch.setattr(cpu_kernels, "FLAGS", ("-O1", "-fPIC", "-shared"))
    monkeypatch.setattr(cpu_kernels, "PORTABLE_FLAGS", ("-O1", "-fPIC", "-shared"))
    scores = torch.randn(4, 7, 16)
    expected = cpu_kernels._torch_selection(scores, 4)
    result = torch.ops.pkm_bert.select_product_keys(scores, 4)
    assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])


@pytest.mark.parametrize(
    "shape, dtype, knn, message",
    [
        ((4, 5, 16), torch.float32, 0, r"knn must be an int in \[1, n_keys=16\], got 0"),  # hung before
        ((4, 5, 16), torch.float32, -3, r"knn must be an int in \[1, n_keys=16\], got -3"),
        ((4, 5, 16), torch.float32, 17, r"knn must be an int in \[1, n_keys=16\], got 17"),
        ((4, 5), torch.float32, 2, r"subkey_scores must be \(heads \* 2, tokens, n_keys\), got \(4, 5\)"),
        ((2, 4, 5, 16), torch.float32, 2, r"must be \(heads \* 2, tokens, n_keys\), got \(2, 4, 5, 16\)"),
        ((4, 5, 16), torch.int64, 2, r"subkey_scores must be floating point, got torch.int64"),
        ((3, 5, 16), torch.float32, 2, r"first dimension must be heads \* 2 \(even, > 0\), got 3"),
    ],
)
def test_the_op_validates_its_arguments(shape, dtype, knn, message):
    scores = torch.randn(shape).to(dtype)
    with pytest.raises(ValueError, match=message):
        torch.ops.pkm_bert.select_product_keys(scores, knn)


def test_the_op_still_compiles_and_exports():
    scores = torch.randn(4, 6, 16)
    expected = torch.ops.pkm_bert.select_product_keys(scores, 4)

    def select(x):
        return torch.ops.pkm_bert.select_product_keys(x, 4)

    got = torch.compile(select, backend="aot_eager", fullgraph=True)(scores)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    class Select(torch.nn.Module):
        def forward(self, x):
            return torch.ops.pkm_bert.select_product_keys(x, 4)

    exported = torch.export.export(Select(), (scores,))
    assert "pkm_bert.select_product_keys" in str(exported.graph)
    got = exported.module()(scores)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(Exception, match=r"knn must be an int in \[1, n_keys=16\], got 0"):
        torch.compile(lambda x: torch.ops.pkm_bert.select_product_keys(x, 0), backend="aot_eager", fullgraph=True)(
            scores
        )


# ---------------------------------------------------------------- resume and final outputs

TRAINING = "--max_train_samples 12 --max_train_steps 4 --track_staleness --checkpointing_steps 2"


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    """4 uninterrupted steps (epochs of 3 batches), a checkpoint every 2 steps, staleness tracked."""
    output_dir = tmp_path_factory.mktemp("straight") / "out"
    run(mlm_args(tiny, output_dir, TRAINING))
    return output_dir


class Evil:
    """Unpickling this runs code: it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.slow  # end to end: run_mlm.py in a process, killed, resumed (20 s on 2 cores)
def test_sigkill_during_a_checkpoint_save_then_resume_latest_is_exact(tiny, straight, tmp_path, capsys):
    """The run is killed while step_4 is being saved (deterministically: the save pauses before publishing its
    folder): step_2 stays complete and loadable, and `--resume_from_checkpoint latest` ends with the weights and
    staleness of the uninterrupted run. A pickle planted in the checkpoint is never loaded."""
    output_dir = tmp_path / "out"
    env = {**os.environ, "PKM_BERT_PAUSE_BEFORE_PUBLISHING": "step_4", "HF_HUB_OFFLINE": "1"}
    # the killed run's steps continue in this process: the same number of torch threads (a float sum split over
    # another number of threads may round differently; an earlier test in the suite may have left this one at 1)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    with open(tmp_path / "log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "run_mlm.py"), *mlm_args(tiny, output_dir, TRAINING)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not (output_dir / "step_4.tmp" / ".paused").exists():
                assert process.poll() is None, (tmp_path / "log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the run never reached the save of step_4"
                time.sleep(0.1)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL
    assert (output_dir / "step_2").is_dir() and not (output_dir / "step_4").exists()
    assert not (output_dir / "model.safetensors").exists()  # the final model was never written
    previous = output_dir / "step_2"
    load_file(previous / "model.safetensors")
    assert json.loads((previous / "run_settings.json").read_text())["seed"] == 3
    assert load_file(previous / "staleness.safetensors")["layer_1"].max() == 2
    assert not (previous / "custom_checkpoint_0.pkl").exists()  # the tracker is not pickled any more
    marker = tmp_path / "planted-pickle-ran"
    torch.save(Evil(marker), previous / "custom_checkpoint_0.pkl")

    line = usage_error(capsys, lambda: run(mlm_args(tiny, output_dir, f"{TRAINING} --resume_from_checkpoint latest")))
    assert "holds pickled custom state ['custom_checkpoint_0.pkl']" in line
    assert not marker.exists()
    (previous / "custom_checkpoint_0.pkl").unlink()

    run(mlm_args(tiny, output_dir, f"{TRAINING} --resume_from_checkpoint latest"))
    expected, resumed = load_file(straight / "model.safetensors"), load_file(output_dir / "model.safetensors")
    assert [name for name in expected if not torch.equal(expected[name], resumed[name])] == []
    assert torch.equal(
        load_file(straight / "staleness.safetensors")["layer_1"], load_file(output_dir / "staleness.safetensors")["layer_1"]
    )
    assert not (output_dir / "step_4.tmp").exists() and not (output_dir / ".final.tmp").exists()


def copy_checkpoint(straight, tmp_path, name="step_2"):
    output_dir = tmp_path / "out"
    shutil.copytree(straight / name, output_dir / name)
    return output_dir


@pytest.mark.parametrize(
    "options, message",
    [
        ("--learning_rate 1e-4", "learning_rate: checkpoint 5e-05, now 0.0001"),
        ("--per_device_train_batch_size 2", "per_device_train_batch_size: checkpoint 4, now 2"),
        ("--seed 4", "seed: checkpoint 3, now 4"),
        ("--max_train_samples 8", "train_data: checkpoint {'rows': 12"),
        ("--gradient_accumulation_steps 2", "gradient_accumulation_steps: checkpoint 1, now 2"),
    ],
)
def test_a_resume_that_cannot_be_exact_stops(tiny, straight, tmp_path, capsys, options, message):
    output_dir = copy_checkpoint(straight, tmp_path)
    training = TRAINING.replace("--max_train_samples 12", "") if "max_train_samples" in options else TRAINING
    args = mlm_args(tiny, output_dir, f"{training} {options} --resume_from_checkpoint latest")
    line = usage_error(capsys, lambda: run(args))
    assert "was saved by a run with other settings" in line
    assert message in line and "--allow_inexact_resume" in line
    assert not (output_dir / "model.safetensors").exists()


def test_allow_inexact_resume_continues_with_a_warning(tiny, straight, tmp_path, caplog):
    output_dir = copy_checkpoint(straight, tmp_path)
    options = f"{TRAINING} --learning_rate 1e-4 --resume_from_checkpoint latest --allow_inexact_resume"
    with caplog.at_level("WARNING"):
        results = run(mlm_args(tiny, output_dir, options))
    assert results["step"] == 4 and "learning_rate: checkpoint 5e-05, now 0.0001" in caplog.text


@pytest.mark.parametrize("damage", ["garbage", "empty", "pickled-list", "missing"])
def test_unreadable_random_states_stop_the_resume(tiny, straight, tmp_path, capsys, damage):
    output_dir = copy_checkpoint(straight, tmp_path)
    states = output_dir / "step_2" / "random_states_0.pkl"
    if damage == "garbage":
        states.write_bytes(b"\x80\x04garbage")
    elif damage == "empty":
        states.write_bytes(b"")
    elif damage == "pickled-list":
        torch.save([1, 2, 3], states)
    else:
        states.unlink()
    line = usage_error(capsys, lambda: run(mlm_args(tiny, output_dir, f"{TRAINING} --resume_from_checkpoint latest")))
    assert "random_states_0.pkl: the random states of the checkpoint cannot be read" in line


def test_a_checkpoint_without_settings_or_with_bad_staleness_stops(tiny, straight, tmp_path, capsys):
    output_dir = copy_checkpoint(straight, tmp_path)
    (output_dir / "step_2" / "run_settings.json").unlink()
    line = usage_error(capsys, lambda: run(mlm_args(tiny, output_dir, f"{TRAINING} --resume_from_checkpoint latest")))
    assert "run_settings.json is missing, nothing can be compared" in line
    from modeling_pkm_bert.analysis.staleness import StalenessTracker

    tracker = StalenessTracker(BertPkmForMaskedLM(tiny_config()))
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="bad.safetensors: not a readable staleness state"):
        tracker.load(tmp_path / "bad.safetensors")
    tracker.load(straight / "step_2" / "staleness.safetensors")


class MainProcess:
    is_main_process = True

    def wait_for_everyone(self):
        pass


def test_final_outputs_are_published_whole_or_not_at_all(tmp_path):
    """A save that fails half-way leaves the previous final files as they were; a complete one replaces them and
    leaves no staging folder."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "model.safetensors").write_text("old weights")
    (output_dir / "config.json").write_text("old config")
    (output_dir / "model-00002-of-00002.safetensors").write_text("an older sharded save")

    def broken(folder):
        os.makedirs(folder)
        Path(folder, "model.safetensors").write_text("new, half written")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_final_outputs(MainProcess(), str(output_dir), broken)
    assert (output_dir / "model.safetensors").read_text() == "old weights"

    def complete(folder):
        os.makedirs(folder, exist_ok=True)
        Path(folder, "model.safetensors").write_text("new weights")
        Path(folder, "config.json").write_text("new config")
        Path(folder, "1_Pooling").mkdir()
        Path(folder, "1_Pooling", "config.json").write_text("{}")

    save_final_outputs(MainProcess(), str(output_dir), complete)
    assert (output_dir / "model.safetensors").read_text() == "new weights"
    assert (output_dir / "config.json").read_text() == "new config" and (output_dir / "1_Pooling" / "config.json").exists()
    assert sorted(p.name for p in output_dir.iterdir()) == ["1_Pooling", "config.json", "model.safetensors"]


def test_an_unwritable_output_dir_fails_before_any_work(tiny, tmp_path, capsys):
    from modeling_pkm_bert.training import prepare_output_dir

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders (the parse-time checks in test_bad_script_inputs.py still run)")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(SystemExit):
            run_mlm.parse_args(mlm_args(tiny, locked / "out"))
        assert "cannot be created" in capsys.readouterr().err
        with pytest.raises(ValueError, match="cannot be written"):
            prepare_output_dir(str(locked / "out"))
    finally:
        locked.chmod(0o700)
