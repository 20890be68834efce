"""Every plan of the memory's lookup computes what the reference computes (values and gradients), for each plan taken as
a parameter; the plan's decisions; the row-wise lazy Adam, parameter groups and sparse-aware clipping."""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import lookup_plans
from modeling_pkm_bert import ProductKeyMemory
from modeling_pkm_bert import product_key_memory_ops
from modeling_pkm_bert.methods.optimizers import (
    SparseRowAdam,
    clip_grad_norm_,
    pkm_lr_lambdas,
    pkm_param_groups,
    pkm_value_parameters,
    set_sparse_values,
)
from modeling_pkm_bert.product_key_memory import ProductKeyValues, candidate_pairs, select_product_keys
from modeling_pkm_bert.product_key_memory_ops import OPS_VERSION, REFERENCE, Plan, plan_lookup, use_plan, use_reference


PLANS = lookup_plans()
FAST_PLANS = [name for name in PLANS if name != "reference"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def brute_force_topk(memory, queries):
    n = memory.n_keys
    keys = memory.keys
    full_keys = torch.cat([keys[:, 0].repeat_interleave(n, dim=1), keys[:, 1].repeat(1, n, 1)], dim=-1)
    return torch.einsum("...hd,hsd->...hs", queries, full_keys).topk(memory.knn, dim=-1)


def configured(memory, *, sparse=False):
    """A deep copy of `memory` with a dense or sparse value gradient."""
    memory = copy.deepcopy(memory)
    memory.sparse_values = sparse
    return memory


def dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


def dtype_for(plan_name):
    """fp64 (exact comparisons) unless the plan runs the native selection, which takes fp32."""
    return torch.float32 if PLANS[plan_name].selection == "native" else torch.float64


def run_step(module, plan, x, g, mask=None):
    """Forward under `plan`, backward of `(out * g).sum()`: the output, the input's and every parameter's gradient."""
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with use_plan(plan):
        out = module(x, mask)
    (out * g).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def assert_same_step(got, expected, exact):
    tolerance = dict(rtol=0, atol=1e-12) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], expected[0], **tolerance)
    torch.testing.assert_close(got[1], expected[1], **tolerance)
    assert got[2].keys() == expected[2].keys()
    for name, grad in expected[2].items():
        torch.testing.assert_close(dense(got[2][name]), dense(grad), **tolerance, msg=name)


# ---------------------------------------------------------------- the plan


def test_the_plan_is_decided_from_the_inputs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = product_key_memory_ops.native_selection_available()
    training = plan_lookup(cpu, torch.float32, needs_grad=True)
    assert (training.search_backward, training.value_read) == ("selected", "csr")
    assert training.selection == ("native" if native else "torch")
    assert plan_lookup(cpu, torch.float32, needs_grad=False).value_read == "torch"
    assert plan_lookup(cpu, torch.bfloat16, needs_grad=True) == Plan("torch", "selected", "torch", why="CPU, with gradients")
    assert plan_lookup(cpu, torch.float32, needs_grad=True, table="other").value_read == "torch"
    compiled = plan_lookup(cpu, torch.float32, needs_grad=True, compiling=True)
    assert (compiled.selection, compiled.search_backward, compiled.value_read) == ("torch", "torch", "op")
    for needs_grad in (False, True):  # a GPU runs the reference: no fast path has shown a win on one
        gpu = plan_lookup(cuda, torch.float32, needs_grad=needs_grad)
        assert (gpu.selection, gpu.search_backward, gpu.value_read) == ("torch", "torch", "torch")
        exported = plan_lookup(cpu, torch.float32, needs_grad=needs_grad, exporting=True)
        assert (exported.selection, exported.search_backward, exported.value_read) == ("torch", "torch", "torch")


def test_explain_paths_prints_the_plan_and_use_reference_forces_the_reference():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=8).train()
    plan = memory.explain_paths(torch.randn(3, 12))
    assert plan == plan_lookup(torch.device("cpu"), torch.float32, needs_grad=True)
    assert str(plan).startswith(f"selection: {plan.selection}; search backward: selected; value read: csr")
    with torch.no_grad():
        assert memory.explain_paths().search_backward == "torch"
    with use_reference():
        assert memory.explain_paths() is REFERENCE
        with use_plan(PLANS["custom_op"]):  # the innermost block decides
            assert memory.explain_paths() is PLANS["custom_op"]
        assert memory.explain_paths() is REFERENCE
    assert memory.explain_paths() == plan
    with pytest.raises(dataclasses_frozen()):
        plan.selection = "torch"


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ---------------------------------------------------------------- search


