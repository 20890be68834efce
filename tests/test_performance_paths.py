"""The fast paths of the memory equal the reference paths: pruned search, fused value backward (dense and sparse),
row-wise lazy Adam, parameter groups, sparse-aware clipping."""

import copy

import pytest
import torch
import torch.nn.functional as F

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
from modeling_pkm_bert.product_key_memory import ProductKeyValues
from modeling_pkm_bert.product_key_memory_ops import OPS_VERSION, candidate_pairs


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _large_size_paths(monkeypatch):
    """The tiny layers here take the paths of large ones (CPU: the sparse CSR kernels and their reused buffers, the
    sub-key score gradient through the selected keys), unless a test asks for the small-size ones."""
    monkeypatch.setattr(product_key_memory_ops, "SMALL_LOOKUP_ELEMENTS", 0)
    monkeypatch.setattr(product_key_memory_ops, "DENSE_SCORE_GRADIENT_CPU_LIMIT", 0)


def brute_force_topk(memory, queries):
    n = memory.n_keys
    keys = memory.keys
    full_keys = torch.cat([keys[:, 0].repeat_interleave(n, dim=1), keys[:, 1].repeat(1, n, 1)], dim=-1)
    return torch.einsum("...hd,hsd->...hs", queries, full_keys).topk(memory.knn, dim=-1)


def configured(memory, *, sparse=False, fused=True, prune=True):
    """A deep copy of `memory` on the given paths (fused=False, prune=False, sparse=False: the reference)."""
    memory = copy.deepcopy(memory)
    memory.sparse_values = sparse
    memory.values.fused_backward = fused
    memory.fused_search_backward = fused
    memory.prune_candidates = prune
    memory.native_search = fused
    return memory


def dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


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
    assert memory.prune_candidates
    queries = torch.randn(*batch_shape, heads, k_dim, dtype=torch.float64)
    scores, indices = memory.search(queries)
    expected_scores, expected_indices = brute_force_topk(memory, queries)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-12)
    assert torch.equal(indices, expected_indices)


@pytest.mark.parametrize("prune,native", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("n_keys,heads,knn,tokens", [(8, 2, 4, 5), (16, 3, 16, 7), (12, 1, 7, 3), (5, 2, 1, 6)])
def test_selection_keeps_the_subkeys_of_every_product_key(n_keys, heads, knn, tokens, prune, native):
    """The sub-keys `(tokens, heads, 2, knn)` that the selection keeps for the backward (gathered from the halves' top-k,
    or split from the native op's indices) are those of the product keys it chose, `i1 * n_keys + i2`, and their
    sub-key scores add up to the product scores; the same selection as the full grid (fp32: the native op runs)."""
    from modeling_pkm_bert.product_key_memory_ops import select_product_keys

    subkey_scores = torch.randn(heads * 2, tokens, n_keys)
    scores, indices, subkeys = select_product_keys(subkey_scores, knn, prune, native, with_subkeys=True)
    assert subkeys.shape == (tokens, heads, 2, knn) and subkeys.is_contiguous() and indices.is_contiguous()
    assert torch.equal(subkeys[:, :, 0] * n_keys + subkeys[:, :, 1], indices)
    halves = subkey_scores.view(heads, 2, tokens, n_keys).permute(2, 0, 1, 3)  # (tokens, heads, 2, n_keys)
    torch.testing.assert_close(halves.gather(-1, subkeys).sum(2), scores, rtol=0, atol=1e-6)
    grid = (halves[:, :, 0, :, None] + halves[:, :, 1, None, :]).flatten(-2)  # every product key
    expected_scores, expected_indices = grid.topk(knn, dim=-1)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-6)
    assert torch.equal(indices.sort(-1).values, expected_indices.sort(-1).values)


