import os
import subprocess

import pytest
import torch
from transformers import (
    BertConfig,
    GradientCheckpointingLayer,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)

from helpers import batch, bert_pkm_code_files, tiny_config
from modeling_pkm_bert import (
    BertPkmForCausalLM,
    BertPkmForMaskedLM,
    BertPkmForMultipleChoice,
    BertPkmForQuestionAnswering,
    BertPkmForSequenceClassification,
    BertPkmForTokenClassification,
    BertPkmModel,
    ProductKeyMemory,
)
from modeling_pkm_bert.modeling_bert_pkm import CACHE_FIELD


def bert_config_of(config) -> BertConfig:
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("pkm_") and k not in ("auto_map", "model_type")}
    return BertConfig(**fields)


@pytest.mark.parametrize(
    "pkm_class,bert_class,outputs",
    [
        (BertPkmForMaskedLM, BertForMaskedLM, ("logits",)),
        (BertPkmForSequenceClassification, BertForSequenceClassification, ("logits",)),
        (BertPkmForQuestionAnswering, BertForQuestionAnswering, ("start_logits", "end_logits")),
        (BertPkmForTokenClassification, BertForTokenClassification, ("logits",)),
    ],
)
def test_without_memory_layers_it_is_bert(pkm_class, bert_class, outputs):
    config = tiny_config(pkm_layers=[], num_labels=2 if "start_logits" in outputs else 3)
    pkm_model = pkm_class(config).eval()
    bert = bert_class(bert_config_of(config)).eval()
    bert.load_state_dict(pkm_model.state_dict(), strict=True)
    input_ids, attention_mask = batch()
    with torch.no_grad():
        ours = pkm_model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        theirs = bert(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    for name in outputs:
        assert (getattr(ours, name) - getattr(theirs, name)).abs().max() <= 1e-5
    assert len(ours.hidden_states) == len(theirs.hidden_states) == config.num_hidden_layers + 1


@pytest.mark.parametrize("train", [False, True])
def test_resm_with_zero_values_starts_as_the_bert(train):
    config = tiny_config(pkm_layers=[0, 2], pkm_value_init="zeros")
    pkm_model = BertPkmForMaskedLM(config).train(train)
    bert = BertForMaskedLM(bert_config_of(config)).train(train)
    result = pkm_model.load_state_dict(bert.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(".memory." in key for key in result.missing_keys) and result.missing_keys
    input_ids, attention_mask = batch()
    assert (pkm_model(input_ids, attention_mask=attention_mask).logits - bert(input_ids, attention_mask=attention_mask).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["resm", "replace"])
@pytest.mark.parametrize("train", [False, True])
def test_padding_changes_no_output_of_real_tokens(mode, train):
    model = BertPkmForMaskedLM(tiny_config(pkm_mode=mode, pkm_layers=[0, 2])).train(train)
    input_ids, attention_mask = batch(seq_len=7, pad_from=(None, 5, 3))
    more_padding = torch.nn.functional.pad(input_ids, (0, 6)), torch.nn.functional.pad(attention_mask, (0, 6))
    short = model(input_ids, attention_mask=attention_mask).logits
    long = model(*more_padding[:1], attention_mask=more_padding[1]).logits
    real = attention_mask.bool()
    torch.testing.assert_close(long[:, :7][real], short[real], atol=2e-5, rtol=1e-4)


def test_layer_structure_follows_the_mode():
    resm = BertPkmModel(tiny_config(pkm_layers=[1], pkm_mode="resm"))
    replace = BertPkmModel(tiny_config(pkm_layers=[1], pkm_mode="replace"))
    assert isinstance(resm.encoder.layer[1].memory, ProductKeyMemory) and resm.encoder.layer[0].memory is None
    assert resm.encoder.layer[1].intermediate is not None
    assert replace.encoder.layer[1].intermediate is None
    assert not any(".1.output.dense" in name or ".1.intermediate" in name for name, _ in replace.named_parameters())
    assert "encoder.layer.1.output.LayerNorm.weight" in dict(replace.named_parameters())
    assert "encoder.layer.1.memory.values.weight" in dict(replace.named_parameters())


@pytest.mark.parametrize("mode", ["resm", "replace"])
def test_memory_layer_formula(mode):
    layer = BertPkmModel(tiny_config(pkm_layers=[0], pkm_mode=mode)).eval().encoder.layer[0]
    x = torch.randn(2, 5, 32)
    attention_output, _ = layer.attention(x)
    memory = layer.memory(attention_output)
    if mode == "resm":  # LN(x + FFN(x) + PKM(x))
        ffn = layer.output.dense(layer.intermediate(attention_output))
        expected = layer.output.LayerNorm(attention_output + ffn + memory)
    else:  # LN(x + PKM(x))
        expected = layer.output.LayerNorm(attention_output + memory)
    torch.testing.assert_close(layer(x), expected)


def test_every_head_runs_with_labels():
    config = tiny_config(num_labels=3)
    input_ids, attention_mask = batch()
    for model_class, labels in [
        (BertPkmForMaskedLM, dict(labels=input_ids.masked_fill(attention_mask == 0, -100))),
        (BertPkmForSequenceClassification, dict(labels=torch.tensor([0, 2, 1]))),
        (BertPkmForTokenClassification, dict(labels=torch.randint(0, 3, input_ids.shape))),
        (BertPkmForQuestionAnswering, dict(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([2, 4, 3]))),
    ]:
        model = model_class(tiny_config() if model_class is BertPkmForQuestionAnswering else config)
        output = model(input_ids, attention_mask=attention_mask, **labels)
        assert torch.isfinite(output.loss), model_class.__name__
        output.loss.backward()
    choices = BertPkmForMultipleChoice(config)
    output = choices(input_ids[None].expand(2, -1, -1), attention_mask=attention_mask[None].expand(2, -1, -1), labels=torch.tensor([0, 2]))
    assert output.logits.shape == (2, 3) and torch.isfinite(output.loss)
    regression = BertPkmForSequenceClassification(tiny_config(num_labels=1))
    assert torch.isfinite(regression(input_ids, attention_mask=attention_mask, labels=torch.randn(3)).loss)


def test_causal_lm_generates_the_same_with_and_without_cache():
    model = BertPkmForCausalLM(tiny_config(is_decoder=True, pkm_layers=[0, 2])).eval()
    prompt = torch.randint(1, 99, (2, 4))
    with_cache = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    without_cache = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert with_cache.shape == (2, 10)
    assert torch.equal(with_cache, without_cache)
    output = model(prompt, labels=prompt)
    assert torch.isfinite(output.loss)


def test_eager_and_sdpa_agree_and_attentions_are_returned():
    config = tiny_config()
    input_ids, attention_mask = batch()
    sdpa = BertPkmForMaskedLM(config).eval()
    eager = BertPkmForMaskedLM(tiny_config(attn_implementation="eager")).eval()
    eager.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa"
    output = eager(input_ids, attention_mask=attention_mask, output_attentions=True)
    torch.testing.assert_close(output.logits, sdpa(input_ids, attention_mask=attention_mask).logits, atol=1e-5, rtol=1e-4)
    assert len(output.attentions) == config.num_hidden_layers and output.attentions[0].shape == (3, 4, 9, 9)
    as_tuple = eager(input_ids, attention_mask=attention_mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], output.logits)


def test_gradient_checkpointing_gives_the_same_gradients():
    input_ids, attention_mask = batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            assert model.bert.encoder.layer[0].gradient_checkpointing
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(".memory.values" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_resized_embeddings_stay_tied():
    model = BertPkmForMaskedLM(tiny_config())
    model.resize_token_embeddings(120)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight.shape[0] == 120 and model.config.vocab_size == 120
    input_ids, attention_mask = batch(vocab=120)
    assert model(input_ids, attention_mask=attention_mask).logits.shape[-1] == 120


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_and_load_round_trip(tmp_path, dtype):
    model = BertPkmForSequenceClassification(tiny_config(num_labels=2)).eval().to(dtype)
    model.save_pretrained(tmp_path)
    loaded = BertPkmForSequenceClassification.from_pretrained(tmp_path).eval()
    assert loaded.dtype == dtype
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    input_ids, attention_mask = batch()
    assert torch.equal(model(input_ids, attention_mask=attention_mask).logits, loaded(input_ids, attention_mask=attention_mask).logits)
    assert (tmp_path / "model.safetensors").exists()
    for code in bert_pkm_code_files():
        assert (tmp_path / code).exists(), code


def test_memories_are_initialised_when_loading_a_plain_bert(tmp_path):
    # transformers 5 builds on the meta device: every memory parameter comes from _init_weights
    config = tiny_config(pkm_layers=[0, 2], pkm_n_keys=16, pkm_k_dim=32)
    BertForMaskedLM(bert_config_of(config)).save_pretrained(tmp_path)
    model = BertPkmForMaskedLM.from_pretrained(tmp_path, config=config)
    for layer in (0, 2):
        memory = model.bert.encoder.layer[layer].memory
        bound = (config.pkm_k_dim // 2) ** -0.5
        assert torch.isfinite(memory.keys).all() and memory.keys.abs().max() <= bound
        assert memory.keys.std() > 0.4 * bound
        assert abs(memory.values.weight.std().item() - config.hidden_size**-0.5) < 0.03
        assert torch.equal(memory.query_batchnorm.running_var, torch.ones_like(memory.query_batchnorm.running_var))
    input_ids, attention_mask = batch()
    assert torch.isfinite(model(input_ids, attention_mask=attention_mask).logits).all()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_in_training_turns_the_decoder_cache_off(use_reentrant):
    """As transformers' layers do (a warning, `use_cache=False`): the recomputation in backward would append the keys
    and values to the cache a second time. The gradients are those of the run without checkpointing."""
    input_ids, attention_mask = batch()
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = BertPkmForCausalLM(tiny_config(is_decoder=True, pkm_layers=[0, 2])).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        output = model(input_ids, attention_mask=attention_mask)  # no labels: config.use_cache=True
        cache = getattr(output, CACHE_FIELD)
        assert cache is None if checkpointing else cache.get_seq_length() == 9
        output.logits.pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(".memory.values" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():  # nothing is recomputed without gradients (generating from a model in training mode)
        cache = getattr(model(input_ids[:, :4], attention_mask=attention_mask[:, :4]), CACHE_FIELD)
    assert cache.get_seq_length() == 4
    with pytest.raises(ValueError, match=r"cache \(holds 4 tokens\) cannot be used with gradient checkpointing"):
        model(input_ids[:, 4:], attention_mask=attention_mask, cache=cache)


def test_the_layers_follow_transformers_gradient_checkpointing_contract():
    """transformers finds the layers to checkpoint as `GradientCheckpointingLayer`s (its common tests, `every_n_layers`)."""
    model = BertPkmForMaskedLM(tiny_config(num_hidden_layers=4))
    assert all(isinstance(layer, GradientCheckpointingLayer) for layer in model.bert.encoder.layer)
    model.activation_checkpointing_enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.bert.encoder.layer] == [True, False, True, False]
    model.activation_checkpointing_disable()
    assert not any(module.gradient_checkpointing for module in model.modules() if hasattr(module, "gradient_checkpointing"))


def test_an_additive_4d_encoder_attention_mask_means_what_the_2d_mask_means():
    """0: attend, a large negative number: blocked (as the self-attention's 4-D masks); boolean 4-D masks too."""
    model = BertPkmModel(tiny_config(is_decoder=True, add_cross_attention=True)).eval()
    input_ids, attention_mask = batch()
    encoder_hidden_states = torch.randn(3, 5, 32)
    encoder_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    additive = (1.0 - encoder_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    with torch.no_grad():
        outputs = [
            model(input_ids, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
                  encoder_attention_mask=mask, use_cache=False).last_hidden_state
            for mask in (encoder_mask, additive, additive.expand(-1, -1, 9, -1), encoder_mask[:, None, None, :].bool())
        ]
        unmasked = model(input_ids, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states).last_hidden_state
    assert not torch.allclose(outputs[0], unmasked, atol=1e-3)  # the mask matters
    for output in outputs[1:]:
        torch.testing.assert_close(output, outputs[0])


MIN_PYTHON_SCRIPT = r"""
import copy
import torch
from transformers import GradientCheckpointingLayer
from modeling_pkm_bert import BertPkmConfig, BertPkmForCausalLM
from modeling_pkm_bert.modeling_bert_pkm import CACHE_FIELD

config = BertPkmConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pkm_layers=[0, 2], pkm_n_keys=8,
                       pkm_heads=2, pkm_knn=4, pkm_k_dim=16, is_decoder=True)
input_ids = torch.randint(1, 99, (3, 9))
for use_reentrant in (False, True):
    model = BertPkmForCausalLM(config).train()
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing
               for layer in checkpointed.bert.encoder.layer)
    for candidate in (model, checkpointed):
        output = candidate(input_ids)
        output.logits.pow(2).mean().backward()
    assert getattr(output, CACHE_FIELD) is None
    for (name, parameter), other in zip(model.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(other.grad, parameter.grad, atol=1e-6, rtol=1e-5, msg=name)
model.eval().set_attn_implementation("eager")
assert model(input_ids, output_attentions=True).attentions[0].shape == (3, 4, 9, 9)
print("ok")
"""


@pytest.mark.skipif(not os.environ.get("PKM_COMPAT_MIN_PYTHON"), reason="PKM_COMPAT_MIN_PYTHON is not set: `make test` builds .venv-min")
@pytest.mark.multiprocess
def test_gradient_checkpointing_under_the_declared_minimum():
    """transformers 5.4's `GradientCheckpointingLayer` wraps `__call__` and drops `past_key_values` (5.24: `forward`,
    `cache`): the model turns the cache off itself, so training with checkpointing is right under both; and
    `set_attn_implementation` switches a built model there too."""
    result = subprocess.run([os.environ["PKM_COMPAT_MIN_PYTHON"], "-c", MIN_PYTHON_SCRIPT], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_attention_implementation_can_be_switched_on_a_built_model():
    """`set_attn_implementation` (transformers' common test_can_set_attention_dynamically): the attention kernel is
    looked up by `config._attn_implementation` at every call, so a built model switches (eager: the weights)."""
    model = BertPkmForMaskedLM(tiny_config()).eval()
    input_ids, attention_mask = batch()
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        sdpa = model(input_ids, attention_mask=attention_mask).logits
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"
        eager = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    assert eager.attentions[0].shape == (3, 4, 9, 9)
    torch.testing.assert_close(eager.logits, sdpa, atol=1e-5, rtol=1e-4)
