"""The memory report's figures (matplotlib, Agg, imported only when a figure is drawn): the slot heat maps and sorted
usage curves of a product-key memory, staleness (Figure 2), per-class usage (Figure 4), training curves (Figure 3),
and the helpers every figure of the package uses (`pyplot_module`, `save_figure`). A module of its own, below the
report and the n-gram usage, so that neither imports the other for a figure."""

import math

import torch

from .metrics_log import is_finite


DPI = 80


def pyplot_module():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> str:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    pyplot_module().close(fig)
    return path


def plot_slot_heatmaps(accumulator, n_keys: int, layer: str, path: str) -> str:
    """Top-1 counts and weight sums of every slot on the `n_keys x n_keys` product-key grid, log colour scale."""
    plt = pyplot_module()
    import numpy as np
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")  # the colour bars' labels keep clear
    fig.get_layout_engine().set(wspace=0.08)
    tokens = int(accumulator.tokens)
    panels = (
        (accumulator.top1_counts.double(), "top-1 picks (tokens)"),
        (accumulator.weight_sums.double(), "summed weight (tokens)"),
    )
    for ax, (counts, unit) in zip(axes, panels):
        grid = counts.cpu().reshape(n_keys, n_keys).numpy()
        positive = grid[grid > 0]
        masked = np.ma.masked_less_equal(grid, 0)
        cmap = plt.get_cmap("viridis").with_extremes(bad="white")
        vmin = positive.min() if positive.size else 1e-3
        vmax = max(positive.max() if positive.size else 1.0, vmin * 1.0001)
        image = ax.imshow(masked, cmap=cmap, norm=LogNorm(vmin=vmin, vmax=vmax), interpolation="nearest", origin="lower")
        ax.set_xlabel("sub-key index, 2nd half of the query")
        ax.set_ylabel("sub-key index, 1st half of the query")
        unused = 100 * (grid <= 0).mean()
        ax.set_title(f"{unit.split(' (')[0]}; white = never ({unused:.1f}% of slots)", fontsize=10)
        fig.colorbar(image, ax=ax, label=f"{unit}, log scale", shrink=0.85)
    fig.suptitle(f"{layer}: usage of the {n_keys}x{n_keys} memory slots over {tokens:,} tokens", fontsize=11)
    return save_figure(fig, path)


def plot_usage_curve(accumulator, metrics: dict, layer: str, path: str) -> str:
    """Share of lookups held by the most-used share of slots (a Lorenz-style curve), for u, w and top-1 counts."""
    plt = pyplot_module()
    fig, ax = plt.subplots(figsize=(6, 4.4))
    size = accumulator.mem_size
    curves = (
        (accumulator.used_counts.double(), "selected in top-k (u)", "-"),
        (accumulator.weight_sums.double(), "weight (w)", "--"),
        (accumulator.top1_counts.double(), "top-1 picks (t)", ":"),
    )
    x = torch.arange(0, size + 1, dtype=torch.float64) / size * 100
    for counts, label, style in curves:
        held = torch.cat([torch.zeros(1, dtype=torch.float64), counts.cpu().sort(descending=True).values.cumsum(0)])
        ax.plot(x.numpy(), (100 * held / held[-1]).numpy(), style, label=label)
    ax.plot([0, 100], [0, 100], color="grey", linewidth=0.8, label="uniform use")
    summary = (
        f"MU {100 * metrics['mu']:.2f}%, top-1 MU {100 * metrics['top1_mu']:.2f}%\n"
        f"KL_u {metrics['kl_u']:.4f}, KL_w {metrics['kl_w']:.4f}\n"
        f"Gini_u {metrics['gini_u']:.4f}, Gini_w {metrics['gini_w']:.4f}"
    )
    ax.plot([], [], " ", label=summary)
    ax.set_xlabel("most-used slots (% of all slots)")
    ax.set_ylabel("share of lookups they receive (%)")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 101)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{layer}: sorted slot usage ({size:,} slots, {int(accumulator.tokens):,} tokens)", fontsize=10)
    return save_figure(fig, path)


