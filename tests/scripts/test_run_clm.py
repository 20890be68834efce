"""run_clm.py on a tiny BertPkm causal LM and the embedded text: training with and without TRIME, both perplexities,
consecutive blocks for TRIME_long, exact resume, 2 CPU processes, a plain BertLMHeadModel, the metrics log and
`--memory_report`, sparse memory finetuning, clear errors on bad input."""

import json
import os

import pytest
import torch
from helpers import REPO_ROOT, load_script, make_tiny_folder, metrics_records, reset_accelerate_state, tiny_config, torchrun, usage_error
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BertTokenizer

from modeling_pkm_bert import BertPkmForCausalLM, register_auto_classes
from modeling_pkm_bert.methods.sparse_finetuning import scripts as sparse_finetuning
from modeling_pkm_bert.methods.sparse_finetuning.arguments import STATISTICS_NAME
from modeling_pkm_bert.methods.sparse_finetuning import BackgroundStatistics


SCRIPTS = REPO_ROOT / "run_scripts"
DATA = SCRIPTS / "data"


run_clm = load_script("run_clm")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny BertPkm config (not yet a decoder: the script makes it one; dropout on) and a word-level tokenizer."""
    return make_tiny_folder(tmp_path_factory.mktemp("tiny"))


def clm_args(tiny, output_dir, options=""):
    return [
        *("--config_name", tiny, "--tokenizer_name", tiny, "--output_dir", str(output_dir)),
        *"--block_size 32 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --seed 3".split(),
        *options.split(),
    ]


def run(args):
    """One run of the script; the next one (often in the same test) starts with a fresh accelerate state."""
    try:
        return run_clm.main(args)
    finally:
        reset_accelerate_state()


TRAINING = "--max_train_samples 24 --gradient_accumulation_steps 2 --max_train_steps 6 --max_eval_samples 8"


@pytest.fixture(scope="module")
def long_run(tiny, tmp_path_factory):
    """TRIME_long, 6 optimizer steps over epochs of 3 groups of 4 consecutive blocks with accumulation 2 (epochs end
    on a short accumulation), a checkpoint every 2 steps, staleness tracking, evaluation before training."""
    output_dir = tmp_path_factory.mktemp("long") / "out"
    options = f"{TRAINING} --trime long --checkpointing_steps 2 --track_staleness --evaluate_before_training"
    return {"results": run(clm_args(tiny, output_dir, options)), "output_dir": output_dir}


def test_trime_long_trains_and_reports_both_perplexities(long_run):
    results, output_dir = long_run["results"], long_run["output_dir"]
    assert json.loads((output_dir / "all_results.json").read_text()) == pytest.approx(results)
    assert (results["step"], results["train_samples"], results["train_tokens_per_step"]) == (6, 24, 2 * 4 * 32)
    for name in ("pride_and_prejudice", "moby_dick"):
        for prefix in ("", "initial_"):
            for kind in ("", "trime_"):
                loss = results[f"{prefix}eval_{name}_{kind}loss"]
                perplexity = results[f"{prefix}eval_{name}_{kind}perplexity"]
                assert perplexity == pytest.approx(torch.tensor(loss).exp().item())
        assert results[f"eval_{name}_trime_loss"] != results[f"eval_{name}_loss"]
        assert results[f"eval_{name}_samples"] == 8
    assert results["perplexity"] == results["eval_pride_and_prejudice_perplexity"]
    assert results["eval_memory/layer_1/tokens"] == 8 * 32
    assert sum(v for k, v in results.items() if k.startswith("staleness/layer_1/")) == pytest.approx(1.0)
    assert sorted(p.name for p in output_dir.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4", "step_6"]
    # a checkpoint holds the run's settings and the staleness state as json / safetensors, never a pickle
    settings = json.loads((output_dir / "step_4" / "run_settings.json").read_text())
    assert (settings["trime"], settings["block_size"], settings["per_device_train_batch_size"]) == ("long", 32, 4)
    assert settings["train_data"]["rows"] == 6  # 24 blocks in groups of 4 consecutive ones
    assert load_file(output_dir / "step_4" / "staleness.safetensors")["layer_1"].max() == 4
    assert list(output_dir.glob("step_*/custom_checkpoint_*")) == [] and not (output_dir / ".final.tmp").exists()
    assert "## Causal language modeling results" in (output_dir / "README.md").read_text()
    register_auto_classes()
    model = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    assert isinstance(model, BertPkmForCausalLM) and model.config.is_decoder
    # a decoder: a position's logits do not depend on later tokens
    input_ids = torch.randint(5, 200, (1, 12))
    changed = input_ids.clone()
    changed[0, 8:] = 7
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids).logits[0, :8], model(input_ids=changed).logits[0, :8])


def test_resume_gives_the_weights_of_the_uninterrupted_run(long_run, tiny, tmp_path):
    """step_4 sits in the middle of epoch 1 (after its first update): the resumed run skips the right groups of
    consecutive blocks, restores dropout, both optimizers, the scheduler and the staleness state."""
    reference = long_run["output_dir"]
    options = f"{TRAINING} --trime long --track_staleness --resume_from_checkpoint {reference / 'step_4'}"
    results = run(clm_args(tiny, tmp_path / "resumed", options))
    expected = load_file(reference / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert expected.keys() == resumed.keys()
    assert [name for name in expected if not torch.equal(expected[name], resumed[name])] == []
    assert torch.equal(
        load_file(tmp_path / "resumed" / "staleness.safetensors")["layer_1"],
        load_file(reference / "staleness.safetensors")["layer_1"],
    )
    assert results["eval_moby_dick_trime_loss"] == long_run["results"]["eval_moby_dick_trime_loss"]



def test_resume_at_an_epoch_end_evaluation_logs_as_the_uninterrupted_run(tiny, tmp_path):
    """A checkpoint every 3 steps at 3 steps an epoch: step_3 ends epoch 0, which evaluates at its end. Resumed from
    step_3, the run logs the uninterrupted run's records (the final evaluation's training loss averages steps 4 to 6
    alone) and ends with its weights."""
    options = f"{TRAINING} --checkpointing_steps 3"
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(clm_args(tiny, full, options))
    assert [r["step"] for r in metrics_records(full) if "eval_moby_dick_loss" in r] == [3, 6]
    run(clm_args(tiny, resumed, f"{options} --resume_from_checkpoint {full / 'step_3'}"))
    assert metrics_records(resumed) == metrics_records(full, after=3)
    reference, weights = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert [name for name in reference if not torch.equal(reference[name], weights[name])] == []


def test_resume_with_other_settings_stops_before_loading(long_run, tiny, tmp_path, capsys):
    """Another memory or learning rate than the checkpoint's would not continue the same run: a clear error naming
    each difference, before any state is loaded."""
    checkpoint = long_run["output_dir"] / "step_4"
    options = f"{TRAINING} --trime local --learning_rate 1e-4 --track_staleness --resume_from_checkpoint {checkpoint}"
    message = usage_error(capsys, lambda: run(clm_args(tiny, tmp_path / "resumed", options)))
    assert "was saved by a run with other settings" in message
    assert "trime: checkpoint 'long', now 'local'" in message and "learning_rate: checkpoint 5e-05, now 0.0001" in message
    assert "--allow_inexact_resume" in message and not (tmp_path / "resumed" / "model.safetensors").exists()


def test_trime_long_batches_are_consecutive_blocks_of_the_text(tiny, tmp_path, monkeypatch):
    """Every training batch of --trime long is 4 consecutive blocks of the tokenized text; the groups are shuffled."""
    seen = []
    original = run_clm.model_trime_losses

    def spy(model, inputs, *args, **kwargs):
        if model.training:
            seen.append(inputs["input_ids"].clone())
        return original(model, inputs, *args, **kwargs)

    monkeypatch.setattr(run_clm, "model_trime_losses", spy)
    run(clm_args(tiny, tmp_path / "out", "--trime long --max_train_steps 4 --max_eval_samples 2"))
    tokenizer = BertTokenizer.from_pretrained(tiny)
    text = (DATA / "pride_and_prejudice_train.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    stream = []
    for line in lines:
        stream += tokenizer(line, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
    starts = []
    for batch in seen:
        assert batch.shape == (4, 32)
        flat = batch.flatten().tolist()
        start = next(s for s in range(0, len(stream), 32) if stream[s : s + 128] == flat)
        assert start % 128 == 0  # groups of 4 blocks
        starts.append(start)
    assert len(seen) == 4 and starts != sorted(starts)  # shuffled groups


def test_local_memory_and_plain_bert_lm_head_model(tiny, tmp_path):
    """A plain BERT config without --pkm_* flags trains a BertLMHeadModel (made a decoder) with TRIME_local."""
    from transformers import BertConfig, BertLMHeadModel

    BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=64).save_pretrained(tmp_path / "bert")
    args = clm_args(tiny, tmp_path / "out", "--trime --max_train_steps 2 --max_eval_samples 4")
    results = run(["--config_name", str(tmp_path / "bert"), *args[2:]])
    assert results["step"] == 2 and "eval_moby_dick_trime_perplexity" in results
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(model, BertLMHeadModel) and model.config.is_decoder


def test_config_overrides_and_pkm_flags_build_the_model(tiny, tmp_path, monkeypatch):
    """--config_overrides and --pkm_* build the model; --memory_max_grad_norm clips the value table's gradient."""
    from modeling_pkm_bert.methods.optimizers import pkm_value_parameters
    from modeling_pkm_bert.methods.optimizers import scripts

    norms = []
    original = scripts.clip_memory_gradients  # the memory optimizer's hook clips (TrainingLoop.step)

    def clip_and_measure(accelerator, model, *args):
        before = original(accelerator, model, *args)
        (values,) = pkm_value_parameters(accelerator.unwrap_model(model))
        grad = values.grad.to_dense() if values.grad.is_sparse else values.grad
        norms.append((before.item(), grad.norm().item()))

    monkeypatch.setattr(scripts, "clip_memory_gradients", clip_and_measure)
    options = "--config_overrides num_hidden_layers=4,intermediate_size=48 --pkm_layers 3 --pkm_n_keys 4"
    options += " --max_train_steps 1 --max_eval_samples 2 --memory_max_grad_norm 1e-4"
    results = run(clm_args(tiny, tmp_path / "out", options))
    ((before, after),) = norms
    assert before > 1e-3 and after == pytest.approx(1e-4, rel=1e-3)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["intermediate_size"], config["pkm_layers"]) == (4, 48, [3])
    assert config["is_decoder"] and "eval_memory/layer_3/mu" in results and "eval_moby_dick_trime_loss" not in results