@pytest.mark.parametrize("score_gradient", ["dense", "selected-subkeys"])
@pytest.mark.parametrize("prune,fused", [(True, True), (True, False), (False, True)])
def test_fast_search_equals_full_grid_reference_with_gradients(prune, fused, score_gradient, monkeypatch):
    """Pruned candidates and the one-node search (`ProductKeySearch`, whose backward scatters a dense sub-key score
    gradient or goes through the selected sub-keys only) vs XLM's full grid with torch's own backward."""
    monkeypatch.setattr(product_key_memory_ops, "DENSE_SCORE_GRADIENT_CPU_LIMIT", 2**40 if score_gradient == "dense" else 0)
    memory = ProductKeyMemory(12, n_keys=16, heads=3, knn=8, k_dim=10).double()
    queries = torch.randn(20, 3, 10, dtype=torch.float64)
    weights = torch.randn(20, 3, 8, dtype=torch.float64)
    results = []
    for prune_, fused_ in ((False, False), (prune, fused)):
        memory.prune_candidates, memory.fused_search_backward = prune_, fused_
        memory.keys.grad = None
        q = queries.clone().requires_grad_()
        scores, indices = memory.search(q)
        (scores * weights).sum().backward()
        results.append((scores, indices, q.grad, memory.keys.grad.clone()))
    (ref_scores, ref_indices, ref_query_grad, ref_keys_grad), (scores, indices, query_grad, keys_grad) = results
    assert torch.equal(scores, ref_scores) and torch.equal(indices, ref_indices)
    assert keys_grad.abs().sum() > 0
    # the same gradient, summed in another order
    torch.testing.assert_close(query_grad, ref_query_grad, rtol=0, atol=1e-14)
    torch.testing.assert_close(keys_grad, ref_keys_grad, rtol=0, atol=1e-14)


# ---------------------------------------------------------------- value lookup


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


