"""The fast paths of `product_key_memory.py` (shipped with it as remote code): autograd functions whose backward is
cheaper than torch's generic one, the buffers they reuse between steps, and the CSR helpers. Each path computes what
the reference torch ops compute (tests/test_performance_paths.py compares them); the switches below choose.

Switches, the one place they are documented: class or module attributes (set one to compare a path with its
reference), an environment variable, and the input checks. `name = default`: what it does; then the other setting.

- `ProductKeyValues.fused_backward = True`: `WeightedRowSum` (compiled: the custom op `weighted_row_sum_v1`), the value
  and per-sample-weight gradients in the cheapest path for the device and size (below). False: EmbeddingBag's backward
  through autograd.
- `ProductKeyValues.triton_devices = ()`: device types whose gathers run in the Triton ops `torch.ops.pkm_bert.bag_sum`,
  `row_sum_backward` and `row_dots` (`kernels/triton_gathers.py`, registered on CUDA, and on CPU under
  `TRITON_INTERPRET=1`). Empty: EmbeddingBag's kernels.
- `TRITON_FUSED_BACKWARD = True` (this module): with `triton_devices`, the value backward is one pass of
  `torch.ops.pkm_bert.row_sum_backward` (both gradients; the table's by fp32 atomics, into the used rows for a sparse
  gradient). False: a sort by row, `bag_sum` over the rows' segments and `row_dots`.
- `CPU_SPARSE_KERNELS = True` (this module): the CPU fp32/fp64 value backward in torch's sparse CSR kernels. False:
  the EmbeddingBag-style kernels used elsewhere (on GPUs: EmbeddingBag's dense backward, sorted segments for a sparse
  gradient).
- `SMALL_LOOKUP_ELEMENTS = 65536` (this module): up to this many elements of looked-up rows (lookups x v_dim) a step
  is host-bound on any device, and the value backward is EmbeddingBag's own (one op per gradient, a sparse one
  coalesced). 0: the paths above at every size.
- `DENSE_SCORE_GRADIENT_CPU_LIMIT = 1048576` (this module): `ProductKeySearch`'s backward scatters a dense sub-key
  score gradient and multiplies it out (two bmm) on GPUs, and on CPU up to this many multiply-adds; above, it goes
  through the selected sub-keys only. 0: the latter on CPU at every size.
- `TORCH_AUTOGRAD_WHEN_HOST_BOUND = True` (this module): where a step costs host time rather than arithmetic (on GPUs,
  and on CPU up to `SMALL_LOOKUP_ELEMENTS` for the value lookup and `DENSE_SCORE_GRADIENT_CPU_LIMIT` for the search),
  the search and a dense value lookup of a table read by one memory differentiate through torch's own autograd nodes
  (C++: no Python runs in their backward) instead of `ProductKeySearch` and `WeightedRowSum`: the value lookup in the
  same kernels, the search in the reference ops (`fused_search_backward = False`). False: the fused nodes at every size.
- `ONE_NODE_WHEN_HOST_BOUND = ("dense", "sparse")` (this module): with `TORCH_AUTOGRAD_WHEN_HOST_BOUND`, the kinds of
  table gradient for which, where both the search and the value lookup are host-bound and the memory reads its own
  `ProductKeyValues` (no Triton device, no hooks, not shared), the search, the score weights and the lookup are one
  autograd node, `HostBoundLookup`: fewer ops (dense 82 instead of 87 a step, sparse 91 instead of 98) and fewer that
  launch a kernel on a GPU (36 instead of 41; 38 instead of 43); on CPU a sparse step takes less host time, a dense
  one up to 5% more (the overhead section of run_benchmarks): a bet on the launches that a GPU run settles. `()`:
  torch's own node for each op of the search, and the lookup's own node (`gpu_layer_compile.py` times both ways).
- `ProductKeyMemory.prune_candidates = True`: only the `(a + 1) * (b + 1) <= knn` pairs of the halves' top-knn lists
  are scored (exact). False: all `knn ** 2` pairs, as XLM (and no native selection).
- `ProductKeyMemory.fused_search_backward = True`: `ProductKeySearch`, the search as one autograd node (under
  torch.compile the custom op `torch.ops.pkm_bert.product_key_search_v1`) whose backward goes through the `knn`
  selected sub-keys only. False: torch's own backward of the bmm, top-k and candidate sums.
- `ProductKeyMemory.native_search = True`: fp32 on CPU, the selection in the native op
  `torch.ops.pkm_bert.select_product_keys` once registered. False: the torch ops.
- `PKM_BERT_NATIVE=0` (or `false`, `no`, `off`; an environment variable, read when `modeling_pkm_bert` registers its
  kernels, `kernels/cpu.py`): that native op is never registered, so `native_search` finds none. Unset: registered,
  built with the system C compiler (without one it computes the same with the torch ops).
- `ProductKeyMemory.trace_training_lookup = True`: under torch.compile, a lookup that needs gradients is traced: the
  search and the value lookup are the custom ops `product_key_search_v1` and `weighted_row_sum_v1` (one node each, with
  the fused backward paths, sparse value gradients included), so a training step compiles with `fullgraph=True`.
  False: the lookup runs eagerly (one graph break per memory).
- `BertPkmModel.validate_input_values = True` (`modeling_bert_pkm.py`): the model's input check also reads the ids'
  values (in range of their embedding tables; one host sync per forward). False: shapes only, which are always
  checked. The memory's own training check (`ProductKeyMemory._check_batch_statistics`: non-finite queries, fewer
  than 2 real tokens) has no switch. Compiled and exported graphs hold neither data-dependent check.

Imports torch only (remote code: no other module of the package).
"""

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

