"""run_glue.py end to end on a slice of SST-2 with tiny models; exact resume; bad input; seed_sweep.py."""

import collections
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT, load_script, reset_accelerate_state, tiny_config, torchrun, usage_error
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, BertConfig, BertModel, BertTokenizer

from modeling_pkm_bert import BertPkmForSequenceClassification, BertPkmModel, register_auto_classes


SCRIPTS = REPO_ROOT / "run_scripts"


run_glue = load_script("run_glue")
seed_sweep = load_script("seed_sweep")


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data):
    """64 training and 32 dev examples of SST-2 in GLUE's layout, and a tiny tokenizer made from their words."""
    folder = tmp_path_factory.mktemp("sst2")
    train = (shared_data / "glue" / "SST-2" / "train.tsv").read_text().splitlines(keepends=True)[:65]
    dev = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text().splitlines(keepends=True)[:33]
    (folder / "train.tsv").write_text("".join(train))
    (folder / "dev.tsv").write_text("".join(dev))
    words = collections.Counter(word for line in train[1:] for word in line.split("\t")[0].split())
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in words.most_common(94)]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    return {"train": str(folder / "train.tsv"), "dev": str(folder / "dev.tsv"), "tokenizer": tokenizer, "dir": folder}


@pytest.fixture(scope="module")
def tiny_pkm(data, tmp_path_factory):
    """A tiny BertPkm encoder checkpoint (memory at layer 1, dropout on so that resume must restore the RNG)."""
    folder = tmp_path_factory.mktemp("tiny_pkm")
    torch.manual_seed(0)
    BertPkmModel(tiny_config(hidden_dropout_prob=0.1)).save_pretrained(folder)
    data["tokenizer"].save_pretrained(folder)
    return str(folder)


def glue_args(model, data, output_dir, options=""):
    """run_glue's arguments for the SST-2 slice, plus `options` (a string of space-separated words)."""
    return [
        *("--model_name_or_path", model, "--task_name", "sst2", "--output_dir", str(output_dir)),
        *("--train_file", data["train"], "--validation_file", data["dev"]),
        *"--per_device_train_batch_size 8 --per_device_eval_batch_size 16 --max_length 32 --seed 1".split(),
        *options.split(),
    ]


@pytest.fixture(scope="module")
def first_run(tiny_pkm, data, tmp_path_factory):
    """6 steps with a checkpoint every 3, the usage before training, and a (mocked) push to the Hub."""
    output_dir = tmp_path_factory.mktemp("run") / "out"
    pushed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("modeling_pkm_bert.hub.upload.push_folder_to_hub", lambda *a, **k: pushed.append((a, k)))
        options = "--max_train_steps 6 --checkpointing_steps 3 --memory_usage_before_training"
        options += " --push_to_hub --hub_model_id someone/tiny-sst2"
        results = run_glue.main(glue_args(tiny_pkm, data, output_dir, options))
    reset_accelerate_state()  # the test that asked for this fixture starts with a fresh state
    return {"results": results, "output_dir": output_dir, "pushed": pushed}


def test_end_to_end_sst2(first_run):
    results, output_dir = first_run["results"], first_run["output_dir"]
    on_disk = json.loads((output_dir / "all_results.json").read_text())
    assert on_disk["eval_accuracy"] == results["eval_accuracy"] and 0 <= results["eval_accuracy"] <= 1
    assert (results["step"], results["train_samples"], results["eval_samples"]) == (6, 64, 32)
    # Table 6 after fine-tuning, Figure 4 before and after, on the 32 dev sentences
    for prefix in ("eval", "pretrained"):
        assert 0 < on_disk[f"{prefix}_memory/layer_1/top1_mu"] <= on_disk[f"{prefix}_memory/layer_1/mu"] <= 1
        assert 0 <= on_disk[f"{prefix}_class_memory/layer_1/top1_iou"] <= 1
        assert on_disk[f"{prefix}_class_memory/layer_1/top1_kl"] >= 0
        assert "mu_negative" in " ".join(on_disk) and "top1_mu_positive" in " ".join(on_disk)
    tokens = on_disk["eval_memory/layer_1/tokens"]
    assert on_disk["eval_class_memory/layer_1/tokens_0"] + on_disk["eval_class_memory/layer_1/tokens_1"] == tokens
    # checkpoints are complete (no .tmp left), the model reloads with the task's labels
    assert sorted(p.name for p in output_dir.iterdir() if p.name.startswith("step_")) == ["step_3", "step_6"]
    assert not list(output_dir.glob("*.tmp"))
    register_auto_classes()
    model = AutoModelForSequenceClassification.from_pretrained(output_dir)
    assert isinstance(model, BertPkmForSequenceClassification)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    # the model card carries the results; the upload got the folder and the repository
    card = (output_dir / "README.md").read_text()
    assert "## Fine-tuning results" in card and "`eval_accuracy`" in card and "--max_train_steps 6" in card
    ((args, kwargs),) = first_run["pushed"]
    assert args == (str(output_dir), "someone/tiny-sst2")


