"""Product key memory (Lample et al. 2019, XLM `pq_fast`), pure torch, all heads batched.

Top-down: `ProductKeyMemory`, the layer (`__init__`, `forward`, then what `forward` calls, in call order), then
`ProductKeyValues`, its value table (an `nn.EmbeddingBag`), and last, in a section of their own, the int8 / 4-bit value
tables for serving (`QuantizedProductKeyValues`). The fast autograd paths they run (value lookup and its backward,
sub-key top-k, the native selection) and the switches that choose between those paths and the reference torch ops are
in `product_key_memory_ops.py`, documented there in one list.
"""

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .product_key_memory_ops import (
    OUTPUT_GATES,
    SCORE_ACTIVATIONS,
    HostBoundLookup,
    ProductKeySearch,
    SharedGradient,
    WeightedRowSum,
    bag_layout,
    is_exporting,
    lookup_is_host_bound,
    read_is_host_bound,
    release_op_workspaces,
    row_sum_op,
    search_is_host_bound,
    search_op,
    select_product_keys,
    subkey_scores,
    triton_bag_sum,
)


def check_memory_scale(name: str, value) -> None:
    """A memory scale must be a finite nonzero number: 0 would cut every gradient of the memory but its own."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        raise ValueError(f"{name}={value!r} must be a finite nonzero number (e.g. 0.01 for a near-zero start) or None")


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _has_hooks(module: nn.Module) -> bool:
    """Whether a forward or backward hook of `module`, or a global one of every module
    (`nn.modules.module.register_module_forward_hook` and the like), is set: each needs the module call."""
    return any(getattr(module, name, None) for name in _HOOKS) or any(
        getattr(nn.modules.module, f"_global{name}", None) for name in _HOOKS
    )


def _dropout(dropout: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """`dropout(hidden_states)`, without the module call where it is a no-op (`p == 0`, the default: a memory step is
    host-bound on a GPU, and every call counts)."""
    return hidden_states if getattr(dropout, "p", None) == 0 else dropout(hidden_states)


class ProductKeyMemory(nn.Module):
    r"""
    Maps `(..., input_dim)` to `(..., v_dim)`: a query network (Linear + BatchNorm) gives each head a query that is
    split in two halves; each half scores its own `n_keys` sub-keys, and the exact top-`knn` of the `n_keys ** 2`
    product keys comes from the top-`knn` of each half. The softmax (in fp32) of the `knn` scores of each head weights
    the selected value rows, and the heads are summed.

    Slot `i1 * n_keys + i2` pairs row `i1` of `keys[h, 0]` (first half of the query) with row `i2` of `keys[h, 1]`.
    Padding tokens (`attention_mask == 0`) are neither looked up nor counted in the BatchNorm statistics; their output is
    zero.

    `sparse=True` (or setting `sparse_values` before wrapping the model in DDP) makes `values.weight.grad` a coalesced
    sparse tensor over the rows a step used, for a row-wise optimizer (`optimization.SparseRowAdam`); the default dense
    gradient suits DDP/NCCL, FSDP and any optimizer. Either way the values are read through `self.values(indices,
    per_sample_weights=weights)`, a [`ProductKeyValues`] (an `nn.EmbeddingBag`).

    Options of Memory+ (Berges et al. 2024) and later memory layers, each off by default (written from the papers'
    descriptions; see the README's "Memory+ and modern options"):
    - `values`: an existing [`ProductKeyValues`] to read instead of a table of its own, e.g. ONE table shared by the
      memories of every layer (Memory+); each memory keeps its own keys, query network and output. The memory does not
      initialise a table it was given.
    - `qk_norm`: LayerNorm (learned gain and bias, shared by heads and halves) on each query half and on every sub-key
      before scoring, as UltraMem and ByteDance's Memory+ port do; the gains start at `(k_dim / 2) ** -1/4` so that a
      half's score has unit scale at the start. The search stays exact over the normalised sub-keys.
    - `score_activation="relu"`: the selected slots are weighted by `relu(score)` (non-competitive, Csordas et al.
      2023) instead of the softmax over the `knn` scores of each head.
    - `output_gate="swilu"`: `output_proj((sum_i w_i v_i) * silu(gate_proj(x)))` (Memory+), with `gate_proj: input_dim
      -> v_dim` (no bias) and `output_proj: v_dim -> v_dim`, whose bias starts at zero so that zero values still give
      a zero output.
    - `memory_scale`: a learned scalar multiplying the output, initialised to the number given (e.g. 0.01 for a
      near-zero start of a memory added beside a pretrained FFN); a finite nonzero number.
    """

    # the fast paths (documented in one list: product_key_memory_ops.py); False: the reference torch ops
    prune_candidates = True
    fused_search_backward = True
    native_search = True
    trace_training_lookup = True  # under torch.compile: True traces a training lookup, False runs it eagerly
    # how errors name this memory (BertPkmLayer sets e.g. "layer 4 memory")
    layer_name = "ProductKeyMemory"

    def __init__(
        self,
        input_dim: int,
        v_dim: int | None = None,
        n_keys: int = 512,
        heads: int = 4,
        knn: int = 32,
        k_dim: int = 256,
        query_batchnorm: bool = True,
        query_bias: bool = True,
        value_init: str = "normal",
        input_dropout: float = 0.0,
        query_dropout: float = 0.0,
        value_dropout: float = 0.0,
        sparse: bool | None = None,
        values: "ProductKeyValues | None" = None,
        qk_norm: bool = False,
        score_activation: str = "softmax",
        output_gate: str = "none",
        memory_scale: float | None = None,
    ):
        super().__init__()
        if k_dim % 2:
            raise ValueError(f"k_dim={k_dim} must be even: the query is split into two halves")
        if not 1 <= knn <= n_keys:
            raise ValueError(f"knn={knn} must be in [1, n_keys={n_keys}]")
        if heads < 1:
            raise ValueError(f"heads={heads} must be >= 1")
        if value_init not in ("normal", "zeros"):
            raise ValueError(f"value_init={value_init!r} must be 'normal' or 'zeros'")
        if score_activation not in SCORE_ACTIVATIONS:
            raise ValueError(f"score_activation={score_activation!r} must be one of {SCORE_ACTIVATIONS}")
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"output_gate={output_gate!r} must be one of {OUTPUT_GATES}")
        if memory_scale is not None:
            check_memory_scale("memory_scale", memory_scale)
        self.input_dim, self.v_dim = input_dim, v_dim or input_dim
        self.n_keys, self.heads, self.knn, self.k_dim = n_keys, heads, knn, k_dim
        self.value_init = value_init
        self.qk_norm, self.score_activation, self.output_gate = bool(qk_norm), score_activation, output_gate
        self.owns_values = values is None

        self.input_dropout = nn.Dropout(input_dropout)
        self.query_proj = nn.Linear(input_dim, heads * k_dim, bias=query_bias)
        self.query_batchnorm = nn.BatchNorm1d(heads * k_dim) if query_batchnorm else nn.Identity()
        self.query_dropout = nn.Dropout(query_dropout)
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, k_dim // 2))
        if values is None:
            values = ProductKeyValues(n_keys**2, self.v_dim, sparse=bool(sparse))
        else:
            self._check_shared_values(values, sparse)
            values.shared = True  # its lookups sum their gradients into one buffer (SharedGradient)
        self.values = values
        self.value_dropout = nn.Dropout(value_dropout)
        if self.qk_norm:  # one norm for the query halves, one for the sub-keys
            self.query_norm = nn.LayerNorm(k_dim // 2)
            self.key_norm = nn.LayerNorm(k_dim // 2)
        if output_gate == "swilu":
            self.gate_proj = nn.Linear(input_dim, self.v_dim, bias=False)
            self.output_proj = nn.Linear(self.v_dim, self.v_dim)
        if memory_scale is not None:
            self.memory_scale = nn.Parameter(torch.tensor(float(memory_scale)))
        else:
            self.register_parameter("memory_scale", None)
        self.reset_parameters()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`(batch, seq, input_dim)` (or any `(..., input_dim)`) -> `(..., v_dim)`; `attention_mask` is 1 on real tokens."""
        if hidden_states.shape[-1] != self.input_dim:
            raise ValueError(f"hidden_states must end in input_dim={self.input_dim}, got {tuple(hidden_states.shape)}")
        batch_shape, flat = hidden_states.shape[:-1], hidden_states.reshape(-1, self.input_dim)
        if attention_mask is None:
            return self.lookup(flat).view(*batch_shape, self.v_dim)
        if attention_mask.shape != batch_shape:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not match hidden_states {tuple(batch_shape)}"
            )
        if is_exporting():  # no data-dependent token selection in an exported graph
            return self._export_forward(flat, attention_mask).view(*batch_shape, self.v_dim)
        # padding is skipped: it must not shift the BatchNorm statistics nor cost lookups
        real = attention_mask.reshape(-1).nonzero().squeeze(1)
        if real.numel() == flat.shape[0]:  # no padding: no gather and scatter of the tokens
            return self.lookup(flat).view(*batch_shape, self.v_dim)
        output = flat.new_zeros(flat.shape[0], self.v_dim)
        # looked up even without a real token: the parameters then get (zero) gradients, which DDP and FSDP wait for
        # on every process, and a table sharded across processes (memory parallel) is read by all of them; but a query
        # BatchNorm in training has no statistics of 0 tokens (the scripts refuse such a batch on every process first)
        if real.numel() or not (self.training and self.query_batchnorms()):
            output = output.index_copy(0, real, self.lookup(flat.index_select(0, real)))
        return output.view(*batch_shape, self.v_dim)

    def lookup(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The memory on a flat batch of tokens: `(tokens, input_dim)` -> `(tokens, v_dim)`."""
        if torch.compiler.is_compiling() and not self.trace_training_lookup and torch.is_grad_enabled():
            if hidden_states.requires_grad or any(p.requires_grad for p in self.parameters()):
                return self._eager_lookup(hidden_states)
        return self._lookup(hidden_states)

    @torch.compiler.disable
    def _eager_lookup(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._lookup(hidden_states)

    def _lookup(self, hidden_states: torch.Tensor) -> torch.Tensor:
        inputs = _dropout(self.input_dropout, hidden_states)
        queries = self.query_proj(inputs)
        batchnorms = self.training and not torch.compiler.is_compiling() and self.query_batchnorms()
        if batchnorms and torch._C._current_graph_task_id() != -1:  # run inside backward: checkpointing recomputes
            queries = self._recomputed_batchnorm(queries, batchnorms)
        else:
            if batchnorms:
                self._check_batch_statistics(hidden_states, queries)
            queries = self.query_batchnorm(queries)
        queries = _dropout(self.query_dropout, queries)
        weight = self._one_node_table(queries)
        if weight is not None:  # host-bound: the search, weights and lookup in one autograd node
            queries, keys = self._scoring_inputs(queries)
            output = HostBoundLookup.apply(
                queries, keys, weight, self.knn, self.prune_candidates, self.native_search, self.score_activation,
                self.values.sparse,
            )  # fmt: skip
        else:
            scores, indices = self._search(queries)  # (tokens, heads, knn)
            weights = self.score_weights(scores)
            output = self.values(
                indices.flatten(1), per_sample_weights=weights.flatten(1).to(lookup_dtype(self.values.weight))
            )  # the bag sums knn rows of every head: heads are summed
        output = output.to(hidden_states.dtype)
        if self.output_gate == "swilu" or self.memory_scale is not None:
            output = self.memory_output(output, inputs)
        return _dropout(self.value_dropout, output)

    def query_batchnorms(self) -> list[nn.Module]:
        """The BatchNorms that normalise the queries: the query BatchNorm, or the copies inside a wrapper of it."""
        if type(self.query_batchnorm) is nn.BatchNorm1d:  # the usual case, without walking the modules
            return [self.query_batchnorm]
        return [module for module in self.query_batchnorm.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]

    def _recomputed_batchnorm(self, queries: torch.Tensor, batchnorms: list[nn.Module]) -> torch.Tensor:
        """The query BatchNorm in a gradient-checkpointing recomputation (it runs inside backward): the same batch
        statistics, and the running ones, already updated by the first forward, stay: the BatchNorms update copies of
        them (they may sit in a wrapper, e.g. PEFT's modules_to_save, so the wrapper's own forward runs)."""
        buffers = [(norm, name, buffer) for norm in batchnorms for name, buffer in norm.named_buffers(recurse=False)]
        for norm, name, buffer in buffers:
            setattr(norm, name, buffer.clone())
        try:
            return self.query_batchnorm(queries)
        finally:
            for norm, name, buffer in buffers:
                setattr(norm, name, buffer)

    def _check_batch_statistics(self, hidden_states: torch.Tensor, queries: torch.Tensor):
        """In training the query BatchNorm normalises each token with statistics of the whole batch and keeps them in
        its running mean and variance: one non-finite query would make every sequence's output and every later
        evaluation non-finite, so such a batch is refused (ValueError) before the BatchNorm, as is a batch of one token
        (no variance). One sum and one host sync per memory and step in eager mode; nothing in compiled/exported
        graphs."""
        if torch.compiler.is_compiling() or is_exporting():
            return
        if queries.shape[0] < 2:
            raise ValueError(
                f"{self.layer_name}: a training batch with {queries.shape[0]} real token(s) (attention_mask == 1): the"
                " query BatchNorm needs at least 2 to compute batch statistics; use a batch with more real tokens,"
                " or eval() mode"
            )
        # a sum is NaN/inf iff some entry is (or, rarely, it overflows: then the exact count decides); read on the host
        # as a number: one op and the sync, not the four ops of torch.isfinite on a tensor
        if not math.isfinite(queries.detach().sum().item()):
            bad_queries = int((~torch.isfinite(queries.detach())).sum())
            if bad_queries:
                bad_inputs = int((~torch.isfinite(hidden_states.detach())).sum())
                raise ValueError(
                    f"{self.layer_name}: {bad_inputs} non-finite value(s) (NaN/inf) in its input hidden_states of shape"
                    f" {tuple(hidden_states.shape)} ({bad_queries} in the queries) in training mode; refused before the"
                    " query BatchNorm so that its running statistics and the other sequences of the batch stay finite."
                    " Check the inputs (inputs_embeds), the learning rate and the loss scale"
                )

    def search(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-`knn` product keys of each head: `(..., heads, k_dim)` -> scores, indices `(..., heads, knn)`."""
        if queries.shape[-2:] != (self.heads, self.k_dim):
            raise ValueError(f"queries must end in (heads, k_dim) = {(self.heads, self.k_dim)}, got {tuple(queries.shape)}")
        scores, indices = self._search(queries.reshape(-1, self.heads * self.k_dim))
        shape = (*queries.shape[:-2], self.heads, self.knn)
        return scores.view(shape), indices.view(shape)

    def _search(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`search` on a flat batch: queries `(tokens, heads * k_dim)` -> scores, indices `(tokens, heads, knn)`."""
        knn, prune, native = self.knn, self.prune_candidates, self.native_search
        queries, keys = self._scoring_inputs(queries)
        needs_grad = torch.is_grad_enabled() and (queries.requires_grad or keys.requires_grad)
        if needs_grad and self.fused_search_backward:  # one node, reshapes included
            if torch.compiler.is_compiling() and not is_exporting():
                return search_op(queries, keys, knn, prune, native)
            scoring = queries.shape[0] * self.heads * self.k_dim * self.n_keys  # multiply-adds of the sub-key scores
            if not search_is_host_bound(queries.device, scoring):
                return ProductKeySearch.apply(queries, keys, knn, prune, native)
        # without gradients, fp32 on CPU: the native kernel (kernels/cpu.py); else the reference, torch's own backward
        return select_product_keys(subkey_scores(queries, keys), knn, prune, native and not needs_grad)[:2]

    def _scoring_inputs(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat queries and the sub-keys `(heads, 2, n_keys, half)` as scored: with `qk_norm` normalised (the
        queries then `(tokens, heads * 2, half)`)."""
        keys = self.scoring_keys().to(queries.dtype)
        if self.qk_norm:
            queries = self.query_norm(queries.view(queries.shape[0], self.heads * 2, self.k_dim // 2))
        return queries, keys

    def _one_node_table(self, queries: torch.Tensor) -> torch.Tensor | None:
        """The table's weight where the read is one `HostBoundLookup` node, else None: a training step with gradients,
        eager, host-bound in both phases, on the memory's own plain table (a hook on `values`, a wrapper of it, a
        shared, Triton or quantized table each needs the module call or its own node)."""
        values, tokens = self.values, queries.shape[0]
        if type(values) is not ProductKeyValues or not torch.is_grad_enabled():
            return None
        scoring = tokens * self.heads * self.k_dim * self.n_keys  # multiply-adds of the sub-key scores
        weight, elements = values.weight, tokens * self.heads * self.knn * self.v_dim
        if not (read_is_host_bound(weight.device, scoring, elements, values.sparse) and self.fused_search_backward):
            return None
        if not values.readable_in_one_node() or torch.compiler.is_compiling() or is_exporting():
            return None  # (the module call; the custom ops; standard ops)
        return weight

    def scoring_keys(self) -> torch.Tensor:
        """The sub-keys the queries are scored against, `(heads, 2, n_keys, k_dim // 2)`: `keys`, with `qk_norm` normalised."""
        return self.key_norm(self.keys) if self.qk_norm else self.keys

    def score_weights(self, scores: torch.Tensor) -> torch.Tensor:
        """The weights of the selected slots from their scores `(..., heads, knn)`, in fp32."""
        if self.score_activation == "relu":
            return F.relu(scores.float())
        return F.softmax(scores.float(), dim=-1)

    def memory_output(self, read: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The options applied to the weighted sum of values `read`: the swilu output and the learned scale."""
        if self.output_gate == "swilu":
            read = self.output_proj(read * F.silu(self.gate_proj(inputs)))
        if self.memory_scale is not None:
            read = read * self.memory_scale.to(read.dtype)
        return read

    def _export_forward(self, flat: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Every token looked up, padding outputs zeroed: exact where the query BatchNorm does not use the batch's own
        statistics (eval mode), which padding would shift."""
        if self.training and self.query_batchnorms():
            raise ValueError(
                "torch.export of a ProductKeyMemory with a query BatchNorm in training mode: padding tokens would enter "
                "its batch statistics; export the model in eval mode (model.eval())"
            )
        real = attention_mask.reshape(-1, 1).bool()
        return torch.where(real, self.lookup(flat), flat.new_zeros(()))

    def _check_shared_values(self, values, sparse):
        if isinstance(values, QuantizedProductKeyValues):  # a quantized table (serving; defined at the end)
            if (values.num_embeddings, values.embedding_dim) != (self.n_keys**2, self.v_dim):
                raise ValueError(f"values: a quantized table of {values.num_embeddings} x {values.embedding_dim} does not fit"
                                 f" this memory's (n_keys ** 2, v_dim) = ({self.n_keys**2}, {self.v_dim})")
            return
        if not isinstance(values, nn.EmbeddingBag) or values.mode != "sum":
            raise ValueError(f"values must be a ProductKeyValues (an nn.EmbeddingBag in 'sum' mode), got {type(values).__name__}")
        if tuple(values.weight.shape) != (self.n_keys**2, self.v_dim):
            raise ValueError(
                f"values: a shared table of shape {tuple(values.weight.shape)} does not fit this memory, which needs "
                f"(n_keys ** 2, v_dim) = ({self.n_keys**2}, {self.v_dim}) (n_keys={self.n_keys}, v_dim={self.v_dim}): "
                "memories sharing one value table must have the same n_keys and v_dim"
            )
        if sparse is not None and bool(sparse) != values.sparse:
            raise ValueError(f"sparse={sparse} differs from the shared table's sparse={values.sparse}: leave sparse=None")

    @torch.no_grad()
    def reset_parameters(self):
        # XLM's uniform keys: the bound of nn.Linear for fan-in k_dim / 2; values N(0, v_dim^-1/2) or zeros
        bound = (self.k_dim // 2) ** -0.5
        nn.init.uniform_(self.keys, -bound, bound)
        if self.owns_values:  # a table given by the caller keeps its weights
            if self.value_init == "zeros":
                nn.init.zeros_(self.values.weight)
            else:
                nn.init.normal_(self.values.weight, mean=0.0, std=self.v_dim**-0.5)
        self.query_proj.reset_parameters()
        if isinstance(self.query_batchnorm, nn.BatchNorm1d):
            self.query_batchnorm.reset_parameters()
        self.reset_option_parameters()

    def reset_option_parameters(self, init=nn.init):
        """Initialises the parameters of the options (qk-norm gains, swilu projections); `init`: a module with
        `constant_`, `normal_` and `zeros_` (torch's, or transformers' `initialization`, which skips loaded weights)."""
        if self.qk_norm:
            gain = (self.k_dim // 2) ** -0.25  # a half's score sum_j (g q_j)(g k_j) then has unit scale at the start
            for norm in (self.query_norm, self.key_norm):
                init.constant_(norm.weight, gain)
                init.zeros_(norm.bias)
        if self.output_gate == "swilu":  # Memory+: N(0, fan_in^-1/2); the output bias at zero
            init.normal_(self.gate_proj.weight, mean=0.0, std=self.input_dim**-0.5)
            init.normal_(self.output_proj.weight, mean=0.0, std=self.v_dim**-0.5)
            init.zeros_(self.output_proj.bias)

    @property
    def mem_size(self) -> int:
        return self.n_keys**2

    @property
    def sparse_values(self) -> bool:
        """Whether `values.weight.grad` is sparse (rows used by the step) rather than dense."""
        return self.values.sparse

    @sparse_values.setter
    def sparse_values(self, sparse: bool):
        self.values.sparse = bool(sparse)

    def extra_repr(self) -> str:
        return (
            f"input_dim={self.input_dim}, v_dim={self.v_dim}, n_keys={self.n_keys} ({self.mem_size} slots), "
            f"heads={self.heads}, knn={self.knn}, k_dim={self.k_dim}"
            + (", qk_norm=True" if self.qk_norm else "")
            + (f", score_activation={self.score_activation!r}" if self.score_activation != "softmax" else "")
            + (f", output_gate={self.output_gate!r}" if self.output_gate != "none" else "")
            + (", shared values" if not self.owns_values else "")
        )


class ProductKeyValues(nn.EmbeddingBag):
    r"""
    The value table of a [`ProductKeyMemory`]: an `nn.EmbeddingBag(num_slots, v_dim, mode="sum")` (same `weight`, same
    call `values(indices, per_sample_weights=weights)`, same output) whose training backward is cheaper.

    - `sparse=False` (default): a dense `weight.grad` as EmbeddingBag's, which DDP/NCCL, FSDP, `clip_grad_norm_` and
      every optimizer accept.
    - `sparse=True`: `weight.grad` is a coalesced sparse COO tensor over the rows the step used (one row each), for
      [`~optimization.SparseRowAdam`] or `torch.optim.SparseAdam`; DDP reads the `sparse` attribute at wrapping time
      (sparse all-reduce needs gloo, not NCCL; FSDP refuses sparse gradients).

    On CPU the gradient lives in a buffer reused from step to step (fresh allocations of hundreds of MiB cost page
    faults), also for a table shared by several memories, whose lookups add their gradients into one buffer (bitwise
    autograd's sum); `eval()` releases it. `fused_backward = False` gives EmbeddingBag's own backward (the reference).
    """

    # the fast paths (documented in one list: product_key_memory_ops.py); opt-in Triton gathers, e.g.
    # `ProductKeyValues.triton_devices = ("cuda",)`
    fused_backward = True
    triton_devices = ()

    def __init__(self, num_embeddings: int, embedding_dim: int, sparse: bool = False, **kwargs):
        super().__init__(num_embeddings, embedding_dim, mode="sum", sparse=sparse, **kwargs)
        self._workspaces = {}
        self._shared_gradient = SharedGradient()
        # set when a second memory reads this table: only then do the lookups keep track of each other (a table read
        # twice otherwise, e.g. a memory module called twice, gets autograd's out-of-place sum: the same gradient)
        self.shared = False

    def forward(self, input, offsets=None, per_sample_weights=None):
        if is_exporting():  # standard ops only
            return super().forward(input, offsets, per_sample_weights)
        return self._fused_forward(input, offsets, per_sample_weights)

    def _fused_forward(self, input, offsets=None, per_sample_weights=None):
        if (
            offsets is not None
            or input.dim() != 2
            or input.dtype != torch.long
            or per_sample_weights is None
            or self.max_norm is not None
            or self.padding_idx is not None
        ):
            return super().forward(input, offsets, per_sample_weights)
        triton = (
            self.weight.device.type in self.triton_devices
            and self.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)  # the kernels sum in fp32
            and hasattr(torch.ops.pkm_bert, "bag_sum")
        )
        needs_grad = torch.is_grad_enabled() and (self.weight.requires_grad or per_sample_weights.requires_grad)
        if needs_grad and self.fused_backward and torch.compiler.is_compiling():  # one node of the graph
            return row_sum_op(self.weight, input, per_sample_weights, self.sparse, triton)
        # a dense gradient of a table read once, host-bound: EmbeddingBag's own node (C++), the kernels WeightedRowSum
        # would call there
        own_node = not (self.sparse or self.shared or triton) and lookup_is_host_bound(
            self.weight.device, input.numel() * self.embedding_dim
        )
        if needs_grad and self.fused_backward and not own_node:
            return WeightedRowSum.apply(
                self.weight, input, per_sample_weights, self.sparse, self._workspaces, triton,
                self._shared_gradient if self.shared else None,
            )
        if triton and not needs_grad:
            return triton_bag_sum(self.weight, input, per_sample_weights)
        # one bag of input.shape[1] rows per token: the offsets made once per shape, not on every call
        offsets = bag_layout(input)[0]
        return torch.embedding_bag(
            self.weight, input.reshape(-1), offsets, False, 0, self.sparse, per_sample_weights.reshape(-1), False, None
        )[0]

    def readable_in_one_node(self) -> bool:
        """Whether a memory may read this table inside its one-node read (`HostBoundLookup`) instead of calling it: the
        fused backward, a plain sum of rows (no max_norm, padding_idx or overridden forward), read by that memory only,
        not on a Triton device, and no forward or backward hook (of the table or of every module) that needs the call."""
        plain = self.max_norm is None and self.padding_idx is None and "forward" not in vars(self)
        return self.fused_backward and plain and not (self.shared or _has_hooks(self)) and (
            self.weight.device.type not in self.triton_devices
        )

    def train(self, mode: bool = True):
        if not mode:
            self.release_workspace()
        return super().train(mode)

    def release_workspace(self):
        """Frees the gradient buffer kept between training steps (it is made again by the next backward)."""
        self._workspaces.clear()
        self._shared_gradient.partial.clear()  # left only by a backward pass that raised
        release_op_workspaces(self.weight)  # those the custom ops keep for this table (a compiled step)

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_workspaces": {}, "_shared_gradient": SharedGradient()}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode='sum', sparse={self.sparse}"


# ----------------------------------------------------------------------------------------------------------------------
# Serving: compact value tables (issue 26), int8 / 4-bit rows in FBGEMM's row-wise layout. `QuantizedProductKeyValues`
# takes the place of a `ProductKeyValues` (same call, same output) in a model made by `quantize_memory_values` or built
# from a config with `pkm_values_quantization`; inference only.
# ----------------------------------------------------------------------------------------------------------------------

VALUE_QUANTIZATIONS = {"int8": 8, "4bit": 4}  # config `pkm_values_quantization` -> bits
_QUANTIZED_OPS = {8: "embedding_bag_byte_rowwise_offsets", 4: "embedding_bag_4bit_rowwise_offsets"}
_fallback_warned = set()


def lookup_dtype(weight: torch.Tensor) -> torch.dtype:
    """The per-sample weights' dtype for a table: its own, fp32 for a quantized (uint8) one."""
    return weight.dtype if weight.is_floating_point() else torch.float32


def quantized_ops_available(bits: int) -> bool:
    """Whether this torch build has FBGEMM's row-wise quantized EmbeddingBag for `bits` (8 or 4) on CPU."""
    try:
        return hasattr(torch.ops.quantized, _QUANTIZED_OPS[bits])
    except (AttributeError, RuntimeError):
        return False


def packed_row_bytes(dim: int, bits: int) -> int:
    """Bytes of one packed row: int8: `dim` codes + fp32 scale + fp32 bias; 4-bit: `dim / 2` bytes + fp16 scale + bias."""
    return dim + 8 if bits == 8 else (dim + 1) // 2 + 4


def _decode_floats(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian IEEE floats of `width` bytes (4: fp32, 2: fp16) from uint8 `(n, k * width)` -> fp32 `(n, k)`, by
    arithmetic on the bits (no dtype view: ONNX has no bitcast for it)."""
    exponent_bits, mantissa_bits = (8, 23) if width == 4 else (5, 10)
    parts = raw.long().unflatten(-1, (-1, width))
    scale = torch.tensor([256**i for i in range(width)], dtype=torch.long, device=raw.device)
    word = (parts * scale).sum(-1)
    mantissa = torch.remainder(word, 2**mantissa_bits).float() / 2**mantissa_bits
    exponent = torch.remainder(torch.div(word, 2**mantissa_bits, rounding_mode="floor"), 2**exponent_bits)
    sign = 1.0 - 2.0 * torch.div(word, 2 ** (8 * width - 1), rounding_mode="floor").float()
    bias = 2 ** (exponent_bits - 1) - 1
    normal = (1.0 + mantissa) * torch.pow(2.0, (exponent - bias).float())
    subnormal = mantissa * 2.0 ** (1 - bias)
    return sign * torch.where(exponent == 0, subnormal, normal)


def dequantize_rows(rows: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Packed rows `(n, packed_row_bytes)` (uint8) -> fp32 `(n, dim)`: `code * scale + bias`, per row (standard ops
    only, so it also runs where FBGEMM's kernels do not: other devices, torch.export; ONNX-exportable there)."""
    exporting = is_exporting()
    if bits == 8:
        codes, raw = rows[:, :dim], rows[:, dim : dim + 8]
        qparams = _decode_floats(raw, 4) if exporting else raw.contiguous().view(torch.float32)
    else:
        start = (dim + 1) // 2
        packed, raw = rows[:, :start], rows[:, start : start + 4]
        if exporting:  # integer arithmetic rather than bit ops on uint8
            packed = packed.long()
            nibbles = (torch.remainder(packed, 16), torch.div(packed, 16, rounding_mode="floor"))
        else:
            nibbles = (packed & 15, packed >> 4)
        codes = torch.stack(nibbles, dim=-1).flatten(-2)[:, :dim]  # low nibble first
        qparams = _decode_floats(raw, 2) if exporting else raw.contiguous().view(torch.float16).float()
    return codes.float() * qparams[:, :1] + qparams[:, 1:2]


class QuantizedProductKeyValues(nn.Module):
    r"""
    A value table stored row-wise quantized for inference: `weight` holds FBGEMM's packed rows (uint8, `(num_slots,
    packed_row_bytes)`: int8 codes with an fp32 scale and bias per row, or 4-bit codes with fp16 ones), read by
    `torch.ops.quantized.embedding_bag_{byte,4bit}_rowwise_offsets` with the softmax weights as per-sample weights:
    the same call and output as [`ProductKeyValues`] (`values(indices, per_sample_weights=weights)`, fp32). Where a torch
    build lacks those kernels, on other devices and under `torch.export`, the rows read are dequantised with standard
    ops (the same numbers; a one-time warning where a kernel was expected). Inference only: the table has no gradient,
    and a training-mode forward with gradients enabled is refused. Made by `modeling_pkm_bert.quantize_memory_values`,
    or built empty for a config with `pkm_values_quantization` and filled by `from_pretrained`.
    """

    sparse = False
    mode = "sum"

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int = 8, packed: torch.Tensor | None = None):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits={bits!r}: quantized value tables have 8 (int8) or 4 (4-bit) bits per value")
        self.num_embeddings, self.embedding_dim, self.bits = num_embeddings, embedding_dim, bits
        shape = (num_embeddings, packed_row_bytes(embedding_dim, bits))
        if packed is None:
            packed = torch.zeros(shape, dtype=torch.uint8)
        elif tuple(packed.shape) != shape or packed.dtype != torch.uint8:
            raise ValueError(f"packed rows must be uint8 of shape {shape}, got {packed.dtype} {tuple(packed.shape)}")
        self.weight = nn.Parameter(packed, requires_grad=False)

    @property
    def quantization(self) -> str:
        return "int8" if self.bits == 8 else "4bit"

    def forward(self, input, offsets=None, per_sample_weights=None):
        if self.training and torch.is_grad_enabled() and not is_exporting():
            raise RuntimeError(
                f"this memory's value table is {self.quantization}-quantized (inference only): it cannot be trained."
                " Call model.eval() (or run under torch.no_grad()/inference_mode) to use it; to train, start from the"
                " fp32 model (the folder converted before quantize_memory_values / --quantize_values)"
            )
        if offsets is not None or input.dim() != 2:
            raise ValueError("QuantizedProductKeyValues takes 2-d indices (bags of equal size) and no offsets")
        tokens, bag = input.shape
        if per_sample_weights is None:
            per_sample_weights = torch.ones(input.shape, dtype=torch.float32, device=input.device)
        weights = per_sample_weights.reshape(-1).float()
        if self._use_kernel():
            offsets = torch.arange(0, tokens * bag, bag, device=input.device)
            kernel = getattr(torch.ops.quantized, _QUANTIZED_OPS[self.bits])
            return kernel(self.weight, input.reshape(-1), offsets, False, 0, False, weights, None, False)
        rows = dequantize_rows(self.weight.index_select(0, input.reshape(-1)), self.embedding_dim, self.bits)
        return (rows.view(tokens, bag, -1) * weights.view(tokens, bag, 1)).sum(1)

    def _use_kernel(self) -> bool:
        if is_exporting() or torch.compiler.is_compiling():  # standard ops only in exported/compiled graphs
            return False
        if self.weight.device.type != "cpu":
            return False
        if quantized_ops_available(self.bits):
            return True
        if self.bits not in _fallback_warned:
            _fallback_warned.add(self.bits)
            warnings.warn(
                f"this torch build has no torch.ops.quantized.{_QUANTIZED_OPS[self.bits]} (FBGEMM): the {self.quantization}"
                " value tables are read by a dequantising torch path instead (same results, slower)",
                stacklevel=3,
            )
        return False

    def dequantize(self) -> torch.Tensor:
        """The whole table in fp32, `(num_embeddings, embedding_dim)` (for checks; as large as the fp32 table)."""
        return dequantize_rows(self.weight, self.embedding_dim, self.bits)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.quantization} rows, mode='sum' (inference only)"


__all__ = ["ProductKeyMemory", "ProductKeyValues", "QuantizedProductKeyValues"]