@pytest.mark.parametrize("knn", [1, 2, 3, 5, 8, 13, 32])
def test_candidate_pairs_are_exactly_those_that_can_win(knn):
    first, second = candidate_pairs(knn)
    pairs = set(zip(first, second))
    assert len(pairs) == len(first)
    assert pairs == {(a, b) for a in range(knn) for b in range(knn) if (a + 1) * (b + 1) <= knn}
    if knn == 32:
        assert len(pairs) == 119


@pytest.mark.parametrize(
    "n_keys,heads,knn,k_dim,batch_shape",
    [(8, 2, 4, 16, (5,)), (8, 2, 8, 6, (3, 4)), (16, 3, 16, 8, (9,)), (12, 1, 7, 4, (2, 5)), (5, 2, 1, 4, (6,)), (32, 4, 32, 8, (40,))],
)
def test_pruned_search_equals_brute_force(n_keys, heads, knn, k_dim, batch_shape):
    """Includes knn == n_keys, where the halves' top-knn lists are every sub-key."""
    memory = ProductKeyMemory(12, n_keys=n_keys, heads=heads, knn=knn, k_dim=k_dim).double()
    queries = torch.randn(*batch_shape, heads, k_dim, dtype=torch.float64)
    scores, indices = memory.search(queries)
    expected_scores, expected_indices = brute_force_topk(memory, queries)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-12)
    assert torch.equal(indices, expected_indices)


