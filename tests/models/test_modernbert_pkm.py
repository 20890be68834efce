"""ModernBertPkm (issue 48): ModernBERT with product key and n-gram memories. Tiny random ModernBERT models built with
transformers' own classes (no Hub): the weight names are transformers', a ModernBERT checkpoint loaded with zero
memory values computes what it computes (every head, eager and sdpa, left and right padding, the local/global
attention pattern and rotary positions of its config), padding changes nothing (outputs, query BatchNorm statistics,
n-gram hashes), the config refuses what the blocks do not implement, and saved folders load through remote code in a
process that cannot import the package."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from helpers import ModernBertPkmModelTester
from modeling_pkm_bert import (
    MODERNBERT_AUTO_MAP,
    ModernBertPkmConfig,
    ModernBertPkmForMaskedLM,
    ModernBertPkmForMultipleChoice,
    ModernBertPkmForQuestionAnswering,
    ModernBertPkmForSequenceClassification,
    ModernBertPkmForTokenClassification,
    ModernBertPkmModel,
    quantize_memory_values,
)
from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES
from modeling_pkm_bert.modeling_bert_pkm import BertPkmLoadingError
from modeling_pkm_bert.ngram_memory import NgramMemory
from modeling_pkm_bert.product_key_memory import ProductKeyMemory


# the tester's ModernBERT body (TINY: 3 layers, global, local, local; a window of 4 tokens that 12-token sequences
# exceed, so the local layers' mask matters; two rotary thetas) and its memory at layer 1 (SMALL_PKM)
TESTER = ModernBertPkmModelTester()
TINY, SMALL_PKM = TESTER.base, TESTER.memory
NGRAM = dict(ngram_layers=[2], ngram_table_size=211, ngram_dim=4, ngram_heads=2)
HEADS = ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice"]  # fmt: skip
OURS = {
    "Model": ModernBertPkmModel,
    "ForMaskedLM": ModernBertPkmForMaskedLM,
    "ForSequenceClassification": ModernBertPkmForSequenceClassification,
    "ForTokenClassification": ModernBertPkmForTokenClassification,
    "ForQuestionAnswering": ModernBertPkmForQuestionAnswering,
    "ForMultipleChoice": ModernBertPkmForMultipleChoice,
}


tiny_config = TESTER.get_config


def source_model(head: str, **overrides):
    """A random transformers ModernBert<head> (its own classes and initialisation)."""
    labels = 2 if head == "ForQuestionAnswering" else 3  # start and end
    config = TESTER.get_source_config(**{"num_labels": labels, **overrides})
    return getattr(transformers, f"ModernBert{head}")(config).eval()


def padded_batch(left: bool = False):
    """Two sequences of 12 and 7 tokens, padded (id 0) on the right or on the left."""
    ids = torch.randint(3, TINY["vocab_size"], (2, 12))
    mask = torch.ones_like(ids)
    if left:
        mask[1, :5] = 0
    else:
        mask[1, 7:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def outputs_of(model, ids, mask, head):
    if head == "ForMultipleChoice":
        ids, mask = ids[None].repeat(2, 1, 1), mask[None].repeat(2, 1, 1)  # 2 questions of 2 choices
    with torch.no_grad():
        result = model(ids, attention_mask=mask)
    if head == "Model":
        return result.last_hidden_state
    if head == "ForQuestionAnswering":
        return torch.stack([result.start_logits, result.end_logits])
    return result.logits


def real(output, mask, head):
    """The entries of `output` that belong to real tokens (per-token outputs) or all of it (per-sequence ones)."""
    if head in ("Model", "ForMaskedLM", "ForTokenClassification"):
        return output[mask.bool()]
    if head == "ForQuestionAnswering":
        return output[:, mask.bool()]
    return output


# ---------------------------------------------------------------------------------------------------- config


def test_config_defaults_and_auto_map():
    config = ModernBertPkmConfig()
    assert "modernbert" in config.model_type and "pkm" in config.model_type
    assert config.pkm_layers == [7, 14]  # [n // 3, 2n // 3] of ModernBERT-base's 22 layers
    assert config.auto_map == MODERNBERT_AUTO_MAP
    assert config.layer_types[:4] == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    again = ModernBertPkmConfig.from_dict(tiny_config(**NGRAM).to_dict())
    assert (again.pkm_layers, again.ngram_layers, again.rope_parameters) == ([1], [2], tiny_config().rope_parameters)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"pkm_layers": [3]}, r"pkm_layers=\[3\]: every index must be in \[0, 2\]"),
        ({"ngram_layers": [0, 0]}, "an index is repeated"),
        ({"pkm_mode": "beside"}, "pkm_mode='beside': must be one of"),
        ({"pkm_n_keys": 10**6}, "max_memory_parameters"),
        ({"is_decoder": True}, "is_decoder=True: ModernBertPkm is an encoder"),
        ({"hidden_size": 30}, "hidden_size=30: must be a multiple of num_attention_heads=4"),
        ({"local_attention": 3}, "local_attention=3"),
        ({"layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type"),
        ({"classifier_dropout": 1.0}, "classifier_dropout=1.0"),
    ],
)  # fmt: skip
def test_bad_config_values_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as raised:
        tiny_config(**overrides)
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------------------------------- the body


@pytest.mark.parametrize("head", HEADS)
def test_weight_names_are_transformers_modernbert_names(head):
    plain = OURS[head](tiny_config(pkm_layers=[], num_labels=3))
    assert set(plain.state_dict()) == set(source_model(head).state_dict())
    with_memories = OURS[head](tiny_config(num_labels=3, **NGRAM))
    prefix = "" if head == "Model" else "model."
    added = set(with_memories.state_dict()) - set(plain.state_dict())
    assert added and all(name.startswith((f"{prefix}layers.1.memory.", f"{prefix}layers.2.ngram.")) for name in added)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("head", HEADS)
def test_a_modernbert_checkpoint_loads_function_preserving_for_every_head(tmp_path, head, attn_implementation):
    """Zero memory values (ResM) and n-gram memories (zero value projection): the logits are the source's to 1e-5,
    with left and right padding in the batch."""
    source = source_model(head, attn_implementation=attn_implementation)
    source.save_pretrained(tmp_path)
    model = (
        OURS[head]
        .from_pretrained(
            tmp_path, pkm_value_init="zeros", attn_implementation=attn_implementation, **SMALL_PKM, **NGRAM
        )
        .eval()
    )
    assert model.config._attn_implementation == attn_implementation
    assert isinstance(model.base_model.layers[1].memory, ProductKeyMemory)
    assert isinstance(model.base_model.layers[2].ngram, NgramMemory)
    for left in (False, True):
        ids, mask = padded_batch(left)
        expected, ours = outputs_of(source, ids, mask, head), outputs_of(model, ids, mask, head)
        torch.testing.assert_close(real(ours, mask, head), real(expected, mask, head), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "options",
    [{"pkm_shared_values": True, "pkm_layers": [0, 2]}, {"pkm_output_gate": "swilu", "pkm_qk_norm": True},
     {"pkm_score_activation": "relu", "pkm_memory_scale": 0.01}],
    ids=["shared_values", "swilu_qk_norm", "relu_scale"],
)  # fmt: skip
def test_memory_plus_options_start_function_preserving(tmp_path, options):
    """Through a state dict, as the conversion loads one (from_pretrained of a plain checkpoint cannot initialise a
    shared table that transformers takes for tied and loaded: convert_to_pkm is the way)."""
    source = source_model("ForMaskedLM")
    model = ModernBertPkmForMaskedLM(ModernBertPkmConfig(**{**source.config.to_dict(), **SMALL_PKM,
                                                            "pkm_value_init": "zeros", **options}))  # fmt: skip
    assert not model.load_state_dict(source.state_dict(), strict=False).unexpected_keys
    ids, mask = padded_batch()
    torch.testing.assert_close(
        real(outputs_of(model.eval(), ids, mask, "ForMaskedLM"), mask, "ForMaskedLM"),
        real(outputs_of(source, ids, mask, "ForMaskedLM"), mask, "ForMaskedLM"),
        atol=1e-5, rtol=0,
    )  # fmt: skip
    if options.get("pkm_shared_values"):
        layers = model.model.layers
        assert layers[0].memory.values is layers[2].memory.values
        model.save_pretrained(tmp_path / "saved")
        again = ModernBertPkmForMaskedLM.from_pretrained(tmp_path / "saved")
        assert again.model.layers[0].memory.values is again.model.layers[2].memory.values


def test_replace_mode_drops_the_mlp_of_memory_layers(tmp_path):
    source_model("ForMaskedLM").save_pretrained(tmp_path)
    model = ModernBertPkmForMaskedLM.from_pretrained(tmp_path, **SMALL_PKM, pkm_mode="replace")
    assert model.model.layers[1].mlp is None and model.model.layers[0].mlp is not None
    assert not any(".layers.1.mlp." in name for name in model.state_dict())
    ids, mask = padded_batch()
    assert torch.isfinite(outputs_of(model.eval(), ids, mask, "ForMaskedLM")).all()


def test_a_checkpoint_whose_memories_do_not_fit_the_config_is_refused(tmp_path):
    ModernBertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(BertPkmLoadingError, match=r"model\.layers\.1\.memory\."):
        ModernBertPkmForMaskedLM.from_pretrained(tmp_path, pkm_layers=[2])


def contributing(model):
    """Memories that change the output: normal values (the default) and an n-gram value projection made nonzero."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, NgramMemory):
                module.value.weight.normal_()
    return model


