"""Hostile configs (issue 44): a folder's config.json is untrusted input. Every size field is bounded before any
computation that grows with it, and the model's memory parameters (product-key and n-gram memories: tables,
projections, convolutions) are counted against one limit, `max_memory_parameters`, which the loader raises, never
the folder. `AutoConfig.from_pretrained` answers at once, naming the field."""

import json
import time

import pytest
import torch
from helpers import tiny_config, tiny_roberta_config
from transformers import AutoConfig

from modeling_pkm_bert import BertPkmConfig, BertPkmForCausalLM, BertPkmForMaskedLM, ModernBertPkmConfig, RobertaPkmConfig
from modeling_pkm_bert.configuration_bert_pkm import PKM_MAX_MEMORY_PARAMETERS
from modeling_pkm_bert.ngram_memory import NgramMemory, is_prime, largest_primes_below
from modeling_pkm_bert.product_key_memory import ProductKeyMemory


# far beyond any hang the review saw (47 s, 81 s, > 90 s): the measure is whether it hangs, not its speed
ANSWER_SECONDS = 2.0

HOSTILE = [
    # (fields written into config.json, the field the error names)
    ({"ngram_table_size": 10**14}, "ngram_table_size"),
    ({"ngram_table_size": 10**16}, "ngram_table_size"),
    ({"ngram_table_size": 10**18}, "ngram_table_size"),
    ({"ngram_table_size": 10**18, "ngram_layers": [0]}, "ngram_table_size"),
    ({"ngram_orders": [10**8]}, "ngram_orders"),
    ({"ngram_orders": [10**8], "ngram_layers": [0]}, "ngram_orders"),
    ({"ngram_conv_kernel": 10**9}, "ngram_conv_kernel"),
    ({"ngram_dim": 2 * 10**8}, "ngram_dim"),
    ({"ngram_dim": 2 * 10**8, "ngram_layers": [0, 1]}, "ngram_dim"),
    ({"pkm_heads": 2**20, "pkm_k_dim": 2**10}, "pkm_heads"),
    ({"ngram_heads": 10**9}, "ngram_heads"),
    ({"ngram_heads": 10**9, "ngram_layers": [2]}, "ngram_heads"),
    ({"pkm_n_keys": 10**12, "pkm_knn": 4}, "pkm_n_keys"),
    # the model's own sizes (issue 60)
    ({"vocab_size": 10**13}, "vocab_size"),
    ({"intermediate_size": 10**13}, "intermediate_size"),
    ({"max_position_embeddings": 10**13}, "max_position_embeddings"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"hidden_size": 10**9, "num_attention_heads": 1}, "hidden_size"),
    ({"num_attention_heads": 10**9}, "num_attention_heads"),
    ({"type_vocab_size": 10**13}, "type_vocab_size"),
]