@pytest.mark.parametrize("n_keys,heads,knn,tokens", [(8, 2, 4, 5), (16, 3, 16, 7), (12, 1, 7, 3), (5, 2, 1, 6)])
def test_selection_equals_the_full_grid(n_keys, heads, knn, tokens):
    """The pruned selection (torch and native) is the top-knn of every product key's score; its scores are the sums of
    the chosen sub-keys' scores."""
    halves, keys = torch.randn(tokens, heads * 2, 6), torch.randn(heads, 2, n_keys, 6)
    grid = torch.einsum("tgd,gnd->tgn", halves, keys.reshape(heads * 2, n_keys, 6)).view(tokens, heads, 2, n_keys)
    full = (grid[:, :, 0, :, None] + grid[:, :, 1, None, :]).flatten(-2)
    expected_scores, expected_indices = full.topk(knn, dim=-1)
    selections = {"torch": select_product_keys(halves, keys, knn)}
    if product_key_memory_ops.native_selection_available():
        from modeling_pkm_bert.product_key_memory import select_native

        selections["native"] = select_native(halves, keys, knn)
    for name, (scores, indices) in selections.items():
        torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-5, msg=name)
        assert torch.equal(indices.sort(-1).values, expected_indices.sort(-1).values), name
        torch.testing.assert_close(full.gather(-1, indices), scores, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("plan", ["reference", "cpu_torch_selection"])
def test_search_gradients_equal_the_full_grid(plan):
    """The search through the selected sub-keys (`ProductKeySearch`) and the reference vs autograd of the full grid."""
    memory = ProductKeyMemory(12, n_keys=16, heads=3, knn=8, k_dim=10).double()
    queries = torch.randn(20, 3, 10, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(20, 3, 8, dtype=torch.float64)
    with use_plan(PLANS[plan]):
        scores, indices = memory.search(queries)
    (scores * weights).sum().backward()
    grads = queries.grad, memory.keys.grad
    queries.grad = memory.keys.grad = None
    expected_scores, expected_indices = brute_force_topk(memory, queries)
    assert torch.equal(indices, expected_indices)
    (expected_scores * weights).sum().backward()
    assert memory.keys.grad.abs().sum() > 0
    torch.testing.assert_close(grads[0], queries.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[1], memory.keys.grad, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- every plan vs the reference


@pytest.mark.parametrize("plan", FAST_PLANS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "mask"])
def test_every_plan_equals_the_reference_outputs_and_gradients(plan, sparse, with_mask):
    torch.manual_seed(0)
    dtype = dtype_for(plan)
    memory = ProductKeyMemory(24, 20, n_keys=16, heads=3, knn=8, k_dim=16).to(dtype).train()
    x, g = torch.randn(4, 7, 24, dtype=dtype), torch.randn(4, 7, 20, dtype=dtype)
    mask = None
    if with_mask:
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[1, 4:] = 0
        mask[3, 1:] = 0
    reference, fast = configured(memory), configured(memory, sparse=sparse)
    expected = run_step(reference, REFERENCE, x, g, mask)
    got = run_step(fast, PLANS[plan], x, g, mask)
    assert got[2]["values.weight"].is_sparse == sparse
    if sparse:  # one entry per row used, sorted
        rows = got[2]["values.weight"].coalesce().indices()[0]
        assert torch.equal(rows, torch.unique(rows))
    assert_same_step(got, expected, exact=dtype == torch.float64)
    torch.testing.assert_close(fast.query_batchnorm.running_mean, reference.query_batchnorm.running_mean)


@pytest.mark.parametrize("plan", FAST_PLANS)
@pytest.mark.parametrize("options", [dict(qk_norm=True, output_gate="swilu", memory_scale=0.5), dict(score_activation="relu")])
def test_every_plan_with_the_memory_plus_options_equals_the_reference(plan, options):
    torch.manual_seed(1)
    dtype = dtype_for(plan)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, **options).to(dtype).train()
    x, g = torch.randn(3, 5, 16, dtype=dtype), torch.randn(3, 5, 12, dtype=dtype)
    expected = run_step(configured(memory), REFERENCE, x, g)
    assert_same_step(run_step(configured(memory), PLANS[plan], x, g), expected, exact=dtype == torch.float64)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_shared_table_gets_the_sum_of_its_memories_gradients(plan, sparse):
    torch.manual_seed(2)
    dtype = dtype_for(plan)
    table = ProductKeyValues(64, 12, sparse=sparse).to(dtype)
    memories = torch.nn.ModuleList(ProductKeyMemory(12, 12, n_keys=8, heads=2, knn=4, k_dim=8, values=table) for _ in range(2))
    memories = memories.to(dtype).train()
    x = torch.randn(3, 4, 12, dtype=dtype)
    with use_plan(PLANS[plan]):
        out = memories[1](memories[0](x)).square().sum()
    out.backward()
    got = dense(table.weight.grad)
    reference = copy.deepcopy(memories)
    for p in reference.parameters():
        p.grad = None
    reference[0].values.sparse = False
    with use_reference():
        reference[1](reference[0](x)).square().sum().backward()
    assert reference[0].values is reference[1].values
    torch.testing.assert_close(got, reference[0].values.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_read_of_no_token_gives_every_parameter_a_zero_gradient(plan, sparse):
    """In eval mode a batch of padding only still reads the memory: zero gradients, which DDP waits for."""
    memory = ProductKeyMemory(12, 10, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).to(dtype_for(plan)).eval()
    x = torch.randn(2, 3, 12, dtype=dtype_for(plan), requires_grad=True)
    with use_plan(PLANS[plan]):
        out = memory(x, torch.zeros(2, 3, dtype=torch.long))
    out.sum().backward()
    assert not out.any()
    for name, p in memory.named_parameters():
        assert p.grad is not None and not dense(p.grad).any(), name


@pytest.mark.parametrize("plan", FAST_PLANS)
@pytest.mark.parametrize("frozen", ["values", "keys", "memory"])
def test_every_plan_with_frozen_parts(plan, frozen):
    torch.manual_seed(3)
    dtype = dtype_for(plan)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8).to(dtype).train()
    for name, p in memory.named_parameters():
        p.requires_grad_(not (frozen == "memory" or name == f"{frozen}.weight" or name == frozen))
    x, g = torch.randn(3, 5, 16, dtype=dtype), torch.randn(3, 5, 12, dtype=dtype)
    expected = run_step(configured(memory), REFERENCE, x, g)
    assert_same_step(run_step(configured(memory), PLANS[plan], x, g), expected, exact=dtype == torch.float64)


# ---------------------------------------------------------------- value read


def test_values_module_is_an_embedding_bag_with_the_hook_contract():
    memory = ProductKeyMemory(12, 10, n_keys=8, heads=2, knn=4, k_dim=8).train()
    assert isinstance(memory.values, torch.nn.EmbeddingBag) and isinstance(memory.values, ProductKeyValues)
    assert memory.values.weight.shape == (64, 10)
    assert "values.weight" in memory.state_dict()
    seen = []
    memory.values.register_forward_hook(lambda m, args, kwargs, out: seen.append((args[0], kwargs["per_sample_weights"], out)), with_kwargs=True)
    x = torch.randn(3, 5, 12)
    out = memory(x)
    indices, weights, values_out = seen[-1]
    assert indices.shape == weights.shape == (15, 2 * 4) and indices.dtype == torch.int64
    torch.testing.assert_close(weights.view(15, 2, 4).sum(-1), torch.ones(15, 2))
    torch.testing.assert_close(values_out.view(3, 5, 10), out)


def test_fused_lookup_equals_embedding_bag_float32_and_per_sample_weight_gradient():
    torch.manual_seed(1)
    values = ProductKeyValues(50, 6)
    indices = torch.randint(0, 50, (9, 12))
    weights = torch.rand(9, 12, requires_grad=True)
    grad_out = torch.randn(9, 6)
    out = values(indices, per_sample_weights=weights)
    out.backward(grad_out)
    ref_weight = values.weight.detach().clone().requires_grad_()
    ref_weights = weights.detach().clone().requires_grad_()
    ref = F.embedding_bag(indices, ref_weight, mode="sum", per_sample_weights=ref_weights)
    ref.backward(grad_out)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(weights.grad, ref_weights.grad)
    torch.testing.assert_close(values.weight.grad, ref_weight.grad)
    # the per-sample-weight gradient is dot(value row, output gradient)
    torch.testing.assert_close(weights.grad, (values.weight[indices] * grad_out[:, None]).sum(-1).detach())


def test_bfloat16_values_take_the_fallback_backward():
    torch.manual_seed(10)
    values = ProductKeyValues(40, 8).to(torch.bfloat16)
    reference = torch.nn.EmbeddingBag(40, 8, mode="sum").to(torch.bfloat16)
    reference.weight.data.copy_(values.weight.data)
    indices, g = torch.randint(0, 40, (6, 5)), torch.randn(6, 8, dtype=torch.bfloat16)
    weights = torch.rand(6, 5, dtype=torch.bfloat16, requires_grad=True)
    ref_weights = weights.detach().clone().requires_grad_()
    values(indices, per_sample_weights=weights).backward(g)
    reference(indices, per_sample_weights=ref_weights).backward(g)
    torch.testing.assert_close(values.weight.grad, reference.weight.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights.grad, ref_weights.grad, rtol=2e-2, atol=2e-2)


def test_inference_and_frozen_paths_use_plain_embedding_bag():
    values = ProductKeyValues(30, 4)
    indices, weights = torch.randint(0, 30, (5, 3)), torch.rand(5, 3)
    with torch.no_grad():
        out = values(indices, per_sample_weights=weights)
    torch.testing.assert_close(out, F.embedding_bag(indices, values.weight, mode="sum", per_sample_weights=weights))
    values.weight.requires_grad_(False)
    out = values(indices, per_sample_weights=weights)
    assert not out.requires_grad


def test_gradient_accumulation_and_buffer_reuse_are_safe():
    """Two backward passes before a step add up (the reused gradient buffer never overwrites a live gradient), and the
    buffer is reused once the gradient is dropped; `eval()` frees it."""
    torch.manual_seed(2)
    for sparse in (False, True):
        values = ProductKeyValues(40, 5, sparse=sparse)
        reference = torch.nn.EmbeddingBag(40, 5, mode="sum")
        reference.weight.data.copy_(values.weight.data)
        for _ in range(2):
            indices, weights, g = torch.randint(0, 40, (6, 4)), torch.rand(6, 4), torch.randn(6, 5)
            values(indices, per_sample_weights=weights).backward(g)
            reference(indices, per_sample_weights=weights).backward(g)
        torch.testing.assert_close(dense(values.weight.grad), reference.weight.grad)
        storages = []
        for _ in range(2):
            values.weight.grad = None
            values(torch.randint(0, 40, (6, 4)), per_sample_weights=torch.rand(6, 4)).sum().backward()
            grad = values.weight.grad
            storages.append((grad._values() if sparse else grad).untyped_storage().data_ptr())
            del grad
        buffer = values.workspaces["sparse" if sparse else "dense"]
        assert storages[0] == storages[1] == buffer.untyped_storage().data_ptr()
        kept = dense(values.weight.grad).clone()
        values(torch.randint(0, 40, (6, 4)), per_sample_weights=torch.rand(6, 4)).sum().backward()
        assert not torch.equal(dense(values.weight.grad), kept)  # accumulated, not overwritten in place and lost
        values.eval()
        assert values.workspaces == {}


# ---------------------------------------------------------------- optimizer


def plain_lazy_row_adam(weight, grads, lr, betas, eps, weight_decay, rowwise, moment_dtype):
    """A straightforward lazy Adam, a Python loop over rows: rows with a nonzero gradient row are updated."""
    weight = weight.clone()
    m = torch.zeros_like(weight)
    v = torch.zeros(weight.shape[0]) if rowwise else torch.zeros_like(weight)
    for step, grad in enumerate(grads, start=1):
        for r in range(weight.shape[0]):
            g = grad[r]
            if not torch.any(g != 0):
                continue
            m_r = m[r] * betas[0] + (1 - betas[0]) * g
            m[r] = m_r.to(moment_dtype).float()
            if rowwise:
                v[r] = v[r] * betas[1] + (1 - betas[1]) * (g * g).mean()
            else:
                v[r] = v[r] * betas[1] + (1 - betas[1]) * g * g
            m_hat = m_r / (1 - betas[0] ** step)
            v_hat = v[r] / (1 - betas[1] ** step)
            weight[r] = weight[r] * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return weight


def random_row_grads(rows, dim, steps, fraction, seed):
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        grad = torch.randn(rows, dim, generator=generator)
        grad[torch.rand(rows, generator=generator) > fraction] = 0
        grads.append(grad)
    return grads


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_sparse_row_adam_equals_plain_reference(rowwise, moment_dtype, sparse_grad):
    rows, dim, steps = 23, 6, 5
    torch.manual_seed(3)
    start = torch.randn(rows, dim)
    grads = random_row_grads(rows, dim, steps, fraction=0.4, seed=4)
    kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    parameter = torch.nn.Parameter(start.clone())
    optimizer = SparseRowAdam([parameter], rowwise=rowwise, exp_avg_dtype=moment_dtype, chunk_rows=4, **kwargs)
    for grad in grads:
        parameter.grad = grad.to_sparse(1) if sparse_grad else grad.clone()
        optimizer.step()
    expected = plain_lazy_row_adam(start, grads, rowwise=rowwise, moment_dtype=moment_dtype, **kwargs)
    tolerance = 1e-6 if moment_dtype == torch.float32 else 1e-5
    torch.testing.assert_close(parameter.detach(), expected, rtol=0, atol=tolerance)
    untouched = torch.stack([g.abs().sum(1) == 0 for g in grads]).all(0)
    assert torch.equal(parameter.detach()[untouched], start[untouched])
    state = optimizer.state[parameter]
    assert state["exp_avg"].dtype == moment_dtype
    assert state["exp_avg_sq"].shape == ((rows,) if rowwise else (rows, dim))


def test_sparse_row_adam_without_first_moment():
    """betas[0] == 0 keeps no first moment: a row-wise RMSprop, the same as the plain reference with beta1 = 0."""
    rows, dim = 15, 4
    start = torch.randn(rows, dim)
    grads = random_row_grads(rows, dim, steps=4, fraction=0.5, seed=12)
    parameter = torch.nn.Parameter(start.clone())
    optimizer = SparseRowAdam([parameter], lr=1e-2, betas=(0.0, 0.99))
    for grad in grads:
        parameter.grad = grad.to_sparse(1)
        optimizer.step()
    assert "exp_avg" not in optimizer.state[parameter]
    expected = plain_lazy_row_adam(
        start, grads, lr=1e-2, betas=(0.0, 0.99), eps=1e-8, weight_decay=0.0, rowwise=True, moment_dtype=torch.float32
    )
    torch.testing.assert_close(parameter.detach(), expected, rtol=0, atol=1e-6)


def test_sparse_row_adam_equals_torch_adam_when_every_row_is_touched():
    torch.manual_seed(5)
    start = torch.randn(17, 8)
    grads = [torch.randn(17, 8) for _ in range(6)]
    ours = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    optimizer = SparseRowAdam([ours], lr=3e-3, rowwise=False, exp_avg_dtype=torch.float32, chunk_rows=5)
    adam = torch.optim.Adam([theirs], lr=3e-3, foreach=False)
    for grad in grads:
        ours.grad = grad.to_sparse(1)
        theirs.grad = grad.clone()
        optimizer.step()
        adam.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=0)
    torch.testing.assert_close(optimizer.state[ours]["exp_avg"], adam.state[theirs]["exp_avg"], rtol=0, atol=0)


