"""The plan of a memory's lookup, and the fast paths it may choose (shipped with `product_key_memory.py`).

Each phase of a lookup has a reference implementation, the plain torch ops of `product_key_memory.py`, and at most
one fast path, kept because a side-by-side measurement on its device shows it faster (docs/performance.md has the
figures and the command). [`plan_lookup`] decides, in one place, which one each phase runs, into a [`Plan`];
`ProductKeyMemory.explain_paths(hidden_states)` prints it, and `with use_plan(REFERENCE):` (or `use_reference()`)
forces a plan on every memory.

| phase | reference ("torch") | fast path: where it runs |
|---|---|---|
| selection | top-k of each half, top-k of the pruned sums | `native` (kernels/csrc): CPU fp32 |
| search backward | torch's autograd of those ops | `selected` ([`ProductKeySearch`]): CPU |
| value read | `nn.EmbeddingBag` and its autograd | `csr` ([`WeightedRowSum`]): CPU fp32/fp64 training |
| | | `op` (custom op `weighted_row_sum_v3`): torch.compile |

`native` runs without gradients or inside `selected`; `csr` and `op` compute the backward in torch's sparse CSR
kernels, `csr` into a gradient buffer reused between steps; `op` makes a compiled step with a sparse value gradient one
graph (inductor fails on EmbeddingBag's sparse backward). A GPU runs the reference: no fast path has shown a win there.

Imports torch only (remote code: no other module of the package).
"""

import contextlib
import dataclasses
import warnings
import weakref

import torch
import torch.nn.functional as F


# the layer's options, defined once (the config imports them from here: a file that imports only torch, so that
# transformers < 5.24, which copies only the direct relative imports of a remote-code file, finds all it needs)
SCORE_ACTIVATIONS = ("softmax", "relu")
OUTPUT_GATES = ("none", "swilu")

# torch.export sets it (torch >= 2.5; older versions: never exporting through this check)
is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


# ----------------------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which implementation each phase of a lookup runs ("torch": the reference)."""

    selection: str = "torch"  # "torch" | "native"
    search_backward: str = "torch"  # "torch" | "selected"
    value_read: str = "torch"  # "torch" | "csr" | "op"
    why: str = ""

    def __str__(self) -> str:
        return (
            f"selection: {self.selection}; search backward: {self.search_backward}; value read: {self.value_read}"
            + (f" ({self.why})" if self.why else "")
        )


REFERENCE = Plan(why="the reference, forced")
_forced: list = []  # the plans of the `use_plan` blocks that are open, innermost last


@contextlib.contextmanager
def use_plan(plan: Plan):
    """Every memory runs `plan` inside the block (e.g. `REFERENCE`: the plain torch ops everywhere)."""
    _forced.append(plan)
    try:
        yield plan
    finally:
        _forced.pop()


def use_reference():
    """`with use_reference():` every memory runs the reference torch ops (the same as `use_plan(REFERENCE)`)."""
    return use_plan(REFERENCE)


def plan_lookup(
    device: torch.device, dtype: torch.dtype, *, needs_grad: bool, table: str = "plain", compiling: bool = False,
    exporting: bool = False,
) -> Plan:  # fmt: skip
    """The plan of a lookup of queries of `dtype` on `device`. `needs_grad`: a backward will follow; `table`: "plain" (a
    `ProductKeyValues` read by the memory's own call), "quantized" or "other" (any other module, read as it reads
    itself). No size decides: no size threshold measured a win (docs/performance.md)."""
    if _forced:
        return _forced[-1]
    if exporting:
        return Plan(why="torch.export: standard ops only")
    on_cpu = device.type == "cpu"
    # the native selection has no backward: it runs without gradients, or inside ProductKeySearch (CPU training)
    selection = "native" if on_cpu and dtype == torch.float32 and native_selection_available() else "torch"
    if not needs_grad:
        return Plan(selection, why="no gradient" + ("" if on_cpu else f"; {device.type}: only the reference has run here"))
    if compiling:  # the search traced as torch ops; a plain table's read one node (a sparse gradient compiles only so)
        return Plan(value_read="op" if table == "plain" else "torch", why="torch.compile")
    if not on_cpu:
        return Plan(why=f"{device.type}: no fast path has shown a win on it")
    csr = table == "plain" and dtype in (torch.float32, torch.float64)
    return Plan(selection, "selected", "csr" if csr else "torch", why="CPU, with gradients")


def native_selection_available() -> bool:
    """Whether `modeling_pkm_bert` registered the native selection (`kernels/cpu.py`; `PKM_BERT_NATIVE=0`: never)."""
    return hasattr(torch.ops.pkm_bert, "select_product_keys")


# ----------------------------------------------------------------------------------------------------------------------
# Search backward on CPU: through the selected sub-keys
# ----------------------------------------------------------------------------------------------------------------------


