"""run_mlm.py on a tiny model and the embedded text: exact resume, 2 CPU processes, several evaluation sets, staleness,
convert-on-load of the real MiniLM, and clear errors on bad data."""

import json
import os
import re

import accelerate
import pytest
import torch
from helpers import (
    REPO_ROOT, load_script, make_tiny_folder, metrics_records, mlm_args, reset_accelerate_state, tiny_config, torchrun,
    usage_error,
)
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM

from modeling_pkm_bert import BertPkmForMaskedLM, register_auto_classes
from modeling_pkm_bert.analysis.memory_usage import track_memory_usage
from modeling_pkm_bert.analysis.staleness import NEVER, StalenessTracker


SCRIPTS = REPO_ROOT / "run_scripts"
DATA = SCRIPTS / "data"


run_mlm = load_script("run_mlm")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_folder(tmp_path_factory.mktemp("tiny"))


def run(args):
    """One run of the script; the next one (often in the same test) starts with a fresh accelerate state."""
    try:
        return run_mlm.main(args)
    finally:
        reset_accelerate_state()


TRAINING = "--max_train_samples 12 --gradient_accumulation_steps 2 --max_train_steps 6 --track_staleness"
TRAINING += " --max_eval_samples 12"


@pytest.fixture(scope="module")
def straight_runs(tiny, tmp_path_factory):
    """Per value optimizer, 6 optimizer steps over epochs of 3 batches with gradient accumulation 2 (so every epoch
    ends on a short accumulation), a checkpoint every 3 steps, staleness tracking; made on first use."""
    runs = {}

    def get(memory_optimizer):
        if memory_optimizer not in runs:
            output_dir = tmp_path_factory.mktemp(memory_optimizer) / "out"
            options = (
                f"{TRAINING} --memory_optimizer {memory_optimizer} --checkpointing_steps 3 --evaluate_before_training"
            )
            runs[memory_optimizer] = {"results": run(mlm_args(tiny, output_dir, options)), "output_dir": output_dir}
        return runs[memory_optimizer]

    return get


@pytest.fixture(scope="module")
def straight_run(straight_runs):
    return straight_runs("adam")


def test_embedded_default_trains_and_reports_every_set(straight_run):
    results, output_dir = straight_run["results"], straight_run["output_dir"]
    on_disk = json.loads((output_dir / "all_results.json").read_text())
    assert on_disk == pytest.approx(results)
    assert (results["step"], results["epoch"], results["train_samples"]) == (6, 3, 12)
    # one loss/perplexity per embedded evaluation set, before and after training; the official "perplexity" key
    for name in ("pride_and_prejudice", "moby_dick"):
        for prefix in ("", "initial_"):
            loss, perplexity = results[f"{prefix}eval_{name}_loss"], results[f"{prefix}eval_{name}_perplexity"]
            assert perplexity == pytest.approx(torch.tensor(loss).exp().item())
        assert results[f"eval_{name}_samples"] == 12
    assert results["perplexity"] == results["eval_pride_and_prejudice_perplexity"]
    # memory usage of the memory layer on the first set, padding excluded: 12 blocks of 32 tokens
    for prefix in ("eval_memory", "initial_eval_memory"):
        assert results[f"{prefix}/layer_1/tokens"] == 12 * 32
        assert 0 < results[f"{prefix}/layer_1/top1_mu"] <= results[f"{prefix}/layer_1/mu"] <= 1
        assert results[f"{prefix}/layer_1/kl_u"] >= 0 and results[f"{prefix}/layer_1/kl_w"] >= 0
    # staleness: every slot is in exactly one step range or "never"
    staleness = {k: v for k, v in results.items() if k.startswith("staleness/layer_1/")}
    assert sum(staleness.values()) == pytest.approx(1.0) and "staleness/layer_1/never" in staleness
    last = load_file(output_dir / "staleness.safetensors")["layer_1"]
    assert last.shape == (64,) and last.max() == 6 and last.min() >= NEVER
    assert results["train_steps_per_second"] > 0 and results["peak_memory_mb"] > 0
    # a Hub-ready folder: code files, tokenizer, model card with the results
    assert {"config.json", "model.safetensors", "modeling_bert_pkm.py", "tokenizer.json", "README.md"} <= {
        p.name for p in output_dir.iterdir()
    }
    assert "## Masked language modeling results" in (output_dir / "README.md").read_text()
    assert sorted(p.name for p in output_dir.iterdir() if p.name.startswith("step_")) == ["step_3", "step_6"]
    assert not list(output_dir.glob("*.tmp"))
    register_auto_classes()
    assert isinstance(AutoModelForMaskedLM.from_pretrained(output_dir), BertPkmForMaskedLM)