def test_sparse_row_adam_state_dict_round_trip():
    parameter = torch.nn.Parameter(torch.randn(10, 4))
    optimizer = SparseRowAdam([parameter])
    parameter.grad = torch.randn(10, 4).to_sparse(1)
    optimizer.step()
    clone = torch.nn.Parameter(parameter.detach().clone())
    restored = SparseRowAdam([clone])
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    grad = torch.randn(10, 4).to_sparse(1)
    parameter.grad, clone.grad = grad, grad.clone()
    optimizer.step()
    restored.step()
    torch.testing.assert_close(parameter, clone, rtol=0, atol=0)


@pytest.mark.parametrize("with_mask", [False, True])
def test_training_sparse_fast_path_equals_dense_reference_after_several_steps(with_mask):
    """Memory trained with (fast sparse lookup + SparseRowAdam on a sparse gradient) vs (reference EmbeddingBag +
    SparseRowAdam on the dense gradient) and (reference + the plain loop): same parameters after several steps."""
    torch.manual_seed(6)
    # no query bias: before a BatchNorm its gradient is rounding noise, which Adam would blow up to lr-sized steps
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, query_bias=False).train()
    fast, reference = configured(memory, sparse=True), configured(memory)
    models = {"fast": fast, "reference": reference}
    optimizers = {}
    for name, module in models.items():
        values = [module.values.weight]
        others = [p for n, p in module.named_parameters() if n != "values.weight"]
        optimizers[name] = (
            torch.optim.AdamW(others, lr=1e-2, foreach=False),
            SparseRowAdam(values, lr=1e-2, exp_avg_dtype=torch.float32),
        )
    value_grads = []
    for step in range(4):
        x = torch.randn(3, 6, 16)
        mask = None
        if with_mask:
            mask = torch.ones(3, 6)
            mask[step % 3, 2:] = 0
        for name, module in models.items():
            with use_plan(PLANS["cpu"] if name == "fast" else REFERENCE):
                loss = module(x, mask).square().mean()
            loss.backward()
            if name == "reference":
                value_grads.append(module.values.weight.grad.clone())
            for optimizer in optimizers[name]:
                optimizer.step()
                optimizer.zero_grad()
    for (name, p), (_, q) in zip(fast.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6, msg=name)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(fast.query_batchnorm, name), getattr(reference.query_batchnorm, name))
    expected = plain_lazy_row_adam(
        memory.values.weight.detach(), value_grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
        rowwise=True, moment_dtype=torch.float32,
    )
    torch.testing.assert_close(reference.values.weight.detach(), expected, rtol=0, atol=2e-6)


