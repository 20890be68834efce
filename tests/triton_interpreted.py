"""Run by `tests/test_triton_kernels.py` in a subprocess: the Triton gathers of `kernels/triton_gathers.py` equal
EmbeddingBag and the memory's reference paths. On CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`), or,
with `PKM_TRITON_TEST_DEVICE=cuda`, compiled on a GPU (tensors made on the default device)."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import modeling_pkm_bert  # noqa: F401  (registers the ops, for CPU tensors too under the interpreter)
from modeling_pkm_bert import ProductKeyMemory, product_key_memory_ops
from modeling_pkm_bert.kernels import triton_gathers
from modeling_pkm_bert.methods.optimizers import SparseRowAdam


DEVICE = os.environ.get("PKM_TRITON_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit("run through tests/test_triton_kernels.py: these tests need TRITON_INTERPRET=1 on CPU", returncode=2)
torch.set_default_device(DEVICE)
# a failed device-side check (torch._assert_async) on CUDA ends the process's CUDA context: checked on CPU only
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="device-side assertions are checked on CPU (the interpreter)")


def op_calls(function) -> dict[str, int]:
    with torch.profiler.profile() as profile:
        function()
    return {name: sum(event.count for event in profile.key_averages() if event.key == name)
            for name in ("pkm_bert::bag_sum", "pkm_bert::row_dots", "pkm_bert::row_sum_backward")}  # fmt: skip


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


@cpu_only
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


def lookups(tokens, bag, n_rows, index_dtype, padding_rows=()):
    """Rows drawn from a small table (duplicates in a bag and across bags), the table's first and last rows in the first
    bag, never a row of `padding_rows`."""
    readable = torch.tensor([r for r in range(n_rows) if r not in padding_rows])
    rows = readable[torch.randint(0, len(readable), (tokens, bag))]
    rows[0, 0], rows[0, -1] = readable[0], readable[-1]
    if bag > 2:
        rows[0, 1] = rows[0, 0]  # the same row twice in one bag
    return rows.to(index_dtype)


def embedding_bag_gradients(table, rows, weights, grad_output):
    """The reference: F.embedding_bag's value, table and per-sample weight gradients, in fp64."""
    table = table.double().requires_grad_()
    weights = weights.double().requires_grad_()
    out = F.embedding_bag(rows.long(), table, mode="sum", per_sample_weights=weights)
    out.backward(grad_output.double())
    return out.detach(), table.grad, weights.grad.reshape(-1)


def assert_rounded_once(actual, exact, dtype):
    """fp32: fp32 sums in another order; bf16 and fp16: an fp32 sum rounded once (within one ulp, 2**-7 and 2**-10
    relative: the interpreter truncates where a GPU rounds to nearest), plus the fp32 summation error near zero; fp64:
    fp64 sums (an fp32 sum would be off by ~1e-7)."""
    assert actual.dtype == dtype
    relative = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float64: 1e-12}[dtype]
    summation = 1e-12 if dtype == torch.float64 else 1e-5
    tolerance = exact.abs() * relative + summation * exact.abs().max().clamp_min(1)
    assert torch.isfinite(actual).all()
    assert ((actual.double() - exact).abs() <= tolerance).all(), (actual.double() - exact).abs().max()


DTYPES_AND_SHAPES = [
    # table dtype, weights dtype, tokens, bag, dim, index dtype
    (torch.float32, torch.float32, 3, 7, 37, torch.int64),  # odd dim
    (torch.float32, torch.float32, 2, 1, 20, torch.int32),  # a bag of 1
    (torch.float32, torch.float32, 2, 20, 300, torch.int32),  # wider than a row block, duplicates in each bag
    (torch.bfloat16, torch.float32, 3, 9, 45, torch.int64),  # bf16 values, fp32 softmax weights (the memory's case)
    (torch.bfloat16, torch.bfloat16, 2, 12, 24, torch.int32),
    (torch.float16, torch.float32, 2, 6, 20, torch.int32),
    (torch.float64, torch.float64, 2, 5, 33, torch.int64),  # fp64 sums, not fp32
]