class ProductKeySearch(torch.autograd.Function):
    """The exact top-`knn` product keys of every head as one autograd node: `select(queries, keys, knn)` (the reference
    search of `product_key_memory.py`, or with the native selection) -> scores, indices `(tokens, heads, knn)`.

    The reference's backward scatters the score gradient into a dense `(heads * 2, tokens, n_keys)` one and multiplies
    it out (two bmm); this one goes through the `knn` selected sub-keys of each half only (two EmbeddingBags).
    """

    @staticmethod
    def forward(ctx, queries, keys, knn, select):
        scores, indices = select(queries, keys, knn)
        n_keys = keys.shape[2]  # product key i1 * n_keys + i2: sub-keys (i1, i2)
        subkeys = torch.stack((indices.div(n_keys, rounding_mode="floor"), indices.remainder(n_keys)), 2)
        ctx.save_for_backward(queries, keys, subkeys)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)
        return scores, indices

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_scores, _grad_indices):
        if grad_scores is None:
            return None, None, None, None
        queries, keys, subkeys = ctx.saved_tensors
        heads, _, n_keys, half = keys.shape
        groups, tokens, knn = heads * 2, queries.shape[0], subkeys.shape[-1]
        halves = queries.reshape(tokens, groups, half).transpose(0, 1)  # (groups, tokens, half)
        # rows of keys.reshape(groups * n_keys, half), each selected sub-key once per product key it is part of
        offsets = torch.arange(0, groups * n_keys, n_keys, device=keys.device).view(1, groups, 1)
        rows = (subkeys.reshape(tokens, groups, knn) + offsets).transpose(0, 1).reshape(-1, knn)
        weights = grad_scores.to(keys.dtype).unsqueeze(2).expand(-1, -1, 2, -1).reshape(tokens, groups, knn)
        weights = weights.transpose(0, 1).reshape(-1, knn)
        flat_keys, grad_queries, grad_keys = keys.reshape(-1, half), None, None
        if ctx.needs_input_grad[0]:
            grad_queries = F.embedding_bag(rows, flat_keys, mode="sum", per_sample_weights=weights)
            grad_queries = grad_queries.view(groups, tokens, half).transpose(0, 1).reshape(queries.shape)
        if ctx.needs_input_grad[1]:  # per sub-key, the queries that selected it: the selections sorted by sub-key
            flat = rows.reshape(-1)
            _, order = flat.sort(stable=True)
            counts = torch.bincount(flat, minlength=groups * n_keys)
            grad_keys = F.embedding_bag(
                torch.div(order, knn, rounding_mode="floor"), halves.reshape(-1, half).to(keys.dtype),
                torch.cumsum(counts, 0) - counts, mode="sum", per_sample_weights=weights.reshape(-1)[order],
            ).view(keys.shape)  # fmt: skip
        return grad_queries, grad_keys, None, None


# ----------------------------------------------------------------------------------------------------------------------
# Value read on CPU: the backward in torch's sparse CSR kernels, into a reused buffer
# ----------------------------------------------------------------------------------------------------------------------