def hostile_folder(folder, fields: dict, config=None):
    """A saved tiny config (with its code files) whose config.json then gets `fields`."""
    (config or tiny_config()).save_pretrained(folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder


def refusal(load) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(ValueError) as caught:
        load()
    return str(caught.value), time.perf_counter() - start


@pytest.mark.parametrize("fields, field", HOSTILE, ids=[json.dumps(f) for f, _ in HOSTILE])
def test_a_hostile_folder_is_refused_at_once_naming_the_field(tmp_path, fields, field):
    folder = hostile_folder(tmp_path / "hostile", fields)
    for name, load in [
        ("AutoConfig", lambda: AutoConfig.from_pretrained(folder, trust_remote_code=True)),
        ("BertPkmConfig.from_pretrained", lambda: BertPkmConfig.from_pretrained(folder)),
        ("BertPkmConfig", lambda: tiny_config(**fields)),
    ]:
        message, seconds = refusal(load)
        assert seconds < ANSWER_SECONDS, f"{name}: {seconds:.1f} s"
        assert message.startswith(f"BertPkmConfig.{field}="), f"{name}: {message}"
        assert "\n" not in message


@pytest.mark.parametrize("fields, field", HOSTILE[2:3] + HOSTILE[9:10])
def test_the_roberta_config_shares_the_bounds(tmp_path, fields, field):
    folder = hostile_folder(tmp_path / "hostile", fields, tiny_roberta_config())
    message, seconds = refusal(lambda: AutoConfig.from_pretrained(folder, trust_remote_code=True))
    assert seconds < ANSWER_SECONDS and message.startswith(f"RobertaPkmConfig.{field}="), message


MODERNBERT_HOSTILE = [
    # ModernBertConfig makes one layer_types entry per layer when a folder has none: 72 s for 3e7 layers before
    ({"num_hidden_layers": 3 * 10**7}, "num_hidden_layers"),
    ({"global_attn_every_n_layers": 0}, "global_attn_every_n_layers"),  # was a ZeroDivisionError
    ({"vocab_size": 10**13}, "vocab_size"),
    ({"max_position_embeddings": 10**13}, "max_position_embeddings"),
]


@pytest.mark.parametrize("fields, field", MODERNBERT_HOSTILE, ids=[json.dumps(f) for f, _ in MODERNBERT_HOSTILE])
def test_the_modernbert_config_bounds_its_sizes_first(tmp_path, fields, field):
    tiny = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64, local_attention=4)  # fmt: skip
    ModernBertPkmConfig(**tiny).save_pretrained(tmp_path)
    config = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    message, seconds = refusal(lambda: AutoConfig.from_pretrained(tmp_path, trust_remote_code=True))
    assert seconds < ANSWER_SECONDS and message.startswith(f"ModernBertPkmConfig.{field}="), message
    assert "\n" not in message


def test_the_limit_counts_every_memory_of_the_model_and_names_the_largest_part():
    # each memory alone fits, together they do not: ten product-key layers of 2**16 slots x hidden 32
    fields = dict(num_hidden_layers=10, pkm_n_keys=256, pkm_layers=list(range(10)))
    one_layer = tiny_config(**{**fields, "pkm_layers": [0]}).num_memory_parameters
    with pytest.raises(ValueError, match=r"^BertPkmConfig\.pkm_n_keys=256: the model's memories would hold"):
        tiny_config(**fields, max_memory_parameters=5 * one_layer)
    assert tiny_config(**fields, max_memory_parameters=10 * one_layer).num_memory_parameters == 10 * one_layer
    # a table shared by every layer (Memory+) is counted once
    shared = tiny_config(**fields, pkm_shared_values=True, max_memory_parameters=5 * one_layer)
    assert shared.num_memory_parameters < 2 * one_layer
    # n-gram memories count too: named by the field furthest above its default
    with pytest.raises(ValueError, match=r"^BertPkmConfig\.ngram_table_size=.*n-gram tables"):
        tiny_config(ngram_layers=[0, 1, 2], ngram_table_size=2**20, max_memory_parameters=2**26)


def test_the_loader_raises_the_limit_the_folder_cannot(tmp_path):
    # over the default limit by a little: 2**28 slots x hidden 32 (the config only: nothing is allocated)
    big = {"pkm_n_keys": 2**14}
    folder = hostile_folder(tmp_path / "big", big)
    with pytest.raises(ValueError, match=r"^BertPkmConfig\.pkm_n_keys=16384: .*max_memory_parameters"):
        AutoConfig.from_pretrained(folder, trust_remote_code=True)
    raised = 2 * PKM_MAX_MEMORY_PARAMETERS
    for load in (
        lambda: AutoConfig.from_pretrained(folder, trust_remote_code=True, max_memory_parameters=raised),
        lambda: BertPkmConfig.from_pretrained(folder, max_memory_parameters=raised),
        lambda: tiny_config(**big, max_memory_parameters=raised),
    ):
        config = load()
        assert config.pkm_n_keys == 2**14 and config.num_memory_parameters > PKM_MAX_MEMORY_PARAMETERS
        assert "max_memory_parameters" not in config.to_dict()  # the loader's setting, never saved
    # a folder that writes its own limit does not raise it
    hostile = hostile_folder(tmp_path / "hostile", {**big, "max_memory_parameters": 2**62})
    with pytest.raises(ValueError, match=r"^BertPkmConfig\.pkm_n_keys="):
        AutoConfig.from_pretrained(hostile, trust_remote_code=True)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"max_memory_parameters=.*a positive integer"):
            tiny_config(max_memory_parameters=bad)