_CANDIDATE_PAIRS: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def candidate_pairs(knn: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ranks `(a, b)` in the two halves' descending top-`knn` lists whose sum can be among the best `knn` products.

    Pair `(a, b)` is matched or beaten by every pair `(a', b')` with `a' <= a` and `b' <= b`, that is by
    `(a + 1) * (b + 1) - 1` others, so only pairs with `(a + 1) * (b + 1) <= knn` can make the top `knn`:
    119 of the 1024 pairs for `knn=32` (about `knn * ln(knn)`).
    """
    if knn not in _CANDIDATE_PAIRS:
        pairs = [(a, b) for a in range(knn) for b in range(knn // (a + 1))]
        _CANDIDATE_PAIRS[knn] = tuple(a for a, _ in pairs), tuple(b for _, b in pairs)
    return _CANDIDATE_PAIRS[knn]


def _reusable_buffer(
    cache: dict, name: str, numel: int, dtype: torch.dtype, device: torch.device, spare: float = 0.0
) -> torch.Tensor:
    """A flat CPU buffer of `numel` elements, the previous one when nothing else holds it any more.

    A fresh allocation of hundreds of MiB costs its page faults on every step on CPU (a 768 MiB value gradient: as
    long as the whole step); reusing the last step's buffer, once the optimizer has dropped the gradient that lived
    in it, avoids them. A buffer still referenced elsewhere (a kept `.grad`, gradient accumulation) is never reused:
    a new one is made and kept instead. `spare`: extra room for sizes that vary from step to step.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or cache is None:  # no way to tell whether the last buffer is free, or no cache: a new one
        return torch.empty(numel, dtype=dtype, device=device)
    entry = cache.get(name)
    if entry is not None:
        buffer, free_count = entry
        if (
            buffer.dtype == dtype
            and buffer.device == device
            and buffer.numel() >= numel
            and use_count(buffer.untyped_storage()._cdata) == free_count
        ):
            return buffer[:numel]
    buffer = torch.empty(numel + int(numel * spare), dtype=dtype, device=device)
    cache[name] = (buffer, use_count(buffer.untyped_storage()._cdata))
    return buffer[:numel]


# CPU fp32/fp64: torch's sparse CSR kernels for the value backward (False: the EmbeddingBag-style kernels used elsewhere)
CPU_SPARSE_KERNELS = True
# with Triton gathers: the value backward in one pass of `row_sum_backward` (False: sort, `bag_sum` and `row_dots`)
TRITON_FUSED_BACKWARD = True


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's once-per-process notice that sparse CSR support is in beta: noise here
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


class SharedGradient:
    """What the value gradient of a table needs across its lookups of one backward pass (memories sharing the table).

    Autograd would add each lookup's gradient out of place into a fresh table-sized buffer; instead every lookup but
    the last one the pass differentiates leaves its gradient here (`partial`, per backward pass and weight) and the
    next one adds its row sums into it, so the table's gradient is one reused buffer. `lookups`: the lookups not yet
    differentiated, weakly held (a graph dropped without backward leaves nothing behind).
    """

    def __init__(self):
        self.lookups = {}  # id(ctx) -> weakref to ctx
        self.partial = {}  # (graph task id, weight key) -> (gradient so far, position of each table row in a sparse one)

    def add(self, ctx):
        key, lookups = id(ctx), self.lookups
        lookups[key] = weakref.ref(ctx, lambda _: lookups.pop(key, None))


_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)


def _pending_lookups(ctx) -> list:
    """The other lookups of ctx's weight that the running backward pass is still to differentiate."""
    lookups = ctx.shared.lookups
    lookups.pop(id(ctx), None)
    if _current_graph_task_id is None or _will_engine_execute_node is None:
        return []
    others = (ref() for ref in list(lookups.values()))  # (a DataParallel replica reads its own copy of the weight)
    return [n for n in others if n is not None and n.weight_key == ctx.weight_key and _will_engine_execute_node(n)]


class WeightedRowSum(torch.autograd.Function):
    """`output[t] = sum_j per_sample_weights[t, j] * weight[indices[t, j]]`, with a cheaper backward than EmbeddingBag's.

    The lookups are sorted by row once; then
    - the weight gradient (row r: the sum of `per_sample_weight * grad_output[token]` over the lookups of r) is a
      (rows x tokens) sparse matrix times `grad_output`: the coalesced rows only, as a sparse COO tensor (`sparse=True`),
      or all rows, dense (`sparse=False`), without a separate zero-fill and scatter;
    - the gradient of each per-sample weight, `dot(weight[indices[t, j]], grad_output[t])`, is a sampled matrix
      product over the same pattern, which reads the value rows in ascending order.
    The paths ([`row_sum_gradients`] chooses): on CPU in fp32/fp64, torch's sparse CSR kernels, for a dense
    ([`_dense_csr_backward`]) or a sparse ([`_sparse_csr_backward`]) weight gradient; with `triton`, one pass of
    `torch.ops.pkm_bert.row_sum_backward` (`kernels/triton_gathers.py`); elsewhere, and at sizes up to
    `SMALL_LOOKUP_ELEMENTS` where a step is host-bound, EmbeddingBag's own kernels, one op per gradient (a large sparse
    gradient by sorted segments) ([`_row_sums_backward`]).
    """

    @staticmethod
    def forward(ctx, weight, indices, per_sample_weights, sparse, workspaces, triton=False, shared=None):
        ctx.save_for_backward(weight, indices, per_sample_weights)
        ctx.sparse, ctx.workspaces, ctx.triton, ctx.shared = sparse, workspaces, triton, shared
        if shared is not None and ctx.needs_input_grad[0]:
            ctx.weight_key, ctx.indices = (weight.device, weight.data_ptr()), indices
            shared.add(ctx)
        ctx.bags = None
        if triton:
            return triton_bag_sum(weight, indices, per_sample_weights)
        ctx.bags = bag_layout(indices)  # kept for a dense gradient in EmbeddingBag's own backward (no CSR kernels)
        return torch.embedding_bag(
            weight, indices.reshape(-1), ctx.bags[0], False, 0, False, per_sample_weights.reshape(-1), False, None
        )[0]

    @staticmethod
    def backward(ctx, grad_output):
        weight, indices, per_sample_weights = ctx.saved_tensors
        grad_weight, grad_per_sample_weights = row_sum_gradients(ctx, weight, indices, per_sample_weights, grad_output)
        return grad_weight, None, grad_per_sample_weights, None, None, None, None


def row_sum_gradients(ctx, weight, indices, per_sample_weights, grad_output):
    """The gradients of `weight` and `per_sample_weights` that `ctx.needs_input_grad[0]` and `[2]` ask for (None for the
    others), in the path that suits the device and dtypes (see [`WeightedRowSum`])."""
    grad_output = grad_output.contiguous()
    so_far = _TableGradientSoFar(ctx)
    small = indices.numel() * weight.shape[1] <= SMALL_LOOKUP_ELEMENTS
    if ctx.triton and TRITON_FUSED_BACKWARD:
        backward = _fused_triton_backward
    elif _csr_kernels(ctx, weight, grad_output.dtype) and not small:
        backward = _sparse_csr_backward if ctx.sparse else _dense_csr_backward
    else:
        backward = _row_sums_backward
    return backward(ctx, weight, indices, per_sample_weights, grad_output, so_far)