def reusable_buffer(cache: dict, name: str, numel: int, dtype: torch.dtype, table: torch.Tensor | None) -> torch.Tensor:
    """A flat CPU buffer of `numel` elements for a gradient of `table`: last step's, where that gradient has left it,
    else a new one, kept for next time (`table=None`: a new one, not kept).

    A fresh gradient of hundreds of MiB costs its page faults on every step (a 768 MiB table's: about as long as the
    rest of the step); reusing last step's buffer avoids them. The buffer is taken again only while `table.grad` does
    not live in it (the optimizer dropped it, or it was added into an older gradient): a gradient kept elsewhere after
    `zero_grad()` (without `clone()`) would be overwritten by the next step.
    """
    entry = cache.get(name) if table is not None else None
    if entry is not None and entry.dtype == dtype and entry.numel() >= numel and not _lives_in(table.grad, entry):
        return entry[:numel]
    buffer = torch.empty(numel + numel // 8, dtype=dtype)  # 1/8 spare room: a sparse gradient's rows vary
    if table is not None:
        cache[name] = buffer
    return buffer[:numel]


def _lives_in(grad: torch.Tensor | None, buffer: torch.Tensor) -> bool:
    if grad is None:
        return False
    if grad.is_sparse:  # autograd drops the coalesced flag of the gradient it keeps: `values()` would refuse it
        grad = grad._values()  # (torch.sparse's documented accessor of an uncoalesced tensor's values)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    return start <= grad.data_ptr() < end


class PendingLookups:
    """The lookups of one table whose backward has not run yet, weakly held (a graph dropped without backward leaves
    nothing behind): a lookup whose gradient may join another's in flight (a table read twice in a step: shared by
    several memories) takes a fresh buffer, so that the reused one never holds a gradient autograd has yet to sum."""

    def __init__(self):
        self.lookups = {}

    def add(self, ctx):
        key, lookups = id(ctx), self.lookups
        lookups[key] = weakref.ref(ctx, lambda _: lookups.pop(key, None))

    def others(self, ctx) -> bool:
        self.lookups.pop(id(ctx), None)
        return any(ref() is not None for ref in list(self.lookups.values()))


def _csr(crow, col, values, size) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's once-per-process notice that sparse CSR support is in beta: noise here
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _sparse_rows(rows: torch.Tensor, values: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The coalesced sparse COO gradient of an `(n_rows, dim)` table from its sorted distinct `rows` and their values."""
    size = (n_rows, values.shape[1])
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, size, is_coalesced=True, check_invariants=False)


def csr_gradients(weight, indices, per_sample_weights, grad_output, sparse, needs, workspaces, table):
    """The gradients of `weight` (dense, or sparse over the rows used) and of `per_sample_weights` of
    `output[t] = sum_j per_sample_weights[t, j] * weight[indices[t, j]]`, for `needs = (weight?, per-sample weights?)`.

    The lookups sorted by row form a `(rows x tokens)` CSR matrix; the table gradient is that matrix times
    `grad_output` (one addmm, written straight into the reused buffer), and the per-sample-weight gradient the sampled
    product `dot(weight[indices[t, j]], grad_output[t])` over the same pattern (the table read in row order).
    `workspaces`, `table`: where the gradient buffer is kept, the parameter whose `.grad` may live in it
    ([`reusable_buffer`]).
    """
    grad_output = grad_output.contiguous()
    (n_rows, dim), tokens, flat = weight.shape, indices.shape[0], indices.reshape(-1)
    sorted_rows, order = flat.sort(stable=True)
    index_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
    columns = torch.div(order, indices.shape[1], rounding_mode="floor").to(index_dtype)
    entries = per_sample_weights.reshape(-1)[order].to(grad_output.dtype)

    def matrix(counts):
        crow = torch.zeros(counts.numel() + 1, dtype=index_dtype)
        torch.cumsum(counts, 0, dtype=index_dtype, out=crow[1:])
        return _csr(crow, columns, entries, (counts.numel(), tokens))

    grad_weight = grad_per_sample_weights = None
    if needs[1]:
        counts = torch.bincount(flat, minlength=n_rows)
        if counts.numel() and int(counts.max()) > tokens:  # sampled_addmm refuses a row with more entries than columns
            rows = weight[indices].to(grad_output.dtype)
            grad_per_sample_weights = (rows * grad_output[:, None]).sum(-1)
        else:
            dots = torch.sparse.sampled_addmm(matrix(counts), weight, grad_output.t(), beta=0.0).values()
            grad_per_sample_weights = torch.empty_like(dots).index_copy_(0, order, dots).view(indices.shape)
    if needs[0] and not sparse:
        out = reusable_buffer(workspaces, "dense", n_rows * dim, grad_output.dtype, table).view(n_rows, dim)
        grad_weight = torch.addmm(out, matrix(torch.bincount(flat, minlength=n_rows)), grad_output, beta=0, out=out)
    elif needs[0]:
        rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        out = reusable_buffer(workspaces, "sparse", rows.numel() * dim, grad_output.dtype, table).view(-1, dim)
        grad_weight = _sparse_rows(rows, torch.addmm(out, matrix(counts), grad_output, beta=0, out=out), n_rows)
    return grad_weight, grad_per_sample_weights


class WeightedRowSum(torch.autograd.Function):
    """`F.embedding_bag(indices, weight, mode="sum", per_sample_weights=...)` for 2-d `indices`, with the backward of
    [`csr_gradients`] (CPU fp32/fp64); `sparse`: the table gradient over the rows used; `values`: the
    `ProductKeyValues` read (its `weight`, the buffers it keeps and its [`PendingLookups`])."""

    @staticmethod
    def forward(ctx, weight, indices, per_sample_weights, sparse, values):
        ctx.save_for_backward(weight, indices, per_sample_weights)
        ctx.sparse, ctx.values = sparse, values
        values.pending.add(ctx)
        return F.embedding_bag(indices, weight, mode="sum", per_sample_weights=per_sample_weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        weight, indices, per_sample_weights = ctx.saved_tensors
        needs = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        values = ctx.values
        table = None if values.pending.others(ctx) else values.weight  # (None: a fresh buffer)
        grads = csr_gradients(weight, indices, per_sample_weights, grad_output, ctx.sparse, needs, values.workspaces, table)
        return grads[0], None, grads[1], None, None


# ----------------------------------------------------------------------------------------------------------------------
# Under torch.compile: the value read as one custom op (fake implementation, backward), so that a training step with a
# sparse value gradient is one graph (inductor fails on EmbeddingBag's sparse backward). Its backward is the CSR path on
# CPU fp32/fp64 (into a fresh buffer), elsewhere the same sums in plain torch ops.
# ----------------------------------------------------------------------------------------------------------------------

# in the op names: a changed op (signature or implementation: tests/compat/test_release.py checks
# tests/custom_ops.json) gets a new name, and another copy of this file (a model's remote code next to the installed
# package) reuses the ops one of them registered only when they are the same
OPS_VERSION = 3


def _custom_op(name: str, function, fake, backward=None, setup_context=None):
    """`torch.ops.pkm_bert.<name>_v<OPS_VERSION>` (registered once per process)."""
    versioned = f"{name}_v{OPS_VERSION}"
    if not hasattr(torch.ops.pkm_bert, versioned):
        op = torch.library.custom_op(f"pkm_bert::{versioned}", mutates_args=())(function)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.pkm_bert, versioned).default


def _row_sum(weight: torch.Tensor, indices: torch.Tensor, per_sample_weights: torch.Tensor, sparse: bool) -> torch.Tensor:
    return F.embedding_bag(indices, weight, mode="sum", per_sample_weights=per_sample_weights)


def _fake_row_sum(weight, indices, per_sample_weights, sparse):
    return weight.new_empty(indices.shape[0], weight.shape[1])


def _setup_row_sum(ctx, inputs, output):
    weight, indices, per_sample_weights, ctx.sparse = inputs
    ctx.save_for_backward(weight, indices, per_sample_weights)


def _row_sum_backward(ctx, grad_output):
    weight, indices, per_sample_weights = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_weight, grad_weights = row_sum_backward_op(grad_output, weight, indices, per_sample_weights, ctx.sparse, *needs)
    return (grad_weight if needs[0] else None), None, (grad_weights if needs[1] else None), None


def _row_sum_backward_impl(
    grad_output: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, per_sample_weights: torch.Tensor,
    sparse: bool, weight_grad: bool, per_sample_weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    needs = weight_grad, per_sample_weights_grad
    if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64) and grad_output.dtype == weight.dtype:
        # (no buffer reused: the op sees a graph input, not the parameter whose `.grad` tells when the buffer is free)
        grads = csr_gradients(weight, indices, per_sample_weights, grad_output, sparse, needs, {}, None)
    else:
        grads = _plain_gradients(weight, indices, per_sample_weights, grad_output, sparse, needs)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (weight, per_sample_weights)))


def _plain_gradients(weight, indices, per_sample_weights, grad_output, sparse, needs):
    """The gradients of [`csr_gradients`] in plain torch ops (other devices and dtypes)."""
    flat, grad_weight, grad_per_sample_weights = indices.reshape(-1), None, None
    grad_output = grad_output.to(weight.dtype)
    if needs[1]:
        grad_per_sample_weights = (weight[indices] * grad_output[:, None]).sum(-1).to(per_sample_weights.dtype)
    if needs[0]:
        contributions = (grad_output[:, None] * per_sample_weights[..., None].to(weight.dtype)).reshape(flat.numel(), -1)
        if sparse:
            rows, slots = torch.unique(flat, return_inverse=True)
            summed = contributions.new_zeros(rows.numel(), weight.shape[1]).index_add_(0, slots, contributions)
            grad_weight = _sparse_rows(rows, summed, weight.shape[0])
        else:
            grad_weight = torch.zeros_like(weight).index_add_(0, flat, contributions)
    return grad_weight, grad_per_sample_weights


def _fake_row_sum_backward(grad_output, weight, indices, per_sample_weights, sparse, weight_grad, psw_grad):
    grad_per_sample_weights = per_sample_weights.new_empty(per_sample_weights.shape if psw_grad else 0)
    if not weight_grad:
        return weight.new_empty(0), grad_per_sample_weights
    if not sparse:
        return weight.new_empty(weight.shape), grad_per_sample_weights
    # the distinct rows read are known only from the data, and a sparse tensor cannot carry an unbacked size out of a
    # graph: its bound, the number of lookups (the gradient leaves the graph straight to autograd's sum)
    rows = indices.numel()
    grad_weight = _sparse_rows(weight.new_empty(rows, dtype=torch.int64), weight.new_empty(rows, weight.shape[1]), weight.shape[0])
    return grad_weight, grad_per_sample_weights


row_sum_op = _custom_op("weighted_row_sum", _row_sum, _fake_row_sum, _row_sum_backward, _setup_row_sum)
row_sum_backward_op = _custom_op("weighted_row_sum_backward", _row_sum_backward_impl, _fake_row_sum_backward)