@pytest.mark.parametrize("head", ["ForMaskedLM", "ForSequenceClassification"])
def test_padding_changes_nothing_for_real_tokens(head):
    """Each row alone computes what it computes in a left- or right-padded batch (memories contributing, eval)."""
    config = tiny_config(num_labels=3, classifier_pooling="mean", **NGRAM)
    model = contributing(OURS[head](config)).eval()
    for left in (False, True):
        ids, mask = padded_batch(left)
        batch = outputs_of(model, ids, mask, head)
        for row in range(2):
            alone_ids = ids[row : row + 1, mask[row].bool()]
            alone = outputs_of(model, alone_ids, torch.ones_like(alone_ids), head)
            ours = batch[row, mask[row].bool()] if head == "ForMaskedLM" else batch[row]
            torch.testing.assert_close(ours, alone[0], atol=1e-5, rtol=0)


def test_padding_does_not_enter_the_query_batchnorm_statistics_nor_the_ngram_hashes():
    """In training (batch statistics), the same sequences padded on the right, or padded more and on the left, give
    the same outputs at real tokens and the same running statistics."""
    model = contributing(ModernBertPkmModel(tiny_config(**NGRAM)))
    ids, mask = padded_batch(left=False)
    wider_ids = torch.cat([torch.zeros(2, 3, dtype=ids.dtype), ids], dim=1)
    wider_mask = torch.cat([torch.zeros(2, 3, dtype=mask.dtype), mask], dim=1)
    # the second row left-padded instead of right-padded inside the wider batch
    wider_ids[1], wider_mask[1] = torch.roll(wider_ids[1], 5), torch.roll(wider_mask[1], 5)
    results, statistics = [], []
    for batch_ids, batch_mask in ((ids, mask), (wider_ids, wider_mask)):
        fresh = contributing(ModernBertPkmModel(tiny_config(**NGRAM)))
        fresh.load_state_dict(model.state_dict())
        fresh.train()
        results.append(fresh(batch_ids, attention_mask=batch_mask).last_hidden_state[batch_mask.bool()])
        batchnorm = fresh.layers[1].memory.query_batchnorm
        statistics.append((batchnorm.running_mean.clone(), batchnorm.running_var.clone()))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(statistics[0], statistics[1], atol=1e-6, rtol=0)
    # the n-gram ids: padding enters as -1 wherever it is
    ngram_ids = model._ngram_ids(wider_ids, wider_mask.bool())
    assert (ngram_ids[wider_mask == 0] == -1).all() and (ngram_ids[wider_mask == 1] >= 0).all()