@pytest.mark.parametrize("paths", ["cpu", "gpu", "small", "small_torch_nodes", "small_fused"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_fast_path_equals_reference_outputs_and_gradients(sparse, with_mask, paths, monkeypatch):
    """Every backward implementation: CPU (sparse CSR kernels, the sub-key score gradient through the selected keys);
    GPU with the fused nodes (EmbeddingBag's dense backward or sorted segments for a sparse gradient, the dense sub-key
    score gradient); host-bound sizes (`small`: the whole read one node, `HostBoundLookup`; `small_torch_nodes`: torch's
    own nodes for the search and a dense lookup, a sparse gradient coalesced; `small_fused`: the fused nodes there,
    EmbeddingBag's own kernels inside)."""
    monkeypatch.setattr(product_key_memory_ops, "CPU_SPARSE_KERNELS", paths == "cpu")
    monkeypatch.setattr(product_key_memory_ops, "DENSE_SCORE_GRADIENT_CPU_LIMIT", 0 if paths == "cpu" else 2**40)
    monkeypatch.setattr(product_key_memory_ops, "SMALL_LOOKUP_ELEMENTS", 2**40 if paths.startswith("small") else 0)
    monkeypatch.setattr(product_key_memory_ops, "TORCH_AUTOGRAD_WHEN_HOST_BOUND", paths in ("small", "small_torch_nodes"))
    monkeypatch.setattr(product_key_memory_ops, "ONE_NODE_WHEN_HOST_BOUND", ("dense", "sparse") if paths == "small" else ())
    memory = ProductKeyMemory(24, 20, n_keys=16, heads=3, knn=8, k_dim=16).double().train()
    x = torch.randn(4, 7, 24, dtype=torch.float64)
    g = torch.randn(4, 7, 20, dtype=torch.float64)
    mask = None
    if with_mask:
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[1, 4:] = 0
        mask[3, 1:] = 0
    results = []
    for module in (configured(memory, sparse=False, fused=False, prune=False), configured(memory, sparse=sparse)):
        xx = x.clone().requires_grad_()
        out = module(xx, mask)
        (out * g).sum().backward()
        grads = {name: p.grad for name, p in module.named_parameters()}
        results.append((out, xx.grad, grads, module))
    (ref_out, ref_xgrad, ref_grads, _), (out, xgrad, grads, module) = results
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(xgrad, ref_xgrad, rtol=0, atol=1e-13)
    assert grads["values.weight"].is_sparse == sparse
    if sparse:  # one entry per row used, sorted (autograd drops the coalesced flag; SparseRowAdam re-flags it)
        rows = grads["values.weight"]._indices()[0]
        assert torch.equal(rows, torch.unique(rows)) and (dense(grads["values.weight"]).abs().sum(1) > 0).sum() == rows.numel()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(dense(grads[name]), ref, rtol=0, atol=1e-13, msg=name)
    torch.testing.assert_close(module.query_batchnorm.running_mean, results[0][3].query_batchnorm.running_mean)


def _autograd_nodes(tensor: torch.Tensor) -> set[str]:
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            names.add(type(node).__name__)
            stack += [next_node for next_node, _ in node.next_functions]
    return names


@pytest.mark.parametrize("host_bound", ["one_node", "torch_nodes", False])
def test_host_bound_steps_take_one_node_or_torch_s_own_nodes(host_bound, monkeypatch):
    """At host-bound sizes the whole read is one node (`HostBoundLookup`, `ONE_NODE_WHEN_HOST_BOUND`), or with that off
    the search and a dense value lookup are torch's own (C++) nodes (`TORCH_AUTOGRAD_WHEN_HOST_BOUND`); with both off,
    the fused nodes of each phase; the same gradients every way."""
    monkeypatch.setattr(product_key_memory_ops, "SMALL_LOOKUP_ELEMENTS", 2**40)
    monkeypatch.setattr(product_key_memory_ops, "DENSE_SCORE_GRADIENT_CPU_LIMIT", 2**40)
    monkeypatch.setattr(product_key_memory_ops, "TORCH_AUTOGRAD_WHEN_HOST_BOUND", bool(host_bound))
    monkeypatch.setattr(product_key_memory_ops, "ONE_NODE_WHEN_HOST_BOUND", ("dense", "sparse") if host_bound == "one_node" else ())
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8).double().train()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    out = memory(x)
    nodes = _autograd_nodes(out)
    fused = {"WeightedRowSumBackward", "ProductKeySearchBackward"}
    expected = {
        "one_node": nodes.isdisjoint(fused | {"EmbeddingBagBackward0", "TopkBackward0"}) and "HostBoundLookupBackward" in nodes,
        "torch_nodes": nodes.isdisjoint(fused | {"HostBoundLookupBackward"}) and "EmbeddingBagBackward0" in nodes,
        False: fused <= nodes and "HostBoundLookupBackward" not in nodes,
    }[host_bound]
    assert expected, nodes
    out.square().sum().backward()
    # the reference: the plain torch ops everywhere
    other = configured(copy.deepcopy(memory), sparse=False, fused=False, prune=False)
    for p in other.parameters():
        p.grad = None
    xx = x.detach().clone().requires_grad_()
    torch.testing.assert_close(other(xx), out, rtol=0, atol=1e-14)
    other(xx).square().sum().backward()
    torch.testing.assert_close(xx.grad, x.grad, rtol=0, atol=1e-13)
    for (name, p), q in zip(memory.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-13, msg=name)
    # a sparse table gradient: the one node too (one coalesced entry per row used), else the fused node
    memory.sparse_values = True
    sparse_node = "HostBoundLookupBackward" if host_bound == "one_node" else "WeightedRowSumBackward"
    assert sparse_node in _autograd_nodes(memory(x))


@pytest.mark.parametrize(
    "options",
    [dict(score_activation="relu"), dict(qk_norm=True, output_gate="swilu", memory_scale=0.5), dict(knn=8, prune=False)],
    ids=["relu", "memory_plus", "unpruned"],
)
@pytest.mark.parametrize("sparse", [False, True])
def test_one_node_read_equals_reference_with_options(options, sparse, one_node_paths):
    """`HostBoundLookup` against the plain torch ops: the relu weights, Memory+'s
    normalised queries and sub-keys, all knn ** 2 candidate pairs; dense and sparse table gradients."""
    options = dict(options)
    prune = options.pop("prune", True)
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, **{"knn": 4, **options}, k_dim=8).double().train()
    x, g = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 5, 12, dtype=torch.float64)
    results = []
    for module in (configured(memory, sparse=False, fused=False, prune=False), configured(memory, sparse=sparse, prune=prune)):
        xx = x.clone().requires_grad_()
        out = module(xx)
        if module.values.fused_backward:
            assert "HostBoundLookupBackward" in _autograd_nodes(out)
        (out * g).sum().backward()
        results.append((out, xx.grad, {name: p.grad for name, p in module.named_parameters()}))
    (ref_out, ref_xgrad, ref_grads), (out, xgrad, grads) = results
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(xgrad, ref_xgrad, rtol=0, atol=1e-13)
    assert grads["values.weight"].is_sparse == sparse
    for name, ref in ref_grads.items():
        torch.testing.assert_close(dense(grads[name]), ref, rtol=0, atol=1e-13, msg=name)