def test_dense_fast_path_with_torch_adam_equals_reference():
    torch.manual_seed(7)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, query_bias=False).train()
    fast, reference = configured(memory), configured(memory)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False) for m in (fast, reference)]
    for _ in range(3):
        x = torch.randn(2, 5, 16)
        for module, optimizer, plan in zip((fast, reference), opts, (PLANS["cpu"], REFERENCE)):
            with use_plan(plan):
                loss = module(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(fast.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_param_groups_and_value_parameters():
    from helpers import tiny_config

    from modeling_pkm_bert import BertPkmForMaskedLM

    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2]))
    values = pkm_value_parameters(model)
    assert [p.shape for p in values] == [(64, 32), (64, 32)]
    assert values[0] is model.bert.encoder.layer[0].memory.values.weight
    groups = pkm_param_groups(model, lr=1e-4, weight_decay=0.01)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"decay", "no_decay", "pkm_values"}
    assert by_name["pkm_values"]["lr"] == 1e-3 and by_name["pkm_values"]["weight_decay"] == 0.0
    assert {id(p) for p in by_name["pkm_values"]["params"]} == {id(p) for p in values}
    assert by_name["decay"]["weight_decay"] == 0.01 and by_name["decay"]["lr"] == 1e-4
    ids = {name: id(p) for name, p in model.named_parameters()}
    no_decay = {id(p) for p in by_name["no_decay"]["params"]}
    decay = {id(p) for p in by_name["decay"]["params"]}
    memory = "bert.encoder.layer.0.memory."
    assert ids[memory + "query_batchnorm.weight"] in no_decay and ids[memory + "query_proj.bias"] in no_decay
    assert ids[memory + "keys"] in decay and ids[memory + "query_proj.weight"] in decay
    assert ids["bert.embeddings.LayerNorm.weight"] in no_decay
    n_params = len({id(p) for p in model.parameters()})
    assert sum(len(g["params"]) for g in groups) == n_params
    assert "pkm_values" not in {g["name"] for g in pkm_param_groups(model, 1e-4, 0.01, include_values=False)}
    optimizer = torch.optim.AdamW(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, pkm_lr_lambdas(optimizer, lambda step: step / 10))
    optimizer.step()
    scheduler.step()
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs["pkm_values"] == 1e-3 and lrs["decay"] == pytest.approx(1e-5)
    assert set_sparse_values(model, True) == 2 and model.bert.encoder.layer[2].memory.values.sparse