def test_hidden_states_attentions_and_a_training_step():
    model = ModernBertPkmForMaskedLM(tiny_config(**NGRAM, attn_implementation="eager"))
    ids, mask = padded_batch()
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_hidden_states=True,
                output_attentions=True)  # fmt: skip
    assert len(out.hidden_states) == 4 and len(out.attentions) == 3
    assert out.attentions[1].shape == (2, 4, 12, 12)
    assert out.attentions[1][0, 0, 0, 3:].abs().max() == 0  # a local layer: 2 tokens each side
    out.loss.backward()
    memory = model.model.layers[1].memory
    assert memory.values.weight.grad is not None and memory.keys.grad is not None
    model.gradient_checkpointing_enable()
    model(ids, attention_mask=mask, labels=ids).loss.backward()


def test_int8_and_4bit_tables_save_and_load(tmp_path):
    for bits in (8, 4):
        model = contributing(ModernBertPkmForMaskedLM(tiny_config(**NGRAM))).eval()
        quantize_memory_values(model, bits=bits)
        assert model.config.pkm_values_quantization == {8: "int8", 4: "4bit"}[bits]
        ids, mask = padded_batch()
        expected = outputs_of(model, ids, mask, "ForMaskedLM")
        model.save_pretrained(tmp_path / str(bits))
        loaded = ModernBertPkmForMaskedLM.from_pretrained(tmp_path / str(bits)).eval()
        torch.testing.assert_close(outputs_of(loaded, ids, mask, "ForMaskedLM"), expected, atol=1e-6, rtol=0)