# up to this many elements of looked-up rows (lookups x v_dim), the value backward is EmbeddingBag's own (one op for each
# gradient, a sparse one coalesced): at such sizes a step is host-bound on every device, and fewer ops win
SMALL_LOOKUP_ELEMENTS = 2**16
# where a step is host-bound (GPUs; CPU at the small sizes), torch's own autograd nodes for the search and a dense value
# lookup: a Python backward per phase (an autograd.Function) costs more host time than the ops it saves
TORCH_AUTOGRAD_WHEN_HOST_BOUND = True
# ...and for these kinds of table gradient, where both phases are host-bound and the table is the memory's own plain
# one, the whole read one node (`HostBoundLookup`): one Python backward in place of the lookup's own node and some twenty
# C++ nodes of the search; fewer ops and kernel launches (a dense step's CPU host time up to 5% above torch's nodes)
ONE_NODE_WHEN_HOST_BOUND = ("dense", "sparse")


def search_is_host_bound(device: torch.device, multiply_adds: int) -> bool:
    """Whether a search with sub-key scores of `multiply_adds` on `device` takes torch's own autograd nodes: on GPUs
    (launch-bound), on CPU up to `DENSE_SCORE_GRADIENT_CPU_LIMIT`; only with `TORCH_AUTOGRAD_WHEN_HOST_BOUND`."""
    return TORCH_AUTOGRAD_WHEN_HOST_BOUND and (device.type != "cpu" or multiply_adds <= DENSE_SCORE_GRADIENT_CPU_LIMIT)


def lookup_is_host_bound(device: torch.device, elements: int) -> bool:
    """Whether a value lookup of `elements` looked-up values on `device` takes EmbeddingBag's own autograd node (a
    dense gradient of a table read once): on GPUs, on CPU up to `SMALL_LOOKUP_ELEMENTS`; only with
    `TORCH_AUTOGRAD_WHEN_HOST_BOUND`."""
    return TORCH_AUTOGRAD_WHEN_HOST_BOUND and (device.type != "cpu" or elements <= SMALL_LOOKUP_ELEMENTS)


def read_is_host_bound(device: torch.device, multiply_adds: int, elements: int, sparse: bool) -> bool:
    """Whether a memory's read (sub-key scores of `multiply_adds`, `elements` looked-up values, a `sparse` table
    gradient or not) on `device` is one `HostBoundLookup` node, where the table allows: both phases host-bound and the
    kind of gradient in `ONE_NODE_WHEN_HOST_BOUND`."""
    one_node = ("sparse" if sparse else "dense") in ONE_NODE_WHEN_HOST_BOUND
    return one_node and search_is_host_bound(device, multiply_adds) and lookup_is_host_bound(device, elements)


def _csr_kernels(ctx, weight, dtype) -> bool:
    """Whether the value backward runs in torch's sparse CSR kernels: CPU, fp32/fp64 (`CPU_SPARSE_KERNELS`)."""
    on_cpu = CPU_SPARSE_KERNELS and not ctx.triton and weight.device.type == "cpu"
    return on_cpu and dtype in (torch.float32, torch.float64) and weight.dtype == dtype


_BAG_LAYOUTS: dict = {}


