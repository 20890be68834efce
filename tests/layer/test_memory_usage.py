"""Memory usage metrics (Kim & Jung 2020 section 3.2, XLM's statistics) against hand-computed values."""

import math
from fractions import Fraction

import pytest
import torch
from helpers import tiny_config
from torch import nn

from modeling_pkm_bert import BertPkmForMaskedLM, ProductKeyMemory
from modeling_pkm_bert.analysis.memory_usage import (
    MemoryUsageAccumulator,
    MemoryUsageTracker,
    flatten_memory_usage,
    format_memory_usage,
    gather,
    track_memory_usage,
)


# 3 tokens, 2 heads x 2 knn, 6 slots; per token: [head 0 picks, head 1 picks]
HAND_INDICES = torch.tensor(
    [
        [[0, 1], [1, 2]],  # A: slot 1 picked by both heads
        [[3, 0], [4, 3]],  # B: slot 3 picked by both heads
        [[2, 0], [1, 4]],  # C: slot 0 selected with weight exactly 0
    ]
)
HAND_WEIGHTS = torch.tensor(
    [
        [[0.75, 0.25], [0.625, 0.375]],
        [[0.75, 0.25], [0.5, 0.5]],
        [[1.0, 0.0], [0.75, 0.25]],
    ]
)
# Summed over heads and divided by heads = 2:
#   w(A) = [.375, .4375, .1875, 0, 0, 0]  argmax slot 1 (.875 summed), though head 0's top-1 is slot 0 (.75)
#   w(B) = [.125, 0, 0, .625, .25, 0]     argmax slot 3
#   w(C) = [0, .375, .5, 0, .125, 0]      argmax slot 2; slot 0 has weight 0, so is not "used" by C
HAND_USED = [2, 2, 2, 1, 2, 0]  # u': A+B, A+C, A+C, B, B+C, none
HAND_TOP1 = [0, 1, 1, 1, 0, 0]  # t': slots 1 (A), 3 (B), 2 (C)
HAND_WEIGHT_SUMS = [0.5, 0.8125, 0.6875, 0.625, 0.375, 0.0]  # w' = w(A) + w(B) + w(C), sums to 3 tokens


def kl_from_uniform_by_hand(shares: list[Fraction]) -> float:
    return math.log(len(shares)) + sum(float(p) * math.log(p) for p in shares if p)


def gini_by_mean_absolute_difference(shares: list[Fraction]) -> Fraction:
    n = len(shares)
    return sum(abs(p - q) for p in shares for q in shares) / (2 * n * sum(shares))


def hand_accumulator() -> MemoryUsageAccumulator:
    accumulator = MemoryUsageAccumulator(6)
    accumulator.update(HAND_INDICES, HAND_WEIGHTS)
    return accumulator


def random_lookups(tokens: int, mem_size: int = 50, heads: int = 3, knn: int = 4):
    indices = torch.randint(0, mem_size, (tokens, heads, knn))  # duplicates within a token happen
    return indices, torch.randn(tokens, heads, knn).softmax(-1)


def assert_same_counts(a: MemoryUsageAccumulator, b: MemoryUsageAccumulator):
    assert int(a.tokens) == int(b.tokens)
    assert torch.equal(a.used_counts, b.used_counts)
    assert torch.equal(a.top1_counts, b.top1_counts)
    torch.testing.assert_close(a.weight_sums, b.weight_sums)


def test_hand_computed_counts():
    accumulator = hand_accumulator()
    assert int(accumulator.tokens) == 3
    assert accumulator.used_counts.tolist() == HAND_USED
    assert accumulator.top1_counts.tolist() == HAND_TOP1
    assert accumulator.weight_sums.tolist() == HAND_WEIGHT_SUMS  # binary fractions: exact


