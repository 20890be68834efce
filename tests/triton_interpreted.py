"""Run by `tests/test_triton_kernels.py` under the Triton interpreter (`TRITON_INTERPRET=1`): the Triton gathers of
`triton_kernels.py`, on CPU tensors, equal EmbeddingBag and the memory's reference paths."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import modeling_pkm_bert  # noqa: F401  (registers the ops, for CPU tensors too under the interpreter)
from modeling_pkm_bert import ProductKeyMemory
from modeling_pkm_bert.methods.optimizers import SparseRowAdam


if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit("run through tests/test_triton_kernels.py: these tests need TRITON_INTERPRET=1", returncode=2)


def op_calls(function) -> dict[str, int]:
    with torch.profiler.profile() as profile:
        function()
    return {name: sum(event.count for event in profile.key_averages() if event.key == name)
            for name in ("pkm_bert::bag_sum", "pkm_bert::row_dots")}  # fmt: skip


@pytest.mark.parametrize(
    "tokens,bag,dim,index_dtype",
    [(5, 12, 100, torch.int64), (3, 33, 300, torch.int32), (1, 1, 7, torch.int64), (4, 16, 256, torch.int64)],
)
def test_bag_sum_equals_embedding_bag(tokens, bag, dim, index_dtype):
    """dim not a power of two, wider than one block; bags shorter, longer, not a multiple of the lookup block."""
    torch.manual_seed(0)
    table, rows, weights = torch.randn(500, dim), torch.randint(0, 500, (tokens, bag)), torch.randn(tokens, bag)
    bounds = torch.arange(0, tokens * bag + 1, bag)
    out = torch.ops.pkm_bert.bag_sum(table, rows.reshape(-1).to(index_dtype), weights.reshape(-1), bounds)
    expected = F.embedding_bag(rows, table, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bag_sum_variable_and_empty_bags():
    torch.manual_seed(1)
    table, rows, weights = torch.randn(60, 24), torch.randint(0, 60, (40,)), torch.rand(40)
    bounds = torch.tensor([0, 0, 5, 5, 21, 40, 40])
    out = torch.ops.pkm_bert.bag_sum(table, rows, weights, bounds)
    expected = F.embedding_bag(rows, table, bounds[:-1], mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out[0] == 0).all() and (out[2] == 0).all() and (out[5] == 0).all()
    assert torch.ops.pkm_bert.bag_sum(table, rows[:0], weights[:0], torch.zeros(1, dtype=torch.long)).shape == (0, 24)


def test_bag_sum_bfloat16_rounds_an_fp32_sum_once():
    """One rounding of the fp32 sum: within a bf16 ulp (the interpreter truncates where a GPU rounds to nearest)."""
    torch.manual_seed(2)
    table, rows, weights = torch.randn(80, 48).bfloat16(), torch.randint(0, 80, (6, 32)), torch.rand(6, 32).bfloat16()
    out = torch.ops.pkm_bert.bag_sum(table, rows.reshape(-1), weights.reshape(-1), torch.arange(0, 6 * 32 + 1, 32))
    assert out.dtype == torch.bfloat16
    exact = F.embedding_bag(rows, table.float(), mode="sum", per_sample_weights=weights.float())
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("dim,index_dtype", [(100, torch.int64), (300, torch.int32), (5, torch.int64)])
def test_row_dots_equal_dot_products(dim, index_dtype):
    torch.manual_seed(3)
    tokens, bag = 7, 13
    table, rows, other = torch.randn(90, dim), torch.randint(0, 90, (tokens, bag)), torch.randn(tokens, dim)
    out = torch.ops.pkm_bert.row_dots(table, rows.reshape(-1).to(index_dtype), other, bag)
    expected = (table[rows] * other[:, None]).sum(-1)
    torch.testing.assert_close(out.view(tokens, bag), expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    table, rows, weights, bounds = torch.randn(10, 4), torch.tensor([1, 2, 3]), torch.rand(3), torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match=r"rows must be in \[0, 10\)"):
        torch.ops.pkm_bert.bag_sum(table, torch.tensor([1, 10, 3]), weights, bounds)
    with pytest.raises(RuntimeError, match=r"rows must be in \[0, 10\)"):
        torch.ops.pkm_bert.row_dots(table, torch.tensor([-1, 2, 3]), torch.randn(1, 4), 3)
    for bad_bounds in ([0, 4], [-1, 3], [0, 2, 1, 3]):
        with pytest.raises(RuntimeError, match=r"offsets must be non-decreasing in \[0, 3\]"):
            torch.ops.pkm_bert.bag_sum(table, rows, weights, torch.tensor(bad_bounds))
    with pytest.raises(ValueError, match="int32 or int64"):
        torch.ops.pkm_bert.bag_sum(table, rows.float(), weights, bounds)
    with pytest.raises(ValueError, match="contiguous 2-d"):
        torch.ops.pkm_bert.bag_sum(table.t(), rows, weights, bounds)
    with pytest.raises(ValueError, match="one length"):
        torch.ops.pkm_bert.bag_sum(table, rows, weights[:2], bounds)
    with pytest.raises(ValueError, match="lookups for each"):
        torch.ops.pkm_bert.row_dots(table, rows, torch.randn(2, 4), 3)


def on_triton(memory):
    memory = copy.deepcopy(memory)
    memory.values.triton_devices = ("cpu",)
    return memory


def reference(memory):
    memory = copy.deepcopy(memory)
    memory.sparse_values = False
    memory.values.fused_backward = memory.fused_search_backward = memory.prune_candidates = memory.native_search = False
    return memory


def test_inference_lookup_uses_bag_sum():
    torch.manual_seed(4)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8).eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        expected = memory(x)
        triton = on_triton(memory)
        calls = op_calls(lambda: triton(x))
        torch.testing.assert_close(triton(x), expected, rtol=1e-5, atol=1e-6)
    assert calls == {"pkm_bert::bag_sum": 1, "pkm_bert::row_dots": 0}
    assert op_calls(lambda: memory(x)) == {"pkm_bert::bag_sum": 0, "pkm_bert::row_dots": 0}  # off by default


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_training_with_triton_gathers_equals_reference(sparse, with_mask):
    """Outputs and every gradient, then the parameters after 3 steps (AdamW; SparseRowAdam or Adam on the values)."""
    torch.manual_seed(5)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, query_bias=False).train()
    fast, slow = on_triton(memory), reference(memory)
    fast.sparse_values = sparse
    optimizers = {}
    for name, module in (("fast", fast), ("slow", slow)):
        others = [p for n, p in module.named_parameters() if n != "values.weight"]
        values = SparseRowAdam([module.values.weight], lr=1e-2, exp_avg_dtype=torch.float32, rowwise=False)
        optimizers[name] = (torch.optim.AdamW(others, lr=1e-2, foreach=False), values)
    for step in range(3):
        x, g = torch.randn(3, 6, 16), torch.randn(3, 6, 12)
        mask = torch.ones(3, 6)
        mask[step % 3, 2:] = 0
        results = []
        for name, module in (("fast", fast), ("slow", slow)):
            xx = x.clone().requires_grad_()
            outputs = []
            run = lambda: outputs.append(module(xx, mask if with_mask else None)) or (outputs[0] * g).sum().backward()  # noqa: E731
            if name == "fast":
                assert op_calls(run) == {"pkm_bert::bag_sum": 2, "pkm_bert::row_dots": 1}  # lookup, value grad; dots
            else:
                run()
            grads = {n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in module.named_parameters()}
            results.append((outputs[0], xx.grad, grads))
            assert module.values.weight.grad.is_sparse == (sparse and name == "fast")
        (out_fast, x_fast, grads_fast), (out_slow, x_slow, grads_slow) = results
        torch.testing.assert_close(out_fast, out_slow, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_fast, x_slow, rtol=1e-5, atol=1e-6)
        for n in grads_slow:
            torch.testing.assert_close(grads_fast[n], grads_slow[n], rtol=1e-5, atol=1e-6, msg=n)
        for pair in optimizers.values():
            for optimizer in pair:
                optimizer.step()
                optimizer.zero_grad()
    for (n, p), (_, q) in zip(fast.named_parameters(), slow.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-5, msg=n)