@pytest.mark.slow  # end to end: run_clm.py with its metrics log and memory report (6 s on 2 cores)
def test_metrics_log_and_memory_report(tiny, tmp_path):
    """metrics.jsonl holds every optimizer step's loss and every evaluation (--eval_steps 2, then the final one) with
    the training loss since the previous one; --memory_report writes the final model's report (blocks of
    --block_size tokens: the tiny model has 64 positions) with the training curves."""
    options = "--max_train_samples 16 --max_train_steps 4 --eval_steps 2 --max_eval_samples 4 --memory_report"
    results = run(clm_args(tiny, tmp_path / "out", options))
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    evaluations = [r for r in records if "eval_moby_dick_perplexity" in r]
    assert [r["step"] for r in evaluations] == [2, 4] and all(r["train_loss"] > 0 for r in evaluations)
    assert evaluations[-1]["eval_moby_dick_perplexity"] == pytest.approx(results["eval_moby_dick_perplexity"])
    assert results["train_runtime"] >= results["train_time"] > 0
    report = json.loads((tmp_path / "out" / "memory_report" / "memory_report.json").read_text())
    assert report["usage"]["layer_1"]["tokens"] > 0
    assert "training_curves.png" in (tmp_path / "out" / "memory_report" / "memory_report.md").read_text()