def test_exact_resume(first_run, tiny_pkm, data, tmp_path):
    """Resuming from step_3 gives bit-identical weights to the uninterrupted 6 steps (dropout on, memory optimizer)."""
    output_dir = tmp_path / "resumed"
    output_dir.mkdir()
    shutil.copytree(first_run["output_dir"] / "step_3", output_dir / "step_3")
    results = run_glue.main(
        glue_args(tiny_pkm, data, output_dir, "--max_train_steps 6 --resume_from_checkpoint latest")
    )
    reference = load_file(first_run["output_dir"] / "model.safetensors")
    resumed = load_file(output_dir / "model.safetensors")
    assert reference.keys() == resumed.keys()
    different = [name for name in reference if not torch.equal(reference[name], resumed[name])]
    assert different == []
    assert results["eval_accuracy"] == first_run["results"]["eval_accuracy"]


def test_convert_on_load_baseline_and_frozen_memory(data, tmp_path):
    """A plain BERT: fine-tuned as is (baseline, no memory metrics), or converted on load (+Init) with memory flags;
    --freeze_memory keeps every memory parameter (and BatchNorm statistic) of a BertPkm checkpoint."""
    bert_dir = tmp_path / "bert"
    config = tiny_config()
    BertModel(
        BertConfig(
            **{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")},
            **{k: getattr(config, k) for k in ("num_attention_heads", "intermediate_size", "max_position_embeddings")},
        )
    ).save_pretrained(bert_dir)
    data["tokenizer"].save_pretrained(bert_dir)

    baseline = run_glue.main(glue_args(str(bert_dir), data, tmp_path / "baseline", "--max_train_steps 2"))
    assert "eval_accuracy" in baseline and not any("memory/" in key for key in baseline)  # peak_memory_mb: device
    assert json.loads((tmp_path / "baseline" / "config.json").read_text())["model_type"] == "bert"

    pkm_flags = "--pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16"
    converted = run_glue.main(
        glue_args(str(bert_dir), data, tmp_path / "converted", f"--max_train_steps 2 {pkm_flags}")
    )
    assert "eval_memory/layer_1/top1_mu" in converted and "eval_class_memory/layer_1/top1_iou" in converted
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert (saved["model_type"], saved["pkm_layers"], saved["pkm_n_keys"]) == ("bert_pkm", [1], 8)

    frozen_dir = tmp_path / "frozen"
    run_glue.main(glue_args(str(tmp_path / "converted"), data, frozen_dir, "--max_train_steps 2 --freeze_memory"))
    before, after = (
        load_file(tmp_path / "converted" / "model.safetensors"),
        load_file(frozen_dir / "model.safetensors"),
    )
    memory = [n for n in before if ".memory." in n and not n.endswith("num_batches_tracked")]
    assert any(n.endswith("running_var") for n in memory)  # the query BatchNorm statistics stay fixed too
    assert memory and all(torch.equal(before[n], after[n]) for n in memory)
    assert not torch.equal(before["classifier.weight"], after["classifier.weight"])


@pytest.mark.filterwarnings("ignore:`log_with=all` was passed but no supported trackers")
def test_stsb_regression_and_csv_without_task(tiny_pkm, data, tmp_path):
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    rows = [
        f"{i}\tmain\tx\t2012\t{i}\tnone\tnone\tit 's a film {i}\tthe film {i % 3}\t{i % 5}.{i % 10}\n"
        for i in range(12)
    ]
    stsb = tmp_path / "stsb.tsv"
    stsb.write_text(header + "".join(rows))
    options = f"--task_name stsb --train_file {stsb} --validation_file {stsb} --output_dir {tmp_path / 'stsb'}"
    results = run_glue.main(["--model_name_or_path", tiny_pkm, "--max_train_steps", "2", *options.split()])
    assert {"eval_pearson", "eval_spearmanr"} <= set(results) and not any("class_memory" in k for k in results)
    assert len(json.loads((tmp_path / "stsb" / "config.json").read_text())["id2label"]) == 1  # one output: regression

    # MNLI: three classes from gold_label, the matched and the mismatched sets; trackers on (none installed: a no-op)
    columns = "index promptID pairID genre s1_binary s2_binary s1_parse s2_parse sentence1 sentence2 label1 gold_label"
    labels = ["entailment", "neutral", "contradiction"]
    rows = [
        ["0", "1", "1", "fiction", "(", "(", "(", "(", f"a film {i}", f"the film {i % 4}", "x", labels[i % 3]]
        for i in range(12)
    ]
    mnli = tmp_path / "mnli.tsv"
    mnli.write_text("\n".join("\t".join(row) for row in [columns.split(), *rows]) + "\n")
    options = f"--task_name mnli --train_file {mnli} --validation_file {mnli} --validation_mismatched_file {mnli}"
    options += f" --with_tracking --checkpointing_steps epoch --output_dir {tmp_path / 'mnli'}"
    results = run_glue.main(["--model_name_or_path", tiny_pkm, "--max_train_steps", "2", *options.split()])
    assert results["eval_accuracy"] == results["eval_accuracy_mm"] and results["eval_samples_mm"] == 12
    assert "eval_memory/layer_1/mu" in results and not any("class_memory" in k for k in results)  # 3 classes
    assert (tmp_path / "mnli" / "epoch_0").is_dir()

    csv_file = tmp_path / "reviews.csv"
    csv_file.write_text("text,label\n" + "".join(f"a good film {i},pos\nbad,neg\n" for i in range(8)))
    options = f"--train_file {csv_file} --validation_file {csv_file} --output_dir {tmp_path / 'csv'}"
    results = run_glue.main(["--model_name_or_path", tiny_pkm, "--max_train_steps", "2", *options.split()])
    assert {"eval_accuracy", "eval_f1"} <= set(results)
    assert json.loads((tmp_path / "csv" / "config.json").read_text())["id2label"] == {"0": "neg", "1": "pos"}


def test_bad_input(tiny_pkm, data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_glue.parse_args(["--model_name_or_path", tiny_pkm, "--task_name", "sst3"])
    assert "unknown --task_name 'sst3'; the GLUE tasks are ['cola', 'mnli'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_glue.parse_args(["--model_name_or_path", tiny_pkm, "--train_file", str(tmp_path / "missing.csv")])
    assert "does not exist" in capsys.readouterr().err

    no_label = tmp_path / "no_label.csv"
    no_label.write_text("sentence,score\ngood,1\n")
    line = usage_error(capsys, lambda: run_glue.main(
        ["--model_name_or_path", tiny_pkm, "--train_file", str(no_label), "--output_dir", str(tmp_path / "x")]
    ))
    assert "no_label.csv has no 'label' column (columns: ['sentence', 'score'])" in line

    # the Hub is out of reach offline: the message says what to do instead
    line = usage_error(capsys, lambda: run_glue.main(["--model_name_or_path", tiny_pkm, "--task_name", "sst2",
                                                      "--output_dir", str(tmp_path / "y")]))  # fmt: skip
    assert re.search("Offline .* --train_file train.tsv --validation_file dev.tsv", line)

    # a checkpoint fine-tuned on a 3-class task cannot silently classify 2 classes
    mnli_dir = tmp_path / "mnli_model"
    labels = {0: "entailment", 1: "neutral", 2: "contradiction"}
    BertPkmForSequenceClassification(tiny_config(id2label=labels)).save_pretrained(mnli_dir)
    data["tokenizer"].save_pretrained(mnli_dir)
    line = usage_error(capsys, lambda: run_glue.main(glue_args(str(mnli_dir), data, tmp_path / "z", "--max_train_steps 1")))
    assert ("classification head of 3 labels ['entailment', 'neutral', 'contradiction'], but the data has 2 labels "
            "['negative', 'positive']. Pass --ignore_mismatched_sizes") in line
    results = run_glue.main(
        glue_args(str(mnli_dir), data, tmp_path / "z", "--max_train_steps 1 --ignore_mismatched_sizes")
    )
    assert json.loads((tmp_path / "z" / "config.json").read_text())["id2label"] == {"0": "negative", "1": "positive"}
    assert "eval_accuracy" in results


def test_seed_sweep_median(tmp_path):
    """The sweep's bookkeeping with a stand-in command: seeds, output dirs, medians, a failing seed, reuse."""
    fake = tmp_path / "fake_run.py"
    fake.write_text(
        "import argparse, json, os, sys\n"
        "p = argparse.ArgumentParser(); p.add_argument('--seed', type=int); p.add_argument('--output_dir')\n"
        "a, _ = p.parse_known_args()\n"
        "if a.seed == 13: sys.exit(3)\n"
        "os.makedirs(a.output_dir, exist_ok=True)\n"
        "results = {'eval_accuracy': a.seed / 10, 'eval_memory/layer_1/mu': 1.0}\n"
        "json.dump(results, open(os.path.join(a.output_dir, 'all_results.json'), 'w'))\n"
    )
    out = tmp_path / "sweep"
    command = [sys.executable, str(fake), "--seed", "99", "--output_dir=elsewhere", "--other", "x"]
    report = seed_sweep.main(["--seeds", "3", "1", "2", "--output_dir", str(out), "--", *command])
    assert report["median"]["eval_accuracy"] == pytest.approx(0.2)
    assert report["metrics"]["eval_accuracy"]["values"] == {"3": 0.3, "1": 0.1, "2": 0.2}
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["seed_1", "seed_2", "seed_3"]
    table = (out / "sweep_summary.md").read_text()
    assert "| **median** | | | **0.2000** |" in table and "eval_memory" not in table
    assert seed_sweep.seed_command(command, 5, "d")[-6:] == ["--other", "x", "--seed", "5", "--output_dir", "d"]

    with pytest.raises(SystemExit, match="1 of 3 runs failed"):
        seed_sweep.main(["--seeds", "1", "13", "5", "--output_dir", str(out), "--", *command])
    summary = json.loads((out / "sweep_summary.json").read_text())
    assert summary["failed_seeds"] == [13] and summary["runs"]["1"]["reused"] is True
    assert summary["median"]["eval_accuracy"] == pytest.approx(0.3)  # median of 0.1 and 0.5


@pytest.mark.slow  # end to end: seed_sweep.py runs run_glue.py (50 s on 2 cores)
def test_seed_sweep_runs_run_glue(tiny_pkm, data, tmp_path):
    """Two real seeds of a 2-step run_glue: each seed trains its own model and the summary holds their median."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    out = tmp_path / "sweep"
    command = [sys.executable, str(SCRIPTS / "seed_sweep.py"), *f"--seeds 1 2 --output_dir {out} --".split()]
    command += [
        sys.executable,
        str(SCRIPTS / "run_glue.py"),
        *glue_args(tiny_pkm, data, "ignored", "--max_train_steps 2"),
    ]
    subprocess.run(command, check=True, env=env, capture_output=True, timeout=300)
    summary = json.loads((out / "sweep_summary.json").read_text())
    values = summary["metrics"]["eval_accuracy"]["values"]
    assert set(values) == {"1", "2"} and summary["median"]["eval_accuracy"] == pytest.approx(sum(values.values()) / 2)
    first, second = (load_file(out / f"seed_{s}" / "model.safetensors")["classifier.weight"] for s in (1, 2))
    assert not torch.equal(first, second)


@pytest.mark.multiprocess
def test_two_processes(tiny_pkm, data, tmp_path):
    """2 CPU processes (torchrun, gloo): every dev example and token is counted once, as in one process."""
    output_dir = tmp_path / "ddp"
    options = "--max_train_steps 2 --per_device_train_batch_size 4"
    done = torchrun(SCRIPTS / "run_glue.py", glue_args(tiny_pkm, data, output_dir, options))
    assert "MULTI_CPU" in done.stderr and "Process index: 1" in done.stderr
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["eval_samples"] == 32 and results["step"] == 2
    single = run_glue.main(glue_args(tiny_pkm, data, tmp_path / "single", "--max_train_steps 0"))
    assert results["eval_memory/layer_1/tokens"] == single["eval_memory/layer_1/tokens"]
    assert results["eval_class_memory/layer_1/tokens_1"] == single["eval_class_memory/layer_1/tokens_1"]


@pytest.mark.multiprocess
def test_two_processes_with_memory_parallel(tiny_pkm, data, tmp_path):
    """FSDP2 with the value tables sharded column-wise (--memory_parallel) on 2 CPU processes: trains, evaluates every
    dev example once, and writes a consolidated Hub folder that loads through remote code."""
    from helpers import remote_code_model

    output_dir = tmp_path / "memory_parallel"
    options = "--max_train_steps 2 --per_device_train_batch_size 4 --memory_parallel"
    done = torchrun(SCRIPTS / "run_glue.py", glue_args(tiny_pkm, data, output_dir, options))
    assert "MULTI_CPU" in done.stderr and "Process index: 1" in done.stderr
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["eval_samples"] == 32 and results["step"] == 2 and 0 <= results["eval_accuracy"] <= 1
    remote_code_model(output_dir, "AutoModelForSequenceClassification")  # the folder's code, not the package


def test_eval_steps_staleness_and_mixed_precision(tiny_pkm, data, tmp_path):
    """The shared loop's flags: an evaluation every --eval_steps (none at epoch ends; the final one at the last step)
    with the training loss since the previous one in metrics.jsonl, --track_staleness, --mixed_precision bf16. An
    evaluation leaves the training random streams alone: resuming at a step that evaluated ends with the same weights
    and logs the same records (the training loss of the next evaluation averages the steps after the checkpoint)."""
    output_dir = tmp_path / "out"
    options = "--max_train_steps 10 --eval_steps 2 --track_staleness --checkpointing_steps 4"  # 8 steps an epoch
    results = run_glue.main(glue_args(tiny_pkm, data, output_dir, options))
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [2, 4, 6, 8, 10]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))
    assert all(r["train_loss"] > 0 for r in records if "eval_accuracy" in r)
    assert results["eval_accuracy"] == records[-1]["eval_accuracy"] and results["step"] == 10
    assert (output_dir / "staleness.safetensors").is_file() and (output_dir / "step_4" / "staleness.safetensors").is_file()
    assert any(key.startswith("staleness/layer_1/") for key in results)

    reset_accelerate_state()
    resumed_dir = tmp_path / "resumed"
    run_glue.main(glue_args(tiny_pkm, data, resumed_dir, f"{options} --resume_from_checkpoint {output_dir / 'step_4'}"))
    reference, resumed = load_file(output_dir / "model.safetensors"), load_file(resumed_dir / "model.safetensors")
    assert all(torch.equal(reference[name], resumed[name]) for name in reference)
    assert metrics_records(resumed_dir) == metrics_records(output_dir, after=4)

    reset_accelerate_state()  # a new Accelerator with another precision
    bf16 = run_glue.main(glue_args(tiny_pkm, data, tmp_path / "bf16", "--max_train_steps 2 --mixed_precision bf16"))
    assert 0 <= bf16["eval_accuracy"] <= 1 and bf16["step"] == 2


def metrics_records(output_dir, after=0):
    """The records of a run's metrics.jsonl past step `after`, without their wall-clock times."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    records = [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]
    return [record for record in records if record["step"] > after]


def test_resume_at_an_epoch_end_evaluation_logs_as_the_uninterrupted_run(tiny_pkm, data, tmp_path):
    """--checkpointing_steps 4 at 8 steps an epoch: step_8 is the last step of epoch 0, which evaluates at its end.
    Resumed from step_8, the run logs the uninterrupted run's records (the final evaluation's training loss averages
    epoch 1 alone) and ends with its weights."""
    options = "--num_train_epochs 2 --checkpointing_steps 4"
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_glue.main(glue_args(tiny_pkm, data, full, options))
    assert [r["step"] for r in metrics_records(full) if "eval_accuracy" in r] == [8, 16]
    reset_accelerate_state()
    run_glue.main(glue_args(tiny_pkm, data, resumed, f"{options} --resume_from_checkpoint {full / 'step_8'}"))
    assert metrics_records(resumed) == metrics_records(full, after=8)
    reference, weights = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(reference[name], weights[name]) for name in reference)