def bag_layout(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bags of 2-d `indices` (one bag of `indices.shape[1]` lookups per row) as EmbeddingBag's kernels take them:
    the offsets, the bag of each lookup and the bag sizes, made once per shape (not on every step: three small ops)."""
    tokens, bag = indices.shape
    key = (tokens, bag, indices.device)
    bags = _BAG_LAYOUTS.get(key)
    if bags is None or torch.compiler.is_compiling():
        if len(_BAG_LAYOUTS) >= 16:  # token counts vary with padding: a few recent shapes only
            _BAG_LAYOUTS.clear()
        with torch.inference_mode(False):  # kept for later steps, which may save them for backward
            bag_of_lookup = torch.arange(tokens, device=indices.device).repeat_interleave(bag)
            bag_size = torch.full((tokens,), bag, dtype=torch.int64, device=indices.device)
            bags = torch.arange(0, tokens * bag, bag, device=indices.device), bag_of_lookup, bag_size
        if not torch.compiler.is_compiling():
            _BAG_LAYOUTS[key] = bags
    return bags


class _TableGradientSoFar:
    """A lookup's view of its table's gradient in the running backward pass, for a table shared by several memories:
    `partial`, the gradient of the lookups this pass already differentiated (`position`: where each table row sits in a
    sparse one), taken out of `ctx.shared`, and `pending`, the lookups it is still to differentiate (then this lookup's
    gradient waits for them in `ctx.shared`). Nothing for a table read once."""

    def __init__(self, ctx):
        self.ctx, self.task, self.partial, self.position, self.pending = ctx, None, None, None, []
        if ctx.needs_input_grad[0] and ctx.shared is not None:
            self.pending = _pending_lookups(ctx)
            if _current_graph_task_id is not None:
                self.task = (_current_graph_task_id(), ctx.weight_key)
                self.partial, self.position = ctx.shared.partial.pop(self.task, (None, None))

    def total(self, grad_weight, partial, position=None):
        """The table gradient a lookup returns: None while other lookups of its table are `pending` in this pass (the
        gradient waits in `ctx.shared` for them), else the whole sum. `partial`: a gradient not yet added."""
        if partial is not None:  # a kind the in-place paths do not take: autograd's own out-of-place sum
            grad_weight, position = partial + grad_weight, None
        if self.pending and self.task is not None:
            self.ctx.shared.partial[self.task] = (grad_weight, position)
            return None
        return grad_weight


def _lookups_by_row(indices, per_sample_weights, dtype, csr=False):
    """The lookups `indices[t, j]` sorted by table row (stable), once for both gradients: the sorted rows, the order
    (where each sorted lookup sits in `indices.reshape(-1)`), the token of each and its per-sample weight in `dtype`.
    `csr`: the tokens in the index dtype of torch's CSR kernels."""
    sorted_rows, order = indices.reshape(-1).sort(stable=True)
    tokens_of_lookups = torch.div(order, indices.shape[1], rounding_mode="floor")
    weights_of_lookups = per_sample_weights.reshape(-1)[order].to(dtype)
    if csr:
        tokens_of_lookups = tokens_of_lookups.to(torch.int32 if indices.numel() < 2**31 else torch.int64)
    return sorted_rows, order, tokens_of_lookups, weights_of_lookups


def _lookup_matrix(counts, tokens_of_lookups, weights_of_lookups, tokens) -> torch.Tensor:
    """The sorted lookups as a `(len(counts), tokens)` CSR matrix: row i holds the next `counts[i]` lookups, each at its
    token's column with its per-sample weight."""
    index_dtype, device = tokens_of_lookups.dtype, tokens_of_lookups.device
    crow = torch.zeros(counts.numel() + 1, dtype=index_dtype, device=device)
    torch.cumsum(counts, 0, dtype=index_dtype, out=crow[1:])
    return _csr(crow, tokens_of_lookups, weights_of_lookups, (counts.numel(), tokens))


def _csr_per_sample_weight_gradient(lookups, weight, grad_output, order, indices, counts) -> torch.Tensor:
    """`dot(weight[indices[t, j]], grad_output[t])` of every lookup, a sampled product over the `(rows x tokens)` CSR
    matrix `lookups` (it reads the value rows in ascending order), put back in the lookups' own order."""
    if counts.numel() and int(counts.max()) > grad_output.shape[0]:
        # torch's sampled_addmm refuses a row with more entries than the matrix has columns: a row read more often
        # than there are tokens (a tiny memory, or a collapsed one whose heads all pick one slot); gathered instead
        dots = torch.empty(indices.shape, dtype=grad_output.dtype, device=grad_output.device)
        step = max(1, 2**24 // max(1, indices.shape[1] * weight.shape[1]))
        for start in range(0, indices.shape[0], step):
            rows = weight[indices[start : start + step]].to(grad_output.dtype)
            dots[start : start + step] = (rows * grad_output[start : start + step, None]).sum(-1)
        return dots
    dots = torch.sparse.sampled_addmm(lookups, weight, grad_output.t(), beta=0.0).values()
    return torch.empty_like(dots).index_copy_(0, order, dots).view(indices.shape)


def _dense_csr_backward(ctx, weight, indices, per_sample_weights, grad_output, so_far):
    """CPU fp32/fp64, a dense weight gradient: the `(rows x tokens)` CSR matrix of the lookups times `grad_output`,
    written straight into the buffer reused between steps, or added in place to the gradient of the table's lookups
    that this pass already differentiated."""
    n_rows, dim = weight.shape
    _, order, tokens_of_lookups, weights_of_lookups = _lookups_by_row(
        indices, per_sample_weights, grad_output.dtype, csr=True
    )
    counts = torch.bincount(indices.reshape(-1), minlength=n_rows)
    lookups = _lookup_matrix(counts, tokens_of_lookups, weights_of_lookups, indices.shape[0])
    grad_per_sample_weights = None
    if ctx.needs_input_grad[2]:
        grad_per_sample_weights = _csr_per_sample_weight_gradient(lookups, weight, grad_output, order, indices, counts)
    if not ctx.needs_input_grad[0]:
        return None, grad_per_sample_weights
    partial = so_far.partial
    if partial is not None and not partial.is_sparse:
        # partial + this lookup's row sums, bitwise the sum autograd forms (each row is summed first)
        grad_weight, partial = torch.addmm(partial, lookups, grad_output, out=partial), None
    else:
        out = _reusable_buffer(ctx.workspaces, "dense_grad", n_rows * dim, grad_output.dtype, weight.device)
        out = out.view(n_rows, dim)
        grad_weight = torch.addmm(out, lookups, grad_output, beta=0, out=out)
    return so_far.total(grad_weight, partial), grad_per_sample_weights


def _sparse_csr_backward(ctx, weight, indices, per_sample_weights, grad_output, so_far):
    """CPU fp32/fp64, a sparse weight gradient: the same product over the rows the lookups used only, as a coalesced
    COO tensor. For a table several memories read, the first lookup of a backward pass lays the gradient out over the
    rows of all of them, and the others add their row sums into it in place."""
    n_rows, dim = weight.shape
    tokens = indices.shape[0]
    sorted_rows, order, tokens_of_lookups, weights_of_lookups = _lookups_by_row(
        indices, per_sample_weights, grad_output.dtype, csr=True
    )
    grad_per_sample_weights = None
    if ctx.needs_input_grad[2]:
        counts = torch.bincount(indices.reshape(-1), minlength=n_rows)
        lookups = _lookup_matrix(counts, tokens_of_lookups, weights_of_lookups, tokens)
        grad_per_sample_weights = _csr_per_sample_weight_gradient(lookups, weight, grad_output, order, indices, counts)
        del lookups, counts
    if not ctx.needs_input_grad[0]:
        return None, grad_per_sample_weights
    rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    partial, position = so_far.partial, so_far.position
    layout = None  # (position of each table row among the gradient's rows, those rows)
    if partial is not None and partial.is_sparse and position is not None:
        union = partial._indices()[0]  # laid out for every lookup of this pass (checked)
        if bool((union[position[rows].clamp(min=0)] == rows).all()):
            layout = position, union
    elif partial is None and so_far.pending:  # the first lookup of a shared table: rows for all of them
        read = torch.zeros(n_rows, dtype=torch.bool, device=weight.device)
        read[rows] = True
        for node in so_far.pending:
            read[node.indices.reshape(-1)] = True
        layout = read.cumsum(0) - 1, read.nonzero().squeeze(1)
    if layout is not None:
        counts = counts.new_zeros(layout[1].numel()).index_copy_(0, layout[0][rows], counts)
        rows = layout[1]
    compact = _lookup_matrix(counts, tokens_of_lookups, weights_of_lookups, tokens)
    if layout is not None and partial is not None:  # partial + these row sums in place, as in the dense path
        out, partial = torch.addmm(partial._values(), compact, grad_output, out=partial._values()), None
    else:  # the number of rows used changes from step to step: 1/8 spare room
        size = rows.numel() * dim
        out = _reusable_buffer(ctx.workspaces, "sparse_grad", size, grad_output.dtype, weight.device, spare=0.125)
        out = out.view(rows.numel(), dim)
        out = torch.addmm(out, compact, grad_output, beta=0, out=out)
    grad_weight = _sparse_rows(rows, out, n_rows)
    return so_far.total(grad_weight, partial, layout[0] if layout is not None else None), grad_per_sample_weights


def _row_sums_backward(ctx, weight, indices, per_sample_weights, grad_output, so_far):
    """GPUs, other dtypes, `CPU_SPARSE_KERNELS = False`: the same sums in EmbeddingBag-style kernels, the Triton ops
    with `ctx.triton`, else EmbeddingBag's own: the rows of each used table row summed as one bag."""
    n_rows, dim = weight.shape
    tokens, bag = indices.shape
    device, flat = weight.device, indices.reshape(-1)
    bags = getattr(ctx, "bags", None)  # kept by the forward for the dense gradient
    grad_weight = grad_per_sample_weights = None
    if ctx.needs_input_grad[2] and ctx.triton:
        grad_per_sample_weights = torch.ops.pkm_bert.row_dots(weight, flat, grad_output, bag).view(tokens, bag)
        grad_per_sample_weights = grad_per_sample_weights.to(per_sample_weights.dtype)
    elif ctx.needs_input_grad[2]:
        if bags is not None:
            offsets, offset2bag = bags[:2]
        else:
            offsets = torch.arange(0, tokens * bag, bag, device=device)
            offset2bag = torch.arange(tokens, device=device).repeat_interleave(bag)
        grad_per_sample_weights = torch.ops.aten._embedding_bag_per_sample_weights_backward(
            grad_output, weight, flat, offsets, offset2bag, 0, -1
        ).view(tokens, bag)
    small = bags is not None and indices.numel() * dim <= SMALL_LOOKUP_ELEMENTS
    if ctx.needs_input_grad[0] and bags is not None and (small or not ctx.sparse):  # EmbeddingBag's own backward
        grad_weight = bag_weight_gradient(grad_output, weight, flat, per_sample_weights.reshape(-1), bags, ctx.sparse)
    elif ctx.needs_input_grad[0]:
        sorted_rows, _, tokens_of_lookups, weights_of_lookups = _lookups_by_row(
            indices, per_sample_weights, grad_output.dtype
        )
        used, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        ends = torch.cumsum(counts, 0)
        if ctx.triton:  # bags: the lookups of each used row; rows of the bags: tokens of grad_output
            bounds = F.pad(ends, (1, 0))
            grad_rows = torch.ops.pkm_bert.bag_sum(grad_output, tokens_of_lookups, weights_of_lookups, bounds)
        else:
            grad_rows = F.embedding_bag(
                tokens_of_lookups, grad_output, ends - counts, mode="sum", per_sample_weights=weights_of_lookups
            )
        grad_rows = grad_rows.to(weight.dtype)
        if ctx.sparse:
            grad_weight = _sparse_rows(used, grad_rows, n_rows)
        else:
            grad_weight = grad_rows.new_zeros(n_rows, dim).index_copy_(0, used, grad_rows)
    return so_far.total(grad_weight, so_far.partial), grad_per_sample_weights


def bag_weight_gradient(grad_output, weight, flat_indices, flat_weights, bags, sparse: bool) -> torch.Tensor:
    """The table gradient of a lookup in bags of `bags` ([`bag_layout`]) in EmbeddingBag's own kernel: dense, or with
    `sparse` the coalesced rows used (the dense kernel over their slots), in the table's dtype."""
    _, offset2bag, bag_size = bags
    if sparse:  # (the maximum indices of mode "max", here bag_size: unused in mode "sum")
        used, slots = torch.unique(flat_indices, return_inverse=True)
        grad_rows = torch.ops.aten._embedding_bag_dense_backward(
            grad_output, slots, offset2bag, bag_size, bag_size, used.numel(), False, 0, flat_weights, -1
        )
        return _sparse_rows(used, grad_rows.to(weight.dtype), weight.shape[0])
    return torch.ops.aten._embedding_bag_dense_backward(
        grad_output, flat_indices, offset2bag, bag_size, bag_size, weight.shape[0], False, 0, flat_weights, -1
    ).to(weight.dtype)


def _fused_triton_backward(ctx, weight, indices, per_sample_weights, grad_output, so_far):
    """With `ctx.triton`: both gradients from one pass over the lookups (`torch.ops.pkm_bert.row_sum_backward`); a
    sparse table gradient goes to the coalesced rows (slot of each lookup: the inverse of `torch.unique`)."""
    tokens, bag = indices.shape
    flat, table_grad, weights_grad = indices.reshape(-1), ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    used, slots = torch.unique(flat, return_inverse=True) if table_grad and ctx.sparse else (None, None)
    grad_weight, grad_per_sample_weights = torch.ops.pkm_bert.row_sum_backward(
        grad_output, weight, flat, per_sample_weights.reshape(-1), bag, table_grad, weights_grad,
        slots, -1 if used is None else used.numel(),
    )  # fmt: skip
    if table_grad and ctx.sparse:
        grad_weight = _sparse_rows(used, grad_weight, weight.shape[0])
    grad_weight = grad_weight if table_grad else None
    grad_per_sample_weights = grad_per_sample_weights.view(tokens, bag) if weights_grad else None
    return so_far.total(grad_weight, so_far.partial), grad_per_sample_weights


def triton_bag_sum(weight: torch.Tensor, indices: torch.Tensor, per_sample_weights: torch.Tensor) -> torch.Tensor:
    """`F.embedding_bag(indices, weight, mode="sum", per_sample_weights=...)` for 2-d `indices`, in the Triton op."""
    tokens, bag = indices.shape
    bounds = torch.arange(0, tokens * bag + 1, bag, device=indices.device)
    return torch.ops.pkm_bert.bag_sum(weight, indices.reshape(-1), per_sample_weights.reshape(-1), bounds)


class ProductKeySearch(torch.autograd.Function):
    """The exact top-`knn` product keys of every head, one autograd node: queries `(tokens, ...)` (each token's
    `heads * 2` halves of `half` values, in any trailing shape) and sub-keys `(heads, 2, n_keys, half)` -> scores and
    indices `(tokens, heads, knn)`.

    The forward scores the sub-keys (one bmm) and selects ([`select_product_keys`]) without recording anything, the
    reshapes included; the score of product key `i1 * n_keys + i2` is the sum of sub-key scores `i1` (first half) and
    `i2` (second half), so its gradient goes to those two, then to the queries and sub-keys
    ([`query_and_key_gradients`]), returned in the inputs' own shapes.
    """

    @staticmethod
    def forward(ctx, queries, keys, knn, prune=True, native=True):
        scores, indices, subkeys = select_product_keys(subkey_scores(queries, keys), knn, prune, native, True)
        ctx.save_for_backward(queries, keys, subkeys)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)  # no zeros made for the indices' gradient
        return scores, indices

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_scores, _grad_indices):
        queries, keys, subkeys = ctx.saved_tensors
        grads = query_and_key_gradients(ctx.needs_input_grad[:2], queries, keys, subkeys, grad_scores)
        return *grads, None, None, None