@pytest.mark.parametrize("hook", ["forward", "forward_pre", "full_backward", "global_forward"])
def test_one_node_read_keeps_the_module_call_for_hooks_on_values(hook, one_node_paths):
    """A hook on the value table (or on every module) sees the table's call: the read is then not one node, and the
    hook runs (a backward hook with the table's output gradient)."""
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, sparse=True).train()
    x = torch.randn(3, 5, 16, requires_grad=True)
    assert "HostBoundLookupBackward" in _autograd_nodes(memory(x))
    seen = []
    register = {
        "forward": lambda: memory.values.register_forward_hook(lambda *args: seen.append("forward")),
        "forward_pre": lambda: memory.values.register_forward_pre_hook(lambda *args: seen.append("pre")),
        "full_backward": lambda: memory.values.register_full_backward_hook(lambda *args: seen.append("backward")),
        "global_forward": lambda: torch.nn.modules.module.register_module_forward_hook(
            lambda module, *args: seen.append("global") if module is memory.values else None
        ),
    }[hook]
    handle = register()
    try:
        out = memory(x)
        assert "HostBoundLookupBackward" not in _autograd_nodes(out)
        out.sum().backward()
    finally:
        handle.remove()
    assert seen, hook
    assert "HostBoundLookupBackward" in _autograd_nodes(memory(x))


@pytest.mark.parametrize("sparse", [False, True])
def test_one_node_read_of_no_token_gives_every_parameter_a_zero_gradient(sparse, one_node_paths):
    """A process whose batch has no real token still reads the memory (DDP and FSDP wait for every parameter's
    gradient on every process): as one node too, zero gradients, as on torch's nodes (no query BatchNorm: it has no
    statistics of 0 tokens)."""
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
    memory.query_batchnorm = torch.nn.Identity()
    x = torch.randn(2, 3, 16, requires_grad=True)
    out = memory(x, torch.zeros(2, 3, dtype=torch.long))
    assert "HostBoundLookupBackward" in _autograd_nodes(out)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(2, 3, 12)) and torch.equal(x.grad, torch.zeros_like(x))
    for name, p in memory.named_parameters():
        assert p.grad is not None and not dense(p.grad).any(), name