@pytest.mark.parametrize("memory_optimizer", ["adam", "sparse_row_adam"])
def test_resume_gives_the_weights_of_the_uninterrupted_run(straight_runs, tiny, tmp_path, memory_optimizer):
    """step_3 sits in the middle of epoch 1 (its first update done): the resumed run skips the right batches, draws the
    same masks and dropout, restores both optimizers, the scheduler and the staleness state."""
    straight = straight_runs(memory_optimizer)
    reference = straight["output_dir"]
    options = f"{TRAINING} --memory_optimizer {memory_optimizer} --resume_from_checkpoint {reference / 'step_3'}"
    results = run(mlm_args(tiny, tmp_path / "resumed", options))
    expected, resumed = (
        load_file(reference / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model.safetensors"),
    )
    assert expected.keys() == resumed.keys()
    assert [name for name in expected if not torch.equal(expected[name], resumed[name])] == []
    staleness = load_file(tmp_path / "resumed" / "staleness.safetensors")["layer_1"]
    assert torch.equal(staleness, load_file(reference / "staleness.safetensors")["layer_1"])
    assert results["eval_moby_dick_loss"] == straight["results"]["eval_moby_dick_loss"]


def test_resume_at_an_epoch_end_evaluation_logs_as_the_uninterrupted_run(tiny, tmp_path):
    """A checkpoint every 2 steps at 2 steps an epoch: step_2 ends epoch 0, which evaluates at its end (the evaluation
    draws its masks). Resumed from step_2, the run logs the uninterrupted run's records, the training loss of each later
    evaluation included, and ends with its weights."""
    options = f"{TRAINING} --checkpointing_steps 2"
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(mlm_args(tiny, full, options))
    assert [r["step"] for r in metrics_records(full) if "eval_moby_dick_loss" in r] == [2, 4, 6]
    run(mlm_args(tiny, resumed, f"{options} --resume_from_checkpoint {full / 'step_2'}"))
    assert metrics_records(resumed) == metrics_records(full, after=2)
    reference, weights = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert [name for name in reference if not torch.equal(reference[name], weights[name])] == []


@pytest.mark.multiprocess
def test_two_cpu_processes_match_one(straight_run, tiny, tmp_path):
    """torchrun, 2 processes, gloo, sparse value gradients under DDP: trains, saves, and evaluates every example once,
    so the model as loaded gets exactly the 1-process perplexities and memory counts."""
    options = "--max_train_samples 12 --gradient_accumulation_steps 2 --max_train_steps 2 --max_eval_samples 12"
    options += " --memory_optimizer sparse_row_adam --evaluate_before_training --per_device_train_batch_size 2"
    done = torchrun(SCRIPTS / "run_mlm.py", mlm_args(tiny, tmp_path / "ddp", options))
    assert "MULTI_CPU" in done.stderr and "[RANK 1]" in done.stderr
    assert "sparse gradients" in done.stderr  # the row-wise update got sparse gradients through DDP (gloo)
    results = json.loads((tmp_path / "ddp" / "all_results.json").read_text())
    assert results["step"] == 2
    one = straight_run["results"]
    for key, value in one.items():
        if key.startswith("initial_"):
            assert results[key] == pytest.approx(value, rel=1e-6), key
    assert isinstance(AutoModelForMaskedLM.from_pretrained(tmp_path / "ddp"), BertPkmForMaskedLM)


def test_named_validation_files_csv_json_and_wikitext(tiny, tmp_path, shared_data, capsys):
    """Evaluation only (no training data): WikiText-2 test (.raw), a csv and a json file, each reported by name."""
    wikitext = shared_data / "wikitext-2-raw" / "wiki.test.raw"
    if not wikitext.is_file():
        pytest.skip(f"WikiText-2 test not found at {wikitext}")
    lines = (DATA / "moby_dick_validation.txt").read_text(encoding="utf-8").splitlines()
    (tmp_path / "moby.csv").write_text(
        "id,body\n" + "".join(f'{i},"{line.replace(chr(34), "")}"\n' for i, line in enumerate(lines))
    )
    (tmp_path / "moby_lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    register_auto_classes()
    model_dir = tmp_path / "model"
    BertPkmForMaskedLM(tiny_config(vocab_size=200, max_position_embeddings=64)).save_pretrained(model_dir)
    options = f"--validation_files wt2={wikitext} {tmp_path / 'moby.csv'} {tmp_path / 'moby_lines.jsonl'}"
    options += " --text_column_name body --max_eval_samples 4"
    line = usage_error(capsys, lambda: run(["--model_name_or_path", str(model_dir), *mlm_args(tiny, tmp_path / "out", options)]))
    assert re.search(r"moby_lines.jsonl has no column 'body' .*columns: \['text'\]", line)
    options = f"--validation_files wt2={wikitext} {tmp_path / 'moby.csv'} --text_column_name body --max_eval_samples 4"
    options += " --line_by_line"
    results = run(["--model_name_or_path", str(model_dir), *mlm_args(tiny, tmp_path / "out", options)])
    assert {"eval_wt2_perplexity", "eval_moby_perplexity", "eval_memory/layer_1/mu"} <= set(results)
    assert "step" not in results and not (tmp_path / "out" / "model.safetensors").exists()  # nothing was trained


def test_trackers_get_perplexities_and_memory_usage(tiny, tmp_path, monkeypatch):
    """--with_tracking: every evaluation (step 0, every --eval_steps, the end) reaches the trackers with the
    perplexity of each set; the memory usage at step 0 and at the end."""
    logged = []
    monkeypatch.setattr(
        accelerate.Accelerator, "log", lambda self, values, step=None, **kw: logged.append((step, values))
    )
    options = "--max_train_steps 4 --eval_steps 2 --max_eval_samples 4 --with_tracking --evaluate_before_training"
    run(mlm_args(tiny, tmp_path / "out", options))
    steps = [step for step, _ in logged]
    assert steps == [0, 2, 4]
    for step, values in logged:
        assert {"eval_pride_and_prejudice_perplexity", "eval_moby_dick_perplexity"} <= set(values)
        assert ("eval_memory/layer_1/top1_mu" in values) == (step != 2)
        assert all(isinstance(v, (int, float)) for v in values.values())


def test_from_scratch_bert_config_with_pkm_flags(tiny, tmp_path):
    """A plain BERT config plus --pkm_* flags trains a BertPkm model from scratch (the paper's rows without +Init)."""
    from transformers import BertConfig

    shape = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)
    BertConfig(vocab_size=200, max_position_embeddings=64, **shape).save_pretrained(tmp_path / "bert")
    options = "--pkm_layers 2 --pkm_mode replace --pkm_n_keys 8 --pkm_knn 4 --pkm_heads 2 --pkm_k_dim 16"
    args = mlm_args(tiny, tmp_path / "out", f"{options} --max_train_steps 1 --max_eval_samples 4")
    results = run(["--config_name", str(tmp_path / "bert"), *args[2:]])
    assert "eval_memory/layer_2/mu" in results
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["pkm_layers"], config["pkm_mode"]) == ("bert_pkm", [2], "replace")