class HostBoundLookup(torch.autograd.Function):
    """The memory's whole read as one autograd node, where a step is host-bound (`ONE_NODE_WHEN_HOST_BOUND`): queries
    `(tokens, ...)` and sub-keys `(heads, 2, n_keys, half)` as [`ProductKeySearch`] takes them, and the value table
    `weight` -> `(tokens, v_dim)`, what the search, the score weights in fp32 (`activation`: softmax over each head's
    `knn` scores, or relu) and `EmbeddingBag(mode="sum")` compute.

    Nothing is recorded in the forward; the backward is one Python call of some twenty ops: EmbeddingBag's own kernels
    for the table (a `sparse` gradient coalesced) and the per-sample weights, the activation's backward, and the query
    and sub-key gradients of [`query_and_key_gradients`], in place of some thirty autograd nodes (views, top-k,
    candidate sums, softmax, EmbeddingBag), each dispatched and bookkept on the host.
    """

    @staticmethod
    def forward(ctx, queries, keys, weight, knn, prune, native, activation, sparse):
        scores, indices, subkeys = select_product_keys(subkey_scores(queries, keys), knn, prune, native, True)
        probabilities = torch.softmax(scores, -1, torch.float32) if activation == "softmax" else torch.relu(scores.float())
        flat, lookup_weights = indices.view(-1), probabilities.view(-1).to(weight.dtype)
        bags = bag_layout(indices.flatten(1))
        output = torch.embedding_bag(weight, flat, bags[0], False, 0, False, lookup_weights, False, None)[0]
        ctx.save_for_backward(queries, keys, weight, flat, subkeys, probabilities, lookup_weights)
        ctx.bags, ctx.activation, ctx.sparse = bags, activation, sparse
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        queries, keys, weight, flat, subkeys, probabilities, lookup_weights = ctx.saved_tensors
        grad_output, (offsets, offset2bag, _) = grad_output.contiguous(), ctx.bags
        grad_weight = grad_queries = grad_keys = None
        if ctx.needs_input_grad[2]:
            grad_weight = bag_weight_gradient(grad_output, weight, flat, lookup_weights, ctx.bags, ctx.sparse)
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return grad_queries, grad_keys, grad_weight, None, None, None, None, None
        grad_probabilities = torch.ops.aten._embedding_bag_per_sample_weights_backward(
            grad_output, weight, flat, offsets, offset2bag, 0, -1
        ).view(probabilities.shape)
        if ctx.activation == "softmax":
            grad_scores = torch._softmax_backward_data(grad_probabilities.float(), probabilities, -1, torch.float32)
        else:
            grad_scores = torch.ops.aten.threshold_backward(grad_probabilities.float(), probabilities, 0)
        grad_queries, grad_keys = query_and_key_gradients(ctx.needs_input_grad[:2], queries, keys, subkeys, grad_scores)
        return grad_queries, grad_keys, grad_weight, None, None, None, None, None


