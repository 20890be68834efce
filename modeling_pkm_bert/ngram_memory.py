"""Hashed n-gram memory (Engram-style, Cheng et al. 2026, "Conditional memory via scalable lookup"), pure torch.

A memory looked up by the input itself rather than by the hidden state: the n-grams around each position are hashed by
several multiply-XOR hash heads into embedding tables of prime sizes, the looked-up rows pass a short depthwise
convolution, and the result is gated by its agreement with the hidden state and added to the residual stream.

Encoders see both sides: n-grams ending at and starting at each position, and a centred convolution. A causal model
(`causal=True`) reads n-grams ending at each position and a causal convolution; since the convolution runs over the
looked-up rows (a function of token ids only), cached generation needs only the last `context_length` tokens
(`history_ids`), not hidden states.

Remote code: this file travels with every saved model; it imports only torch and the standard library.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn


# witnesses that make Miller-Rabin exact below 3.3e23 (Jaeschke; Sorenson & Webster), so for every 64-bit number
_PRIME_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality of `n` < 2**64 (deterministic Miller-Rabin): microseconds where trial division took minutes."""
    if n >= 2**64:
        raise ValueError(f"is_prime({n}): exact below 2**64 only")
    if n < 2:
        return False
    for p in _PRIME_WITNESSES:
        if n % p == 0:
            return n == p
    odd, halvings = n - 1, 0
    while not odd & 1:
        odd, halvings = odd >> 1, halvings + 1
    for witness in _PRIME_WITNESSES:
        x = pow(witness, odd, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(halvings - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=64)
def _largest_primes_below(limit: int, count: int) -> tuple[int, ...]:
    primes, candidate = [], limit
    while len(primes) < count:
        if candidate < 2:
            raise ValueError(f"there are fewer than {count} primes <= {limit}: raise the table size")
        if is_prime(candidate):
            primes.append(candidate)
        candidate -= 1
    return tuple(primes)


def largest_primes_below(limit: int, count: int) -> list[int]:
    """The `count` largest primes <= `limit` (< 2**64), largest first (distinct prime table sizes keep the hash heads'
    collisions independent of each other). About `count * ln(limit)` candidates are tested: the config bounds
    `count` (the tables) before calling it."""
    return list(_largest_primes_below(int(limit), int(count)))


def hash_multipliers(seed: int, count: int) -> list[int]:
    """`count` odd multipliers below 2**31 from splitmix64 of `seed`: fixed by the seed alone (no global random state),
    so that a saved model hashes the same way when loaded. With ids below 2**31 the products stay below 2**62."""
    state, multipliers = seed & (2**64 - 1), []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
        mixed = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        multipliers.append(((mixed ^ (mixed >> 31)) & (2**31 - 1)) | 1)
    return multipliers


class NgramMemory(nn.Module):
    r"""
    Maps hidden states `(batch, seq, hidden_size)` and the token ids of the same positions to `(batch, seq,
    hidden_size)`, to be added to the residual stream.

    For each position, each n-gram kind (an order in `orders`; ending at the position, and with `causal=False` also
    starting at it) is hashed by `heads` hash heads, each into a table of its own of a distinct prime size (the largest
    primes <= `table_size`); the `kinds * heads` rows of `dim` features are concatenated into `e`. Then
    `x = e + silu(conv(RMSNorm(e)))` with a depthwise convolution of `conv_kernel` taps over the positions (centred, or
    causal), `k = W_k x`, `v = W_v x`, a scalar gate `g = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(hidden_size))` from the
    hidden state `h`, and the output `g * v`. `W_v` and the convolution start at zero: a memory added to a trained
    model leaves its function unchanged until it learns.

    Token ids are hashed as given, after masking: a `[MASK]` enters as itself, so the memory never reads a hidden token.
    Ids < 0 (the model passes padding as -1) and the positions beyond either end of the sequence enter as one reserved
    id, `vocab_size`, so n-grams crossing padding or an edge are explicit, and the output at padding is zero: a padded
    sequence gives its real tokens the same outputs as the unpadded one. Special tokens ([CLS], [SEP]) enter as
    themselves. `token_map=True` adds a `token_map` buffer (filled by the caller, saved with the model) that maps every
    id to a canonical id (e.g. lowercase and accent-folded forms of the vocabulary) before hashing.

    All tables are rows of one `nn.Embedding`, `tables` (`sparse=True`: a sparse gradient over the rows a step used);
    table `t` holds rows `[offsets[t], offsets[t] + primes[t])`. `table_factory(rows, dim, sparse)` builds another
    module for them, read as bags of one row each (`tables(indices (n, 1), per_sample_weights=ones) -> (n, dim)`, an
    `nn.EmbeddingBag` in sum mode): the models pass the product-key memory's `ProductKeyValues`, whose dense backward
    writes into a buffer reused between steps (an `nn.Embedding` allocates and zero-fills a table-sized gradient every
    step), or, for serving, packed int8/4-bit rows (`QuantizedProductKeyValues`, made by `quantize_memory_values`).
    """

    # how errors name this memory (BertPkmLayer sets e.g. "encoder.layer.1.ngram")
    layer_name = "NgramMemory"

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        orders: tuple[int, ...] = (2, 3),
        heads: int = 4,
        table_size: int = 65536,
        dim: int = 32,
        conv_kernel: int = 3,
        causal: bool = False,
        token_map: bool = False,
        seed: int = 0,
        sparse: bool = False,
        table_factory=None,
    ):
        super().__init__()
        if not orders or any(int(n) < 1 for n in orders) or len(set(orders)) != len(orders):
            raise ValueError(f"orders={orders!r}: distinct n-gram orders >= 1 are needed")
        if heads < 1 or dim < 1 or conv_kernel < 1 or vocab_size < 1:
            raise ValueError(f"heads={heads}, dim={dim}, conv_kernel={conv_kernel}, vocab_size={vocab_size}: each >= 1")
        if vocab_size >= 2**31:
            raise ValueError(f"vocab_size={vocab_size}: the hash needs ids below 2**31")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.orders, self.heads, self.dim = tuple(int(n) for n in orders), heads, dim
        self.causal, self.conv_kernel = causal, conv_kernel
        # (order, direction) pairs; direction +1: the n-gram starting at the position, -1: ending at it
        self.kinds = [(n, -1) for n in self.orders] + ([] if causal else [(n, +1) for n in self.orders])
        self.num_tables = len(self.kinds) * heads
        self.primes = largest_primes_below(table_size, self.num_tables)
        self.offsets = [sum(self.primes[:t]) for t in range(self.num_tables)]
        # one multiplier per table and n-gram position: rows of the longest order, shorter orders use a prefix
        self.multipliers = hash_multipliers(seed, self.num_tables * max(self.orders))
        # fixed by the arguments, never saved (a model built on the meta device refills them: `hash_buffers`)
        for name, value in self.hash_buffers().items():
            self.register_buffer(name, value, persistent=False)
        if token_map:
            self.register_buffer("token_map", torch.arange(vocab_size))
        else:
            self.token_map = None

        # the positions the convolution reads beyond a position, and the tokens the outermost n-grams reach
        self.conv_left = conv_kernel - 1 if causal else (conv_kernel - 1) // 2
        self.conv_right = conv_kernel - 1 - self.conv_left
        self.context_left = self.conv_left + max(self.orders) - 1
        self.context_right = self.conv_right + (0 if causal else max(self.orders) - 1)

        memory_dim = self.num_tables * dim
        rows = sum(self.primes)
        self.tables = nn.Embedding(rows, dim, sparse=sparse) if table_factory is None else table_factory(rows, dim, sparse)
        self.embedding_norm = nn.RMSNorm(memory_dim, eps=1e-6)
        self.conv = nn.Conv1d(memory_dim, memory_dim, conv_kernel, groups=memory_dim)
        self.key = nn.Linear(memory_dim, hidden_size)
        self.value = nn.Linear(memory_dim, hidden_size)
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.key_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.reset_parameters()

    def hash_buffers(self) -> dict[str, torch.Tensor]:
        return {
            "table_primes": torch.tensor(self.primes),
            "table_offsets": torch.tensor(self.offsets),
            "hash_multipliers": torch.tensor(self.multipliers).view(self.num_tables, max(self.orders)),
        }

    @property
    def context_length(self) -> int:
        """Earlier tokens a causal memory reads for the first new position (what cached generation passes)."""
        return self.context_left

    @property
    def sparse(self) -> bool:
        return self.tables.sparse

    @sparse.setter
    def sparse(self, sparse: bool):
        self.tables.sparse = bool(sparse)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        history_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids` (batch, seq): the ids of the positions of `hidden_states`, < 0 at padding. `history_ids` (batch,
        context_length), causal only: the tokens before them (cached generation; < 0 where there is none)."""
        if input_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(
                f"{self.layer_name}: input_ids of shape {tuple(input_ids.shape)} must match the hidden states' "
                f"{tuple(hidden_states.shape[:-1])}"
            )
        tokens = self.context_tokens(input_ids, history_ids)
        x = self.mixed_rows(self.bucket_indices(tokens), input_ids.shape[1])
        output = self.gate(hidden_states, x) * self.value(x)
        return output.masked_fill((input_ids < 0)[..., None], 0.0)

    def context_tokens(self, input_ids: torch.Tensor, history_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The ids with the context the n-grams and the convolution reach beyond them: `history_ids` or the boundary
        (-1) on the left, the boundary on the right; (batch, context_left + seq + context_right)."""
        boundary = torch.full((), -1, dtype=torch.long, device=input_ids.device)
        left = boundary.expand(input_ids.shape[0], self.context_left)
        if history_ids is not None:
            if not self.causal:
                raise ValueError(f"{self.layer_name}: history_ids are for causal memories (cached generation)")
            if history_ids.shape != left.shape:
                raise ValueError(
                    f"{self.layer_name}: history_ids of shape {tuple(history_ids.shape)} must be (batch, "
                    f"context_length) = {tuple(left.shape)}"
                )
            left = history_ids.long()
        right = boundary.expand(input_ids.shape[0], self.context_right)
        return torch.cat([left, input_ids.long(), right], dim=1)

    def mixed_rows(self, indices: torch.Tensor, length: int) -> torch.Tensor:
        """`x = e + silu(conv(RMSNorm(e)))` at the `length` positions, `e` the concatenated rows of `indices` (batch,
        length + conv_kernel - 1, num_tables)."""
        embeddings = self.table_rows(indices).flatten(-2)
        mixed = self.conv(self.embedding_norm(embeddings).transpose(1, 2)).transpose(1, 2)
        return embeddings[:, self.conv_left : self.conv_left + length] + F.silu(mixed)

    def table_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of `tables` at `indices` (any shape): `(*indices.shape, dim)`."""
        if isinstance(self.tables, nn.Embedding):
            return self.tables(indices)
        # a bag of one row per index (packed rows come dequantised to fp32: then in the projections' dtype)
        flat, weight = indices.reshape(-1, 1), self.tables.weight
        ones = torch.ones(flat.shape, dtype=weight.dtype if weight.is_floating_point() else torch.float32, device=flat.device)
        rows = self.tables(flat, per_sample_weights=ones).to(self.key.weight.dtype)
        return rows.view(*indices.shape, self.dim)

    def gate(self, hidden_states: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The scalar gate of each position, `sigmoid(RMSNorm(h) . RMSNorm(W_k x) / sqrt(hidden_size))`: (..., 1)."""
        key = self.key_norm(self.key(x))
        return torch.sigmoid((self.hidden_norm(hidden_states) * key).sum(-1, keepdim=True) / self.hidden_size**0.5)

    def bucket_indices(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of `tables` read at each position of `tokens` (`context_tokens`; < 0: the boundary) whose n-grams lie
        inside it: (batch, positions, num_tables), positions = the length less the n-grams' reach on both sides."""
        boundary = self.vocab_size
        canonical = tokens.clamp(min=0)
        if self.token_map is not None:
            canonical = self.token_map[canonical]
        canonical = torch.where(tokens < 0, boundary, canonical)
        reach_left = max(self.orders) - 1
        reach_right = 0 if self.causal else max(self.orders) - 1
        positions = canonical.shape[1] - reach_left - reach_right
        hashes = []
        for n, direction in self.kinds:
            start = reach_left - (n - 1) if direction < 0 else reach_left
            grams = [canonical[:, start + j : start + j + positions] for j in range(n)]  # (batch, positions) each
            for _ in range(self.heads):
                hashes.append(grams)
        multipliers = self.hash_multipliers  # (num_tables, max order)
        result = []
        for t, grams in enumerate(hashes):
            h = grams[0] * multipliers[t, 0]
            for j in range(1, len(grams)):
                h = torch.bitwise_xor(h, grams[j] * multipliers[t, j])
            result.append(h)
        hashed = torch.stack(result, dim=-1)  # (batch, positions, num_tables)
        return torch.remainder(hashed, self.table_primes) + self.table_offsets

    def reset_parameters(self):
        if self.tables.weight.is_floating_point():  # packed rows are only ever loaded
            nn.init.normal_(self.tables.weight, std=self.dim**-0.5)
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)
        nn.init.zeros_(self.value.weight)
        nn.init.zeros_(self.value.bias)

    def extra_repr(self) -> str:
        return (
            f"orders={self.orders}, heads={self.heads}, tables={self.num_tables} of primes {self.primes[-1]}.."
            f"{self.primes[0]}, dim={self.dim}, causal={self.causal}, conv_kernel={self.conv_kernel}"
        )


__all__ = ["NgramMemory", "hash_multipliers", "is_prime", "largest_primes_below"]