def test_bert_pkm_training_step_with_sparse_values():
    from helpers import tiny_config

    from modeling_pkm_bert import BertPkmForMaskedLM

    torch.manual_seed(8)
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], pkm_query_bias=False)).train()
    reference = copy.deepcopy(model)
    set_sparse_values(model, True)
    input_ids = torch.randint(0, 99, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0
    optimizers = {}
    for name, m in (("fast", model), ("reference", reference)):
        main = torch.optim.AdamW(pkm_param_groups(m, 1e-3, 0.01, include_values=False), foreach=False)
        optimizers[name] = (main, SparseRowAdam(pkm_value_parameters(m), lr=1e-3))
    for _ in range(3):
        for name, m in (("fast", model), ("reference", reference)):
            with use_plan(PLANS["cpu"] if name == "fast" else REFERENCE):
                loss = m(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
            loss.backward()
            norm = clip_grad_norm_(pkm_value_parameters(m), 1.0)
            assert torch.isfinite(norm)
            for optimizer in optimizers[name]:
                optimizer.step()
                optimizer.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)


def test_clip_grad_norm_matches_torch_on_dense_and_handles_sparse():
    torch.manual_seed(9)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7, 3))
    grad_a, grad_b = torch.randn(5, 3), torch.randn(7, 3)
    grad_b[[1, 4]] = 0
    a.grad, b.grad = grad_a.clone(), grad_b.to_sparse(1)
    # an uncoalesced sparse gradient: the same row twice
    b.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.ones(3, 3), (7, 3), check_invariants=True) + b.grad
    dense_b = b.grad.to_dense()
    ref_a, ref_b = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    ref_a.grad, ref_b.grad = grad_a.clone(), dense_b.clone()
    total = clip_grad_norm_(iter([a, b]), 0.5)  # any iterable, as torch's
    ref_total = torch.nn.utils.clip_grad_norm_([ref_a, ref_b], 0.5)
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(a.grad, ref_a.grad)
    torch.testing.assert_close(b.grad.to_dense(), ref_b.grad)


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_training_lookup_compiles_to_one_graph(sparse):
    """The search is traced as torch ops, the value read is the custom op (`torch.ops.pkm_bert.weighted_row_sum_v*`):
    a training step is one graph, sparse value gradients included."""
    torch._dynamo.reset()
    memory = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
    explanation = torch._dynamo.explain(memory)(torch.randn(2, 3, 16))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert targets.count(f"pkm_bert.weighted_row_sum_v{OPS_VERSION}.default") == 1


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_custom_ops_pass_opcheck(sparse):
    """Schema, fake (meta) implementation, autograd registration and compile consistency, as torch.library.opcheck
    tests them."""
    forward = getattr(torch.ops.pkm_bert, f"weighted_row_sum_v{OPS_VERSION}").default
    backward = getattr(torch.ops.pkm_bert, f"weighted_row_sum_backward_v{OPS_VERSION}").default
    torch.manual_seed(3)
    weight, rows = torch.randn(64, 7, requires_grad=True), torch.randint(0, 64, (6, 8))
    weights = torch.rand(6, 8, requires_grad=True)
    # (a sparse gradient's fake tensor bounds its rows by the lookups: opcheck's exact comparison of it is left out)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor") if not sparse else ("test_schema", "test_autograd_registration")
    torch.library.opcheck(forward, (weight, rows, weights, sparse), test_utils=tests)
    for table in (weight.detach(), weight.detach().double()):  # CSR kernels; plain torch ops (fp32 grad, fp64 table)
        arguments = (torch.randn(6, 7), table, rows, weights.detach(), sparse, True, True)
        torch.library.opcheck(backward, arguments, test_utils=tests)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_the_custom_op_backward_off_the_csr_kernels_equals_the_reference(sparse):
    """What the op's backward runs on other devices and dtypes (plain torch ops), checked here on a bf16 table."""
    from modeling_pkm_bert.product_key_memory_ops import _plain_gradients

    torch.manual_seed(4)
    weight, rows = torch.randn(30, 6, dtype=torch.float64, requires_grad=True), torch.randint(0, 30, (5, 7))
    weights, g = torch.rand(5, 7, dtype=torch.float64, requires_grad=True), torch.randn(5, 6, dtype=torch.float64)
    F.embedding_bag(rows, weight, mode="sum", per_sample_weights=weights).backward(g)
    grad_weight, grad_weights = _plain_gradients(weight.detach(), rows, weights.detach(), g, sparse, (True, True))
    assert grad_weight.is_sparse == sparse
    torch.testing.assert_close(dense(grad_weight), weight.grad)
    torch.testing.assert_close(grad_weights, weights.grad)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_lookup_accumulates_safely(sparse):
    """Two backward passes of a compiled training lookup (the custom op) before a step add up, as eager ones do."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    eager = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
    memory = copy.deepcopy(eager)
    compiled = torch.compile(memory, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 5, 16)
        for module in (eager, compiled):
            (module(x) ** 2).sum().backward()
    torch.testing.assert_close(dense(memory.values.weight.grad), dense(eager.values.weight.grad))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_table_read_twice_in_a_step_never_reuses_a_buffer_in_flight(sparse):
    """The second read's gradient waits for the first's in autograd: it takes a fresh buffer; the next step, with the
    gradient dropped, reuses the kept one; the sum is the reference's every step."""
    torch.manual_seed(5)
    values = ProductKeyValues(40, 5, sparse=sparse)
    reference = torch.nn.EmbeddingBag(40, 5, mode="sum")
    reference.weight.data.copy_(values.weight.data)
    for _ in range(3):
        values.weight.grad = reference.weight.grad = None
        reads = [(torch.randint(0, 40, (6, 4)), torch.rand(6, 4)) for _ in range(2)]
        sum(values(i, per_sample_weights=w) for i, w in reads).square().sum().backward()
        sum(reference(i, per_sample_weights=w) for i, w in reads).square().sum().backward()
        torch.testing.assert_close(dense(values.weight.grad), reference.weight.grad)


