"""Hashed n-gram memory (Engram-style, issue 35): the layer, its place in the models, masking, padding, cached
generation, the function-preserving start, config validation and saving."""

import pytest
import torch
from helpers import tiny_config
from transformers import BertConfig, BertForMaskedLM

from modeling_pkm_bert import BertPkmForCausalLM, BertPkmForMaskedLM, BertPkmForSequenceClassification, BertPkmModel
from modeling_pkm_bert.modeling_bert_pkm import BertPkmLoadingError
from modeling_pkm_bert.ngram_memory import NgramMemory, hash_multipliers, largest_primes_below


MASK = 4
NGRAM = dict(ngram_layers=[0, 2], ngram_table_size=211, ngram_dim=4)


def learned(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A model whose n-gram memories contribute (their convolution and value projection start at zero)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, NgramMemory):
            for parameter in (module.conv.weight, module.conv.bias, module.value.weight, module.value.bias):
                with torch.no_grad():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def memory(**overrides) -> NgramMemory:
    arguments = dict(hidden_size=16, vocab_size=50, orders=(2, 3), heads=2, table_size=97, dim=4, conv_kernel=3)
    arguments.update(overrides)
    return learned(NgramMemory(**arguments)).eval()


# --- the layer ----------------------------------------------------------------------------------------------------


def test_tables_have_distinct_prime_sizes_and_fixed_hashes():
    layer = NgramMemory(16, 50, orders=(2, 3), heads=2, table_size=100, dim=4)
    assert layer.primes == [97, 89, 83, 79, 73, 71, 67, 61]  # 2 orders x 2 directions x 2 heads
    assert layer.tables.weight.shape == (sum(layer.primes), 4)
    assert largest_primes_below(13, 3) == [13, 11, 7]
    # the multipliers depend on the seed alone (a saved model hashes the same way when loaded): fixed values
    assert hash_multipliers(0, 3) == [2065550767, 565798389, 607567]
    assert all(m % 2 == 1 and m < 2**31 for m in hash_multipliers(5, 100))
    tokens = torch.tensor([[-1, -1, 7, 8, 9, -1, -1]])
    rows = layer.bucket_indices(tokens)  # (1, 3 positions, 8 tables)
    offsets = torch.tensor([sum(layer.primes[:t]) for t in range(8)])
    assert rows.shape == (1, 3, 8)
    assert ((rows >= offsets) & (rows < offsets + torch.tensor(layer.primes))).all()
    assert torch.equal(rows, layer.bucket_indices(tokens.clone()))


def test_encoder_memory_reads_both_sides_within_its_reach_and_causal_only_the_past():
    for causal in (False, True):
        layer = memory(causal=causal)
        ids = torch.randint(5, 50, (1, 12))
        hidden = torch.randn(1, 12, 16)
        base = layer(hidden, ids)
        position = 6
        changed = ids.clone()
        changed[0, position] = (ids[0, position] + 1 - 5) % 45 + 5
        difference = (layer(hidden, changed) - base).abs().sum(-1)[0]
        reach = range(position - layer.context_right, position + layer.context_left + 1)
        assert all(difference[i] > 0 for i in reach), (causal, difference)
        assert all(difference[i] == 0 for i in range(12) if i not in reach), (causal, difference)
        assert (layer.context_left, layer.context_right) == ((4, 0) if causal else (3, 3))


def test_padding_and_edges_are_explicit_a_padded_sequence_equals_the_unpadded_one():
    layer = memory()
    ids = torch.randint(5, 50, (1, 7))
    hidden = torch.randn(1, 10, 16)
    padded = torch.cat([ids, torch.full((1, 3), -1)], dim=1)
    out = layer(hidden, padded)
    assert torch.allclose(out[:, :7], layer(hidden[:, :7], ids), atol=1e-6)
    assert out[:, 7:].abs().max() == 0  # padding outputs nothing


def test_sparse_tables_give_a_sparse_gradient_over_the_rows_used():
    layer = memory(sparse=True).train()
    layer(torch.randn(2, 5, 16), torch.randint(5, 50, (2, 5))).sum().backward()
    grad = layer.tables.weight.grad
    assert grad.is_sparse
    used = grad.coalesce().indices()[0].unique()
    assert 0 < used.numel() <= 2 * (5 + 2) * layer.num_tables


