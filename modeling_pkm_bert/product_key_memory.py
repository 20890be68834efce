"""Product key memory (Lample et al. 2019), pure torch, all heads batched: the reference path, top-down.

`ProductKeyMemory.forward` -> `lookup`: the query network (Linear, then a BatchNorm whose statistics skip padding), the
exact product-key search (each query half scores its `n_keys` sub-keys; the top-`knn` of each half; the top-`knn` of
the candidate sums), the score weights (softmax in fp32, or relu), the value read (`ProductKeyValues`, an
`nn.EmbeddingBag`), then the Memory+ options. `ProductKeyValues` and, last, the int8 / 4-bit tables for serving
(`QuantizedProductKeyValues`) follow. Where a fast path has measured faster on its device, `product_key_memory_ops.py`
holds it and its one plan (`ProductKeyMemory.explain_paths` prints it; `use_reference()` turns every fast path off).
"""

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .product_key_memory_ops import (
    OUTPUT_GATES,
    SCORE_ACTIVATIONS,
    ProductKeySearch,
    PendingLookups,
    WeightedRowSum,
    is_exporting,
    plan_lookup,
    row_sum_op,
)


def check_memory_scale(name: str, value) -> None:
    """A memory scale must be a finite nonzero number: 0 would cut every gradient of the memory but its own."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        raise ValueError(f"{name}={value!r} must be a finite nonzero number (e.g. 0.01 for a near-zero start) or None")


_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


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
    sparse tensor over the rows a step used, for a row-wise optimizer (`SparseRowAdam`); the default dense gradient
    suits DDP/NCCL, FSDP and any optimizer. Either way the values are read through `self.values(indices,
    per_sample_weights=weights)`, a [`ProductKeyValues`] (an `nn.EmbeddingBag`).

    Options of Memory+ (Berges et al. 2024) and later memory layers, each off by default (written from the papers'
    descriptions; see docs/memory_plus_smf_trime.md#memory-and-modern-options):
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

    # how errors name this memory (BertPkmLayer sets e.g. "layer 4 memory")
    layer_name = "ProductKeyMemory"
    # set by a gradient-checkpointed layer before each of its forwards (BertPkmLayer): the query BatchNorm updates its
    # running statistics in that many more training lookups; the checkpoint's recomputation in backward finds 0
    batch_statistics_updates = None

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
        inputs = self.input_dropout(hidden_states)
        queries = self.query_dropout(self.normalized_queries(hidden_states, self.query_proj(inputs)))
        scores, indices = self._search(queries)  # (tokens, heads, knn)
        weights = self.score_weights(scores).flatten(1).to(lookup_dtype(self.values.weight))
        # one bag of heads * knn rows per token: the heads are summed
        output = self.values(indices.flatten(1), per_sample_weights=weights).to(hidden_states.dtype)
        if self.output_gate == "swilu":
            output = self.output_proj(output * F.silu(self.gate_proj(inputs)))
        if self.memory_scale is not None:
            output = output * self.memory_scale.to(output.dtype)
        return self.value_dropout(output)

    def normalized_queries(self, hidden_states: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """The query BatchNorm; in training, a batch it cannot take is refused first ([`check_batch_statistics`]), and
        in a gradient-checkpointing recomputation its running statistics stay (the first forward updated them)."""
        batchnorms = self.training and self.query_batchnorms()
        if not batchnorms:
            return self.query_batchnorm(queries)
        if self.batch_statistics_updates == 0:
            return self._recomputed_batchnorm(queries, batchnorms)
        if self.batch_statistics_updates is not None:
            self.batch_statistics_updates -= 1
        self.check_batch_statistics(hidden_states, queries)
        return self.query_batchnorm(queries)

    def query_batchnorms(self) -> list[nn.Module]:
        """The BatchNorms that normalise the queries: the query BatchNorm, or the copies inside a wrapper of it."""
        return [module for module in self.query_batchnorm.modules() if isinstance(module, _BATCHNORMS)]

    def _recomputed_batchnorm(self, queries: torch.Tensor, batchnorms: list[nn.Module]) -> torch.Tensor:
        """The query BatchNorm with the same batch statistics, its running ones left as they are: the BatchNorms update
        copies of them (they may sit in a wrapper, e.g. PEFT's modules_to_save, so the wrapper's own forward runs)."""
        buffers = [(norm, name, buffer) for norm in batchnorms for name, buffer in norm.named_buffers(recurse=False)]
        for norm, name, buffer in buffers:
            setattr(norm, name, buffer.clone())
        try:
            return self.query_batchnorm(queries)
        finally:
            for norm, name, buffer in buffers:
                setattr(norm, name, buffer)

    def check_batch_statistics(self, hidden_states: torch.Tensor, queries: torch.Tensor):
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
        # a sum is NaN/inf iff some entry is (or, rarely, it overflows: then the exact count decides)
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
        keys = self.scoring_keys().to(queries.dtype)
        halves = queries.view(queries.shape[0], self.heads * 2, self.k_dim // 2)
        if self.qk_norm:
            halves = self.query_norm(halves)
        plan = self.plan(queries)
        select = select_native if plan.selection == "native" else select_product_keys
        if plan.search_backward == "selected":
            return ProductKeySearch.apply(halves, keys, self.knn, select)
        return select(halves, keys, self.knn)

    def scoring_keys(self) -> torch.Tensor:
        """The sub-keys the queries are scored against, `(heads, 2, n_keys, k_dim // 2)`: `keys`, with `qk_norm` normalised."""
        return self.key_norm(self.keys) if self.qk_norm else self.keys

    def score_weights(self, scores: torch.Tensor) -> torch.Tensor:
        """The weights of the selected slots from their scores `(..., heads, knn)`, in fp32."""
        if self.score_activation == "relu":
            return F.relu(scores.float())
        return F.softmax(scores.float(), dim=-1)

    def plan(self, queries: torch.Tensor) -> "Plan":  # noqa: F821 (product_key_memory_ops.Plan)
        """Which implementation each phase of a lookup of these queries runs (`product_key_memory_ops.plan_lookup`)."""
        needs_grad = torch.is_grad_enabled() and (
            queries.requires_grad or any(p.requires_grad for p in (self.keys, self.values.weight))
        )
        return plan_lookup(
            queries.device, queries.dtype, needs_grad=needs_grad, table=table_kind(self.values),
            compiling=torch.compiler.is_compiling(), exporting=is_exporting(),
        )  # fmt: skip

    def explain_paths(self, hidden_states: torch.Tensor | None = None) -> "Plan":  # noqa: F821
        """The plan a lookup of `hidden_states` (`(..., input_dim)`; default: one token on the memory's device, in the
        query network's dtype) runs now, in this grad mode: print it, or read its fields."""
        weight = self.query_proj.weight
        if hidden_states is None:
            hidden_states = torch.zeros(1, self.input_dim, device=weight.device, dtype=weight.dtype)
        queries = torch.empty(0, self.heads * self.k_dim, device=hidden_states.device, dtype=weight.dtype)
        return self.plan(queries.requires_grad_(torch.is_grad_enabled() and hidden_states.requires_grad))

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


# ----------------------------------------------------------------------------------------------------------------------
# The search: sub-key scores, the top-knn of each half, the top-knn of the candidate sums
# ----------------------------------------------------------------------------------------------------------------------


def subkey_scores(halves: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each query half against its head-half's sub-keys (one bmm): halves `(tokens, heads * 2, half)`, keys `(heads, 2,
    n_keys, half)` -> `(heads * 2, tokens, n_keys)`."""
    groups, n_keys, half = keys.shape[0] * 2, keys.shape[2], keys.shape[3]
    return torch.bmm(halves.transpose(0, 1), keys.reshape(groups, n_keys, half).transpose(1, 2))


def candidate_pairs(knn: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ranks `(a, b)` in the two halves' descending top-`knn` lists whose sum can be among the best `knn` products.

    Pair `(a, b)` is matched or beaten by every pair `(a', b')` with `a' <= a` and `b' <= b`, that is by
    `(a + 1) * (b + 1) - 1` others, so only pairs with `(a + 1) * (b + 1) <= knn` can make the top `knn` (exact):
    119 of the 1024 pairs for `knn=32` (about `knn * ln(knn)`).
    """
    pairs = [(a, b) for a in range(knn) for b in range(knn // (a + 1))]
    return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


_RANKS: dict = {}


def _candidate_ranks(knn: int, device: torch.device) -> torch.Tensor:
    """`(2, candidates)`, the ranks of [`candidate_pairs`], made once per device (a constant while tracing)."""
    if torch.compiler.is_compiling():
        return torch.tensor(candidate_pairs(knn), device=device)
    if (knn, device) not in _RANKS:
        with torch.inference_mode(False):  # made under inference_mode, it could not be saved for a later backward
            _RANKS[knn, device] = torch.tensor(candidate_pairs(knn), device=device)
    return _RANKS[knn, device]


def select_product_keys(halves: torch.Tensor, keys: torch.Tensor, knn: int):
    """The exact top-`knn` product keys: scores, indices `(tokens, heads, knn)`, from the query halves `(tokens, heads *
    2, half)` and the sub-keys `(heads, 2, n_keys, half)`."""
    return select_from_scores(subkey_scores(halves, keys), knn)


def ranked_topk(values: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`values.topk(knn, dim=-1)` with equal values ranked by position, the lower first (torch.topk leaves their order
    unspecified, and it differs between devices and the native selection): a stable descending sort, one op where a
    packed-key topk dispatched about ten. An exported graph takes torch.topk itself (ONNX's TopK ranks ties so by
    definition)."""
    if is_exporting():
        return values.topk(knn, dim=-1)
    ranked, positions = values.sort(dim=-1, descending=True, stable=True)
    return ranked[..., :knn], positions[..., :knn]


def select_from_scores(scores: torch.Tensor, knn: int):
    """[`select_product_keys`] from the sub-key scores `(heads * 2, tokens, n_keys)`. A product key's score is the sum
    of its two sub-keys' scores, so the best `knn` are among the pairs of each half's top-`knn` (only those of
    [`candidate_pairs`] can win).

    Ties have one order on every path (the native selection's): in each half the lower sub-key index first, and among
    equal product scores the pair of better half ranks (the first half's, then the second's), the order of
    [`candidate_pairs`]. Every pair a candidate pair beats precedes it in that order, so the search stays exact."""
    groups, tokens, n_keys = scores.shape
    half_scores, half_indices = (  # (tokens, heads, 2, knn), descending; the keys of the search made contiguous
        half.view(groups // 2, 2, tokens, knn).permute(2, 0, 1, 3) for half in ranked_topk(scores, knn)
    )
    ranks = _candidate_ranks(knn, scores.device).expand(*half_scores.shape[:2], -1, -1)
    best_scores, best = ranked_topk(half_scores.gather(-1, ranks).sum(2), knn)
    subkeys = half_indices.gather(-1, ranks.gather(-1, best.unsqueeze(2).expand(-1, -1, 2, -1)))
    return best_scores, subkeys[:, :, 0] * n_keys + subkeys[:, :, 1]


def select_native(halves: torch.Tensor, keys: torch.Tensor, knn: int):
    """[`select_product_keys`] with the selection in the native op (`kernels/csrc`, CPU fp32)."""
    return torch.ops.pkm_bert.select_product_keys(subkey_scores(halves, keys), knn)


# ----------------------------------------------------------------------------------------------------------------------
# The value table
# ----------------------------------------------------------------------------------------------------------------------


def table_kind(values: nn.Module) -> str:
    """"plain": a `ProductKeyValues` whose read is the weighted sum of rows; "quantized"; "other" (any other module)."""
    if isinstance(values, QuantizedProductKeyValues):
        return "quantized"
    plain = type(values) is ProductKeyValues and values.max_norm is None and values.padding_idx is None
    return "plain" if plain else "other"


class ProductKeyValues(nn.EmbeddingBag):
    r"""
    The value table of a [`ProductKeyMemory`]: an `nn.EmbeddingBag(num_slots, v_dim, mode="sum")` (same `weight`, same
    call `values(indices, per_sample_weights=weights)`, same output), whose training backward on CPU may take the fast
    path of the plan (`product_key_memory_ops.WeightedRowSum`).

    - `sparse=False` (default): a dense `weight.grad` as EmbeddingBag's, which DDP/NCCL, FSDP, `clip_grad_norm_` and
      every optimizer accept.
    - `sparse=True`: `weight.grad` is a coalesced sparse COO tensor over the rows the step used (one row each), for
      `SparseRowAdam` or `torch.optim.SparseAdam`; DDP reads the `sparse` attribute at wrapping time (sparse
      all-reduce needs gloo, not NCCL; FSDP refuses sparse gradients).

    On that CPU path the gradient lives in a buffer reused from step to step (fresh allocations of hundreds of MiB
    cost page faults); `eval()` releases it.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, sparse: bool = False, **kwargs):
        super().__init__(num_embeddings, embedding_dim, mode="sum", sparse=sparse, **kwargs)
        self.workspaces, self.pending = {}, PendingLookups()

    def forward(self, input, offsets=None, per_sample_weights=None):
        weight = self.weight
        if offsets is None and input.dim() == 2 and per_sample_weights is not None and table_kind(self) == "plain":
            needs_grad = torch.is_grad_enabled() and (weight.requires_grad or per_sample_weights.requires_grad)
            plan = plan_lookup(
                weight.device, weight.dtype, needs_grad=needs_grad, compiling=torch.compiler.is_compiling(),
                exporting=is_exporting(),
            )  # fmt: skip
            if plan.value_read == "csr":
                return WeightedRowSum.apply(weight, input, per_sample_weights, self.sparse, self)
            if plan.value_read == "op":
                return row_sum_op(weight, input, per_sample_weights, self.sparse)
        return super().forward(input, offsets, per_sample_weights)

    def train(self, mode: bool = True):
        if not mode:
            self.release_workspace()
        return super().train(mode)

    def release_workspace(self):
        """Frees the gradient buffer kept between training steps (it is made again by the next backward)."""
        self.workspaces.clear()

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "workspaces": {}, "pending": PendingLookups()}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode='sum', sparse={self.sparse}"


# ----------------------------------------------------------------------------------------------------------------------
# Serving: compact value tables, int8 / 4-bit rows in FBGEMM's row-wise layout. `QuantizedProductKeyValues`
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