@pytest.mark.parametrize("dtype,weights_dtype,tokens,bag,dim,index_dtype", DTYPES_AND_SHAPES)
def test_bag_sum_and_fused_backward_equal_embedding_bag(dtype, weights_dtype, tokens, bag, dim, index_dtype):
    """Forward (`bag_sum`) and backward (`row_sum_backward`: table and weight gradients in one pass) against
    EmbeddingBag's autograd in fp64; padding rows (NaN) never read, their gradient exactly zero."""
    torch.manual_seed(6)
    n_rows, padding = 11, (3, 7)
    table = torch.randn(n_rows, dim).to(dtype)
    table[list(padding)] = float("nan")
    rows = lookups(tokens, bag, n_rows, index_dtype, padding)
    weights, grad_output = torch.randn(tokens, bag).to(weights_dtype), torch.randn(tokens, dim).to(dtype)
    out, grad_table, grad_weights = embedding_bag_gradients(table, rows, weights, grad_output)
    flat_rows, flat_weights = rows.reshape(-1), weights.reshape(-1)
    bounds = torch.arange(0, tokens * bag + 1, bag)
    assert_rounded_once(torch.ops.pkm_bert.bag_sum(table, flat_rows, flat_weights, bounds), out, dtype)
    fused = torch.ops.pkm_bert.row_sum_backward(grad_output, table, flat_rows, flat_weights, bag, True, True)
    assert_rounded_once(fused[0], grad_table.nan_to_num(), dtype)  # (EmbeddingBag's fp64 reference: 0 * NaN there)
    assert (fused[0][list(padding)] == 0).all()
    assert_rounded_once(fused[1], grad_weights, weights_dtype)
    table_only = torch.ops.pkm_bert.row_sum_backward(grad_output, table, flat_rows, flat_weights, bag, True, False)
    weights_only = torch.ops.pkm_bert.row_sum_backward(grad_output, table, flat_rows, flat_weights, bag, False, True)
    assert table_only[1].numel() == 0 and weights_only[0].numel() == 0
    assert_rounded_once(table_only[0], grad_table.nan_to_num(), dtype)  # (atomics: the order of a GPU's sums varies)
    assert torch.equal(weights_only[1], fused[1])


def test_fused_backward_into_the_coalesced_rows_of_a_sparse_gradient():
    """With `slots` (the inverse of torch.unique), lookup l adds into row slots[l] of the (used rows, dim) gradient."""
    torch.manual_seed(7)
    table, rows = torch.randn(40, 19), lookups(4, 6, 40, torch.int64)
    weights, grad_output = torch.randn(4, 6), torch.randn(4, 19)
    used, slots = torch.unique(rows.reshape(-1), return_inverse=True)
    flat_rows, flat_weights = rows.reshape(-1), weights.reshape(-1)
    dense, _ = torch.ops.pkm_bert.row_sum_backward(grad_output, table, flat_rows, flat_weights, 6, True, False)
    coalesced, _ = torch.ops.pkm_bert.row_sum_backward(
        grad_output, table, flat_rows, flat_weights, 6, True, False, slots, used.numel()
    )
    torch.testing.assert_close(coalesced, dense[used], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [{"BLOCK_LOOKUPS": 2, "BLOCK_DIM": 16, "num_warps": 1}, {"BLOCK_LOOKUPS": 8, "BLOCK_DIM": 64, "num_warps": 4}],
)
def test_every_launch_configuration_sums_the_same(config):
    """Bags spanning several lookup tiles, rows spanning several (or one padded) column blocks: the configurations that
    benchmarks/gpu_triton_gathers.py sweeps all give EmbeddingBag's sums."""
    torch.manual_seed(8)
    table, rows, weights = torch.randn(30, 40), torch.randint(0, 30, (3, 9)), torch.randn(3, 9)
    out = table.new_empty(3, 40)
    triton_gathers.launch_bag_sum(table, rows.reshape(-1), weights.reshape(-1), torch.arange(0, 28, 9), out, config)
    torch.testing.assert_close(out, F.embedding_bag(rows, table, mode="sum", per_sample_weights=weights))
    grad_output, grad_table, grad_weights = torch.randn(3, 40), torch.zeros(30, 40), torch.empty(27)
    triton_gathers.launch_row_sum_backward(
        grad_output, table, rows.reshape(-1), weights.reshape(-1), 9, grad_table, grad_weights, config=config
    )
    _, expected_table, expected_weights = embedding_bag_gradients(table, rows, weights, grad_output)
    torch.testing.assert_close(grad_table, expected_table.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_weights, expected_weights.float(), rtol=1e-5, atol=1e-5)