@pytest.mark.parametrize("sparse", [False, True])
def test_product_key_value_tables_give_nn_embedding_s_outputs_and_gradients(sparse):
    """The models' tables (`ProductKeyValues`, bags of one row: a dense gradient into a buffer reused between steps, a
    sparse one coalesced) against the plain `nn.Embedding` ones, in fp64, over two steps."""
    from modeling_pkm_bert.product_key_memory import ProductKeyValues

    torch.manual_seed(0)
    plain = memory(sparse=sparse).double().train()
    bags = memory(sparse=sparse, table_factory=lambda rows, dim, sparse: ProductKeyValues(rows, dim, sparse=sparse))
    bags = bags.double().train()
    bags.load_state_dict(plain.state_dict())
    assert isinstance(bags.tables, ProductKeyValues) and bags.tables.sparse == sparse
    for _ in range(2):
        h, ids = torch.randn(2, 5, 16, dtype=torch.float64), torch.randint(5, 50, (2, 5))
        outputs = [layer(h, ids) for layer in (plain, bags)]
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-13)
        for layer, output in zip((plain, bags), outputs):
            layer.zero_grad(set_to_none=True)
            (output * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
        for (name, p), q in zip(plain.named_parameters(), bags.parameters()):
            expected, got = (t.to_dense() if t.is_sparse else t for t in (p.grad, q.grad))
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-13, msg=name)
    if sparse:  # one entry per row read, sorted
        rows = bags.tables.weight.grad._indices()[0]
        assert torch.equal(rows, rows.unique())


def test_token_map_hashes_canonical_ids():
    layer = memory(token_map=True)
    layer.token_map[7] = 9  # e.g. "The" -> "the"
    hidden = torch.randn(1, 4, 16)
    assert torch.equal(layer(hidden, torch.tensor([[5, 7, 6, 8]])), layer(hidden, torch.tensor([[5, 9, 6, 8]])))
    assert "token_map" in layer.state_dict()


# --- in the models ------------------------------------------------------------------------------------------------


def test_a_masked_position_s_gold_token_changes_no_output():
    model = learned(BertPkmForMaskedLM(tiny_config(**NGRAM))).eval()
    ids = torch.tensor([[2, 10, 11, MASK, 13, 14, 3]])
    outputs = []
    for gold in (12, 40):
        labels = torch.full_like(ids, -100)
        labels[0, 3] = gold
        with torch.no_grad():
            outputs.append(model(ids, labels=labels, output_hidden_states=True))
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    for a, b in zip(outputs[0].hidden_states, outputs[1].hidden_states):
        assert torch.equal(a, b)
    # the memory does read that position: unmasked, the gold token would change the outputs
    unmasked = [ids.clone(), ids.clone()]
    unmasked[0][0, 3], unmasked[1][0, 3] = 12, 40
    with torch.no_grad():
        assert not torch.allclose(model(unmasked[0]).logits, model(unmasked[1]).logits)


def test_padding_in_a_batch_leaves_the_real_tokens_outputs_unchanged():
    model = learned(BertPkmForMaskedLM(tiny_config(**NGRAM))).eval()
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    padded = torch.tensor([[2, 10, 11, 12, 3, 0, 0], [2, 20, 21, 22, 23, 24, 3]])
    with torch.no_grad():
        alone = model(ids).logits
        batch = model(padded, attention_mask=(padded != 0).long()).logits
    assert torch.allclose(batch[0, :5], alone[0], atol=1e-5)