def test_push_to_hub_uploads_the_folder_with_its_card(tiny, tmp_path, monkeypatch):
    pushed = []
    monkeypatch.setattr("modeling_pkm_bert.hub.upload.push_folder_to_hub", lambda *a, **k: pushed.append((a, k)))
    options = "--max_train_steps 1 --max_eval_samples 4 --push_to_hub --hub_model_id someone/tiny-mlm"
    run(mlm_args(tiny, tmp_path / "out", options))
    ((args, kwargs),) = pushed
    assert args == (str(tmp_path / "out"), "someone/tiny-mlm") and kwargs["private"] is False
    card = (tmp_path / "out" / "README.md").read_text()
    assert "someone/tiny-mlm" in card and "`eval_moby_dick_perplexity`" in card and "--max_train_steps 1" in card


def test_dataset_name_with_splits_and_a_held_out_percentage(tiny, tmp_path):
    """--dataset_name: a local folder of text files (train.txt, validation.txt) uses its validation split; without
    one, --validation_split_percentage of the training lines are held out."""
    lines = (DATA / "pride_and_prejudice_train.txt").read_text(encoding="utf-8").splitlines()
    for name, folder in (("with", tmp_path / "with_validation"), ("without", tmp_path / "train_only")):
        folder.mkdir()
        (folder / "train.txt").write_text("\n".join(lines[:200]) + "\n")
        if name == "with":
            (folder / "validation.txt").write_text("\n".join(lines[-40:]) + "\n")
        options = f"--dataset_name {folder} --max_train_steps 1 --max_eval_samples 4 --validation_split_percentage 10"
        results = run(mlm_args(tiny, tmp_path / f"out_{name}", options))
        assert results["step"] == 1 and results["eval_validation_samples"] == 4
        assert results["perplexity"] == results["eval_validation_perplexity"]