def test_opcheck():
    torch.manual_seed(9)
    table, rows, weights = torch.randn(12, 10), torch.randint(0, 12, (8,)), torch.randn(8)
    grad_output = torch.randn(2, 10)
    used, slots = torch.unique(rows, return_inverse=True)
    for args in (
        (grad_output, table, rows, weights, 4, True, True),
        (grad_output, table, rows.int(), weights, 4, False, True),
        (grad_output.bfloat16(), table.bfloat16(), rows, weights, 4, True, False, slots, used.numel()),
    ):
        torch.library.opcheck(torch.ops.pkm_bert.row_sum_backward, args)
    torch.library.opcheck(torch.ops.pkm_bert.bag_sum, (table, rows, weights, torch.tensor([0, 3, 8])))
    torch.library.opcheck(torch.ops.pkm_bert.row_dots, (table, rows, grad_output, 4))


@cpu_only
def test_fused_backward_bad_inputs_raise_clear_errors():
    table, rows, weights, grad_output = torch.randn(10, 4), torch.tensor([1, 2, 3, 4]), torch.rand(4), torch.randn(2, 4)
    backward = torch.ops.pkm_bert.row_sum_backward
    with pytest.raises(RuntimeError, match=r"rows must be in \[0, 10\)"):
        backward(grad_output, table, torch.tensor([1, 2, 10, 4]), weights, 2, True, True)
    with pytest.raises(RuntimeError, match=r"slots must be in \[0, 3\)"):
        backward(grad_output, table, rows, weights, 2, True, False, torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="n_slots >= 0"):
        backward(grad_output, table, rows, weights, 2, True, False, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="2 lookups for each of the 3 rows of grad_output"):
        backward(torch.randn(3, 4), table, rows, weights, 2, True, True)
    with pytest.raises(ValueError, match="weights must have the shape of rows"):
        backward(grad_output, table, rows, weights[:3], 2, True, True)
    with pytest.raises(ValueError, match="rows must be int32 or int64"):
        backward(grad_output, table, rows.float(), weights, 2, True, True)


@cpu_only
def test_gpu_benchmark_runs_at_a_tiny_size():
    """benchmarks/gpu_triton_gathers.py --smoke: every op and a corner of the sweep, on CPU (figures meaningless)."""
    from helpers import load_script

    results = load_script("gpu_triton_gathers", "benchmarks").main(["--smoke", "--sweep", "--dtypes", "bf16"])
    ops = {(r["phase"], r["op"]) for r in results}
    assert {("forward", "bag_sum"), ("forward", "EmbeddingBag"), ("backward", "row_sum_backward (fused)")} <= ops
    assert {r["phase"] for r in results} == {"forward", "backward", "forward sweep", "backward sweep"}


def on_triton(memory):
    memory = copy.deepcopy(memory)
    memory.values.triton_devices = (DEVICE,)
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
    assert calls == {"pkm_bert::bag_sum": 1, "pkm_bert::row_dots": 0, "pkm_bert::row_sum_backward": 0}
    assert set(op_calls(lambda: memory(x)).values()) == {0}  # off by default


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_training_with_triton_gathers_equals_reference(sparse, with_mask, fused, monkeypatch):
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
                monkeypatch.setattr(product_key_memory_ops, "TRITON_FUSED_BACKWARD", fused)
                expected = (1, 0, 1) if fused else (2, 1, 0)  # lookup; both gradients in one pass, else value grad, dots
                assert tuple(op_calls(run).values()) == expected
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