def four_d_mask(real: torch.Tensor, causal: bool, additive: bool) -> torch.Tensor:
    """The 4-D mask (batch, 1, query, key) of a 2-D padding mask: every query may attend to the real keys (in a decoder
    only those up to itself); boolean (True: may attend) or additive (0 or the dtype's minimum)."""
    length = real.shape[1]
    allowed = real.bool()[:, None, None, :].expand(-1, 1, length, length)
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min) if additive else allowed


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mask_kind", ["2d", "4d-bool", "4d-additive"])
@pytest.mark.parametrize("ngram", [False, True], ids=["no-ngram", "ngram"])
@pytest.mark.parametrize("pkm", [False, True], ids=["no-pkm", "pkm"])
def test_padding_leaves_real_tokens_outputs_unchanged_whatever_the_mask_and_memories(pkm, ngram, mask_kind, side, decoder):
    """Issue 44: with a 4-D mask and no product-key layer, the n-gram memories hashed the pad ids into the real
    tokens' n-grams (the padding mask was derived from a 4-D mask only for product-key layers)."""
    memories = dict(pkm_layers=[1] if pkm else [], **(NGRAM if ngram else {}))
    config = tiny_config(is_decoder=decoder, **memories)
    model = learned(BertPkmForCausalLM(config) if decoder else BertPkmForMaskedLM(config)).eval()
    short, full = torch.tensor([2, 10, 11, 12, 3]), torch.tensor([2, 20, 21, 22, 23, 24, 25, 3])
    padding = full.numel() - short.numel()
    real = torch.ones(2, full.numel(), dtype=torch.long)
    if side == "left":
        real[0, :padding] = 0
    else:
        real[0, short.numel() :] = 0
    positions = (real.cumsum(1) - 1).clamp(min=0)  # BERT's positions count the real tokens (left padding)
    with torch.no_grad():
        alone = [model(short[None]).logits[0], model(full[None]).logits[0]]
        for pad_id in (0, 57):
            batch = torch.full((2, full.numel()), pad_id)
            batch[0, real[0].bool()], batch[1] = short, full
            mask = real if mask_kind == "2d" else four_d_mask(real, decoder, additive=mask_kind == "4d-additive")
            logits = model(batch, attention_mask=mask, position_ids=positions).logits
            torch.testing.assert_close(logits[0, real[0].bool()], alone[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(logits[1], alone[1], atol=1e-5, rtol=0)


def test_cached_steps_with_4d_masks_hash_the_cached_padding_as_padding():
    """A cached decoding step's 4-D mask tells which cached tokens are padding (no new token may attend to them): the
    n-gram memories hash them as padding, as with the 2-D mask, whatever the pad id in `ngram_history_ids`."""
    model = learned(BertPkmForCausalLM(tiny_config(is_decoder=True, pkm_layers=[], **NGRAM))).eval()
    short, padding, new = torch.tensor([2, 10, 11]), 5, torch.tensor([[40]])
    real = torch.tensor([[0] * padding + [1] * short.numel()])
    positions = (real.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(torch.cat([short[None], new], dim=1)).logits[:, -1]
        for pad_id in (0, 57):
            prompt = torch.cat([torch.full((1, padding), pad_id), short[None]], dim=1)
            step = model(prompt, attention_mask=four_d_mask(real, True, False), position_ids=positions, use_cache=True)
            step_mask = torch.cat([real, torch.ones(1, 1, dtype=torch.long)], dim=1).bool()[:, None, None, :]
            logits = model(
                new,
                attention_mask=step_mask,
                position_ids=positions[:, -1:] + 1,
                cache=step.cache if hasattr(step, "cache") else step.past_key_values,
                use_cache=True,
                ngram_history_ids=prompt,
            ).logits[:, -1]
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_inputs_embeds_alone_is_refused_with_n_gram_layers():
    model = BertPkmModel(tiny_config(**NGRAM)).eval()
    with pytest.raises(ValueError, match="n-gram memories .* pass input_ids"):
        model(inputs_embeds=torch.randn(1, 4, 32))


def test_the_n_gram_memory_trains():
    model = BertPkmForMaskedLM(tiny_config(**NGRAM))
    ids = torch.randint(5, 99, (2, 8))
    model(ids, labels=ids).loss.backward()
    layer = model.bert.encoder.layer[0].ngram
    assert layer.value.weight.grad.abs().sum() > 0  # zero-initialised, yet learning


def causal_model(**overrides):
    config = tiny_config(is_decoder=True, pkm_layers=[1], **{**NGRAM, **overrides})
    return learned(BertPkmForCausalLM(config)).eval()


def test_causal_generation_with_a_cache_gives_the_tokens_of_generation_without_one():
    model = causal_model()
    prompts = torch.tensor([[0, 0, 2, 10, 11], [2, 20, 21, 22, 23]])
    mask = (prompts != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompts, use_cache=True, **kwargs)
        uncached = model.generate(prompts, use_cache=False, **kwargs)
        # beam search reorders the cache between steps: the history comes from the reordered token ids
        beams = [model.generate(prompts, use_cache=c, num_beams=3, **kwargs) for c in (True, False)]
    assert torch.equal(cached, uncached)
    assert torch.equal(beams[0], beams[1])
    # and step by step: the logits of each new token equal the full forward's
    ids = cached[1:, :]
    with torch.no_grad():
        full = model(ids).logits
        step = model(ids[:, :5], use_cache=True)
        cache, logits = step.cache if hasattr(step, "cache") else step.past_key_values, [step.logits]
        for i in range(5, ids.shape[1]):
            step = model(ids[:, i : i + 1], cache=cache, use_cache=True, ngram_history_ids=ids[:, :i])
            logits.append(step.logits)
    assert torch.allclose(torch.cat(logits, dim=1), full, atol=1e-5)


def test_a_cache_without_the_token_history_is_refused():
    model = causal_model()
    ids = torch.tensor([[2, 10, 11, 12]])
    with torch.no_grad():
        step = model(ids, use_cache=True)
        cache = step.cache if hasattr(step, "cache") else step.past_key_values
        with pytest.raises(ValueError, match="ngram_history_ids"):
            model(torch.tensor([[13]]), cache=cache, use_cache=True)


def test_adding_n_gram_memories_to_bert_is_function_preserving(tmp_path):
    bert_config = BertConfig(**{k: v for k, v in tiny_config().to_dict().items() if not k.startswith(("pkm_", "ngram_"))})
    bert = BertForMaskedLM(bert_config).eval()
    bert.save_pretrained(tmp_path)
    ids = torch.randint(5, 99, (2, 9))
    for pkm in ({"pkm_layers": []}, {"pkm_layers": [1], "pkm_value_init": "zeros"}):
        model = BertPkmForMaskedLM.from_pretrained(tmp_path, config=tiny_config(**pkm, **NGRAM)).eval()
        assert model.bert.encoder.layer[2].ngram is not None
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, bert(ids).logits, atol=1e-5)


def test_saved_n_gram_model_reloads_and_refuses_missing_tables(tmp_path):
    model = learned(BertPkmForMaskedLM(tiny_config(**NGRAM, ngram_token_map=True))).eval()
    model.bert.encoder.layer[0].ngram.token_map[7] = 9
    model.save_pretrained(tmp_path / "full")
    assert (tmp_path / "full" / "ngram_memory.py").is_file()
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path / "full").eval()
    ids = torch.randint(5, 99, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.bert.encoder.layer[0].ngram.token_map[7] == 9
    state = {k: v for k, v in model.state_dict().items() if ".ngram." not in k}
    model.save_pretrained(tmp_path / "stripped", state_dict=state)
    with pytest.raises(BertPkmLoadingError, match="ngram"):
        BertPkmForMaskedLM.from_pretrained(tmp_path / "stripped")


# --- configuration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("ngram_layers", [3], "must be in"),
        ("ngram_layers", [1, 1], "repeated"),
        ("ngram_orders", [], "at least one order"),
        ("ngram_orders", [2, 2], "repeated"),
        ("ngram_orders", [0], "each >= 1"),
        ("ngram_heads", 0, ">= 1"),
        ("ngram_dim", 0, ">= 1"),
        ("ngram_conv_kernel", 0, ">= 1"),
        ("ngram_table_size", 10, "distinct primes"),
        ("ngram_table_size", 2**40, "TiB"),
    ],
)
def test_config_refuses_bad_ngram_fields(field, value, problem):
    with pytest.raises(ValueError, match=f"BertPkmConfig.{field}=.*{problem}"):
        tiny_config(**{field: value})