def subkey_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`(heads * 2, tokens, n_keys)`: each query half scored against its head-half's sub-keys (one bmm)."""
    groups, n_keys, half = keys.shape[0] * keys.shape[1], keys.shape[2], keys.shape[3]
    return torch.bmm(queries.reshape(-1, groups, half).transpose(0, 1), keys.reshape(groups, n_keys, half).transpose(1, 2))


# a dense sub-key score gradient up to this many multiply-adds (groups * tokens * n_keys * half) on CPU: below, its two
# bmm cost less than the dozen small ops of the sparse one (a GPU takes the dense one at every size: its ops are cheap,
# their launches are not)
DENSE_SCORE_GRADIENT_CPU_LIMIT = 2**20


def query_and_key_gradients(needs_input_grad, queries, keys, subkeys, grad_scores):
    """Gradients of queries `(tokens, ...)` and sub-keys `(heads, 2, n_keys, half)` from those of the product-key scores
    `(tokens, heads, knn)` of the selected `subkeys` `(tokens, heads, 2, knn)`, in the inputs' shapes (None where not
    needed, or where the scores got no gradient).

    The score of product key `i1 * n_keys + i2` is the sum of sub-key scores `i1` (first half) and `i2` (second half),
    so its gradient goes to those two: scattered into the dense sub-key score gradient and multiplied out (two bmm) on
    GPUs, and on CPU up to `DENSE_SCORE_GRADIENT_CPU_LIMIT` multiply-adds; above, through the selected sub-keys only
    ([`_subkey_score_gradients`]).
    """
    if grad_scores is None:
        return None, None
    heads, _, n_keys, half = keys.shape
    tokens, groups = subkeys.shape[0], heads * 2
    grad_subkey_scores = grad_scores.to(queries.dtype).unsqueeze(2).expand(-1, -1, 2, -1)  # (tokens, heads, 2, knn)
    halves, grad_queries, grad_keys = queries.reshape(tokens, groups, half).transpose(0, 1), None, None
    if queries.device.type != "cpu" or groups * tokens * n_keys * half <= DENSE_SCORE_GRADIENT_CPU_LIMIT:
        dense = queries.new_zeros(tokens, heads, 2, n_keys).scatter_add_(-1, subkeys, grad_subkey_scores)
        dense = dense.view(tokens, groups, n_keys).transpose(0, 1)  # (heads * 2, tokens, n_keys)
        if needs_input_grad[0]:
            grad_queries = torch.bmm(dense, keys.view(groups, n_keys, half)).transpose(0, 1).reshape(queries.shape)
        if needs_input_grad[1]:
            grad_keys = torch.bmm(dense.transpose(1, 2), halves).view(keys.shape)
        return grad_queries, grad_keys
    subkeys, grad_subkey_scores = (t.flatten(1, 2).transpose(0, 1) for t in (subkeys, grad_subkey_scores))
    grad_halves, grad_keys = _subkey_score_gradients(
        needs_input_grad, halves, keys.reshape(groups, n_keys, half), subkeys, grad_subkey_scores
    )
    return (
        grad_halves.transpose(0, 1).reshape(queries.shape) if grad_halves is not None else None,
        grad_keys.view(keys.shape) if grad_keys is not None else None,
    )