@pytest.mark.parametrize("one_node", [("dense", "sparse"), ()])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("fused,prune,native", [(True, True, True), (True, True, False), (True, False, False), (False, True, False), (False, False, False)])
def test_a_read_of_no_token_on_every_selection_path(fused, prune, native, sparse, one_node, monkeypatch):
    """A batch with no real token (a process of DDP/FSDP or of memory parallelism whose batch is all padding) through
    every selection path, with the small-size paths (the one node or torch's nodes) and the large ones: no error, zero
    outputs, zero gradients for every parameter."""
    monkeypatch.setattr(product_key_memory_ops, "ONE_NODE_WHEN_HOST_BOUND", one_node)
    for small_sizes in (True, False):
        monkeypatch.setattr(product_key_memory_ops, "SMALL_LOOKUP_ELEMENTS", 2**20 if small_sizes else 0)
        monkeypatch.setattr(product_key_memory_ops, "DENSE_SCORE_GRADIENT_CPU_LIMIT", 2**20 if small_sizes else 0)
        memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
        memory.query_batchnorm = torch.nn.Identity()  # (no batch statistics of 0 tokens)
        memory.values.fused_backward = memory.fused_search_backward = fused
        memory.prune_candidates, memory.native_search = prune, native
        x = torch.randn(2, 3, 16, requires_grad=True)
        out = memory(x, torch.zeros(2, 3, dtype=torch.long))
        out.sum().backward()
        assert torch.equal(out, torch.zeros(2, 3, 12)) and torch.equal(x.grad, torch.zeros_like(x))
        for name, p in memory.named_parameters():
            assert p.grad is not None and not dense(p.grad).any(), (name, small_sizes)
        scores, indices = memory.eval().search(torch.randn(0, 2, 8))
        assert scores.shape == indices.shape == (0, 2, 4)


def test_one_node_read_under_bfloat16_autocast_is_close_to_torch_nodes(monkeypatch, one_node_paths):
    """CPU autocast to bf16 (the sub-key scores in bf16, as on a GPU under autocast): the one node's outputs and
    gradients match torch's own nodes to bf16 rounding."""
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8).train()
    x, g = torch.randn(3, 5, 16), torch.randn(3, 5, 12)
    results = []
    for one_node in (True, False):
        monkeypatch.setattr(product_key_memory_ops, "ONE_NODE_WHEN_HOST_BOUND", ("dense",) if one_node else ())
        module = copy.deepcopy(memory)
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(xx)
        assert ("HostBoundLookupBackward" in _autograd_nodes(out)) == one_node
        (out.float() * g).sum().backward()
        results.append((out.float(), xx.grad, [p.grad for p in module.parameters()]))
    (out, xgrad, grads), (ref_out, ref_xgrad, ref_grads) = results
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xgrad, ref_xgrad, rtol=5e-2, atol=5e-2)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2)


@pytest.fixture
def one_node_paths(monkeypatch):
    """The paths of host-bound sizes (those of the tiny layers outside this file), the read one node for dense and
    sparse table gradients alike."""
    monkeypatch.setattr(product_key_memory_ops, "SMALL_LOOKUP_ELEMENTS", 2**40)
    monkeypatch.setattr(product_key_memory_ops, "DENSE_SCORE_GRADIENT_CPU_LIMIT", 2**40)
    monkeypatch.setattr(product_key_memory_ops, "ONE_NODE_WHEN_HOST_BOUND", ("dense", "sparse"))


@pytest.mark.parametrize("small", [False, True], ids=["large_size_paths", "one_node"])
@pytest.mark.parametrize("frozen", ["values", "keys", "memory"])
def test_fast_path_with_frozen_parts(frozen, small, request):
    """Frozen values (or keys, or the whole memory, as `--freeze_memory`): the input gradient is still exact."""
    if small:
        request.getfixturevalue("one_node_paths")
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8).double().train()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    grads = []
    for module in (configured(memory, sparse=False, fused=False, prune=False), configured(memory, sparse=True)):
        parameters = {"values": [module.values.weight], "keys": [module.keys], "memory": list(module.parameters())}
        for parameter in parameters[frozen]:
            parameter.requires_grad_(False)
        xx = x.clone().requires_grad_()
        module(xx).square().sum().backward()
        grads.append([xx.grad] + [p.grad for p in module.parameters() if p.requires_grad])
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(dense(got), expected, rtol=0, atol=1e-12)


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