def test_config_defaults_have_no_n_gram_memory():
    config = tiny_config()
    assert config.ngram_layers == [] and config.ngram_orders == [2, 3] and config.ngram_tables == 16
    assert all(layer.ngram is None for layer in BertPkmModel(config).encoder.layer)
    assert tiny_config(is_decoder=True).ngram_tables == 8


# --- training: the tables' own optimizer group, sparse row updates ----------------------------------------------


def test_tables_train_in_the_memory_group_with_sparse_row_updates():
    from modeling_pkm_bert.methods.optimizers import (
        PKM_VALUES_GROUP,
        SparseRowAdam,
        freeze_memory,
        pkm_param_groups,
        pkm_value_parameters,
        set_sparse_values,
    )

    model = learned(BertPkmForMaskedLM(tiny_config(**NGRAM))).train()  # a zero value projection: no table gradient
    tables = [model.bert.encoder.layer[i].ngram.tables.weight for i in (0, 2)]
    pkm_values = model.bert.encoder.layer[1].memory.values.weight
    assert [id(p) for p in pkm_value_parameters(model)] == [id(pkm_values), *map(id, tables)]
    groups = {group["name"]: group for group in pkm_param_groups(model, lr=1e-4, weight_decay=0.01)}
    assert {id(p) for p in groups[PKM_VALUES_GROUP]["params"]} == {id(pkm_values), *map(id, tables)}
    assert not {id(p) for p in tables} & {id(p) for p in groups["decay"]["params"] + groups["no_decay"]["params"]}

    assert set_sparse_values(model, True) == 3
    optimizer = SparseRowAdam(pkm_value_parameters(model), lr=1e-2)
    before = tables[0].detach().clone()
    ids = torch.randint(5, 99, (2, 6))
    model(ids, labels=ids).loss.backward()
    assert tables[0].grad.is_sparse
    read = model.bert.encoder.layer[0].ngram.bucket_indices(
        torch.nn.functional.pad(ids, (3, 3), value=-1)
    ).unique()
    optimizer.step()
    moved = (tables[0].detach() != before).any(dim=1).nonzero().squeeze(1)
    assert set(moved.tolist()) <= set(read.tolist()) and moved.numel() > 0  # only rows the step read

    assert freeze_memory(model) > 0 and not any(p.requires_grad for p in model.bert.encoder.layer[0].ngram.parameters())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bits, name, tolerance, ratio", [(8, "int8", 0.02, 0.32), (4, "4bit", 0.25, 0.16)])