@pytest.mark.parametrize(
    "options, message",
    [
        ("--train_file {tmp}/missing.txt", "does not exist"),
        ("--train_file {tmp}/empty.txt", "is empty"),
        ("--train_file {tmp}/notes.md", "expected a txt"),
        ("--validation_files a={tmp}/blank.txt", "is empty"),
        ("--validation_files {tmp}/a/x.txt {tmp}/b/x.txt", "two evaluation sets are named 'x'"),
    ],
)
def test_bad_data_files_are_refused_before_anything_runs(tiny, tmp_path, capsys, options, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "notes.md").write_text("text")
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.txt").write_text("some text")
    with pytest.raises(SystemExit):
        run_mlm.parse_args(mlm_args(tiny, tmp_path / "out", options.format(tmp=tmp_path)))
    assert message in capsys.readouterr().err


def test_missing_column_and_too_short_text_are_clear_errors(tiny, tmp_path, capsys):
    (tmp_path / "train.csv").write_text("a,b\nx,y\n")
    line = usage_error(capsys, lambda: run(mlm_args(tiny, tmp_path / "out", f"--train_file {tmp_path / 'train.csv'}")))
    assert "no 'text' column; name the text column with --text_column_name" in line
    (tmp_path / "short.txt").write_text("too short\n")
    options = f"--train_file {DATA / 'moby_dick_validation.txt'} --validation_files {tmp_path / 'short.txt'}"
    assert "short yields no sequence of 32 tokens" in usage_error(capsys, lambda: run(mlm_args(tiny, tmp_path / "out", options)))


def test_embedded_validation_text_is_held_out():
    train = set((DATA / "pride_and_prejudice_train.txt").read_text(encoding="utf-8").splitlines())
    for name in ("pride_and_prejudice_validation.txt", "moby_dick_validation.txt"):
        held_out = [line for line in (DATA / name).read_text(encoding="utf-8").splitlines() if len(line) > 40]
        assert held_out and not train.intersection(held_out)
    args = run_mlm.parse_args(["--model_name_or_path", "x"])
    assert args.embedded_data and args.train_file.endswith("pride_and_prejudice_train.txt")
    assert list(args.validation_sets) == ["pride_and_prejudice", "moby_dick"]