def test_gradient_accumulation_and_buffer_reuse_are_safe():
    """Two backward passes before a step add up (the reused gradient buffer never overwrites a live gradient),
    and the buffer is reused once the gradient is dropped."""
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
        values.weight.grad = None
        indices, weights = torch.randint(0, 40, (6, 4)), torch.rand(6, 4)
        values(indices, per_sample_weights=weights).sum().backward()
        buffer, _ = values._workspaces["sparse_grad" if sparse else "dense_grad"]
        grad_storage = (values.weight.grad._values() if sparse else values.weight.grad).untyped_storage()
        assert grad_storage.data_ptr() == buffer.untyped_storage().data_ptr()
        kept = dense(values.weight.grad).clone()
        values(torch.randint(0, 40, (6, 4)), per_sample_weights=torch.rand(6, 4)).sum().backward()
        assert not torch.equal(dense(values.weight.grad), kept)  # accumulated, not overwritten in place and lost
        values.eval()
        assert values._workspaces == {}


def test_inference_and_frozen_paths_use_plain_embedding_bag():
    values = ProductKeyValues(30, 4)
    indices, weights = torch.randint(0, 30, (5, 3)), torch.rand(5, 3)
    with torch.no_grad():
        out = values(indices, per_sample_weights=weights)
    torch.testing.assert_close(out, F.embedding_bag(indices, values.weight, mode="sum", per_sample_weights=weights))
    values.weight.requires_grad_(False)
    out = values(indices, per_sample_weights=weights)
    assert not out.requires_grad


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
    fast, reference = configured(memory, sparse=True), configured(memory, sparse=False, fused=False, prune=False)
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
    fast, reference = configured(memory, sparse=False), configured(memory, sparse=False, fused=False, prune=False)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False) for m in (fast, reference)]
    for _ in range(3):
        x = torch.randn(2, 5, 16)
        for module, optimizer in zip((fast, reference), opts):
            module(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(fast.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- groups, clipping


def test_param_groups_and_value_parameters():
    from conftest import tiny_config

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
    from conftest import tiny_config

    from modeling_pkm_bert import BertPkmForMaskedLM

    torch.manual_seed(8)
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], pkm_query_bias=False)).train()
    reference = copy.deepcopy(model)
    set_sparse_values(model, True)
    for module in reference.modules():
        if isinstance(module, ProductKeyMemory):
            module.values.fused_backward = False
            module.fused_search_backward = False
            module.prune_candidates = False
    input_ids = torch.randint(0, 99, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0
    optimizers = {}
    for name, m in (("fast", model), ("reference", reference)):
        main = torch.optim.AdamW(pkm_param_groups(m, 1e-3, 0.01, include_values=False), foreach=False)
        optimizers[name] = (main, SparseRowAdam(pkm_value_parameters(m), lr=1e-3))
    for _ in range(3):
        for name, m in (("fast", model), ("reference", reference)):
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
def test_training_lookup_compiles_to_one_graph_by_default(sparse):
    """The search and the value lookup are custom ops (`torch.ops.pkm_bert.*_v<OPS_VERSION>`): a training step is one
    graph, sparse value gradients included, and each phase one node of it."""
    torch._dynamo.reset()
    memory = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
    explanation = torch._dynamo.explain(memory)(torch.randn(2, 3, 16))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert targets.count(f"pkm_bert.product_key_search_v{OPS_VERSION}.default") == 1
    assert targets.count(f"pkm_bert.weighted_row_sum_v{OPS_VERSION}.default") == 1


def test_eager_training_lookup_under_compile_when_asked():
    """`trace_training_lookup = False`: a lookup that needs gradients runs eagerly (one break per memory)."""
    torch._dynamo.reset()
    memory = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8).train()
    memory.trace_training_lookup = False
    explanation = torch._dynamo.explain(memory)(torch.randn(2, 3, 16))
    assert explanation.graph_break_count >= 1  # one break (dynamo may count it in more than one frame)
    assert all("_eager_lookup" in str(reason) for reason in explanation.break_reasons)
    with torch.no_grad():  # nothing to differentiate: one graph
        assert torch._dynamo.explain(memory)(torch.randn(2, 3, 16)).graph_break_count == 0