def test_quantized_n_gram_tables_serve_up_to_rounding_save_small_and_reload(tmp_path, bits, name, tolerance, ratio):
    from safetensors import safe_open

    from modeling_pkm_bert import quantize_memory_values
    from modeling_pkm_bert.product_key_memory import QuantizedProductKeyValues

    torch.manual_seed(0)
    config = tiny_config(pkm_layers=[1], ngram_layers=[0, 2], ngram_table_size=211, ngram_dim=32)
    learned(BertPkmForMaskedLM(config)).save_pretrained(tmp_path / "fp32")
    reference = BertPkmForMaskedLM.from_pretrained(tmp_path / "fp32").eval()
    model = BertPkmForMaskedLM.from_pretrained(tmp_path / "fp32").eval()
    ids = torch.randint(5, 99, (2, 9))
    ids[0, 3] = MASK
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0

    assert quantize_memory_values(model, bits=bits) == 3  # one product-key value table, two n-gram tables
    assert model.config.pkm_values_quantization == name
    ngram, fp32 = model.bert.encoder.layer[0].ngram, reference.bert.encoder.layer[0].ngram
    assert isinstance(ngram.tables, QuantizedProductKeyValues) and ngram.tables.weight.dtype == torch.uint8
    hidden = torch.randn(2, 9, config.hidden_size)
    with torch.no_grad():
        # the packed rows are the fp32 rows up to rounding, and the memory's output follows
        assert relative_error(ngram.tables.dequantize(), fp32.tables.weight) < tolerance / 2
        assert relative_error(ngram(hidden, ids), fp32(hidden, ids)) < tolerance
        expected = model(ids, attention_mask=mask).logits
        assert relative_error(expected, reference(ids, attention_mask=mask).logits) < tolerance
    assert torch.equal(ngram.bucket_indices(ngram.context_tokens(ids)), fp32.bucket_indices(fp32.context_tokens(ids)))

    model.save_pretrained(tmp_path / name)

    def table_bytes(folder):
        with safe_open(folder / "model.safetensors", "pt") as f:
            return sum(f.get_tensor(k).nbytes for k in f.keys() if "ngram.tables" in k)

    assert table_bytes(tmp_path / name) <= ratio * table_bytes(tmp_path / "fp32")
    loaded, info = BertPkmForMaskedLM.from_pretrained(tmp_path / name, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids, attention_mask=mask).logits, expected)
    # serving only: training and a second quantization are refused, naming the problem
    with pytest.raises(RuntimeError, match="quantized \\(inference only\\)"):
        loaded.train()(ids, labels=ids)
    with pytest.raises(ValueError, match="already"):
        quantize_memory_values(loaded, bits=bits)


