"""What a model's hashed n-gram memories do (issue 35): per memory layer, the usage of the hash buckets, the collisions
between distinct n-grams, and the distribution of the gate, on held-out text; and their figure for the memory report.

`NgramUsageTracker(model)` hooks every `NgramMemory` (also a remote-code copy) while attached and recomputes, from the
same inputs, the buckets each real position reads and its gate (the memory's own `context_tokens`, `bucket_indices`,
`mixed_rows` and `gate`): the numbers are exactly those of the forward pass.

- bucket usage: the share of table rows read at least once (per table and over the layer);
- collisions: of the distinct n-grams seen (per order and direction), the share whose bucket some other n-gram seen
  also reads, in at least one hash head and in every head (then no head tells it apart: a true collision);
- gate: the scalar gate of every real token (mean, deciles, a histogram).
"""

import torch
from torch import nn

from ..utils.memories import ngram_memory_modules, readable_name
from .figures import pyplot_module, save_figure


GATE_BINS = 20


class NgramLayerUsage:
    """The counts of one n-gram memory: row hits of its tables, the (bucket, n-gram) pairs seen, the gates."""

    def __init__(self, memory: nn.Module):
        self.memory = memory
        self.row_hits = torch.zeros(memory.tables.weight.shape[0], dtype=torch.int64)
        self.pairs = [[] for _ in range(memory.num_tables)]  # per table: (bucket, n-gram key) tensors
        self.gate_histogram = torch.zeros(GATE_BINS, dtype=torch.int64)
        self.gates = []
        self.tokens = 0

    @torch.no_grad()
    def add(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, history_ids: torch.Tensor | None):
        memory = self.memory
        tokens = memory.context_tokens(input_ids, history_ids)
        indices = memory.bucket_indices(tokens)
        length = input_ids.shape[1]
        gate = memory.gate(hidden_states, memory.mixed_rows(indices, length))[..., 0]
        real = input_ids >= 0
        own = indices[:, memory.conv_left : memory.conv_left + length][real].cpu()  # (tokens, tables)
        self.tokens += int(real.sum())
        self.row_hits += torch.bincount(own.reshape(-1), minlength=self.row_hits.numel())
        keys = self._ngram_keys(tokens)[:, :, memory.conv_left : memory.conv_left + length][:, real].cpu()
        for table in range(memory.num_tables):
            kind = table // memory.heads
            self.pairs[table].append(torch.stack([own[:, table], keys[kind]], dim=1).unique(dim=0))
        gates = gate[real].float().cpu()
        self.gates.append(gates)
        self.gate_histogram += torch.histc(gates, bins=GATE_BINS, min=0.0, max=1.0).to(torch.int64)

    def _ngram_keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """An integer naming each n-gram (its canonical ids in base vocab_size + 1): (kinds, batch, positions)."""
        memory = self.memory
        canonical = tokens.clamp(min=0)
        if memory.token_map is not None:
            canonical = memory.token_map[canonical]
        canonical = torch.where(tokens < 0, memory.vocab_size, canonical)
        reach_left = max(memory.orders) - 1
        reach_right = 0 if memory.causal else max(memory.orders) - 1
        positions = canonical.shape[1] - reach_left - reach_right
        base, keys = memory.vocab_size + 1, []
        for n, direction in memory.kinds:
            start = reach_left - (n - 1) if direction < 0 else reach_left
            key = torch.zeros_like(canonical[:, :positions])
            for j in range(n):  # wraps for very long n-grams: still a key, with a negligible chance of a clash
                key = key * base + canonical[:, start + j : start + j + positions]
            keys.append(key)
        return torch.stack(keys)

    def results(self) -> dict:
        memory = self.memory
        primes, offsets = memory.primes, memory.offsets
        used = [int((self.row_hits[o : o + p] > 0).sum()) for o, p in zip(offsets, primes)]
        shared_any, shared_all, distinct = {}, {}, {}
        for kind_index, (n, direction) in enumerate(memory.kinds):
            name = f"{n}-gram {'ending' if direction < 0 else 'starting'}"
            per_head = []
            for head in range(memory.heads):
                table = kind_index * memory.heads + head
                pairs = torch.cat(self.pairs[table]).unique(dim=0) if self.pairs[table] else torch.zeros(0, 2, dtype=torch.long)
                buckets, bucket_of_pair = pairs[:, 0].unique(return_inverse=True)
                n_grams_in_bucket = torch.bincount(bucket_of_pair, minlength=buckets.numel())
                collided = n_grams_in_bucket[bucket_of_pair] > 1
                per_head.append(dict(zip(pairs[:, 1].tolist(), collided.tolist())))
            keys = set(per_head[0])
            distinct[name] = len(keys)
            shared_any[name] = sum(any(h[k] for h in per_head) for k in keys) / max(len(keys), 1)
            shared_all[name] = sum(all(h[k] for h in per_head) for k in keys) / max(len(keys), 1)
        gates = torch.cat(self.gates) if self.gates else torch.zeros(0)
        deciles = gates.quantile(torch.tensor([0.1, 0.5, 0.9])).tolist() if gates.numel() else [float("nan")] * 3
        return {
            "tokens": self.tokens,
            "rows": int(sum(primes)),
            "bucket_usage": sum(used) / sum(primes),
            "table_usage": [u / p for u, p in zip(used, primes)],
            "distinct_ngrams": distinct,
            "collision_any_head": shared_any,
            "collision_every_head": shared_all,
            "gate_mean": float(gates.mean()) if gates.numel() else float("nan"),
            "gate_p10": deciles[0],
            "gate_p50": deciles[1],
            "gate_p90": deciles[2],
            "gate_histogram": self.gate_histogram.tolist(),
        }


