"""BERT / DistilBERT -> BertPkm conversion: equivalence, report, errors, Hub folder, CLI, clean-process loading."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertForQuestionAnswering,
    DistilBertForSequenceClassification,
    GPT2Config,
    RobertaConfig,
    RobertaModel,
)

from helpers import BertPkmModelTester, bert_pkm_code_files, load_script, usage_error
from modeling_pkm_bert import (
    AUTO_MAP,
    BertPkmConfig,
    BertPkmForMaskedLM,
    BertPkmForSequenceClassification,
    BertPkmModel,
)
from modeling_pkm_bert.hub import conversion
from modeling_pkm_bert.hub.conversion import convert_to_pkm, save_converted
from modeling_pkm_bert.hub.model_card import source_license


SMALL_PKM = dict(pkm_layers=[1], pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=16, pkm_value_init="zeros")
TOL = 1e-4
CODE_FILES = set(bert_pkm_code_files())


def bert_config(**kw):
    kw = {
        **dict(
            vocab_size=99,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        **kw,
    }
    return BertConfig(**kw)


def distilbert_config(**kw):
    kw = {
        **dict(
            vocab_size=99, dim=32, n_layers=3, n_heads=4, hidden_dim=37, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, seq_classif_dropout=0.0, qa_dropout=0.0,
        ),
        **kw,
    }
    return DistilBertConfig(**kw)


def perturbed(model):
    """Every weight moved off its init (LayerNorm 1/0, zero biases would hide a wrong mapping)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def inputs(batch=2, seq=7, token_types=True):
    ids = torch.randint(5, 99, (batch, seq))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        out["token_type_ids"] = (torch.arange(seq) >= 3).long().expand(batch, seq)
    return out