def test_models_load_under_the_default_limit_and_a_lowered_limit_refuses_them(tmp_path):
    BertPkmForMaskedLM(tiny_config(ngram_layers=[0], ngram_table_size=211, ngram_dim=4)).save_pretrained(tmp_path)
    assert BertPkmForMaskedLM.from_pretrained(tmp_path).config.ngram_layers == [0]
    with pytest.raises(ValueError, match=r"^BertPkmConfig\.pkm_n_keys=8: .*max_memory_parameters=1,000"):
        BertPkmForMaskedLM.from_pretrained(tmp_path, max_memory_parameters=1000)
    # BERT-base with memories of the paper's size and n-gram memories needs no raise
    for config in (BertPkmConfig(), BertPkmConfig(ngram_layers=[1, 6]), RobertaPkmConfig(ngram_layers=[2])):
        assert 4 * 10**8 < config.num_memory_parameters < PKM_MAX_MEMORY_PARAMETERS


def memory_parameters_of(model: torch.nn.Module) -> int:
    memories = [m for m in model.modules() if isinstance(m, (ProductKeyMemory, NgramMemory))]
    return sum(p.numel() for p in {id(p): p for m in memories for p in m.parameters()}.values())


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"pkm_layers": [0, 2], "pkm_shared_values": True, "pkm_output_gate": "swilu", "pkm_qk_norm": True},
        {"pkm_query_batchnorm": False, "pkm_query_bias": False, "pkm_memory_scale": 0.5, "pkm_mode": "replace"},
        {"pkm_layers": [], "ngram_layers": [0, 2], "ngram_table_size": 211, "ngram_dim": 4, "ngram_conv_kernel": 4},
        {"ngram_layers": [1], "ngram_table_size": 97, "ngram_orders": [2, 3, 4], "is_decoder": True},
    ],
)
def test_the_count_is_the_built_model_s(fields):
    config = tiny_config(**fields)
    model = BertPkmForCausalLM(config) if config.is_decoder else BertPkmForMaskedLM(config)
    assert config.num_memory_parameters == memory_parameters_of(model)


@pytest.mark.parametrize(
    "fields, field, problem",
    [
        ({"ngram_orders": [65]}, "ngram_orders", "max_position_embeddings=64"),
        ({"ngram_conv_kernel": 65}, "ngram_conv_kernel", "max_position_embeddings=64"),
        ({"ngram_heads": 300}, "ngram_heads", "1,200 hash tables"),
        ({"ngram_table_size": 10}, "ngram_table_size", "distinct primes"),
        ({"ngram_table_size": 2**63}, "ngram_table_size", r"below 2\*\*62"),
        ({"ngram_table_size": 2**40}, "ngram_table_size", "one n-gram memory would hold.*max_memory_parameters"),
    ],
)
def test_size_fields_are_bounded(fields, field, problem):
    with pytest.raises(ValueError, match=rf"^BertPkmConfig\.{field}=.*{problem}"):
        tiny_config(**fields)


def test_primality_is_exact_and_fast():
    def by_trial_division(n):
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if by_trial_division(n)]
    # strong pseudoprimes to several bases, Carmichael numbers, and known primes near 2**61 and 2**64
    assert not any(is_prime(n) for n in (561, 2047, 3215031751, 3825123056546413051))
    assert is_prime(2**61 - 1) and is_prime(2**64 - 59) and not is_prime(2**64 - 57)
    with pytest.raises(ValueError, match="below 2"):
        is_prime(2**64)
    start = time.perf_counter()
    assert largest_primes_below(10**18, 16)[:2] == [999999999999999989, 999999999999999967]
    assert time.perf_counter() - start < ANSWER_SECONDS
