"""Product key memory (Lample et al. 2019, XLM `pq_fast`), pure torch, all heads batched."""

import torch
import torch.nn.functional as F
from torch import nn


class ProductKeyMemory(nn.Module):
    r"""
    Maps `(..., input_dim)` to `(..., v_dim)`: a query network (Linear + BatchNorm) gives each head a query that is
    split in two halves; each half scores its own `n_keys` sub-keys, and the exact top-`knn` of the `n_keys ** 2`
    product keys comes from the top-`knn` of each half. The softmax (in fp32) of the `knn` scores of each head weights
    the selected value rows, and the heads are summed.

    Slot `i1 * n_keys + i2` pairs row `i1` of `keys[h, 0]` (first half of the query) with row `i2` of `keys[h, 1]`.
    Padding tokens (`attention_mask == 0`) are neither looked up nor counted in the BatchNorm statistics; their output is
    zero.
    """

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
        self.input_dim, self.v_dim = input_dim, v_dim or input_dim
        self.n_keys, self.heads, self.knn, self.k_dim = n_keys, heads, knn, k_dim
        self.value_init = value_init

        self.input_dropout = nn.Dropout(input_dropout)
        self.query_proj = nn.Linear(input_dim, heads * k_dim, bias=query_bias)
        self.query_batchnorm = nn.BatchNorm1d(heads * k_dim) if query_batchnorm else nn.Identity()
        self.query_dropout = nn.Dropout(query_dropout)
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, k_dim // 2))
        self.values = nn.EmbeddingBag(n_keys**2, self.v_dim, mode="sum")
        self.value_dropout = nn.Dropout(value_dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # XLM's uniform keys: the bound of nn.Linear for fan-in k_dim / 2; values N(0, v_dim^-1/2) or zeros
        bound = (self.k_dim // 2) ** -0.5
        nn.init.uniform_(self.keys, -bound, bound)
        if self.value_init == "zeros":
            nn.init.zeros_(self.values.weight)
        else:
            nn.init.normal_(self.values.weight, mean=0.0, std=self.v_dim**-0.5)
        self.query_proj.reset_parameters()
        if isinstance(self.query_batchnorm, nn.BatchNorm1d):
            self.query_batchnorm.reset_parameters()

    @property
    def mem_size(self) -> int:
        return self.n_keys**2

    def search(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-`knn` product keys of each head: `(..., heads, k_dim)` -> scores, indices `(..., heads, knn)`."""
        if queries.shape[-2:] != (self.heads, self.k_dim):
            raise ValueError(f"queries must end in (heads, k_dim) = {(self.heads, self.k_dim)}, got {tuple(queries.shape)}")
        batch_shape, knn, n_keys = queries.shape[:-2], self.knn, self.n_keys
        halves = queries.reshape(-1, self.heads * 2, self.k_dim // 2).transpose(0, 1)  # (heads * 2, tokens, half)
        subkey_scores = torch.bmm(halves, self.keys.to(halves.dtype).flatten(0, 1).transpose(1, 2))
        half_scores, half_indices = subkey_scores.topk(knn, dim=-1)  # (heads * 2, tokens, knn)
        half_scores = half_scores.unflatten(0, (self.heads, 2))
        half_indices = half_indices.unflatten(0, (self.heads, 2))
        # a product key is the concatenation of its two sub-keys, so its score is the sum of the halves' scores
        candidate_scores = half_scores[:, 0, :, :, None] + half_scores[:, 1, :, None, :]  # (heads, tokens, knn, knn)
        candidate_indices = half_indices[:, 0, :, :, None] * n_keys + half_indices[:, 1, :, None, :]
        scores, best = candidate_scores.flatten(-2).topk(knn, dim=-1)  # (heads, tokens, knn)
        indices = candidate_indices.flatten(-2).gather(-1, best)
        return (
            scores.transpose(0, 1).reshape(*batch_shape, self.heads, knn),
            indices.transpose(0, 1).reshape(*batch_shape, self.heads, knn),
        )

    def lookup(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The memory on a flat batch of tokens: `(tokens, input_dim)` -> `(tokens, v_dim)`."""
        queries = self.query_proj(self.input_dropout(hidden_states))
        queries = self.query_dropout(self.query_batchnorm(queries))
        scores, indices = self.search(queries.unflatten(-1, (self.heads, self.k_dim)))
        weights = F.softmax(scores.float(), dim=-1)
        output = self.values(
            indices.flatten(1), per_sample_weights=weights.flatten(1).to(self.values.weight.dtype)
        )  # the bag sums knn rows of every head: heads are summed
        return self.value_dropout(output.to(hidden_states.dtype))

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
        # padding is skipped: it must not shift the BatchNorm statistics nor cost lookups
        real = attention_mask.reshape(-1).nonzero().squeeze(1)
        output = flat.new_zeros(flat.shape[0], self.v_dim)
        if real.numel():
            output = output.index_copy(0, real, self.lookup(flat.index_select(0, real)))
        return output.view(*batch_shape, self.v_dim)

    def extra_repr(self) -> str:
        return (
            f"input_dim={self.input_dim}, v_dim={self.v_dim}, n_keys={self.n_keys} ({self.mem_size} slots), "
            f"heads={self.heads}, knn={self.knn}, k_dim={self.k_dim}"
        )


__all__ = ["ProductKeyMemory"]