def select_product_keys(
    subkey_scores: torch.Tensor, knn: int, prune: bool = True, native: bool = True, with_subkeys: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The best `knn` product keys from the sub-key scores `(heads * 2, tokens, n_keys)`: scores, indices
    `(tokens, heads, knn)` and the sub-keys of each half `(tokens, heads, 2, knn)` that the backward needs, which the
    torch path has at no cost (None from the native op unless `with_subkeys`). The native op on fp32 CPU scores where
    registered (`native`, pruned pairs), else each half's top-`knn` combined by [`combine_halves`]."""
    select = native_selection(subkey_scores) if native and prune else None
    if select is not None:
        scores, indices = select(subkey_scores, knn)
        return scores, indices, split_product_keys(indices, subkey_scores.shape[-1]) if with_subkeys else None
    return combine_halves(*top_subkeys(subkey_scores, knn), subkey_scores.shape[-1], knn, prune)


def _subkey_score_gradients(needs_input_grad, halves, keys, indices, grad_scores):
    """Gradients of `halves` and `keys` from those of the selected sub-key scores `bmm(halves, keys^T)[g, t, indices]`.

    The query gradient sums the `knn` selected sub-keys of each row (an EmbeddingBag) and the key gradient sums, per
    sub-key, the queries that selected it (an EmbeddingBag over the selections sorted by key); a sub-key selected twice
    in a row counts twice.
    """
    groups, tokens, half = halves.shape
    n_keys, knn = keys.shape[1], indices.shape[-1]
    # rows of keys.reshape(groups * n_keys, half)
    rows = (indices + _group_offsets(groups, n_keys, indices.device)).reshape(-1, knn)
    grad_scores = grad_scores.reshape(-1, knn).to(keys.dtype)
    grad_halves = grad_keys = None
    if needs_input_grad[0]:
        grad_halves = F.embedding_bag(rows, keys.reshape(-1, half), mode="sum", per_sample_weights=grad_scores)
        grad_halves = grad_halves.view(groups, tokens, half)
    if needs_input_grad[1]:
        flat = rows.reshape(-1)
        _, order = flat.sort(stable=True)
        counts = torch.bincount(flat, minlength=groups * n_keys)
        grad_keys = F.embedding_bag(
            torch.div(order, knn, rounding_mode="floor"),
            halves.reshape(groups * tokens, half).to(keys.dtype),
            torch.cumsum(counts, 0) - counts,
            mode="sum",
            per_sample_weights=grad_scores.reshape(-1)[order],
        ).view(groups, n_keys, half)
    return grad_halves, grad_keys


_CONSTANTS: dict = {}


def _constant(key, make) -> torch.Tensor:
    """A small index tensor made once per device (not from Python lists on every step: each would cost its copies);
    made afresh while tracing (a constant of the graph, never a fake tensor kept)."""
    if torch.compiler.is_compiling():
        return make()
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        with torch.inference_mode(False):  # made under inference_mode, it could not be saved for a later backward
            tensor = _CONSTANTS[key] = make()
    return tensor


def _group_offsets(groups: int, n_keys: int, device) -> torch.Tensor:
    """`(groups, 1, 1)`: where each head-half's sub-keys start in the flat `(groups * n_keys, half)` keys."""
    make = lambda: torch.arange(0, groups * n_keys, n_keys, device=device).view(groups, 1, 1)  # noqa: E731
    return _constant(("group_offsets", groups, n_keys, device), make)


def _candidate_ranks(knn: int, prune: bool, device) -> torch.Tensor:
    """`(2, candidates)`: the ranks in each half's top-`knn` of every candidate pair (`candidate_pairs` with `prune`,
    else all `knn ** 2`)."""

    def make():
        pairs = candidate_pairs(knn) if prune else tuple(zip(*((a, b) for a in range(knn) for b in range(knn))))
        return torch.tensor(pairs, device=device)

    return _constant(("candidate_ranks", knn, prune, device), make)


def combine_halves(
    half_scores: torch.Tensor, half_indices: torch.Tensor, n_keys: int, knn: int, prune: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `knn` product keys from each half's sorted top-`knn` `(tokens, heads, 2, knn)` ([`top_subkeys`]):
    scores and indices `(tokens, heads, knn)`, and the sub-keys of each half `(tokens, heads, 2, knn)` (product key
    `i1 * n_keys + i2`).

    A product key is the concatenation of its two sub-keys, so its score is the sum of the halves' scores; with
    `prune`, only the rank pairs `(a, b)` with `(a + 1) * (b + 1) <= knn` are scored (exact), else all `knn ** 2`, as XLM.
    The pruned candidates' scores are one gather of both halves; the sub-keys are gathered for the best only, through
    their ranks.
    """
    ranks = _candidate_ranks(knn, prune, half_scores.device).expand(*half_scores.shape[:2], -1, -1)
    if prune:
        candidate_scores = half_scores.gather(-1, ranks).sum(2)
    else:  # every pair, candidate a * knn + b: broadcast, without a gathered copy of the halves
        first, second = half_scores.unbind(2)
        candidate_scores = (first[..., :, None] + second[..., None, :]).flatten(-2)
    scores, best = candidate_scores.topk(knn, dim=-1)
    subkeys = half_indices.gather(-1, ranks.gather(-1, best.unsqueeze(2).expand(-1, -1, 2, -1)))
    first, second = subkeys.unbind(2)
    return scores, torch.add(second, first, alpha=n_keys), subkeys


def top_subkeys(subkey_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each half's top-`knn` sub-keys from the sub-key scores `(heads * 2, tokens, n_keys)`: scores and indices
    `(tokens, heads, 2, knn)`, contiguous (the top-k of a permuted view comes out in its layout)."""
    groups, tokens, n_keys = subkey_scores.shape  # (no -1: a process may have 0 tokens)
    return subkey_scores.view(groups // 2, 2, tokens, n_keys).permute(2, 0, 1, 3).topk(knn, dim=-1)


def split_product_keys(indices: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The sub-keys `(..., 2, knn)` of product keys `indices` `(..., knn)`: `i1 * n_keys + i2` -> `(i1, i2)`."""
    return torch.stack((indices.div(n_keys, rounding_mode="floor"), indices.remainder(n_keys)), -2)


def native_selection(subkey_scores: torch.Tensor):
    """`torch.ops.pkm_bert.select_product_keys` for fp32 CPU scores once `modeling_pkm_bert` registered it, else None.

    Never under `torch.export`: an exported program (and the ONNX made from it) holds standard ops only, so that it runs
    where this package is not installed."""
    if subkey_scores.dtype != torch.float32 or subkey_scores.device.type != "cpu" or is_exporting():
        return None
    return getattr(torch.ops.pkm_bert, "select_product_keys", None)


def _sparse_rows(rows: torch.Tensor, values: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The sparse COO gradient of a `(n_rows, dim)` table from its sorted distinct `rows` and their `values`."""
    return torch.sparse_coo_tensor(
        rows.unsqueeze(0), values, (n_rows, values.shape[1]), is_coalesced=True, check_invariants=False
    )


# ----------------------------------------------------------------------------------------------------------------------
# The two phases as torch.library custom ops, for torch.compile: the search and the value lookup are each one node of
# the graph, with a fake (meta) implementation and a backward that is the fused path above (sparse value gradients
# included), so that a compiled training step is one graph. Eager calls use the autograd functions above, which run the
# same code without the op's dispatch; torch.export never sees these ops (an exported program keeps standard ops).
# ----------------------------------------------------------------------------------------------------------------------

# in the op names: a changed op (signature or implementation: tests/test_release.py checks tests/custom_ops.json) gets
# a new name, and another copy of this file (a model's remote code next to the installed package) reuses the ops one
# of them registered only when they are the same
OPS_VERSION = 2


def _custom_op(name: str, function, fake, backward=None, setup_context=None):
    """`torch.ops.pkm_bert.<name>_v<OPS_VERSION>` (registered once per process)."""
    versioned = f"{name}_v{OPS_VERSION}"
    if not hasattr(torch.ops.pkm_bert, versioned):
        op = torch.library.custom_op(f"pkm_bert::{versioned}", mutates_args=())(function)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.pkm_bert, versioned).default


def _search_op(
    queries: torch.Tensor, keys: torch.Tensor, knn: int, prune: bool, native: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return select_product_keys(subkey_scores(queries, keys), knn, prune, native)[:2]


def _fake_search(queries, keys, knn, prune, native):
    shape = (queries.shape[0], keys.shape[0], knn)
    return queries.new_empty(shape), queries.new_empty(shape, dtype=torch.int64)


def _setup_search(ctx, inputs, output):
    queries, keys = inputs[:2]
    ctx.save_for_backward(queries, keys, output[1])
    ctx.mark_non_differentiable(output[1])


def _search_backward(ctx, grad_scores, _grad_indices):
    queries, keys, indices = ctx.saved_tensors
    needs = ctx.needs_input_grad[:2]
    grad_queries, grad_keys = search_backward_op(queries, keys, indices, grad_scores, *needs)
    return (grad_queries if needs[0] else None), (grad_keys if needs[1] else None), None, None, None


def _search_backward_op(
    queries: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, grad_scores: torch.Tensor, queries_grad: bool,
    keys_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    subkeys = split_product_keys(indices, keys.shape[2])
    grads = query_and_key_gradients((queries_grad, keys_grad), queries, keys, subkeys, grad_scores.contiguous())
    return tuple(g.contiguous() if g is not None else t.new_empty(0) for g, t in zip(grads, (queries, keys)))


def _fake_search_backward(queries, keys, indices, grad_scores, queries_grad, keys_grad):
    return queries.new_empty(queries.shape if queries_grad else 0), keys.new_empty(keys.shape if keys_grad else 0)


# the one state the custom ops keep between steps: the CPU gradient buffers of each table (by its storage), reused as
# the module's own are (`_reusable_buffer`: a fresh 768 MiB gradient costs as much in page faults as the whole step);
# a few tables' worth, a table's freed by its `ProductKeyValues.release_workspace()` (eval())
_OP_WORKSPACES: dict = {}


def _op_workspace_key(weight: torch.Tensor) -> tuple:
    return weight.device, weight.dtype, weight.data_ptr(), tuple(weight.shape)


def release_op_workspaces(weight: torch.Tensor):
    """Frees the gradient buffers the custom ops keep between steps for the table `weight` (the next backward makes
    them again)."""
    _OP_WORKSPACES.pop(_op_workspace_key(weight), None)


class _OpLookup:
    """What the value-gradient paths read of an autograd ctx, for the custom op, as `WeightedRowSum` keeps it: the bags
    of the lookups for EmbeddingBag's own kernels, the table's reused CPU buffers (by the table's storage,
    `_OP_WORKSPACES`); no table shared across lookups (autograd sums the gradients of a shared table)."""

    shared = None

    def __init__(self, needs_input_grad, sparse, triton, weight, indices):
        self.needs_input_grad, self.sparse, self.triton = needs_input_grad, sparse, triton
        self.bags = None if triton else bag_layout(indices)
        key = _op_workspace_key(weight)
        if key not in _OP_WORKSPACES and len(_OP_WORKSPACES) >= 16:  # tables freed since: their buffers go too
            _OP_WORKSPACES.clear()
        self.workspaces = _OP_WORKSPACES.setdefault(key, {})


def _row_sum_op(
    weight: torch.Tensor, indices: torch.Tensor, per_sample_weights: torch.Tensor, sparse: bool, triton: bool
) -> torch.Tensor:
    if triton:
        return triton_bag_sum(weight, indices, per_sample_weights)
    return F.embedding_bag(indices, weight, mode="sum", per_sample_weights=per_sample_weights)


def _fake_row_sum(weight, indices, per_sample_weights, sparse, triton):
    return weight.new_empty(indices.shape[0], weight.shape[1])


def _setup_row_sum(ctx, inputs, output):
    weight, indices, per_sample_weights, ctx.sparse, ctx.triton = inputs
    ctx.save_for_backward(weight, indices, per_sample_weights)


def _row_sum_backward(ctx, grad_output):
    weight, indices, per_sample_weights = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_weight, grad_per_sample_weights = row_sum_backward_op(
        grad_output, weight, indices, per_sample_weights, ctx.sparse, ctx.triton, *needs
    )
    return (grad_weight if needs[0] else None), None, (grad_per_sample_weights if needs[1] else None), None, None


def _row_sum_backward_op(
    grad_output: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, per_sample_weights: torch.Tensor,
    sparse: bool, triton: bool, weight_grad: bool, per_sample_weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    lookup = _OpLookup((weight_grad, False, per_sample_weights_grad), sparse, triton, weight, indices)
    grads = row_sum_gradients(lookup, weight, indices, per_sample_weights, grad_output)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (weight, per_sample_weights)))


def _fake_row_sum_backward(grad_output, weight, indices, per_sample_weights, sparse, triton, weight_grad, psw_grad):
    grad_per_sample_weights = per_sample_weights.new_empty(per_sample_weights.shape if psw_grad else 0)
    if not weight_grad:
        return weight.new_empty(0), grad_per_sample_weights
    if not sparse:
        return weight.new_empty(weight.shape), grad_per_sample_weights
    # the distinct rows the lookups read are known only from the data, and a sparse tensor cannot carry an unbacked size
    # out of a graph: its bound, the number of lookups (the gradient leaves the graph straight to autograd's sum)
    rows = indices.numel()
    return _sparse_rows(weight.new_empty(rows, dtype=torch.int64), weight.new_empty(rows, weight.shape[1]), weight.shape[0]), (
        grad_per_sample_weights
    )


search_op = _custom_op("product_key_search", _search_op, _fake_search, _search_backward, _setup_search)
search_backward_op = _custom_op("product_key_search_backward", _search_backward_op, _fake_search_backward)
row_sum_op = _custom_op("weighted_row_sum", _row_sum_op, _fake_row_sum, _row_sum_backward, _setup_row_sum)
row_sum_backward_op = _custom_op("weighted_row_sum_backward", _row_sum_backward_op, _fake_row_sum_backward)