def test_bad_inputs_are_refused_in_one_line():
    model = ModernBertPkmModel(tiny_config(**NGRAM))
    for call, message in [
        (lambda: model(torch.tensor([1, 2, 3])), "must be 2-D"),
        (lambda: model(torch.tensor([[1, 2, 300]])), "holds 300; values must be in"),
        (lambda: model(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 4)), "attention_mask of shape"),
        (lambda: model(inputs_embeds=torch.zeros(1, 3, 32)), "n-gram memories"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            call()
        assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------------------------------- remote code


REMOTE_SCRIPT = r"""
import json, sys
sys.modules["modeling_pkm_bert"] = None
try:
    import modeling_pkm_bert
    raise SystemExit("modeling_pkm_bert must not be importable here")
except ImportError:
    pass
import torch
import transformers
folders = json.loads(sys.argv[1])
ids = torch.tensor(json.loads(sys.argv[2]))
mask = torch.tensor(json.loads(sys.argv[3]))
out = {}
for name, (auto, folder) in folders.items():
    model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
    out[name + "_module"] = type(model).__module__
    with torch.no_grad():
        result = model(ids, attention_mask=mask)
    out[name] = (result.start_logits if name == "qa" else result.logits if hasattr(result, "logits")
                 else result.last_hidden_state).tolist()
print("RESULT" + json.dumps(out))
"""


def test_saved_folders_load_as_remote_code_without_the_package(tmp_path):
    ids, mask = padded_batch(left=True)
    folders, expected = {}, {}
    for name, auto, model_class in [
        ("mlm", "AutoModelForMaskedLM", ModernBertPkmForMaskedLM),
        ("cls", "AutoModelForSequenceClassification", ModernBertPkmForSequenceClassification),
        ("qa", "AutoModelForQuestionAnswering", ModernBertPkmForQuestionAnswering),
        ("tok", "AutoModelForTokenClassification", ModernBertPkmForTokenClassification),
        ("base", "AutoModel", ModernBertPkmModel),
    ]:
        model = contributing(model_class(tiny_config(num_labels=2, **NGRAM))).eval()
        model.save_pretrained(tmp_path / name)
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["auto_map"] == MODERNBERT_AUTO_MAP and saved["model_type"] == "modernbert_pkm"
        code = sorted(path.name for path in (tmp_path / name).glob("*.py"))
        assert code == sorted(f for f in REMOTE_CODE_FILES if "roberta" not in f), code
        folders[name] = (auto, str(tmp_path / name))
        with torch.no_grad():
            result = model(ids, attention_mask=mask)
        expected[name] = result.start_logits if name == "qa" else getattr(result, "logits", None)
        if name == "base":
            expected[name] = result.last_hidden_state

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, json.dumps(folders), json.dumps(ids.tolist()), json.dumps(mask.tolist())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.split("RESULT", 1)[1])
    for name in folders:
        assert out[name + "_module"].startswith("transformers_modules."), out[name + "_module"]
        torch.testing.assert_close(torch.tensor(out[name]), expected[name], atol=1e-6, rtol=0)


def test_register_auto_classes_resolves_modernbert_pkm_folders_without_remote_code(tmp_path):
    from modeling_pkm_bert import register_auto_classes

    register_auto_classes()
    ModernBertPkmForTokenClassification(tiny_config(num_labels=4)).save_pretrained(tmp_path)
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path)
    assert type(model) is ModernBertPkmForTokenClassification  # the package's class, not a copy from the folder
    assert type(transformers.AutoModel.from_config(model.config)) is ModernBertPkmModel


def test_the_weights_checksum_covers_modernbert_names(tmp_path):
    from safetensors.torch import load_file, save_file

    model = ModernBertPkmForMaskedLM(tiny_config(**NGRAM))
    model.save_pretrained(tmp_path, checksum=True)
    ModernBertPkmForMaskedLM.from_pretrained(tmp_path)  # verified
    # the body digest holds the layers and the final norm: a head class of the same body verifies it too
    ModernBertPkmModel.from_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors["model.final_norm.weight"] + 1
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="do not match the pkm_weights_checksum"):
        ModernBertPkmForMaskedLM.from_pretrained(tmp_path)