class NgramUsageTracker:
    """Counts the n-gram memories of `model` over the forward passes run while attached (`with tracker:`)."""

    def __init__(self, model: nn.Module):
        self.memories = {readable_name(path): module for path, module in ngram_memory_modules(model).items()}
        self.layers = {name: NgramLayerUsage(module) for name, module in self.memories.items()}
        self._handles = []

    def attach(self):
        for name, module in self.memories.items():
            layer = self.layers[name]

            def hook(module, args, output, layer=layer):
                hidden, ids = args[0], args[1]
                layer.add(hidden, ids, args[2] if len(args) > 2 else None)

            self._handles.append(module.register_forward_hook(hook))
        return self

    def detach(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc):
        self.detach()

    def results(self) -> dict[str, dict]:
        return {name: layer.results() for name, layer in self.layers.items()}


def plot_ngram_usage(layer: str, usage: dict, path: str) -> str:
    """One figure per n-gram layer: bucket usage per table, collisions per n-gram kind, the gate's histogram."""
    plt = pyplot_module()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), layout="constrained")
    tables = usage["table_usage"]
    axes[0].bar(range(len(tables)), [100 * u for u in tables], color="tab:blue")
    axes[0].set_xlabel("hash table (order, direction, head)")
    axes[0].set_ylabel("rows read at least once (%)")
    axes[0].set_title(f"bucket usage: {100 * usage['bucket_usage']:.2f}% of {usage['rows']:,} rows", fontsize=10)
    kinds = list(usage["collision_any_head"])
    x = range(len(kinds))
    axes[1].bar([i - 0.2 for i in x], [100 * usage["collision_any_head"][k] for k in kinds], 0.4, label="in some head")
    axes[1].bar([i + 0.2 for i in x], [100 * usage["collision_every_head"][k] for k in kinds], 0.4, label="in every head")
    labels = [k.replace(" ", "\n") + f"\n({usage['distinct_ngrams'][k]:,} seen)" for k in kinds]
    axes[1].set_xticks(list(x), labels, fontsize=8)
    axes[1].set_ylabel("distinct n-grams sharing a bucket (%)")
    axes[1].set_title("collisions between the n-grams seen", fontsize=10)
    axes[1].set_ylim(0, 118)  # room for the legend above the bars
    axes[1].legend(fontsize=8, loc="upper center", ncol=2)
    edges = [i / GATE_BINS for i in range(GATE_BINS)]
    axes[2].bar(edges, usage["gate_histogram"], width=1 / GATE_BINS, align="edge", color="tab:green")
    axes[2].set_xlim(0, 1)
    axes[2].set_xlabel("gate sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(d))")
    axes[2].set_ylabel("tokens")
    axes[2].set_title(
        f"gate: mean {usage['gate_mean']:.3f}, p10/p50/p90 {usage['gate_p10']:.2f}/{usage['gate_p50']:.2f}/"
        f"{usage['gate_p90']:.2f}",
        fontsize=10,
    )
    fig.suptitle(f"{layer}: n-gram memory over {usage['tokens']:,} tokens", fontsize=11)
    return save_figure(fig, path)


def ngram_report_lines(usage: dict[str, dict], figures: dict[str, str]) -> list[str]:
    """The memory report's section on the n-gram memories."""
    lines = [
        "## n-gram memories",
        "",
        "Bucket usage = share of hash-table rows read at least once; collisions = share of the distinct n-grams seen "
        "whose bucket another n-gram seen also reads (in some hash head / in every head: then no head tells them "
        "apart); gate = the scalar gate of each real token (`modeling_pkm_bert.analysis.ngram_usage`).",
        "",
        "| layer | tokens | rows | bucket usage (%) | collisions, some head (%) | collisions, every head (%) | gate mean "
        "| gate p10 / p50 / p90 |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for layer, m in usage.items():
        distinct = m["distinct_ngrams"]
        total = max(sum(distinct.values()), 1)
        some = sum(m["collision_any_head"][k] * distinct[k] for k in distinct) / total
        every = sum(m["collision_every_head"][k] * distinct[k] for k in distinct) / total
        lines.append(
            f"| {layer} | {m['tokens']} | {m['rows']:,} | {100 * m['bucket_usage']:.2f} | {100 * some:.2f} | "
            f"{100 * every:.3f} | {m['gate_mean']:.3f} | {m['gate_p10']:.2f} / {m['gate_p50']:.2f} / {m['gate_p90']:.2f} |"
        )
    lines.append("")
    for layer, figure in figures.items():
        lines += [f"### {layer} (n-gram memory)", "", f"![{layer}: n-gram memory usage]({figure})", ""]
    return lines


__all__ = ["NgramLayerUsage", "NgramUsageTracker", "ngram_report_lines", "plot_ngram_usage"]