def plot_staleness(histograms: dict[str, dict[str, dict[str, int]]], labels: list[str], path: str, title: str) -> str:
    """Figure 2: per run and layer, the share of slots by the step range of their last top-1 pick (and never)."""
    plt = pyplot_module()
    import numpy as np

    series = [(run, layer, counts) for run, layers in histograms.items() for layer, counts in layers.items()]
    columns = ["never", *labels]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(columns) + 2), 4.4))
    width = 0.8 / max(len(series), 1)
    for i, (run, layer, counts) in enumerate(series):
        total = sum(counts.values())
        heights = [100 * counts.get(c, 0) / total for c in columns]
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar(np.arange(len(columns)) + offset, heights, width, label=f"{run} {layer}".strip())
    ax.set_xticks(range(len(columns)), ["never"] + [f"steps {c}" for c in labels], rotation=20, ha="right")
    ax.set_xlabel("training steps of the slot's last top-1 pick")
    ax.set_ylabel("memory slots (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2 if len(series) > 4 else 1)
    return save_figure(fig, path)


def plot_class_usage(results: dict[str, dict], label_names: list[str], path: str, title: str) -> str:
    """Figure 4: per layer, each class's top-1 MU, and the top-1 KL and IOU between the two classes."""
    plt = pyplot_module()
    import numpy as np

    layers = list(results)
    two = all("top1_kl" in results[layer] for layer in layers)
    fig, axes = plt.subplots(1, 3 if two else 1, figsize=(12 if two else 5, 3.8), squeeze=False)
    axes = axes[0]
    x = np.arange(len(layers))
    width = 0.8 / len(label_names)
    for i, name in enumerate(label_names):
        heights = [100 * results[layer].get(f"top1_mu_{name}", float("nan")) for layer in layers]
        axes[0].bar(x + (i - (len(label_names) - 1) / 2) * width, heights, width, label=f"class {name}")
    axes[0].set_ylabel("top-1 memory usage (% of slots)")
    axes[0].set_title("top-1 MU per class", fontsize=10)
    axes[0].legend(fontsize=8)
    if two:
        axes[1].bar(x, [results[layer]["top1_kl"] for layer in layers], color="tab:red")
        axes[1].set_ylabel("KL(class 1 || class 0) of top-1 usage (nats)")
        axes[1].set_title("KL between the classes (higher: more distinct)", fontsize=10)
        axes[2].bar(x, [results[layer]["top1_iou"] for layer in layers], color="tab:green")
        axes[2].set_ylabel("IOU of top-1 usage (0-1)")
        axes[2].set_ylim(0, 1)
        axes[2].set_title("IOU between the classes (lower: more distinct)", fontsize=10)
    for ax in axes:
        ax.set_xticks(x, layers)
        ax.set_xlabel("memory layer")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_training_curves(runs: dict[str, list[dict]], path: str, title: str, max_perplexity: float | None = None) -> str:
    """Figure 3: training loss per step (smoothed) and the perplexity of every validation set at each evaluation,
    one colour per run."""
    plt = pyplot_module()
    sets = sorted({key[5:-11] for records in runs.values() for r in records for key in r if _is_perplexity(key, r)})
    panels = 1 + len(sets)
    columns = min(panels, 2)
    rows = math.ceil(panels / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.6 * rows), squeeze=False)
    axes = axes.flatten()
    for ax in axes[panels:]:
        ax.axis("off")
    axes = axes[:panels]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (run, records) in enumerate(runs.items()):
        colour = colours[index % len(colours)]
        steps = [r["step"] for r in records if is_finite(r.get("loss"))]
        losses = [r["loss"] for r in records if is_finite(r.get("loss"))]
        if losses:
            window = max(1, len(losses) // 8)
            windows = [losses[max(0, i - window + 1) : i + 1] for i in range(len(losses))]
            smooth = [sum(w) / len(w) for w in windows]
            axes[0].plot(steps, smooth, color=colour, label=run)
        for ax, name in zip(axes[1:], sets):
            key = f"eval_{name}_perplexity"
            points = [(r["step"], r[key]) for r in records if _is_perplexity(key, r)]
            if points:
                ax.plot(*zip(*points), "o-", color=colour, markersize=3, label=run)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("training loss (nats/token, moving average)")
    axes[0].set_title("training loss", fontsize=10)
    axes[0].legend(*_handles(axes), fontsize=8)  # one legend: the runs have the same colour in every panel
    for ax, name in zip(axes[1:], sets):
        ax.set_xlabel("optimizer step")
        low, high = ax.get_ylim()
        wide = low > 0 and high / low > 20  # a log scale only where the values span orders of magnitude
        ax.set_ylabel("masked-LM perplexity" + (" (log scale)" if wide else ""))
        if wide:
            ax.set_yscale("log")
        if max_perplexity is not None:
            ax.set_ylim(top=max_perplexity)
        ax.set_title(f"held-out perplexity: {name}", fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def _handles(axes):
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    return list(handles.values()), list(handles)


def _is_perplexity(key: str, record: dict) -> bool:
    return key.startswith("eval_") and key.endswith("_perplexity") and is_finite(record.get(key))


__all__ = [
    "plot_class_usage",
    "plot_slot_heatmaps",
    "plot_staleness",
    "plot_training_curves",
    "plot_usage_curve",
    "pyplot_module",
    "save_figure",
]