def test_hand_computed_metrics():
    metrics = hand_accumulator().compute()
    u = [Fraction(c, 9) for c in HAND_USED]
    w = [Fraction(c, 48) for c in (8, 13, 11, 10, 6, 0)]  # HAND_WEIGHT_SUMS * 16 / 48
    assert [float(p) for p in w] == pytest.approx([s / 3 for s in HAND_WEIGHT_SUMS])
    expected = {
        "mu": 5 / 6,  # slot 5 never used
        "top1_mu": 3 / 6,
        "kl_u": kl_from_uniform_by_hand(u),
        "kl_w": kl_from_uniform_by_hand(w),
        "gini_u": Fraction(13, 54),  # pairwise |differences| of [0,1,2,2,2,2] (in 9ths): 26 / (2 * 6 * 9)
        "gini_w": Fraction(41, 144),  # of [0,6,8,10,11,13] (in 48ths): 164 / (2 * 6 * 48)
        # u' sorted down 2,2,2,2,1,0 -> cumulated 2,4,6,8,9 of 9: >= 4.5 at 3 slots, >= 8.1 and >= 8.91 at 5
        "top50_u": 3,
        "top90_u": 5,
        "top99_u": 5,
        # w' in 48ths sorted down 13,11,10,8,6,0 -> cumulated 13,24,34,42,48: exactly half at 2 slots, 90/99 % at 5
        "top50_w": 2,
        "top90_w": 5,
        "top99_w": 5,
        "tokens": 3,
    }
    assert expected["gini_u"] == gini_by_mean_absolute_difference(u)
    assert expected["gini_w"] == gini_by_mean_absolute_difference(w)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-12, abs=1e-12), key


def test_flat_and_per_head_shapes_agree():
    flat = MemoryUsageAccumulator(6)
    flat.update(HAND_INDICES.flatten(1), HAND_WEIGHTS.flatten(1))
    assert_same_counts(flat, hand_accumulator())


def test_duplicates_count_once_and_ties_go_to_the_lowest_slot():
    accumulator = MemoryUsageAccumulator(8)
    # both heads pick slots 5 and 3 with equal weights, in different orders: a tie between 3 and 5
    accumulator.update(torch.tensor([[5, 3, 3, 5]]), torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    assert accumulator.used_counts.tolist() == [0, 0, 0, 1, 0, 1, 0, 0]
    assert accumulator.top1_counts.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    assert accumulator.weight_sums.tolist() == [0, 0, 0, 0.5, 0, 0.5, 0, 0]


def test_top_n_counts_a_share_of_exactly_n_percent_as_reached():
    # one lookup per token: slot 0 for 50 tokens, slot 1 for 40, slot 2 for 9, slot 3 for 1 -> shares .5 .4 .09 .01
    indices = torch.tensor([0] * 50 + [1] * 40 + [2] * 9 + [3] * 1)[:, None]
    accumulator = MemoryUsageAccumulator(5)
    accumulator.update(indices, torch.ones(100, 1))
    metrics = accumulator.compute()
    # top 1 holds exactly 50 %, top 2 exactly 90 %, top 3 exactly 99 % (XLM's strict "more than" would say 2, 3, 4)
    for suffix in ("u", "w"):
        assert (metrics[f"top50_{suffix}"], metrics[f"top90_{suffix}"], metrics[f"top99_{suffix}"]) == (1, 2, 3)
    assert metrics["mu"] == metrics["top1_mu"] == 4 / 5
    # used equally by every token: u and w are the same distribution
    assert metrics["kl_u"] == pytest.approx(metrics["kl_w"])
    assert metrics["kl_w"] == pytest.approx(kl_from_uniform_by_hand([Fraction(c, 100) for c in (50, 40, 9, 1, 0)]))


def test_uniform_use_has_zero_kl_and_gini():
    accumulator = MemoryUsageAccumulator(4)
    accumulator.update(torch.arange(4)[:, None], torch.ones(4, 1))
    metrics = accumulator.compute()
    assert metrics["kl_u"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["gini_w"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["top50_w"] == 2


def test_streaming_updates_equal_one_update():
    indices, weights = random_lookups(40)
    whole, streamed = MemoryUsageAccumulator(50), MemoryUsageAccumulator(50)
    whole.update(indices, weights)
    for chunk in (slice(0, 7), slice(7, 8), slice(8, 8), slice(8, 40)):  # an empty batch too
        streamed.update(indices[chunk], weights[chunk])
    assert_same_counts(streamed, whole)
    assert streamed.compute() == pytest.approx(whole.compute())


def test_merge_equals_one_accumulator_over_both():
    indices, weights = random_lookups(30)
    whole, first, second = MemoryUsageAccumulator(50), MemoryUsageAccumulator(50), MemoryUsageAccumulator(50)
    whole.update(indices, weights)
    first.update(indices[:12], weights[:12])
    second.update(indices[12:], weights[12:])
    assert first.merge(second) is first
    assert_same_counts(first, whole)
    with pytest.raises(ValueError, match="mem_size=50"):
        first.merge(MemoryUsageAccumulator(49))


def test_state_dict_round_trip_and_reset():
    accumulator = hand_accumulator()
    state = accumulator.state_dict()
    restored = MemoryUsageAccumulator(6)
    restored.load_state_dict(state)
    assert_same_counts(restored, accumulator)
    accumulator.update(HAND_INDICES, HAND_WEIGHTS)  # the state dict is a copy
    assert int(state["tokens"]) == 3
    accumulator.reset()
    assert int(accumulator.tokens) == 0 and not accumulator.weight_sums.any() and not accumulator.used_counts.any()
    with pytest.raises(ValueError, match="mem_size=6"):
        MemoryUsageAccumulator(7).load_state_dict(state)


def test_empty_accumulator_raises():
    accumulator = MemoryUsageAccumulator(6)
    accumulator.update(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4))
    with pytest.raises(ValueError, match="no tokens"):
        accumulator.compute()
    accumulator.update(torch.tensor([[1, 2]]), torch.zeros(1, 2))  # a token without weight: counted, uses nothing
    assert int(accumulator.tokens) == 1 and not accumulator.used_counts.any() and not accumulator.top1_counts.any()
    with pytest.raises(ValueError, match="zero weights"):
        accumulator.compute()


@pytest.mark.parametrize(
    "indices, weights, error, message",
    [
        (torch.tensor([0, 1]), torch.ones(2), ValueError, "tokens"),
        (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3), ValueError, "one shape"),
        (torch.zeros(2, 4), torch.ones(2, 4), TypeError, "int64"),
        (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), TypeError, "floating"),
        (torch.full((2, 4), 6), torch.ones(2, 4), ValueError, r"\[0, mem_size=6\)"),
        (torch.full((2, 4), -1), torch.ones(2, 4), ValueError, r"\[0, mem_size=6\)"),
        (torch.zeros(2, 4, dtype=torch.long), -torch.ones(2, 4), ValueError, ">= 0"),
        (torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4), math.nan), ValueError, "finite"),
    ],
)
def test_bad_inputs_raise(indices, weights, error, message):
    accumulator = MemoryUsageAccumulator(6)
    with pytest.raises(error, match=message):
        accumulator.update(indices, weights)
    assert int(accumulator.tokens) == 0