def test_staleness_tracker_records_top1_picks_of_training_forwards_only():
    register_auto_classes()
    model = BertPkmForMaskedLM(tiny_config(pkm_query_batchnorm=False))  # train and eval forwards then agree
    inputs = {"input_ids": torch.randint(5, 99, (3, 10)), "attention_mask": torch.ones(3, 10, dtype=torch.long)}
    inputs["attention_mask"][0, 7:] = 0
    staleness = StalenessTracker(model).attach()
    staleness.step = 4
    model.train()
    model(**inputs)
    with track_memory_usage(model) as usage:  # eval forward: counted by the usage tracker, ignored by staleness
        model.eval()
        with torch.no_grad():
            model(**inputs)
    top1 = usage.accumulators["layer_1"].top1_counts > 0
    last = staleness.last_top1_step["layer_1"]
    assert torch.equal(last == 4, top1) and torch.equal(last == NEVER, ~top1)
    histogram = staleness.histogram(total_steps=5, bins=5)["layer_1"]
    assert histogram["steps_4-4"] == int(top1.sum()) and sum(histogram.values()) == 64
    copy = StalenessTracker(model)
    copy.load_state_dict(staleness.state_dict())
    assert torch.equal(copy.last_top1_step["layer_1"], last)
    staleness.detach()
    staleness.step = 9
    model.train()
    model(**inputs)
    assert torch.equal(staleness.last_top1_step["layer_1"], last)


