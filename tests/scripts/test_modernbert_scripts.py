"""ModernBertPkm through the tools (issue 48): `convert_to_pkm` / `convert_to_pkm.py` take ModernBERT-type folders and Hub
ids (function-preserving with zero values for every head, padding in the batch; the tokenizer copied; a card naming
the base model and its license), and the scripts (run_mlm, run_glue, run_squad) convert one on load, train it and
train the saved folder on; the memory report and explorer read it. Tiny random ModernBERT models built with
transformers' own classes and a word-level tokenizer built here (no Hub)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import ModernBertConfig

from helpers import ModernBertPkmModelTester, load_script, reset_accelerate_state, torchrun
from modeling_pkm_bert import (
    MODERNBERT_AUTO_MAP,
    ModernBertPkmConfig,
    ModernBertPkmForMaskedLM,
    ModernBertPkmForMultipleChoice,
    ModernBertPkmForQuestionAnswering,
    ModernBertPkmForSequenceClassification,
    ModernBertPkmForTokenClassification,
    ModernBertPkmModel,
)
from modeling_pkm_bert.hub.conversion import convert_to_pkm


# the tester's ModernBERT body with a vocabulary of 64 (TINY) and its memory at layer 1, zero values (PKM)
TESTER = ModernBertPkmModelTester(vocab_size=64, pkm_value_init="zeros")
TINY, PKM = TESTER.base, TESTER.memory
PKM_FLAGS = "--pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16".split()
HEADS = {
    "Model": ModernBertPkmModel,
    "ForMaskedLM": ModernBertPkmForMaskedLM,
    "ForSequenceClassification": ModernBertPkmForSequenceClassification,
    "ForTokenClassification": ModernBertPkmForTokenClassification,
    "ForQuestionAnswering": ModernBertPkmForQuestionAnswering,
    "ForMultipleChoice": ModernBertPkmForMultipleChoice,
}
SENTENCES = ["a good movie", "the cat sat on the mat", "a bad film", "the movie was good", "awful and bad",
             "good good good", "the mat is bad", "a great cat"]  # fmt: skip


def source_model(head: str, **overrides):
    labels = 2 if head == "ForQuestionAnswering" else 3
    config = TESTER.get_source_config(**{"num_labels": labels, **overrides})
    return getattr(transformers, f"ModernBert{head}")(config).eval()


def outputs_of(model, head: str) -> torch.Tensor:
    """The model's output on a batch with a right-padded row (ids below TINY's vocabulary)."""
    ids = torch.tensor([[1, 7, 8, 9, 10, 11, 12, 2], [1, 13, 14, 2, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    if head == "ForMultipleChoice":
        ids, mask = ids[None].repeat(2, 1, 1), mask[None].repeat(2, 1, 1)
    with torch.no_grad():
        result = model(ids, attention_mask=mask)
    if head == "Model":
        return result.last_hidden_state[mask.bool()]
    if head == "ForQuestionAnswering":
        return torch.stack([result.start_logits, result.end_logits])[:, mask.bool()]
    if head in ("ForMaskedLM", "ForTokenClassification"):
        return result.logits[mask.bool()]
    return result.logits


@pytest.mark.parametrize("head", list(HEADS))
def test_convert_to_pkm_is_function_preserving_for_every_head(head):
    source = source_model(head)
    model, report = convert_to_pkm(source, ngram_layers=[2], ngram_table_size=211, ngram_dim=4, **PKM)
    assert type(model) is HEADS[head] and report.memory_layers == [1]
    assert not report.dropped and all(".memory." in name or ".ngram." in name for name in report.new)
    torch.testing.assert_close(outputs_of(model, head), outputs_of(source, head), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "options",
    [{"pkm_shared_values": True, "pkm_layers": [0, 2]}, {"pkm_output_gate": "swilu", "pkm_qk_norm": True}],
    ids=["shared_values", "swilu_qk_norm"],
)
def test_memory_plus_conversions_are_function_preserving(options):
    source = source_model("ForMaskedLM")
    model, _ = convert_to_pkm(source, **{**PKM, **options})
    torch.testing.assert_close(outputs_of(model, "ForMaskedLM"), outputs_of(source, "ForMaskedLM"), atol=1e-5, rtol=0)


def test_replace_conversion_drops_the_mlp_and_a_bert_class_name_maps_to_modernbert():
    model, report = convert_to_pkm(
        source_model("ForMaskedLM"), "BertPkmForSequenceClassification", **{**PKM, "pkm_mode": "replace"}
    )
    assert type(model) is ModernBertPkmForSequenceClassification
    assert sorted(name for name in report.dropped if ".mlp." in name) == [
        "model.layers.1.mlp.Wi.weight", "model.layers.1.mlp.Wo.weight"
    ]  # fmt: skip
    from modeling_pkm_bert import RobertaPkmForMaskedLM

    with pytest.raises(ValueError, match="does not fit a ModernBertForMaskedLM source"):
        convert_to_pkm(source_model("ForMaskedLM"), RobertaPkmForMaskedLM, **PKM)


def test_cli_converts_a_hub_id_from_the_cache_and_the_card_names_the_base_model(tmp_path):
    """A ModernBERT-type Hub id resolved offline from the Hub cache: converted from its config alone, the tokenizer
    copied, the card's base_model the Hub id and its license the source card's; logits the source's."""
    repo = tmp_path / "cache" / "models--someone--tiny-modernbert"
    snapshot = repo / "snapshots" / ("a" * 40)
    source = source_model("ForMaskedLM")
    source.save_pretrained(snapshot)
    TESTER.get_tokenizer().save_pretrained(snapshot)
    (snapshot / "README.md").write_text("---\nlicense: mit\n---\n# tiny ModernBERT\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script = Path(load_script("convert_to_pkm").__file__)
    argv = ["--model_name_or_path", "someone/tiny-modernbert", "--output_dir", str(tmp_path / "out"), *PKM_FLAGS]
    argv += ["--pkm_value_init", "zeros", "--ngram_layers", "2", "--ngram_table_size", "211", "--ngram_dim", "4"]
    completed = subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "ModernBertPkmForMaskedLM" in completed.stdout
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: someone/tiny-modernbert" in card and "license: mit" in card and "- modernbert" in card
    assert "ModernBERT with product key memory" in card
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "modernbert_pkm" and config["auto_map"] == MODERNBERT_AUTO_MAP
    assert (
        config["layer_types"] == source.config.layer_types
        and config["rope_parameters"] == source.config.rope_parameters
    )
    model = ModernBertPkmForMaskedLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(outputs_of(model, "ForMaskedLM"), outputs_of(source, "ForMaskedLM"), atol=1e-5, rtol=0)


def test_a_modernbert_pkm_folder_is_not_converted_again(tmp_path):
    from modeling_pkm_bert.hub.conversion import check_source

    ModernBertPkmForMaskedLM(ModernBertPkmConfig(**TINY, **PKM)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is already a ModernBertPkm model"):
        check_source(tmp_path)


# ---------------------------------------------------------------------------------------------------- the scripts


@pytest.fixture
def modernbert_folder(tmp_path):
    folder = tmp_path / "modernbert"
    source_model("ForMaskedLM", num_labels=2).save_pretrained(folder)  # a pre-trained encoder's config: 2 labels
    TESTER.get_tokenizer().save_pretrained(folder)
    return folder


def run(script: str, argv: list[str]) -> dict:
    try:
        return load_script(script).main(argv)
    finally:
        reset_accelerate_state()


def test_run_mlm_converts_a_modernbert_checkpoint_on_load_and_trains_the_saved_folder_with_smf(
    modernbert_folder, tmp_path
):
    from safetensors.torch import load_file

    (tmp_path / "train.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    data = ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "train.txt")]
    data += "--max_seq_length 16 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --seed 1".split()
    results = run("run_mlm", ["--model_name_or_path", str(modernbert_folder), "--output_dir", str(tmp_path / "out"),
                              *data, "--max_train_steps", "2", *PKM_FLAGS, "--memory_report"])  # fmt: skip
    assert results["perplexity"] > 1 and "eval_memory/layer_1/mu" in results
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("modernbert_pkm", ["ModernBertPkmForMaskedLM"])
    assert (tmp_path / "out" / "modeling_modernbert_pkm.py").is_file()
    # the saved folder trains on as it is: sparse memory finetuning moves value rows only (SGD, the memory's optimizer)
    background = Path(load_script("run_mlm").__file__).parent / "data" / "pride_and_prejudice_validation.txt"
    smf = f"--sparse_memory_finetuning --smf_background_file {background} --smf_background_batches 2 --smf_top_t 6"
    run("run_mlm", ["--model_name_or_path", str(tmp_path / "out"), "--output_dir", str(tmp_path / "smf"), *data,
                    "--max_train_steps", "2", *smf.split(), "--memory_optimizer", "sgd", "--memory_learning_rate", "1.0"])  # fmt: skip
    initial, trained = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(tmp_path / "smf" / "model.safetensors"),
    )
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["model.layers.1.memory.values.weight"]


def test_run_glue_converts_a_modernbert_checkpoint_on_load_and_trains_the_saved_folder(modernbert_folder, tmp_path):
    rows = [f"{sentence}\t{i % 2}\n" for i, sentence in enumerate(SENTENCES * 2)]
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "".join(rows))
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\n" + "".join(rows[:8]))

    def glue(model, output_dir, options):
        argv = ["--model_name_or_path", str(model), "--task_name", "sst2", "--output_dir", str(output_dir)]
        argv += ["--train_file", str(tmp_path / "train.tsv"), "--validation_file", str(tmp_path / "dev.tsv")]
        argv += "--per_device_train_batch_size 4 --per_device_eval_batch_size 8 --max_length 16 --seed 1".split()
        return run("run_glue", argv + options)

    converted = glue(modernbert_folder, tmp_path / "converted", ["--max_train_steps", "2", *PKM_FLAGS])
    assert "eval_accuracy" in converted and "eval_memory/layer_1/top1_mu" in converted
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == (
        "modernbert_pkm",
        ["ModernBertPkmForSequenceClassification"],
    )
    again = glue(tmp_path / "converted", tmp_path / "again", ["--max_train_steps", "1"])
    assert "eval_accuracy" in again


def test_run_squad_converts_a_modernbert_checkpoint_on_load(modernbert_folder, tmp_path):
    context = "the cat sat on the mat in paris"
    questions = [{"id": f"q{i}", "question": question, "answers": [{"text": answer, "answer_start": context.index(answer)}]}
                 for i, (question, answer) in enumerate([("who sat", "the cat"), ("where", "on the mat"),
                                                          ("what city", "paris")])]  # fmt: skip
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": questions}]}]}
    (tmp_path / "squad.json").write_text(json.dumps(data))
    argv = ["--model_name_or_path", str(modernbert_folder), "--output_dir", str(tmp_path / "out")]
    argv += ["--train_file", str(tmp_path / "squad.json"), "--validation_file", str(tmp_path / "squad.json")]
    argv += "--max_seq_length 32 --doc_stride 8 --per_device_train_batch_size 2 --per_device_eval_batch_size 2".split()
    results = run("run_squad", [*argv, "--max_train_steps", "1", *PKM_FLAGS])
    assert 0 <= results["eval_exact_match"] <= results["eval_f1"] <= 100
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("modernbert_pkm", ["ModernBertPkmForQuestionAnswering"])


@pytest.fixture
def modernbert_pkm_folder(tmp_path):
    """A ModernBertPkm masked LM with a memory that reads (normal values) and an n-gram memory, and its tokenizer."""
    folder = tmp_path / "modernbert_pkm"
    config = ModernBertPkmConfig(**TINY, **{**PKM, "pkm_value_init": "normal"}, ngram_layers=[2], ngram_table_size=211,
                                 ngram_dim=4)  # fmt: skip
    ModernBertPkmForMaskedLM(config).save_pretrained(folder)
    TESTER.get_tokenizer().save_pretrained(folder)
    return folder


def test_memory_report_and_explorer_read_a_modernbert_pkm_folder(modernbert_pkm_folder, tmp_path):
    from modeling_pkm_bert.analysis.explorer import read_explorer_data

    (tmp_path / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    report = tmp_path / "report"
    run("memory_report", ["--model_name_or_path", str(modernbert_pkm_folder), "--validation_file",
                          str(tmp_path / "text.txt"), "--output_dir", str(report), "--max_seq_length", "16"])  # fmt: skip
    assert "layer_1" in (report / "memory_report.md").read_text()
    explorer = tmp_path / "explorer"
    run("memory_explorer", ["--model_name_or_path", str(modernbert_pkm_folder), "--text_file", str(tmp_path / "text.txt"),
                            "--output_dir", str(explorer)])  # fmt: skip
    assert (explorer / "index.html").is_file()
    names = [layer["name"] for layer in read_explorer_data(explorer)["layers"]]
    assert names == ["layer_1", "layer_2_ngram"], names


def test_fp16_loss_scaling_steps_the_memory_optimizer_as_without_it(tmp_path):
    """CUDA's --mixed_precision fp16 path simulated on CPU (a GradScaler where accelerate keeps its own, as
    tests/test_training_loop.py does for BertPkm): the values' own optimizer and the main one update a ModernBertPkm as
    a scaler-free run does."""
    import argparse
    import logging

    from accelerate import Accelerator

    from modeling_pkm_bert.methods.optimizers.scripts import create_memory_optimizer, optimizer_param_groups
    from modeling_pkm_bert.methods.optimizers import MemoryOptimizerMethod
    from modeling_pkm_bert.training.loop import TrainingLoop, create_scheduler

    def fp16_run(scaler):
        reset_accelerate_state()
        accelerator = Accelerator(cpu=True)
        if scaler is not None:
            accelerator.scaler = scaler
        torch.manual_seed(0)
        model = ModernBertPkmForMaskedLM(ModernBertPkmConfig(**TINY, **{**PKM, "pkm_value_init": "normal"}))
        args = argparse.Namespace(
            output_dir=str(tmp_path), gradient_accumulation_steps=1, per_device_train_batch_size=4, num_train_epochs=1,
            max_train_steps=2, learning_rate=1e-3, lr_scheduler_type="linear", checkpointing_steps=None,
            resume_from_checkpoint=None, eval_steps=None, track_staleness=False, staleness_bins=5, with_tracking=False,
            memory_max_grad_norm=None, memory_learning_rate=1e-3, allow_inexact_resume=False, seed=0,
            memory_optimizer="adam",
        )  # fmt: skip
        main_groups, memory_groups = optimizer_param_groups(model, 0.01)
        optimizer = torch.optim.AdamW(main_groups, lr=1e-3)
        memory = create_memory_optimizer(memory_groups, args, model)
        model, optimizer, memory = accelerator.prepare(model, optimizer, memory)
        scheduler = create_scheduler(accelerator, args, optimizer, num_warmup_steps=0)
        loop = TrainingLoop(accelerator, args, model, [optimizer, memory], scheduler, None, steps_per_epoch=2,
                            settings={}, logger=logging.getLogger(__name__),
                            methods=[MemoryOptimizerMethod(args, accelerator, model, memory)])  # fmt: skip
        unwrapped = accelerator.unwrap_model(model)
        table, other = unwrapped.model.layers[1].memory.values.weight, unwrapped.model.layers[0].attn.Wqkv.weight
        before = table.detach().clone(), other.detach().clone()
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            input_ids = torch.randint(5, TINY["vocab_size"], (4, 8), generator=generator)
            with accelerator.accumulate(model):
                loop.step(model(input_ids=input_ids, labels=input_ids).loss)
        return table.detach() - before[0], other.detach() - before[1]

    table, other = fp16_run(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaled_table, scaled_other = fp16_run(scaler)
    assert table.abs().max() > 0
    torch.testing.assert_close(scaled_table, table, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(scaled_other, other, rtol=1e-4, atol=1e-7)
    assert scaler.get_scale() == 1024.0 * 2**2


@pytest.mark.multiprocess
def test_run_mlm_trains_a_modernbert_pkm_on_two_gloo_processes(modernbert_pkm_folder, tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    argv = ["--model_name_or_path", str(modernbert_pkm_folder), "--output_dir", str(tmp_path / "ddp")]
    argv += ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "train.txt")]
    argv += "--max_seq_length 16 --per_device_train_batch_size 2 --per_device_eval_batch_size 4 --seed 1".split()
    argv += "--max_train_steps 2 --memory_optimizer sparse_row_adam".split()
    done = torchrun(Path(load_script("run_mlm").__file__), argv)
    assert "MULTI_CPU" in done.stderr and "[RANK 1]" in done.stderr
    assert json.loads((tmp_path / "ddp" / "all_results.json").read_text())["step"] == 2
    assert isinstance(ModernBertPkmForMaskedLM.from_pretrained(tmp_path / "ddp"), ModernBertPkmForMaskedLM)


def test_the_benchmark_section_times_plain_ours_and_resm_in_one_run(monkeypatch):
    """`run_benchmarks.py --sections modernbert`: one row per batch with the three models' throughputs and ratios (here
    on tiny models: the arithmetic, not the speed)."""
    import argparse

    from benchmarks.speed import modernbert as bench

    tiny = dict(TINY, vocab_size=30001, max_position_embeddings=128)

    def build(kind):
        if kind == "plain":
            return transformers.ModernBertModel(ModernBertConfig(**tiny, attn_implementation="sdpa")).eval()
        layers = [] if kind == "ours" else [1]
        return ModernBertPkmModel(ModernBertPkmConfig(**tiny, **{**PKM, "pkm_layers": layers})).eval()

    monkeypatch.setattr(bench, "build_modernbert", build)
    monkeypatch.setattr(bench, "table1_rounds", lambda args, size, batch: 2)
    lines = bench.section_modernbert(argparse.Namespace(quick=True))
    rows = [line for line in lines if line.startswith(("| 1 x 128 |", "| 32 x 128 |"))]
    assert len(rows) == 2 and all(len(row.split("|")) == 11 for row in rows), rows
    assert lines[-1].startswith("Verdicts (target 0.95")