def _compiler_backends():
    import shutil

    inductor = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
    return ["aot_eager", pytest.param("inductor", marks=inductor)]


@pytest.mark.slow  # torch.compile (inductor among the backends: 3.8 s on 2 loaded cores)
@pytest.mark.parametrize("backend", _compiler_backends())
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_memory_trains_like_eager(backend, sparse):
    """torch.compile (`fullgraph=True`) of a memory in training: outputs, every gradient and the parameters after 3
    optimizer steps (AdamW, values in Adam or SparseRowAdam) equal eager mode's."""
    torch._dynamo.reset()
    torch.manual_seed(12)
    # no query bias: before the BatchNorm its gradient is rounding noise, which Adam would scale up to lr-sized steps
    eager = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, query_bias=False, sparse=sparse).train()
    memory = copy.deepcopy(eager)
    compiled = torch.compile(memory, backend=backend, fullgraph=True)
    optimizers = {}
    for name, m in (("eager", eager), ("compiled", memory)):
        rest = [p for p in m.parameters() if p is not m.values.weight]
        values = SparseRowAdam([m.values.weight], lr=1e-2) if sparse else torch.optim.Adam([m.values.weight], lr=1e-2)
        optimizers[name] = (torch.optim.AdamW(rest, lr=1e-2, foreach=False), values)
    for step in range(3):
        x = torch.randn(2, 5, 16)
        grad_output = torch.randn(2, 5, 16)
        outputs, input_grads = {}, {}
        for name, run in (("eager", eager), ("compiled", compiled)):
            inputs = x.clone().requires_grad_()
            outputs[name] = run(inputs)
            (outputs[name] * grad_output).sum().backward()
            input_grads[name] = inputs.grad
        torch.testing.assert_close(outputs["compiled"], outputs["eager"])
        torch.testing.assert_close(input_grads["compiled"], input_grads["eager"])
        for (name, p), q in zip(eager.named_parameters(), memory.parameters()):
            assert q.grad.is_sparse == p.grad.is_sparse == (sparse and name == "values.weight"), name
            torch.testing.assert_close(q.grad.to_dense(), p.grad.to_dense(), msg=f"step {step}: {name}")
        for optimizer in (*optimizers["eager"], *optimizers["compiled"]):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(eager.named_parameters(), memory.parameters()):
        torch.testing.assert_close(q, p, msg=name)
    torch.testing.assert_close(memory.query_batchnorm.running_mean, eager.query_batchnorm.running_mean)