@pytest.mark.slow  # end to end: run_mlm.py trains the real MiniLM (10 s on 2 cores)
def test_convert_minilm_on_load_and_train(minilm_path, tmp_path):
    """The real all-MiniLM-L6-v2 (a BertModel without MLM head) converted on load into ResM at [2, 4] (+Init): a few
    steps, the memories in the results, the head and memories saved; the FFN weights came from the checkpoint."""
    options = "--pkm_layers 2 4 --pkm_n_keys 16 --pkm_knn 8 --pkm_k_dim 32 --max_train_steps 2 --max_eval_samples 4"
    args = ["--model_name_or_path", str(minilm_path), "--output_dir", str(tmp_path / "resm")]
    args += "--max_seq_length 16 --per_device_train_batch_size 2 --seed 0".split() + options.split()
    results = run(args)
    assert {"eval_memory/layer_2/mu", "eval_memory/layer_4/mu", "eval_moby_dick_perplexity"} <= set(results)
    saved = load_file(tmp_path / "resm" / "model.safetensors")
    source = load_file(minilm_path / "model.safetensors")
    assert saved["bert.encoder.layer.2.memory.values.weight"].shape == (256, 384)
    assert "cls.predictions.transform.dense.weight" in saved
    # the plain FFN of a non-memory layer barely moved in 2 steps at lr 5e-5 from the MiniLM weights
    name = "encoder.layer.0.intermediate.dense.weight"
    assert (saved[f"bert.{name}"] - source[name]).abs().max() < 1e-3


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_loaded_weights_are_copied_out_of_the_checkpoint_file(tmp_path):
    """from_pretrained leaves CPU weights as a copy-on-write map of model.safetensors (first writes fault page by page,
    which made the sparse value update crawl); load_model copies them into process memory, ties kept."""
    from modeling_pkm_bert.training import load_model

    register_auto_classes()
    BertPkmForMaskedLM(tiny_config(pkm_n_keys=64, hidden_size=64)).save_pretrained(tmp_path)  # 1 MiB of values
    checkpoint = str(tmp_path / "model.safetensors")

    def file_mapped(tensor):
        address = tensor.data_ptr()
        for line in open("/proc/self/maps").read().splitlines():
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return line.endswith(checkpoint)
        return False

    assert file_mapped(BertPkmForMaskedLM.from_pretrained(tmp_path).bert.encoder.layer[1].memory.values.weight)
    model = load_model("masked-lm", str(tmp_path))
    assert not any(file_mapped(p) for p in model.parameters())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def write_facts(path, people=("elizabeth", "jane", "lydia", "darcy", "bingley", "wickham", "collins", "lucas")):
    """A json-lines file of facts in the tiny folder's words, each value ("the <place>") a span to mask."""
    places = ("netherfield", "room", "house", "ball", "family", "evening", "dance", "day")
    rows = []
    for i, person in enumerate(people):
        for template in ("{} is at the {} .", "mr {} was in the {} ."):
            text = template.format(person, places[i])
            start = text.index(" the ") + 1
            rows.append({"text": text, "spans": [[start, start + len(f"the {places[i]}")]]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_span_masking_trains_on_the_values_only_and_resumes_exactly(tiny, tmp_path, monkeypatch):
    """--span_column with --mlm_probability 0: every training batch masks exactly its rows' spans (the value, two
    tokens here), shown as [MASK]; a resumed run ends with the uninterrupted run's weights."""
    facts = write_facts(tmp_path / "facts.jsonl")
    options = f"--train_file {facts} --validation_file {facts} --span_column spans --mlm_probability 0"
    options += " --mask_replace_prob 1 --line_by_line --max_train_steps 4 --checkpointing_steps 2"
    drawn = []
    mask_batch = run_mlm.mask_batch

    def recording(args, tokenizer, input_ids, special, units, seed):
        masked = mask_batch(args, tokenizer, input_ids, special, units, seed)
        drawn.append((input_ids.clone(), *masked))
        return masked

    monkeypatch.setattr(run_mlm, "mask_batch", recording)
    results = run(mlm_args(tiny, tmp_path / "full", options))
    tokenizer = run_mlm.load_tokenizer(tiny, "--tokenizer_name")
    values = {tokenizer.convert_tokens_to_ids(w) for w in "the netherfield room house ball family evening dance day".split()}
    assert len(drawn) > 4  # the evaluation set's masks, then 4 training batches
    for original, input_ids, labels in drawn:
        masked = labels != -100
        assert (masked.sum(dim=1) == 2).all()  # "the <place>", in every row
        assert set(labels[masked].tolist()) <= values
        assert (input_ids[masked] == tokenizer.mask_token_id).all() and torch.equal(labels[masked], original[masked])
        assert torch.equal(input_ids[~masked], original[~masked])
    assert results["eval_facts_samples"] == 16 and results["eval_facts_loss"] > 0
    run(mlm_args(tiny, tmp_path / "resumed", f"{options} --resume_from_checkpoint {tmp_path / 'full' / 'step_2'}"))
    reference, weights = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert [name for name in reference if not torch.equal(reference[name], weights[name])] == []


@pytest.mark.parametrize(
    "options, message",
    [
        ("--span_column spans", r"--span_column needs a json/jsonl --train_file .*--train_file is '.*\.txt'"),
        ("--mlm_probability 0", r"--mlm_probability must be in \(0, 1\), got 0.0"),
        ("--mask_replace_prob 0.95 --random_replace_prob 0.1", r"--mask_replace_prob 0.95 and --random_replace_prob 0.1 add up to more than 1"),
        ("--mask_replace_prob 1.5", r"--mask_replace_prob must be in \[0, 1\], got 1.5"),
        ("--span_column spans --span_mask_probability 0 --train_file {facts}", r"--span_mask_probability must be in"),
    ],
)
def test_bad_masking_flags_are_one_line_errors(tiny, tmp_path, capsys, options, message):
    facts = write_facts(tmp_path / "facts.jsonl")
    train = "" if "--train_file" in options else f"--train_file {DATA / 'pride_and_prejudice_train.txt'}"
    line = usage_error(capsys, lambda: run(mlm_args(tiny, tmp_path / "out", f"{train} {options.format(facts=facts)}")))
    assert re.search(message, line), line


def test_span_column_missing_from_the_training_file_is_a_clear_error(tiny, tmp_path, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": "elizabeth is at the ball ."}) + "\n" for _ in range(8)))
    options = f"--train_file {plain} --validation_file {write_facts(tmp_path / 'facts.jsonl')} --span_column spans"
    line = usage_error(capsys, lambda: run(mlm_args(tiny, tmp_path / "out", options)))
    assert re.search(r"plain.jsonl has no column 'spans' \(--span_column\)", line), line