@pytest.mark.parametrize("trace", [False, True], ids=["eager-lookup", "traced-lookup"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_training_step_uses_the_fused_backward(trace, sparse):
    """Traced or eager, a compiled step differentiates the lookup in the fused paths (on CPU: the CSR kernels), never in
    torch's generic EmbeddingBag backward."""
    torch._dynamo.reset()
    memory = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
    memory.trace_training_lookup = trace
    compiled = torch.compile(memory, backend="aot_eager", fullgraph=trace)
    x = torch.randn(2, 3, 16, requires_grad=True)
    compiled(x).sum().backward()  # compiles
    with torch.profiler.profile() as profile:
        compiled(x).sum().backward()
    ops = {event.name for event in profile.events()}
    assert "aten::sparse_sampled_addmm" in ops  # the fused per-sample-weight gradient (CPU)
    assert "aten::_embedding_bag_backward" not in ops  # torch's generic backward
    assert (f"pkm_bert::weighted_row_sum_backward_v{OPS_VERSION}" in ops) == trace
    assert memory.values.weight.grad.is_sparse == sparse


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_lookup_on_the_gpu_value_backward_equals_eager(sparse, monkeypatch):
    """Without the CPU CSR kernels (the value backward a GPU runs: EmbeddingBag's own kernels over the lookups' bags,
    sorted segments for a large sparse gradient), the custom op's backward equals the eager lookup's."""
    monkeypatch.setattr(product_key_memory_ops, "CPU_SPARSE_KERNELS", False)
    torch._dynamo.reset()
    torch.manual_seed(4)
    eager = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).double().train()
    memory = copy.deepcopy(eager)
    compiled = torch.compile(memory, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for module in (eager, compiled):
        (module(x) ** 2).sum().backward()
    for (name, p), q in zip(eager.named_parameters(), memory.parameters()):
        assert q.grad.is_sparse == p.grad.is_sparse == (sparse and name == "values.weight"), name
        torch.testing.assert_close(dense(q.grad), dense(p.grad), rtol=0, atol=1e-12, msg=name)


OPS = ("product_key_search", "product_key_search_backward", "weighted_row_sum", "weighted_row_sum_backward")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_custom_ops_pass_opcheck(sparse):
    """The four custom ops: schema, fake (meta) implementation, autograd registration and compile consistency, as
    torch.library.opcheck tests them."""
    ops = {name: getattr(torch.ops.pkm_bert, f"{name}_v{OPS_VERSION}").default for name in OPS}
    torch.manual_seed(3)
    # 6 tokens, 2 heads of 2 halves of 5, 8 sub-keys per half
    queries, keys = torch.randn(6, 20, requires_grad=True), torch.randn(2, 2, 8, 5, requires_grad=True)
    torch.library.opcheck(ops["product_key_search"], (queries, keys, 4, True, False))
    scores, indices = ops["product_key_search"](queries.detach(), keys.detach(), 4, True, False)
    assert scores.shape == indices.shape == (6, 2, 4)
    for needs in ((True, True), (True, False)):
        # (the backward ops are not differentiable themselves: inputs without gradients)
        arguments = (queries.detach(), keys.detach(), indices, torch.randn(6, 2, 4), *needs)
        torch.library.opcheck(ops["product_key_search_backward"], arguments)
    weight, rows = torch.randn(64, 7, requires_grad=True), torch.randint(0, 64, (6, 8))
    weights = torch.rand(6, 8, requires_grad=True)
    # (a sparse gradient's fake tensor bounds its rows by the lookups: opcheck's exact comparison of it is left out)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor") if not sparse else ("test_schema", "test_autograd_registration")
    torch.library.opcheck(ops["weighted_row_sum"], (weight, rows, weights, sparse, False), test_utils=tests)
    torch.library.opcheck(
        ops["weighted_row_sum_backward"],
        (torch.randn(6, 7), weight.detach(), rows, weights.detach(), sparse, False, True, True),
        test_utils=tests,
    )


def _compiler_backends():
    import shutil

    inductor = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
    return ["aot_eager", pytest.param("inductor", marks=inductor)]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_lookup_reuses_its_gradient_buffer_and_accumulates_safely(sparse):
    """A compiled training lookup (the custom ops) reuses the table's CPU gradient buffer from step to step as the
    eager one does (a fresh table-sized gradient costs its page faults every step), never while a gradient lives in it:
    two backward passes before a step add up; `eval()` frees the buffers."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    eager = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, sparse=sparse).train()
    memory = copy.deepcopy(eager)
    compiled = torch.compile(memory, backend="aot_eager", fullgraph=True)

    def step(module, x):
        (module(x) ** 2).sum().backward()

    xs = [torch.randn(2, 5, 16) for _ in range(3)]
    for x in xs[:2]:  # accumulated: the first gradient is alive while the second backward runs
        step(eager, x)
        step(compiled, x)
    torch.testing.assert_close(dense(memory.values.weight.grad), dense(eager.values.weight.grad))
    storages = []
    for _ in range(2):
        memory.values.weight.grad = None
        step(compiled, xs[2])
        grad = memory.values.weight.grad
        storages.append((grad._values() if sparse else grad).untyped_storage().data_ptr())
        del grad  # (held here, it would be alive in the next step: a new buffer, rightly)
    assert storages[0] == storages[1]  # the second step wrote into the first one's buffer, dropped in between
    buffers = [buffer for kept in product_key_memory_ops._OP_WORKSPACES.values() for buffer, _ in kept.values()]
    assert storages[1] in [buffer.untyped_storage().data_ptr() for buffer in buffers]  # the ops' kept buffer
    eager.values.weight.grad = None
    step(eager, xs[2])
    torch.testing.assert_close(dense(memory.values.weight.grad), dense(eager.values.weight.grad))
    ours = product_key_memory_ops._op_workspace_key(memory.values.weight)
    ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8).eval()  # another table's eval(): ours stay
    assert ours in product_key_memory_ops._OP_WORKSPACES
    memory.eval()
    assert ours not in product_key_memory_ops._OP_WORKSPACES


@pytest.mark.parametrize("backend", _compiler_backends())
@pytest.mark.parametrize("trace", [False, True], ids=["eager-lookup", "traced-lookup"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_memory_trains_like_eager(backend, trace, sparse):
    """torch.compile of a memory in training: outputs, every gradient and the parameters after 3 optimizer steps (AdamW,
    values in Adam or SparseRowAdam) equal eager mode's; a traced lookup is one graph (`fullgraph=True`), dense or sparse."""
    torch._dynamo.reset()
    torch.manual_seed(12)
    # no query bias: before the BatchNorm its gradient is rounding noise, which Adam would scale up to lr-sized steps
    eager = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8, query_bias=False, sparse=sparse).train()
    memory = copy.deepcopy(eager)
    memory.trace_training_lookup = trace
    compiled = torch.compile(memory, backend=backend, fullgraph=trace)
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


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_compiled_masked_lm_with_padding_trains_like_eager(sparse):
    from conftest import tiny_config

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


# ---------------------------------------------------------------- the benchmark's XLM peer


def test_benchmark_xlm_reference_computes_the_same_layer():
    """benchmarks/xlm_reference.py (the peer of the speed comparison) is the same function as ProductKeyMemory."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from xlm_reference import XlmProductKeyMemory

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
    from conftest import tiny_config

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
