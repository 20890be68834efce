"""RobertaPkm: RoBERTa / DistilRoBERTa / XLM-RoBERTa checkpoints converted function-preserving (+Init), every head
trained a step, saved folders loaded through remote code without the package, the fill-mask and text-classification
pipelines. Tiny random models built with transformers' own classes and RobertaPkmModelTester's byte-level BPE
tokenizer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import RobertaConfig, XLMRobertaConfig

from helpers import RobertaPkmModelTester, load_script, reset_accelerate_state, tiny_roberta_config
from modeling_pkm_bert import (
    ROBERTA_AUTO_MAP,
    BertPkmForMaskedLM,
    RobertaPkmConfig,
    RobertaPkmForCausalLM,
    RobertaPkmForMaskedLM,
    RobertaPkmForMultipleChoice,
    RobertaPkmForQuestionAnswering,
    RobertaPkmForSequenceClassification,
    RobertaPkmForTokenClassification,
    RobertaPkmModel,
)
from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES
from modeling_pkm_bert.hub.conversion import convert_to_pkm, load_source_tokenizer, save_converted
from modeling_pkm_bert.ngram_memory import NgramMemory


SMALL_PKM = dict(pkm_layers=[1], pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=16, pkm_value_init="zeros")
HEADS = ["Model", "ForMaskedLM", "ForCausalLM", "ForSequenceClassification", "ForMultipleChoice",
         "ForTokenClassification", "ForQuestionAnswering"]  # fmt: skip


TESTER = RobertaPkmModelTester()
VOCAB_SIZE = len(TESTER.get_tokenizer())


def source_config(kind: str, **overrides):
    config_class = XLMRobertaConfig if kind == "xlm-roberta" else RobertaConfig
    kwargs = dict(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return config_class(**{**kwargs, **overrides})


def source_model(kind: str, head: str, **overrides):
    family = "XLMRoberta" if kind == "xlm-roberta" else "Roberta"
    torch.manual_seed(1)
    num_labels = 3 if head in ("ForSequenceClassification", "ForTokenClassification") else 2  # QA: start and end
    config = source_config(kind, is_decoder=head == "ForCausalLM", num_labels=num_labels, **overrides)
    return getattr(transformers, f"{family}{head}")(config).eval()


def batch(multiple_choice=False):
    """Two sequences, the first padded (<pad> = 1): positions count from 2 and skip the padding."""
    input_ids = torch.tensor([[0, 40, 41, 42, 2, 1, 1], [0, 43, 44, 45, 46, 47, 2]])
    attention_mask = (input_ids != 1).long()
    if multiple_choice:
        return input_ids[None].repeat(2, 1, 1), attention_mask[None].repeat(2, 1, 1)
    return input_ids, attention_mask


def outputs_of(model, head, multiple_choice=False):
    input_ids, attention_mask = batch(multiple_choice)
    with torch.no_grad():
        output = model(input_ids, attention_mask=attention_mask)
    if head == "ForQuestionAnswering":
        return torch.stack([output.start_logits, output.end_logits])
    if head == "Model":
        return output.last_hidden_state
    return output.logits


@pytest.mark.parametrize("kind", ["roberta", "xlm-roberta"])
@pytest.mark.parametrize("head", HEADS)
def test_conversion_computes_what_the_source_computes(tmp_path, kind, head):
    source = source_model(kind, head)
    source.save_pretrained(tmp_path / "source")
    model, report = convert_to_pkm(tmp_path / "source", **SMALL_PKM)
    assert type(model).__name__ == f"RobertaPkm{head}" and model.config.model_type == "roberta_pkm"
    assert model.config.pad_token_id == 1 and model.config.type_vocab_size == 1
    new_outside_memories = [n for n in report.new if ".memory." not in n]
    assert new_outside_memories == [], new_outside_memories  # every head the source has is carried
    multiple_choice = head == "ForMultipleChoice"
    expected, got = outputs_of(source, head, multiple_choice), outputs_of(model, head, multiple_choice)
    assert (got - expected).abs().max() <= 1e-5
    # the padded sequence computes what it computes alone
    if head in ("ForMaskedLM", "ForTokenClassification"):
        alone = outputs_of_single(model)
        assert (alone - got[0, :5]).abs().max() <= 1e-5


def outputs_of_single(model):
    input_ids, _ = batch()
    with torch.no_grad():
        return model(input_ids[:1, :5]).logits[0]


def test_distilroberta_style_source_with_fewer_layers(tmp_path):
    source = source_model("roberta", "ForMaskedLM", num_hidden_layers=2)
    source.save_pretrained(tmp_path / "source")
    TESTER.save_tokenizer(tmp_path / "source")
    model, report = convert_to_pkm(tmp_path / "source", **{**SMALL_PKM, "pkm_layers": [0]})
    assert model.config.num_hidden_layers == 2 and report.memory_layers == [0]
    assert (outputs_of(model, "ForMaskedLM") - outputs_of(source, "ForMaskedLM")).abs().max() <= 1e-5
    folder = save_converted(model, report, tmp_path / "out", tokenizer=load_source_tokenizer(tmp_path / "source"),
                            source_name="distilroberta/tiny", license="apache-2.0")  # fmt: skip
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "roberta_pkm" and saved["auto_map"] == ROBERTA_AUTO_MAP
    assert saved["tokenizer_class"] == "RobertaTokenizer"
    assert {"tokenizer.json", "tokenizer_config.json", "README.md", *(f for f in REMOTE_CODE_FILES if "modernbert" not in f)} <= set(os.listdir(folder))
    card = (folder / "README.md").read_text()
    assert "distilroberta/tiny" in card and "apache-2.0" in card and "RoBERTa with product key memory" in card
    assert "pipeline_tag: fill-mask" in card and "- roberta_pkm" in card and "AutoModelForMaskedLM" in card


def test_conversion_refuses_a_roberta_source_into_a_bert_class(tmp_path):
    with pytest.raises(ValueError, match="RobertaPkm classes"):
        convert_to_pkm(source_model("roberta", "ForMaskedLM"), target_class=BertPkmForMaskedLM, **SMALL_PKM)
    RobertaPkmModel(tiny_roberta_config()).save_pretrained(tmp_path / "converted")
    with pytest.raises(ValueError, match="is already a RobertaPkm model"):
        convert_to_pkm(tmp_path / "converted", **SMALL_PKM)
    # a BertPkm name (as the scripts pass) becomes the RobertaPkm class
    model, _ = convert_to_pkm(source_model("roberta", "ForMaskedLM"), "BertPkmForSequenceClassification", **SMALL_PKM)
    assert isinstance(model, RobertaPkmForSequenceClassification)


def test_positions_count_from_the_padding_id_and_the_limit_says_so():
    model = RobertaPkmModel(tiny_roberta_config()).eval()
    input_ids = torch.full((1, 64), 5)
    model(input_ids)  # positions 2..65: the last position embedding
    with pytest.raises(ValueError, match="reach position 66, beyond the position embeddings"):
        model(torch.full((1, 65), 5))
    with pytest.raises(ValueError, match="pad_token_id"):
        RobertaPkmConfig(pad_token_id=None)
    with pytest.raises(ValueError, match="RobertaPkmConfig.pkm_layers"):
        tiny_roberta_config(pkm_layers=[7])


@pytest.mark.parametrize(
    "model_class",
    [RobertaPkmForMaskedLM, RobertaPkmForCausalLM, RobertaPkmForSequenceClassification, RobertaPkmForMultipleChoice,
     RobertaPkmForTokenClassification, RobertaPkmForQuestionAnswering],
)  # fmt: skip
def test_a_training_step_of_every_head_moves_the_memory(model_class):
    num_labels = 2 if model_class is RobertaPkmForQuestionAnswering else 3
    config = tiny_roberta_config(num_labels=num_labels, is_decoder=model_class is RobertaPkmForCausalLM)
    model = model_class(config).train()
    multiple_choice = model_class is RobertaPkmForMultipleChoice
    input_ids, attention_mask = batch(multiple_choice)
    labels = {
        RobertaPkmForMaskedLM: {"labels": input_ids.masked_fill(attention_mask == 0, -100)},
        RobertaPkmForCausalLM: {"labels": input_ids.masked_fill(attention_mask == 0, -100)},
        RobertaPkmForSequenceClassification: {"labels": torch.tensor([0, 2])},
        RobertaPkmForMultipleChoice: {"labels": torch.tensor([1, 0])},
        RobertaPkmForTokenClassification: {"labels": torch.zeros_like(input_ids)},
        RobertaPkmForQuestionAnswering: {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])},
    }[model_class]
    memory = model.base_model.encoder.layer[1].memory
    before = memory.values.weight.detach().clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = model(input_ids, attention_mask=attention_mask, **labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    assert not torch.equal(memory.values.weight, before)


def test_causal_lm_generates_with_a_cache():
    model = RobertaPkmForCausalLM(tiny_roberta_config(is_decoder=True)).eval()
    input_ids = torch.tensor([[0, 40, 41]])
    generated = model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert generated.shape == (1, 7)
    without_cache = model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=1, use_cache=False)
    assert torch.equal(generated, without_cache)


def generation_model(**overrides) -> RobertaPkmForCausalLM:
    """A tiny RoBERTa decoder that never generates <pad> (which RoBERTa's positions would skip) and whose n-gram
    memories, if any, contribute."""
    torch.manual_seed(0)
    model = RobertaPkmForCausalLM(tiny_roberta_config(is_decoder=True, **overrides)).eval()
    with torch.no_grad():
        model.lm_head.bias[model.config.pad_token_id] = -1e4
        for module in model.modules():
            if isinstance(module, NgramMemory):
                for parameter in (module.conv.weight, module.value.weight):
                    parameter.normal_(std=0.5)
    return model


@pytest.mark.parametrize("memories", [{}, dict(ngram_layers=[0], ngram_table_size=97, ngram_dim=4)], ids=["pkm", "ngram"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_generated_scores_equal_a_plain_forward_over_the_same_tokens(use_cache, memories):
    """Issue 44: transformers' generate passes positions counted from 0, RoBERTa's table counts them from
    pad_token_id + 1 (as a plain forward does): every step's scores were a forward's at positions 2 lower."""
    model, pad = generation_model(**memories), 1
    prompts = torch.tensor([[0, 40, 41, 42, 43], [pad, pad, 0, 50, 51]])  # the second left-padded
    mask = (prompts != pad).long()
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad, use_cache=use_cache,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        assert len(out.scores) == 4
        for step, scores in enumerate(out.scores):
            tokens = out.sequences[:, : prompts.shape[1] + step]
            padded = model(tokens, attention_mask=(tokens != pad).long()).logits[:, -1]
            torch.testing.assert_close(scores, padded, atol=1e-4, rtol=0)
            for row in range(len(tokens)):  # and the unpadded sequence alone
                alone = model(tokens[row][tokens[row] != pad][None]).logits[0, -1]
                torch.testing.assert_close(scores[row], alone, atol=1e-4, rtol=0)


# Runs in a fresh interpreter whose import of modeling_pkm_bert is made to fail: only the folder's code can be used.
REMOTE_SCRIPT = r"""
import json, sys
sys.modules["modeling_pkm_bert"] = None
import torch
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, pipeline
folders = json.loads(sys.argv[1])
inputs, mask = torch.tensor(json.loads(sys.argv[2])), torch.tensor(json.loads(sys.argv[3]))
out = {"config_class": type(AutoConfig.from_pretrained(folders["mlm"], trust_remote_code=True)).__name__}
for name, auto in [("mlm", AutoModelForMaskedLM), ("cls", AutoModelForSequenceClassification)]:
    model = auto.from_pretrained(folders[name], trust_remote_code=True).eval()
    out[name + "_module"] = type(model).__module__
    with torch.no_grad():
        out[name] = model(inputs, attention_mask=mask).logits.tolist()
base = AutoModel.from_pretrained(folders["mlm"], trust_remote_code=True)
out["base_class"] = type(base).__name__
out["fill-mask"] = pipeline("fill-mask", model=folders["mlm"], trust_remote_code=True)(" the cat<mask> on the mat", top_k=3)
out["text-classification"] = pipeline("text-classification", model=folders["cls"], trust_remote_code=True)(" a good movie")
print("RESULT" + json.dumps(out, default=float))
"""


def test_saved_folders_load_as_remote_code_with_the_pipelines(tmp_path):
    input_ids, attention_mask = batch()
    folders, expected = {}, {}
    for name, head in [("mlm", "ForMaskedLM"), ("cls", "ForSequenceClassification")]:
        source = source_model("roberta", head)
        source.save_pretrained(tmp_path / f"{name}_source")
        TESTER.save_tokenizer(tmp_path / f"{name}_source")
        model, report = convert_to_pkm(tmp_path / f"{name}_source", **{**SMALL_PKM, "pkm_value_init": "normal"})
        tokenizer = load_source_tokenizer(tmp_path / f"{name}_source")
        folders[name] = str(save_converted(model, report, tmp_path / name, tokenizer=tokenizer, source_name="tiny"))
        expected[name] = outputs_of(model, head)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    arguments = [json.dumps(folders), json.dumps(input_ids.tolist()), json.dumps(attention_mask.tolist())]
    completed = subprocess.run([sys.executable, "-c", REMOTE_SCRIPT, *arguments], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.split("RESULT", 1)[1])
    for name in ("mlm", "cls"):
        assert torch.allclose(torch.tensor(out[name]), expected[name], atol=1e-6), name
        assert out[name + "_module"].startswith("transformers_modules."), out[name + "_module"]
    assert out["config_class"] == "RobertaPkmConfig" and out["base_class"] == "RobertaPkmModel"
    assert len(out["fill-mask"]) == 3 and all("<mask>" not in r["sequence"] for r in out["fill-mask"])
    assert out["text-classification"][0]["label"] in ("LABEL_0", "LABEL_1", "LABEL_2")


def test_cli_converts_an_xlm_roberta_folder_from_its_config_alone(tmp_path, capsys):
    source = source_model("xlm-roberta", "ForSequenceClassification")
    source.save_pretrained(tmp_path / "source")
    TESTER.save_tokenizer(tmp_path / "source")
    out = tmp_path / "converted"
    argv = ["--model_name_or_path", str(tmp_path / "source"), "--output_dir", str(out), "--pkm_layers", "1"]
    argv += ["--pkm_n_keys", "8", "--pkm_heads", "2", "--pkm_knn", "4", "--pkm_k_dim", "16", "--pkm_value_init", "zeros"]
    load_script("convert_to_pkm").main(argv)

    assert "RobertaPkmForSequenceClassification" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "roberta_pkm" and config["pkm_layers"] == [1] and config["auto_map"] == ROBERTA_AUTO_MAP
    model = RobertaPkmForSequenceClassification.from_pretrained(out).eval()
    got, expected = outputs_of(model, "ForSequenceClassification"), outputs_of(source, "ForSequenceClassification")
    assert (got - expected).abs().max() <= 1e-5


SENTENCES = ["a good movie", "the cat sat on the mat", "a bad film", "the movie was good", "awful and bad",
             "good good good", "the mat is bad", "a great cat"]  # fmt: skip


@pytest.fixture
def roberta_folder(tmp_path):
    folder = tmp_path / "roberta"
    source_model("roberta", "ForMaskedLM").save_pretrained(folder)
    TESTER.save_tokenizer(folder)
    return folder


def test_run_glue_converts_a_roberta_checkpoint_on_load_and_trains_the_saved_folder(roberta_folder, tmp_path):
    rows = [f"{sentence}\t{i % 2}\n" for i, sentence in enumerate(SENTENCES * 2)]
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "".join(rows))
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\n" + "".join(rows[:8]))
    run_glue = load_script("run_glue")

    def glue(model, output_dir, options):
        argv = ["--model_name_or_path", str(model), "--task_name", "sst2", "--output_dir", str(output_dir)]
        argv += ["--train_file", str(tmp_path / "train.tsv"), "--validation_file", str(tmp_path / "dev.tsv")]
        argv += "--per_device_train_batch_size 4 --per_device_eval_batch_size 8 --max_length 16 --seed 1".split()
        try:
            return run_glue.main(argv + options.split())
        finally:
            reset_accelerate_state()

    pkm_flags = "--pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16"
    converted = glue(roberta_folder, tmp_path / "converted", f"--max_train_steps 2 {pkm_flags}")
    assert "eval_accuracy" in converted and "eval_memory/layer_1/top1_mu" in converted
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("roberta_pkm", ["RobertaPkmForSequenceClassification"])
    # the saved RobertaPkm folder trains on as it is (its classes, no conversion)
    again = glue(tmp_path / "converted", tmp_path / "again", "--max_train_steps 1")
    assert "eval_accuracy" in again


def test_run_mlm_converts_a_roberta_checkpoint_on_load(roberta_folder, tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    run_mlm = load_script("run_mlm")
    argv = ["--model_name_or_path", str(roberta_folder), "--output_dir", str(tmp_path / "out")]
    argv += ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "train.txt")]
    argv += "--max_seq_length 16 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --seed 1".split()
    argv += "--max_train_steps 2 --pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16".split()
    try:
        results = run_mlm.main(argv)
    finally:
        reset_accelerate_state()
    assert results["perplexity"] > 1 and "eval_memory/layer_1/mu" in results
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("roberta_pkm", ["RobertaPkmForMaskedLM"])


def test_run_clm_makes_a_roberta_checkpoint_a_decoder_with_blocks_that_fit_its_positions(roberta_folder, tmp_path):
    (tmp_path / "train.txt").write_text(" ".join(SENTENCES * 40) + "\n")
    run_clm = load_script("run_clm")
    argv = ["--model_name_or_path", str(roberta_folder), "--output_dir", str(tmp_path / "out")]
    argv += ["--train_file", str(tmp_path / "train.txt"), "--validation_files", f"text={tmp_path / 'train.txt'}"]
    argv += "--per_device_train_batch_size 2 --per_device_eval_batch_size 2 --seed 1 --max_eval_samples 2".split()
    argv += "--max_train_steps 1 --pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16".split()
    try:  # no --block_size: the model's 66 positions hold 64 tokens (RoBERTa's start at pad_token_id + 1 = 2)
        results = run_clm.main(argv)
    finally:
        reset_accelerate_state()
    assert results["eval_text_perplexity"] > 1
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["is_decoder"]) == ("roberta_pkm", True)
    assert saved["architectures"] == ["RobertaPkmForCausalLM"]


def test_run_squad_converts_a_roberta_checkpoint_on_load(roberta_folder, tmp_path):
    context = "the cat sat on the mat in a good movie"
    questions = [{"id": f"q{i}", "question": question, "answers": [{"text": answer, "answer_start": context.index(answer)}]}
                 for i, (question, answer) in enumerate([("who sat", "the cat"), ("where", "on the mat"),
                                                          ("what movie", "a good movie")])]  # fmt: skip
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": questions}]}]}
    (tmp_path / "squad.json").write_text(json.dumps(data))
    run_squad = load_script("run_squad")
    argv = ["--model_name_or_path", str(roberta_folder), "--output_dir", str(tmp_path / "out")]
    argv += ["--train_file", str(tmp_path / "squad.json"), "--validation_file", str(tmp_path / "squad.json")]
    argv += "--max_seq_length 48 --doc_stride 16 --per_device_train_batch_size 2 --per_device_eval_batch_size 2".split()
    argv += "--max_train_steps 1 --pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16".split()
    try:
        results = run_squad.main(argv)
    finally:
        reset_accelerate_state()
    assert 0 <= results["eval_exact_match"] <= results["eval_f1"] <= 100
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("roberta_pkm", ["RobertaPkmForQuestionAnswering"])


def test_memory_methods_run_on_robertapkm_as_on_bertpkm(tmp_path):
    """Memory+ options, the memory report's tracker, TRIME's check, --freeze_memory, int8 tables (in memory and as a
    folder) and refresh_code: the same code paths as for BertPkm (they find memories by module type)."""
    from modeling_pkm_bert import quantize_memory_values
    from modeling_pkm_bert.analysis.memory_usage import track_memory_usage
    from modeling_pkm_bert.hub.refresh import refresh_code
    from modeling_pkm_bert.hub.upload import quantize_folder
    from modeling_pkm_bert.methods.optimizers import freeze_memory
    from modeling_pkm_bert.methods.trime import check_trime_model

    memory_plus = dict(pkm_layers=[0, 2], pkm_shared_values=True, pkm_output_gate="swilu", pkm_qk_norm=True)
    model = RobertaPkmForMaskedLM(tiny_roberta_config(**memory_plus)).eval()
    input_ids, attention_mask = batch()
    with track_memory_usage(model) as tracker, torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
    assert set(tracker.results()) == {"layer_0", "layer_2", "shared_values"}
    check_trime_model(model)
    assert freeze_memory(model) > 0 and not model.roberta.encoder.layer[0].memory.values.weight.requires_grad

    model.save_pretrained(tmp_path / "mlm")
    quantized = RobertaPkmForMaskedLM.from_pretrained(quantize_folder(tmp_path / "mlm", tmp_path / "int8", 8)).eval()
    assert quantized.config.pkm_values_quantization == "int8"
    with torch.no_grad():
        assert (quantized(input_ids, attention_mask=attention_mask).logits - expected).abs().max() < 0.1
    quantize_memory_values(model, 8)
    assert model.config.pkm_values_quantization == "int8"

    (tmp_path / "mlm" / "modeling_roberta_pkm.py").write_text("# an old copy\n")
    assert refresh_code(tmp_path / "mlm") == ["modeling_roberta_pkm.py"]


def test_register_auto_classes_resolves_roberta_pkm_folders_without_remote_code(tmp_path):
    from modeling_pkm_bert import register_auto_classes

    register_auto_classes()
    RobertaPkmForTokenClassification(tiny_roberta_config(num_labels=4)).save_pretrained(tmp_path)
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path)
    assert type(model) is RobertaPkmForTokenClassification  # the package's class, not a copy from the folder
    assert type(transformers.AutoModel.from_config(model.config)) is RobertaPkmModel


@pytest.fixture
def robertapkm_folder(tmp_path):
    folder = tmp_path / "robertapkm"
    TESTER.save_folder(folder, RobertaPkmForMaskedLM, seed=0, vocab_size=VOCAB_SIZE)
    return folder


def test_sparse_memory_finetuning_moves_only_value_rows_of_a_robertapkm_model(robertapkm_folder, tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "train.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    background = Path(load_script("run_mlm").__file__).parent / "data" / "pride_and_prejudice_validation.txt"
    argv = ["--model_name_or_path", str(robertapkm_folder), "--output_dir", str(tmp_path / "out")]
    argv += ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "train.txt")]
    argv += "--max_seq_length 16 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --seed 3".split()
    argv += f"--max_train_steps 2 --sparse_memory_finetuning --smf_background_file {background}".split()
    argv += "--smf_background_batches 2 --smf_top_t 6 --memory_optimizer sgd --memory_learning_rate 1.0".split()
    try:
        load_script("run_mlm").main(argv)
    finally:
        reset_accelerate_state()
    initial, trained = load_file(robertapkm_folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["roberta.encoder.layer.1.memory.values.weight"]


def test_trime_trains_a_roberta_decoder(roberta_folder, tmp_path):
    (tmp_path / "train.txt").write_text(" ".join(SENTENCES * 40) + "\n")
    argv = ["--model_name_or_path", str(roberta_folder), "--output_dir", str(tmp_path / "out"), "--trime", "long"]
    argv += ["--train_file", str(tmp_path / "train.txt"), "--validation_files", f"text={tmp_path / 'train.txt'}"]
    argv += "--block_size 16 --per_device_train_batch_size 2 --per_device_eval_batch_size 2 --seed 1".split()
    argv += "--max_train_steps 2 --max_eval_samples 2 --pkm_layers 1 --pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4".split()
    argv += "--pkm_k_dim 16".split()
    try:
        results = load_script("run_clm").main(argv)
    finally:
        reset_accelerate_state()
    assert results["eval_text_perplexity"] > 1 and any(key.startswith("eval_text_trime") for key in results), results


def _memory_parallel_worker(rank, port, out_dir):
    """One of two processes: a RobertaPkm masked LM under FSDP2 + memory-parallel value tables, on its half of the
    batch; writes its logits and loss."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from modeling_pkm_bert.parallel import fully_shard_with_memory_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = RobertaPkmForMaskedLM(tiny_roberta_config(pkm_layers=[0, 2])).eval()
    fully_shard_with_memory_parallel(model, init_device_mesh("cpu", (2,)))
    input_ids, attention_mask = batch()
    rows = slice(rank, rank + 1)
    output = model(input_ids[rows], attention_mask=attention_mask[rows], labels=input_ids[rows])
    torch.save({"logits": output.logits.detach(), "loss": output.loss.detach()}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_memory_parallel_values_on_two_processes_compute_what_one_process_computes(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_memory_parallel_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    model = RobertaPkmForMaskedLM(tiny_roberta_config(pkm_layers=[0, 2])).eval()
    input_ids, attention_mask = batch()
    for rank in range(2):
        rows = slice(rank, rank + 1)
        with torch.no_grad():
            expected = model(input_ids[rows], attention_mask=attention_mask[rows], labels=input_ids[rows])
        got = torch.load(tmp_path / f"{rank}.pt")
        assert (got["logits"] - expected.logits).abs().max() < 1e-5 and (got["loss"] - expected.loss).abs() < 1e-5


@pytest.mark.slow  # end to end: convert_to_pkm.py in a process (18 s on 2 cores)
def test_cli_converts_a_hub_id_from_the_cache_and_the_card_names_the_base_model(tmp_path):
    """A Hub id resolved offline from the Hub cache (as after `hf download`): converted, the tokenizer copied, the
    card's base_model the Hub id and its license the source card's."""
    repo = tmp_path / "cache" / "models--someone--tiny-xlmr"
    snapshot = repo / "snapshots" / ("a" * 40)
    source = source_model("xlm-roberta", "ForMaskedLM")
    source.save_pretrained(snapshot)
    TESTER.save_tokenizer(snapshot)
    (snapshot / "README.md").write_text("---\nlicense: mit\n---\n# tiny XLM-R\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    script = Path(load_script("convert_to_pkm").__file__)
    argv = ["--model_name_or_path", "someone/tiny-xlmr", "--output_dir", str(tmp_path / "out"), "--pkm_layers", "1"]
    argv += "--pkm_n_keys 8 --pkm_heads 2 --pkm_knn 4 --pkm_k_dim 16 --pkm_value_init zeros".split()
    completed = subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: someone/tiny-xlmr" in card and "license: mit" in card and "- xlm-roberta" in card
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["tokenizer_class"] == "RobertaTokenizer"
    model = RobertaPkmForMaskedLM.from_pretrained(tmp_path / "out").eval()
    assert (outputs_of(model, "ForMaskedLM") - outputs_of(source, "ForMaskedLM")).abs().max() <= 1e-5