@pytest.mark.slow  # torch.compile (9 s on 2 cores, both cases)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_masked_lm_with_padding_trains_like_eager(sparse):
    from helpers import tiny_config

    from modeling_pkm_bert import BertPkmForMaskedLM

    torch._dynamo.reset()
    torch.manual_seed(13)
    eager = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).train()
    set_sparse_values(eager, sparse)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aot_eager")
    input_ids = torch.randint(0, 99, (3, 9))
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0  # padding: the query BatchNorm statistics skip these tokens
    losses = {}
    for name, run in (("eager", eager), ("compiled", compiled)):
        losses[name] = run(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
        losses[name].backward()
    torch.testing.assert_close(losses["compiled"], losses["eager"])
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad.to_dense(), p.grad.to_dense(), msg=name)


def test_benchmark_xlm_reference_computes_the_same_layer():
    """benchmarks/speed/xlm_reference.py (the peer of the speed comparison) is the same function as ProductKeyMemory."""
    from benchmarks.speed.xlm_reference import XlmProductKeyMemory

    torch.manual_seed(11)
    ours = ProductKeyMemory(20, 12, n_keys=8, heads=3, knn=5, k_dim=10).double().train()
    xlm = XlmProductKeyMemory(20, 12, n_keys=8, heads=3, knn=5, k_dim=10).double().train()
    state = ours.state_dict()
    xlm.load_state_dict(
        {
            "keys": state["keys"],
            "values.weight": state["values.weight"],
            **{f"query_proj.0.{k}": state[f"query_proj.{k}"] for k in ("weight", "bias")},
            **{f"query_proj.1.{k}": v for k, v in state.items() if k.startswith("query_batchnorm.") for k in [k.split(".", 1)[1]]},
        }
    )
    x = torch.randn(4, 6, 20, dtype=torch.float64)
    torch.testing.assert_close(xlm(x), ours(x))
    ours.eval(), xlm.eval()
    torch.testing.assert_close(xlm(x), ours(x))


def test_bfloat16_values_for_inference_are_close():
    from helpers import tiny_config

    from modeling_pkm_bert import BertPkmModel
    from modeling_pkm_bert.methods.optimizers import cast_pkm_values

    model = BertPkmModel(tiny_config(pkm_layers=[0, 2])).eval()
    ids = torch.randint(0, 99, (2, 7))
    with torch.inference_mode():
        expected = model(input_ids=ids).last_hidden_state
        assert cast_pkm_values(model, torch.bfloat16) == 2
        assert model.encoder.layer[0].memory.values.weight.dtype == torch.bfloat16
        output = model(input_ids=ids).last_hidden_state
    assert output.dtype == torch.float32
    torch.testing.assert_close(output, expected, rtol=0, atol=5e-2)