@pytest.fixture(scope="module")
def causal_checkpoint(tiny, tmp_path_factory):
    """A tiny BertPkmForCausalLM (a decoder, dropout on) saved with the word-level tokenizer."""
    folder = tmp_path_factory.mktemp("causal")
    BertTokenizer.from_pretrained(tiny).save_pretrained(folder)
    torch.manual_seed(0)
    BertPkmForCausalLM(tiny_config(vocab_size=200, hidden_dropout_prob=0.1, is_decoder=True)).save_pretrained(folder)
    return folder


def smf_args(checkpoint, output_dir, options=""):
    background = DATA / "pride_and_prejudice_validation.txt"
    smf = f"--sparse_memory_finetuning --smf_background_file {background} --smf_background_batches 5 --smf_top_t 6"
    smf += " --memory_optimizer sgd --memory_learning_rate 1.0"
    training = "--max_train_samples 12 --max_eval_samples 4 --gradient_accumulation_steps 2 --max_train_steps 6"
    return ["--model_name_or_path", str(checkpoint), *clm_args(None, output_dir, f"{training} {smf} {options}")[4:]]


def test_sparse_memory_finetuning_trains_only_chosen_rows_and_resumes_exactly(causal_checkpoint, tmp_path, monkeypatch):
    """--sparse_memory_finetuning: everything but the memory values stays fixed, only rows chosen at some step change
    (at most --smf_top_t a step), the background statistics (causal blocks) go beside the model and into every
    checkpoint, and a resumed run ends with the weights of the straight one."""
    chosen = []
    setup = sparse_finetuning.setup_from_args  # prepare_training calls it

    def spy(*args, **kwargs):  # records the rows chosen at every step
        smf = setup(*args, **kwargs)
        select = smf.select

        def select_and_record():
            masks = select()
            chosen.append(set(smf.chosen["layer_1"].tolist()))
            return masks

        smf.select = select_and_record
        return smf

    monkeypatch.setattr(sparse_finetuning, "setup_from_args", spy)
    straight = tmp_path / "straight"
    run(smf_args(causal_checkpoint, straight, "--checkpointing_steps 3"))
    initial, trained = load_file(causal_checkpoint / "model.safetensors"), load_file(straight / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["bert.encoder.layer.1.memory.values.weight"]
    changed = set((trained[moved[0]] != initial[moved[0]]).any(1).nonzero().flatten().tolist())
    assert len(chosen) == 6 and all(0 < len(rows) <= 6 for rows in chosen)
    assert changed and changed <= set().union(*chosen)
    statistics = BackgroundStatistics.load(straight / STATISTICS_NAME)
    assert statistics.num_batches == 5
    assert statistics.reads["layer_1"].sum() == 5 * (4 * 2) * 32 * 2 * 4  # documents x blocks x tokens x heads x knn
    assert BackgroundStatistics.load(straight / "step_3" / STATISTICS_NAME) == statistics
    # the resumed run takes the statistics from the checkpoint and ends with the weights of the straight run
    resumed = tmp_path / "resumed"
    run(smf_args(causal_checkpoint, resumed, f"--resume_from_checkpoint {straight / 'step_3'}"))
    expected, got = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert [n for n in expected if not torch.equal(expected[n], got[n])] == []


@pytest.mark.multiprocess
def test_two_cpu_processes_match_one(long_run, tiny, tmp_path):
    """torchrun, 2 processes, gloo: TRIME_long trains; every evaluation block counts once, so the model as loaded gets
    the 1-process perplexities (with and without the memory)."""
    options = "--max_train_samples 24 --max_train_steps 2 --max_eval_samples 8 --trime long --evaluate_before_training"
    options += " --per_device_train_batch_size 2 --memory_optimizer sparse_row_adam"
    done = torchrun(SCRIPTS / "run_clm.py", clm_args(tiny, tmp_path / "ddp", options))
    assert "MULTI_CPU" in done.stderr and "[RANK 1]" in done.stderr
    results = json.loads((tmp_path / "ddp" / "all_results.json").read_text())
    assert results["step"] == 2
    one = long_run["results"]
    for name in ("pride_and_prejudice", "moby_dick"):
        # 8 blocks in 2 shards of 4 = the 1-process batches of 4 consecutive blocks: the same memories
        for kind in ("", "trime_"):
            key = f"initial_eval_{name}_{kind}loss"
            assert results[key] == pytest.approx(one[key], rel=1e-6), key


def test_push_to_hub_uploads_the_folder_with_its_card(tiny, tmp_path, monkeypatch):
    """The card names the license and base model given, and the command without the token or this machine's paths;
    the token reaches no file of the run (a real tensorboard tracker included)."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the real tracker this test runs)")
    from huggingface_hub import ModelCard

    token = "hf_" + "Zq8wLx3TnVb5Rk2Jm7Yc9Pd4Hs6Gf1Ae"  # token-shaped, not a real one
    pushed = []
    monkeypatch.setattr("modeling_pkm_bert.hub.upload.push_folder_to_hub", lambda *a, **k: pushed.append((a, k)))
    options = "--max_train_steps 1 --max_eval_samples 2 --push_to_hub --hub_model_id someone/tiny-clm"
    options += f" --hub_token {token} --license mit --base_model org/tiny-bert --with_tracking --report_to tensorboard"
    run(clm_args(tiny, tmp_path / "out", options))
    ((args, kwargs),) = pushed
    assert args == (str(tmp_path / "out"), "someone/tiny-clm") and kwargs["token"] == token
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert (card.data.license, card.data.base_model) == ("mit", "org/tiny-bert")
    assert "someone/tiny-clm" in card.text and "`eval_moby_dick_perplexity`" in card.text
    produced_by = card.text.split("Produced by:")[1]
    # local paths shown by their name (or relative to the output folder), never in full
    assert f"python run_scripts/run_clm.py --config_name {os.path.basename(tiny)} " in produced_by
    assert "--output_dir out " in produced_by and tiny not in card.text and str(tmp_path) not in card.text
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.name == "hparams.yml" for p in written)  # the tracker ran
    assert [p.name for p in written if token.encode() in p.read_bytes()] == []


@pytest.mark.parametrize(
    "options, message",
    [
        ("--train_file {tmp}/empty.txt", "is empty"),
        ("--train_file {tmp}/missing.txt", "does not exist"),
        ("--block_size 1", "--block_size must be at least 2"),
        ("--model_name_or_path x --config_overrides hidden_size=8", "--config_overrides applies to a model trained"),
        ("--trime global", "invalid choice: 'global'"),
        ("--gradient_accumulation_steps 0", "--gradient_accumulation_steps must be >= 1 (batches per optimizer step)"),
        ("--train_file {tmp}/latin1.txt", "--train_file '{tmp}/latin1.txt' is not UTF-8 text: byte 3 (line 1)"),
        ("--output_dir {tmp}/a_file", "--output_dir '{tmp}/a_file': exists and is not a folder"),
        ("--memory_max_grad_norm 0", "--memory_max_grad_norm: must be a finite number > 0, got 0"),
        ("--base_model {tmp}", "is not a Hub model id"),
        ("--resume_from_checkpoint {tmp}/nowhere/step_2", "is not a folder (a step_<N>/epoch_<E> folder, or 'latest')"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tiny, tmp_path, capsys, options, message):
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(SystemExit) as raised:
        run_clm.parse_args(clm_args(tiny, tmp_path / "out", options.format(tmp=tmp_path)))
    assert raised.value.code == 2  # argparse's usage error
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing was created


def test_bad_model_or_text_is_a_clear_error_before_training(tiny, tmp_path, monkeypatch, capsys):
    line = usage_error(capsys, lambda: run(clm_args(tiny, tmp_path / "out", "--block_size 128")))
    assert "--block_size 128 is longer than the model's 64 positions" in line
    (tmp_path / "short.txt").write_text("far too short a text\n")
    line = usage_error(capsys, lambda: run(clm_args(tiny, tmp_path / "out", f"--validation_files {tmp_path / 'short.txt'}")))
    assert "short yields no block of 32 tokens" in line
    line = usage_error(capsys, lambda: run(clm_args(tiny, tmp_path / "out", "--trime long --max_train_samples 2")))
    assert "--trime long: the training set has 2 blocks of 32 tokens, fewer than one" in line
    from transformers import BertConfig

    BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=64).save_pretrained(tmp_path / "bert")  # fmt: skip
    line = usage_error(capsys, lambda: run(["--config_name", str(tmp_path / "bert"),
                                            *clm_args(tiny, tmp_path / "out", "--freeze_memory")[2:]]))  # fmt: skip
    assert "--freeze_memory: the model (BertLMHeadModel) has no product key memory" in line
    monkeypatch.setattr(BertPkmForCausalLM, "get_output_embeddings", lambda self: None)
    line = usage_error(capsys, lambda: run(clm_args(tiny, tmp_path / "out", "--trime local")))
    assert "--trime: BertPkmForCausalLM has no output embeddings" in line
    assert not (tmp_path / "out" / "model.safetensors").exists()