def max_diff(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        return max(max_diff(x, y) for x, y in zip(a, b))
    return (a - b).abs().max().item()


@pytest.fixture
def bert_dir(tmp_path):
    """A random BertForPreTraining checkpoint (MLM + NSP heads, pooler) with a tokenizer and a licensed README."""
    folder = tmp_path / "bert-src"
    perturbed(BertForPreTraining(bert_config())).save_pretrained(folder)
    BertPkmModelTester().get_placeholder_tokenizer(tmp_path).save_pretrained(folder)  # also writes tmp_path/vocab.txt
    (folder / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# tiny bert\n")
    return folder


# ----------------------------------------------------------------------------------------------------------------------
# Equivalence: ResM with zero values computes what the source computes


def test_bert_pretraining_checkpoint_to_masked_lm_is_equivalent(bert_dir):
    model, report = convert_to_pkm(bert_dir, **SMALL_PKM)
    reference = BertForMaskedLM.from_pretrained(bert_dir).eval()

    assert isinstance(model, BertPkmForMaskedLM) and not model.training
    x = inputs()
    with torch.no_grad():
        ours, theirs = model(**x, output_hidden_states=True), reference(**x, output_hidden_states=True)
    assert len(ours.hidden_states) == 4
    assert max_diff(ours.hidden_states, theirs.hidden_states) <= TOL
    assert max_diff(ours.logits, theirs.logits) <= TOL

    # the checkpoint's pooler and NSP head have no place in an MLM; everything new is the memory
    pooler_and_nsp = ["bert.pooler.dense.weight", "bert.pooler.dense.bias"]
    pooler_and_nsp += ["cls.seq_relationship.weight", "cls.seq_relationship.bias"]
    assert sorted(report.dropped) == sorted(pooler_and_nsp)
    assert report.new and all(".encoder.layer.1.memory." in name for name in report.new)
    assert "cls.predictions.transform.dense.weight" in report.carried
    assert report.source_parameters == report.carried_parameters + report.dropped_parameters
    assert report.target_parameters == report.carried_parameters + report.new_parameters == model.num_parameters()
    assert report.memory_layers == [1]
    assert report.memory_value_parameters == 8**2 * 32
    text = str(report)
    assert "BertForPreTraining" in text and "cls.seq_relationship.{weight,bias}" in text
    assert "bert.encoder.layer.1.memory.query_proj.{weight,bias}" in text


@pytest.mark.parametrize(
    "source_class, target_name, output",
    [
        (BertForSequenceClassification, "BertPkmForSequenceClassification", "logits"),
        (BertForTokenClassification, "BertPkmForTokenClassification", "logits"),
        (BertForQuestionAnswering, "BertPkmForQuestionAnswering", "start_logits"),
        (BertLMHeadModel, "BertPkmForCausalLM", "logits"),
    ],
)
def test_fine_tuned_bert_heads_are_carried(source_class, target_name, output):
    labels = {0: "neg", 1: "pos"} if output == "start_logits" else {0: "neg", 1: "neu", 2: "pos"}
    source = perturbed(source_class(bert_config(id2label=labels, is_decoder=source_class is BertLMHeadModel)))
    model, report = convert_to_pkm(source, **SMALL_PKM)

    assert type(model).__name__ == target_name
    assert model.config.id2label == labels
    assert not any(name.startswith(("classifier", "qa_outputs")) for name in report.new)
    x = inputs()
    with torch.no_grad():
        assert max_diff(getattr(model(**x), output), getattr(source(**x), output)) <= TOL


@pytest.mark.parametrize("sinusoidal", [False, True])
def test_distilbert_masked_lm_is_equivalent(tmp_path, sinusoidal):
    perturbed(DistilBertForMaskedLM(distilbert_config(sinusoidal_pos_embds=sinusoidal))).save_pretrained(tmp_path)
    model, report = convert_to_pkm(tmp_path, **SMALL_PKM)
    reference = DistilBertForMaskedLM.from_pretrained(tmp_path).eval()

    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size) == (
        32, 3, 4, 37,
    )
    assert (config.hidden_act, config.layer_norm_eps, config.type_vocab_size) == ("gelu", 1e-12, 2)
    token_types = model.bert.embeddings.token_type_embeddings.weight
    assert torch.equal(token_types, torch.zeros_like(token_types))
    assert "bert.embeddings.token_type_embeddings.weight" in report.new
    assert report.dropped == []
    assert report.renamed["bert.encoder.layer.2.attention.self.query.weight"] == (
        "distilbert.transformer.layer.2.attention.q_lin.weight"
    )

    x = inputs(token_types=False)
    with torch.no_grad():
        ours, theirs = model(**x, output_hidden_states=True), reference(**x, output_hidden_states=True)
    assert max_diff(ours.hidden_states, theirs.hidden_states) <= TOL
    assert max_diff(ours.logits, theirs.logits) <= TOL


def test_distilbert_heads(tmp_path):
    qa = perturbed(DistilBertForQuestionAnswering(distilbert_config()))
    model, _ = convert_to_pkm(qa, **SMALL_PKM)
    x = inputs(token_types=False)
    with torch.no_grad():
        assert max_diff(model(**x).end_logits, qa(**x).end_logits) <= TOL

    # no pooler in DistilBERT: its ReLU pre_classifier goes into BERT's (tanh) pooler, and the report says so
    sc = perturbed(DistilBertForSequenceClassification(distilbert_config(num_labels=2)))
    model, report = convert_to_pkm(sc, **SMALL_PKM)
    assert isinstance(model, BertPkmForSequenceClassification)
    assert report.renamed["bert.pooler.dense.weight"] == "pre_classifier.weight"
    assert torch.equal(model.classifier.weight, sc.classifier.weight)
    assert any("pre_classifier" in note and "tanh" in note for note in report.notes)


def test_memory_with_normal_values_changes_the_output(bert_dir):
    """The equivalence above is the zero values' doing, not a comparison that cannot fail."""
    model, _ = convert_to_pkm(bert_dir, **{**SMALL_PKM, "pkm_value_init": "normal"})
    reference = BertForMaskedLM.from_pretrained(bert_dir).eval()
    x = inputs()
    with torch.no_grad():
        assert max_diff(model(**x).logits, reference(**x).logits) > 1e-2


def test_replace_mode_drops_the_ffn_of_memory_layers():
    source = perturbed(BertModel(bert_config()))
    model, report = convert_to_pkm(source, **{**SMALL_PKM, "pkm_mode": "replace"})

    assert isinstance(model, BertPkmModel)
    assert sorted(report.dropped) == sorted(
        f"encoder.layer.1.{part}.dense.{kind}" for part in ("intermediate", "output") for kind in ("weight", "bias")
    )
    assert model.encoder.layer[1].intermediate is None
    assert torch.equal(model.encoder.layer[1].output.LayerNorm.weight, source.encoder.layer[1].output.LayerNorm.weight)
    assert torch.equal(model.encoder.layer[2].output.dense.weight, source.encoder.layer[2].output.dense.weight)
    assert report.dropped_parameters == 2 * 32 * 37 + 37 + 32
    assert any("replace" in note for note in report.notes)


def test_bert_model_into_a_new_classification_head():
    source = perturbed(BertModel(bert_config()))
    model, report = convert_to_pkm(
        source, "BertPkmForSequenceClassification", config_overrides={"num_labels": 3}, **SMALL_PKM
    )
    assert model.config.num_labels == 3 and model.classifier.out_features == 3
    assert {"classifier.weight", "classifier.bias"} <= set(report.new)
    assert "bert.pooler.dense.weight" in report.carried
    assert any("classifier" in note for note in report.notes)
    x = inputs()
    with torch.no_grad():
        assert max_diff(model.bert(**x).pooler_output, source(**x).pooler_output) <= TOL


def test_a_head_of_another_size_is_initialised_new():
    source = perturbed(BertForSequenceClassification(bert_config(num_labels=2)))
    model, report = convert_to_pkm(source, config_overrides={"num_labels": 5}, **SMALL_PKM)
    assert model.classifier.out_features == 5
    assert {"classifier.weight", "classifier.bias"} <= set(report.dropped) & set(report.new)


# ----------------------------------------------------------------------------------------------------------------------
# Errors


def test_unsupported_sources_are_refused(tmp_path):
    GPT2Config(n_layer=2, n_embd=32, n_head=4).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        convert_to_pkm(tmp_path / "gpt2", **SMALL_PKM)
    # RoBERTa converts into the RobertaPkm classes (tests/models/test_roberta_pkm.py), never into a BertPkm one
    roberta = RobertaModel(RobertaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    assert type(convert_to_pkm(roberta, **SMALL_PKM)[0]).__name__ == "RobertaPkmModel"
    with pytest.raises(ValueError, match="does not fit a RobertaModel source"):
        convert_to_pkm(roberta, BertPkmModel, **SMALL_PKM)
    config = bert_config(architectures=["BertForSomethingElse"])
    config.save_pretrained(tmp_path / "odd")
    with pytest.raises(ValueError, match="architecture 'BertForSomethingElse' is not supported"):
        convert_to_pkm(tmp_path / "odd", **SMALL_PKM)


def test_bad_options_are_refused():
    source = BertModel(bert_config())
    with pytest.raises(ValueError, match=r"pkm_layers=\[1, 3\] does not fit .* 3 layers .* \[0, 2\]"):
        convert_to_pkm(source, **{**SMALL_PKM, "pkm_layers": [1, 3]})
    with pytest.raises(TypeError, match="unknown PKM option.*pkm_slots"):
        convert_to_pkm(source, pkm_slots=4)
    with pytest.raises(ValueError, match=r"cannot change \['hidden_size'\]"):
        convert_to_pkm(source, config_overrides={"hidden_size": 64}, **SMALL_PKM)
    with pytest.raises(ValueError, match="not a BertPkm model class"):
        convert_to_pkm(source, "BertForMaskedLM", **SMALL_PKM)
    with pytest.raises(ValueError, match="pkm_mode"):
        convert_to_pkm(source, **{**SMALL_PKM, "pkm_mode": "beside"})


# ----------------------------------------------------------------------------------------------------------------------
# The Hub folder


def test_saved_folder_is_a_complete_hub_repository(bert_dir, tmp_path):
    model, report = convert_to_pkm(bert_dir, **SMALL_PKM)
    out = save_converted(
        model,
        report,
        tmp_path / "out",
        tokenizer=conversion.load_source_tokenizer(bert_dir),
        source_name="google/bert_uncased_L-2_H-128_A-2",
        license=source_license(bert_dir),
        repo_id="me/tiny-bert-pkm",
        max_shard_size="60KB",
    )
    files = set(os.listdir(out))
    assert CODE_FILES <= files
    assert {"config.json", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "model.safetensors.index.json" in files
    shards = {f for f in files if f.startswith("model-") and f.endswith(".safetensors")}
    assert len(shards) > 1 and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    assert sorted(os.listdir(tmp_path)) == ["bert-src", "out", "vocab.txt"]  # no temporary folder left

    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and len(config["auto_map"]) == 8
    assert config["architectures"] == ["BertPkmForMaskedLM"] and config["tokenizer_class"] == "BertTokenizer"
    assert (config["pkm_layers"], config["pkm_n_keys"], config["pkm_value_init"]) == ([1], 8, "zeros")

    card = ModelCard.load(out / "README.md")
    assert card.text.lstrip().startswith("# me/tiny-bert-pkm\n")
    assert "computes exactly what the source computes" in card.text
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "fill-mask"
    assert card.data.license == "mit" and card.data.base_model == "google/bert_uncased_L-2_H-128_A-2"
    assert {"pkm", "product-key-memory", "bert"} <= set(card.data.tags)
    assert 'AutoModelForMaskedLM.from_pretrained("me/tiny-bert-pkm", trust_remote_code=True)' in card.text
    assert 'AutoTokenizer.from_pretrained("me/tiny-bert-pkm", trust_remote_code=True)' in card.text
    assert f"| total | {model.num_parameters():,} |" in card.text
    assert f"| memory values | {report.memory_value_parameters:,} |" in card.text
    assert f"| other memory parameters (keys, query network) | {report.memory_other_parameters:,} |" in card.text

    reloaded = BertPkmForMaskedLM.from_pretrained(out).eval()
    x = inputs()
    with torch.no_grad():
        assert max_diff(reloaded(**x).logits, model(**x).logits) == 0


def test_save_refuses_a_non_empty_folder_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    model, report = convert_to_pkm(BertModel(bert_config()), **SMALL_PKM)
    existing = tmp_path / "out"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty and convert_to_pkm did not write it"):
        save_converted(model, report, existing)
    assert os.listdir(existing) == ["keep.txt"]

    def broken_card(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(conversion, "write_model_card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        save_converted(model, report, tmp_path / "new")
    with pytest.raises(RuntimeError, match="disk full"):
        save_converted(model, report, existing, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(existing) == ["keep.txt"]

    monkeypatch.undo()
    save_converted(model, report, existing, overwrite=True)
    assert "keep.txt" not in os.listdir(existing) and "model.safetensors" in os.listdir(existing)
    assert sorted(os.listdir(tmp_path)) == ["out"]


CLEAN_PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer
    folder = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # transformers 5 reads the config
    x = tokenizer(["w1 w2 w3 w4", "w5 w6"], padding=True, return_tensors="pt")
    out = {"input_ids": x["input_ids"].tolist()}
    with torch.no_grad():
        model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        out["AutoModel"] = [type(model).__module__, model(**x).last_hidden_state.tolist()]
        model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
        out["AutoModelForMaskedLM"] = [type(model).__module__, model(**x).logits.tolist()]
        model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
        hidden = model(**x, output_hidden_states=True).hidden_states[-1]
        out["AutoModelForSequenceClassification"] = [type(model).__module__, hidden.tolist()]
    out["imported"] = sorted(m for m in sys.modules if m.startswith("modeling_pkm_bert"))
    print(json.dumps(out))
    """
)


def test_converted_folder_loads_in_a_clean_process(bert_dir, tmp_path):
    model, report = convert_to_pkm(bert_dir, **SMALL_PKM)
    out = save_converted(model, report, tmp_path / "out", tokenizer=conversion.load_source_tokenizer(bert_dir))
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    # -I: no cwd, script dir or PYTHONPATH on sys.path, so the repository cannot be imported
    result = subprocess.run(
        [sys.executable, "-I", "-c", CLEAN_PROCESS, str(out)], cwd=workdir, env=env, capture_output=True, text=True,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])

    assert got["imported"] == []
    x = {"input_ids": torch.tensor(got["input_ids"])}
    x["attention_mask"] = (x["input_ids"] != 0).long()
    assert (x["attention_mask"] == 0).any()  # padding is part of the check
    with torch.no_grad():
        ours = model(**x, output_hidden_states=True)
    for auto_class, expected in [
        ("AutoModel", ours.hidden_states[-1]),
        ("AutoModelForMaskedLM", ours.logits),
        ("AutoModelForSequenceClassification", ours.hidden_states[-1]),
    ]:
        module, value = got[auto_class]
        assert module.startswith("transformers_modules."), module
        assert max_diff(torch.tensor(value), expected) <= TOL, auto_class


# ----------------------------------------------------------------------------------------------------------------------
# The real checkpoint


def test_minilm_conversion_is_equivalent(minilm_path):
    source = BertModel.from_pretrained(minilm_path).eval()
    tokenizer = conversion.load_source_tokenizer(minilm_path)
    x = tokenizer(
        ["Product key memory adds a huge memory to BERT at little cost.", "It starts from the pretrained weights."],
        padding=True,
        return_tensors="pt",
    )
    assert len(tokenizer) == 30522 and (x["attention_mask"] == 0).any()
    with torch.no_grad():
        reference = source(**x, output_hidden_states=True)

    pkm = dict(pkm_layers=[2, 4], pkm_mode="resm", pkm_value_init="zeros", pkm_n_keys=32, pkm_knn=8, pkm_k_dim=64)
    model, report = convert_to_pkm(minilm_path, **pkm)
    assert isinstance(model, BertPkmModel) and report.dropped == [] and report.memory_layers == [2, 4]
    assert report.carried_parameters == report.source_parameters == source.num_parameters()
    with torch.no_grad():
        ours = model(**x, output_hidden_states=True)
    assert len(ours.hidden_states) == 7
    assert max_diff(ours.last_hidden_state, reference.last_hidden_state) <= TOL
    assert max_diff(ours.hidden_states, reference.hidden_states) <= TOL
    assert max_diff(ours.pooler_output, reference.pooler_output) <= TOL

    # into an MLM: the checkpoint has no MLM head, so the head is new (its decoder stays tied to the embeddings)
    model, report = convert_to_pkm(minilm_path, "BertPkmForMaskedLM", **pkm)
    assert {"cls.predictions.bias", "cls.predictions.transform.dense.weight"} <= set(report.new)
    assert "cls.predictions.decoder.weight" in report.carried
    assert sorted(report.dropped) == ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]
    assert any(note.startswith("head cls initialised new") for note in report.notes)
    with torch.no_grad():
        ours = model(**x, output_hidden_states=True)
    assert max_diff(ours.hidden_states, reference.hidden_states) <= TOL
    assert ours.logits.shape == (2, x["input_ids"].shape[1], 30522)


# ----------------------------------------------------------------------------------------------------------------------
# Command line


def test_cli_has_an_option_for_every_pkm_field():
    script = load_script("convert_to_pkm")
    # every pkm_* field a user sets (pkm_weights_checksum is written by save_pretrained(..., checksum=True))
    fields = [f.name for f in dataclasses.fields(BertPkmConfig) if f.name.startswith("pkm_") and f.name != "pkm_weights_checksum"]
    args = script.parse_args(["--model_name_or_path", "x", "--output_dir", "y"])
    assert not hasattr(args, "pkm_weights_checksum")
    assert fields and all(hasattr(args, name) and getattr(args, name) is None for name in fields)
    with pytest.raises(SystemExit):  # a training option has no meaning here
        script.parse_args(["--model_name_or_path", "x", "--output_dir", "y", "--freeze_memory"])


def test_cli_converts_and_saves(bert_dir, tmp_path, capsys):
    script = load_script("convert_to_pkm")
    out = tmp_path / "converted"
    argv = ["--model_name_or_path", str(bert_dir), "--output_dir", str(out), "--pkm_layers", "0", "2"]
    argv += ["--pkm_mode", "replace", "--pkm_n_keys", "8", "--pkm_heads", "2", "--pkm_knn", "4", "--pkm_k_dim", "16"]
    argv += ["--pkm_query_batchnorm", "false", "--pkm_value_dropout", "0.1"]
    script.main(argv)

    printed = capsys.readouterr().out
    assert "BertPkmForMaskedLM" in printed and "bert.encoder.layer.{0,2}.intermediate.dense.{weight,bias}" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["pkm_layers"] == [0, 2] and config["pkm_mode"] == "replace"
    assert config["pkm_query_batchnorm"] is False and config["pkm_value_dropout"] == 0.1
    assert ModelCard.load(out / "README.md").data.license == "mit"  # carried over from the source README

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.txt").write_text("mine")
    assert "--overwrite_output_dir" in usage_error(capsys, lambda: script.main(argv[:2] + ["--output_dir",
                                                                                          str(tmp_path / "foreign")]))
    assert "pkm_layers" in usage_error(capsys, lambda: script.main(argv[:2] + ["--output_dir", str(tmp_path / "bad"),
                                                                              "--pkm_layers", "3"]))  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_cli_adds_n_gram_memories_function_preserving(bert_dir, tmp_path):
    """--ngram_* flags (issue 35): n-gram memories alone (--pkm_layers with no index) or beside PKM, +Init exact; the
    tokenizer's vocabulary folded into the saved token map."""
    source = BertForPreTraining.from_pretrained(bert_dir).eval()
    x = inputs(token_types=False)
    with torch.no_grad():
        reference = source(**x).prediction_logits
    script = load_script("convert_to_pkm")
    for name, pkm in [("alone", ["--pkm_layers"]), ("both", ["--pkm_layers", "1", "--pkm_value_init", "zeros"])]:
        out = tmp_path / name
        argv = ["--model_name_or_path", str(bert_dir), "--output_dir", str(out), *pkm, "--pkm_n_keys", "8"]
        argv += ["--pkm_knn", "4", "--pkm_k_dim", "16", "--ngram_layers", "0", "2", "--ngram_table_size", "211"]
        argv += ["--ngram_dim", "4", "--ngram_token_map", "true"]
        script.main(argv)
        config = json.loads((out / "config.json").read_text())
        assert config["ngram_layers"] == [0, 2] and config["ngram_token_map"] is True
        assert (out / "ngram_memory.py").is_file()
        model = BertPkmForMaskedLM.from_pretrained(out).eval()
        assert model.bert.encoder.layer[0].ngram is not None
        assert (model.bert.encoder.layer[1].memory is not None) == (name == "both")
        with torch.no_grad():
            assert max_diff(model(**x).logits, reference) <= TOL


def test_normalized_token_map_folds_case_and_accents():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "The", "thé", "##the", "cat", "[cls]"]
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=False)
    token_map = conversion.normalized_token_map(tokenizer, 12)
    assert token_map.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 8, 9, 10, 11]  # specials and "##" pieces keep their ids