def memory_counts(model, **inputs) -> MemoryUsageAccumulator:
    with torch.no_grad(), track_memory_usage(model) as tracker:
        model(**inputs)
    return tracker.accumulators["layer_1"]


def test_padding_is_not_counted():
    model = BertPkmForMaskedLM(tiny_config()).eval()
    input_ids = torch.randint(1, 99, (2, 5))
    padded_ids = torch.cat([input_ids, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    attention_mask = (padded_ids != 0).long()
    unpadded = memory_counts(model, input_ids=input_ids)
    padded = memory_counts(model, input_ids=padded_ids, attention_mask=attention_mask)
    assert int(padded.tokens) == int(unpadded.tokens) == 10  # not the 16 positions of the padded batch
    assert_same_counts(padded, unpadded)
    assert int(unpadded.used_counts.sum()) > 0


def test_tracker_leaves_no_hook_behind():
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).eval()
    values = [layer.memory.values for layer in model.bert.encoder.layer if layer.memory is not None]
    with track_memory_usage(model) as tracker:
        assert [len(v._forward_hooks) for v in values] == [1, 1]
        tracker.attach()  # attaching twice hooks once
        assert [len(v._forward_hooks) for v in values] == [1, 1]
        model(input_ids=torch.randint(1, 99, (1, 4)))
    assert [len(v._forward_hooks) for v in values] == [0, 0]
    model(input_ids=torch.randint(1, 99, (1, 4)))  # not counted
    results = tracker.results()
    assert list(results) == ["layer_0", "layer_2"]
    assert [metrics["tokens"] for metrics in results.values()] == [4, 4]
    tracker.reset()
    with pytest.raises(ValueError, match="no tokens"):
        tracker.results()


def test_eval_only_skips_training_forwards():
    model = BertPkmForMaskedLM(tiny_config())
    with track_memory_usage(model) as tracker:  # by default whatever runs counts
        model.train()(input_ids=torch.randint(1, 99, (1, 4)))
    assert int(tracker.accumulators["layer_1"].tokens) == 4
    with track_memory_usage(model, eval_only=True) as tracker:
        model.train()(input_ids=torch.randint(1, 99, (1, 4)))
        assert int(tracker.accumulators["layer_1"].tokens) == 0
        model.eval()(input_ids=torch.randint(1, 99, (1, 3)))
    assert int(tracker.accumulators["layer_1"].tokens) == 3


def test_layer_names():
    assert list(MemoryUsageTracker(ProductKeyMemory(8, n_keys=4, heads=1, knn=2, k_dim=4)).accumulators) == ["memory"]
    twice = nn.ModuleDict(
        {
            name: nn.ModuleDict({"layer": nn.ModuleList([ProductKeyMemory(8, n_keys=4, heads=1, knn=2, k_dim=4)])})
            for name in ("first", "second")
        }
    )
    # both memories would be "layer_0": the module paths keep them apart
    assert list(MemoryUsageTracker(twice).accumulators) == ["first.layer.0", "second.layer.0"]
    assert MemoryUsageTracker(BertPkmForMaskedLM(tiny_config(pkm_layers=[]))).results() == {}


def test_memories_of_hub_remote_code_are_found(tmp_path):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    BertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    # the class of the folder's own code files (AutoModel would give this package's classes once another test in this
    # process called register_auto_classes)
    remote_class = get_class_from_dynamic_module("modeling_bert_pkm.BertPkmForMaskedLM", str(tmp_path))
    model = remote_class.from_pretrained(tmp_path)
    memory = model.bert.encoder.layer[1].memory
    assert not isinstance(memory, ProductKeyMemory)  # the Hub's own copy of the class
    assert list(MemoryUsageTracker(model).accumulators) == ["layer_1"]


class DoublingAccelerator:
    """Stands for two processes that counted the same tokens: `reduce(..., "sum")` doubles."""

    def reduce(self, tensors, reduction):
        assert reduction == "sum"
        return {name: 2 * tensor for name, tensor in tensors.items()}


def test_gather():
    accumulator = hand_accumulator()
    assert gather(accumulator) is accumulator  # no process group: nothing to sum
    assert_same_counts(accumulator, hand_accumulator())

    gather(accumulator, DoublingAccelerator())
    doubled = hand_accumulator().merge(hand_accumulator())
    assert_same_counts(accumulator, doubled)

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = BertPkmForMaskedLM(tiny_config()).eval()
        with track_memory_usage(model) as tracker:
            model(input_ids=torch.randint(1, 99, (2, 5)))
        before = MemoryUsageAccumulator(model.bert.encoder.layer[1].memory.mem_size)
        before.load_state_dict(tracker.accumulators["layer_1"].state_dict())
        assert gather(tracker) is tracker  # all_reduce over one process: the sum is the counts themselves
        assert_same_counts(tracker.accumulators["layer_1"], before)
    finally:
        torch.distributed.destroy_process_group()


def test_flatten_and_format():
    results = {"layer_1": hand_accumulator().compute()}
    flat = flatten_memory_usage(results)
    assert flat["memory/layer_1/mu"] == results["layer_1"]["mu"]
    assert len(flat) == len(results["layer_1"])
    assert "layer_1/top1_mu" in flatten_memory_usage(results, prefix="")
    table = format_memory_usage(results).splitlines()
    assert table[0].split() == [
        "layer", "tokens", "MU", "%", "top-1", "MU", "%", "KL_u", "KL_w", "gini_w", "top50_w", "top90_w", "top99_w"
    ]  # fmt: skip
    assert table[1].split()[:3] == ["layer_1", "3", "83.33"] and table[1].split()[3] == "50.00"
    assert format_memory_usage({}) == "no memory layers"