def test_quantized_n_gram_memories_alone_and_in_a_causal_model_generate_as_with_fp32():
    from modeling_pkm_bert import quantize_memory_values

    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[], ngram_layers=[1], ngram_dim=8)).eval()
    assert quantize_memory_values(model, bits=8) == 1  # a model with n-gram memories alone
    causal = causal_model()
    assert quantize_memory_values(causal, bits=8) == 3  # the product-key values and two n-gram tables
    prompts = torch.tensor([[0, 0, 2, 10, 11], [2, 20, 21, 22, 23]])
    kwargs = dict(attention_mask=(prompts != 0).long(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # the cached history reads the packed rows as the full forward does
        assert torch.equal(causal.generate(prompts, use_cache=True, **kwargs), causal.generate(prompts, use_cache=False, **kwargs))


def test_4_bit_rows_of_an_odd_size_are_refused_before_any_table_changes():
    from modeling_pkm_bert import quantize_memory_values

    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[1], ngram_layers=[0], ngram_dim=5)).eval()
    with pytest.raises(ValueError, match="even row size.*encoder.layer.0.ngram.*5 values a row"):
        quantize_memory_values(model, bits=4)
    assert model.bert.encoder.layer[0].ngram.tables.weight.dtype == torch.float32
    assert model.config.pkm_values_quantization is None
    assert type(model.bert.encoder.layer[1].memory.values).__name__ == "ProductKeyValues"  # left as it was
    assert quantize_memory_values(model, bits=8) == 2


QUANTIZED_REMOTE = r"""
import json, sys
sys.modules["modeling_pkm_bert"] = None
import torch
from transformers import AutoModelForMaskedLM
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[2]))).logits
tables = model.bert.encoder.layer[0].ngram.tables
print("RESULT" + json.dumps({"logits": logits.tolist(), "class": type(tables).__name__, "module": type(tables).__module__}))
"""


def test_a_quantized_n_gram_folder_runs_as_remote_code_without_the_package(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from modeling_pkm_bert import quantize_memory_values

    model = learned(BertPkmForMaskedLM(tiny_config(pkm_layers=[1], **NGRAM))).eval()
    quantize_memory_values(model, bits=4)
    ids = torch.randint(5, 99, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path / "folder")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    completed = subprocess.run(
        [sys.executable, "-c", QUANTIZED_REMOTE, str(tmp_path / "folder"), json.dumps(ids.tolist())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.split("RESULT", 1)[1])
    assert out["class"] == "QuantizedProductKeyValues" and out["module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, atol=1e-5, rtol=1e-5)


def test_memory_parallel_refuses_n_gram_memories_clearly():
    from modeling_pkm_bert.parallel.memory_parallel import shard_memory_values

    model = BertPkmForMaskedLM(tiny_config(**NGRAM))
    with pytest.raises(ValueError, match="n-gram memories .*does not shard"):
        shard_memory_values(model, device_mesh=None)


# --- integrations: PEFT, Trainer -----------------------------------------------------------------------------------


def test_lora_adapter_with_trained_n_gram_memories_reloads_exactly(tmp_path):
    from peft import PeftModel, get_peft_model

    from modeling_pkm_bert.integrations.lora import pkm_lora_config

    torch.manual_seed(0)
    config = tiny_config(pkm_layers=[], num_labels=2, **NGRAM)
    learned(BertPkmForSequenceClassification(config)).save_pretrained(tmp_path / "base")
    ids = torch.randint(5, 99, (4, 8))
    labels = torch.tensor([0, 1, 1, 0])
    base = BertPkmForSequenceClassification.from_pretrained(tmp_path / "base")
    lora = pkm_lora_config(base, ngram_memories=True, task_type="SEQ_CLS", r=4)
    assert "ngram" in lora.modules_to_save
    model = get_peft_model(base, lora)
    before = model.base_model.model.bert.encoder.layer[0].ngram.modules_to_save["default"].tables.weight.clone()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.base_model.model.bert.encoder.layer[0].ngram.modules_to_save["default"].tables.weight
    assert not torch.equal(before, after)  # the tables trained with the adapter
    model.eval().save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        BertPkmForSequenceClassification.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="no n-gram memory"):
        pkm_lora_config(BertPkmForSequenceClassification(tiny_config(num_labels=2)), ngram_memories=True)


def test_pkm_trainer_trains_n_gram_tables_in_the_memory_group(tmp_path):
    from datasets import Dataset
    from transformers import TrainingArguments

    from modeling_pkm_bert.integrations.trainer import PkmTrainer
    from modeling_pkm_bert.methods.optimizers import PKM_VALUES_GROUP

    model = learned(BertPkmForMaskedLM(tiny_config(pkm_layers=[], **NGRAM)))
    ids = torch.randint(5, 99, (8, 8))
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-4, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True,
    )
    before = model.bert.encoder.layer[0].ngram.tables.weight.detach().clone()
    trainer = PkmTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    groups = {group["name"]: group for group in trainer.optimizer.param_groups}
    assert groups[PKM_VALUES_GROUP]["lr"] == 1e-3
    assert {id(p) for p in groups[PKM_VALUES_GROUP]["params"]} == {
        id(model.bert.encoder.layer[i].ngram.tables.weight) for i in (0, 2)
    }
    assert not torch.equal(before, model.bert.encoder.layer[0].ngram.tables.weight)


# --- the evidence script, tiny (benchmarks/ngram_memory.py; the real run: benchmarks/NGRAM_MEMORY.md) -------------


@pytest.mark.multiprocess
def test_ngram_benchmark_runs_its_arms_and_reports(tmp_path):
    from helpers import load_script
    from transformers import BertTokenizer

    bench = load_script("runner", folder="benchmarks/studies/ngram_memory")
    source = tmp_path / "bert"
    words = (bench.DATA / "pride_and_prejudice_validation.txt").read_text().lower().split()[:400]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words))[:250]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(source)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(source)
    report = tmp_path / "NGRAM_MEMORY.md"
    argv = ["--model_name_or_path", str(source), "--output_dir", str(tmp_path / "runs"), "--report", str(report)]
    argv += ["--tiny", "--seeds", "0", "--arms", "0", "3", "--max_train_steps", "2", "--max_seq_length", "32"]
    argv += ["--max_eval_samples", "4", "--glue_train_samples", "16"]
    if not (bench.SHARED_DATA / "glue" / "SST-2").is_dir():
        argv.append("--skip_glue")
    bench.main(argv)
    bench.main(argv[:6] + ["--tiny", "--speed", "--speed_rounds", "1"])
    # the report comes from the results file alone: the run folders may be gone
    import json
    import shutil

    kept = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert {"mlm/plain/0", "mlm/both/0"} <= set(kept["runs"]) and {"layer", "quantized", "steps"} <= set(kept["speed"])
    for folder in (tmp_path / "runs").glob("*_seed0"):
        shutil.rmtree(folder)
    bench.main(argv + ["--report_only"])
    text = report.read_text()
    assert "| plain | 1 |" in text and "| both | 1 |" in text and "s / step" in text
    assert "n-gram / PKM" not in text and "PKM time / n-gram time" in text  # the speed section
    assert "| 1x128 | int8 |" in text and "| 8x128 | 4-bit |" in text  # the packed serving tables


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_gradients_of_training_without(use_reentrant):
    torch.manual_seed(0)
    model = learned(BertPkmForMaskedLM(tiny_config(**NGRAM))).train()
    ids = torch.randint(5, 99, (2, 7))
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append(model.bert.encoder.layer[0].ngram.tables.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0].abs().sum() > 0
