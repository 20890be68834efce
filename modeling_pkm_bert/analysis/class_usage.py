r"""The per-class memory usage of Kim & Jung (2020), Figure 4: how differently the examples of two classes use each
memory layer (IOU and KL of their usage distributions).

Per-class memory usage (Figure 4). For a two-class task, run the model over the evaluation set and count the
memory usage of each memory layer separately for the tokens of class-0 examples and of class-1 examples (every real
token of an example, `[CLS]` and `[SEP]` included, gets its example's gold label). With the definitions of
`memory_usage` (a token's weight `w(x)_i` summed over heads and normalised to 1; its top-1 slot `argmax_i w(x)_i`),
class `c` has top-1 counts `t'^c`, weight sums `w'^c` and `n_c` tokens, over `N = |K|` slots:

* `top1_iou` = sum_i min(t^1_i, t^0_i) / sum_i max(t^1_i, t^0_i), with `t^c = t'^c / n_c` the top-1 usage
  distribution of class `c` (the paper's IOU, on distributions so that the class sizes do not matter): 1 when the two
  classes pick their top-1 slots in the same proportions, 0 when they share no top-1 slot.
* `top1_set_iou` = |A_1 ∩ A_0| / |A_1 ∪ A_0| with `A_c = {i : t'^c_i > 0}`: the plain IOU of the sets of slots used as
  top-1 at least once.
* `top1_kl` = KL(P_1 ‖ P_0) = sum_i P_1,i log(P_1,i / P_0,i) (natural log) between the classes' smoothed top-1
  distributions `P_c,i = (t'^c_i + 1/N) / (n_c + 1)`: one pseudo-token of uniform weight is added to each class, so
  the divergence stays finite when class 0 never picks a slot that class 1 picks (with 512**2 slots and an evaluation
  set of thousands of tokens that is the rule, not the exception). Direction: class 1 (SST-2's "positive") relative
  to class 0 ("negative"). 0 when the distributions agree; larger means the classes use the memory differently.
* `weight_iou`, `weight_kl`: the same on the weight distributions `w'^c / n_c` (smoothed as
  `(w'^c_i + 1/N) / (n_c + 1)`).
* `tokens_0`, `tokens_1`: `n_0`, `n_1`.

The paper reports, for SST-2, higher KL and lower IOU for its best model (+Init +ResM) than for plain PKM, "implying
better discriminative ability", measured with the pretrained weights and after fine-tuning.
"""

import math
from collections.abc import Sequence

import torch
from torch import nn

from .memory_usage import MemoryUsageAccumulator, MemoryUsageTracker, gather


def _smoothed(counts: torch.Tensor, tokens: int) -> torch.Tensor:
    return (counts.double() + 1.0 / counts.numel()) / (tokens + 1)


def _iou(p: torch.Tensor, q: torch.Tensor) -> float:
    union = torch.maximum(p, q).sum()
    return (torch.minimum(p, q).sum() / union).item() if union > 0 else math.nan


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return torch.special.xlogy(p, p / q).sum().item()


def class_usage_divergence(class_1: MemoryUsageAccumulator, class_0: MemoryUsageAccumulator) -> dict[str, float]:
    """IOU and KL between the memory usage of two classes, as defined in the module docstring.

    Raises:
        ValueError: When the accumulators are of different sizes or one class counted no token.
    """
    if class_1.mem_size != class_0.mem_size:
        raise ValueError(f"accumulators of {class_1.mem_size} and {class_0.mem_size} slots cannot be compared")
    n1, n0 = int(class_1.tokens), int(class_0.tokens)
    if n1 == 0 or n0 == 0:
        raise ValueError(f"class 1 counted {n1} tokens and class 0 {n0}: both classes need evaluation examples")
    t1, t0 = class_1.top1_counts.double().cpu(), class_0.top1_counts.double().cpu()
    w1, w0 = class_1.weight_sums.double().cpu(), class_0.weight_sums.double().cpu()
    used1, used0 = t1 > 0, t0 > 0
    return {
        "top1_iou": _iou(t1 / n1, t0 / n0),
        "top1_set_iou": ((used1 & used0).sum().double() / (used1 | used0).sum()).item(),
        "top1_kl": _kl(_smoothed(t1, n1), _smoothed(t0, n0)),
        "weight_iou": _iou(w1 / n1, w0 / n0),
        "weight_kl": _kl(_smoothed(w1, n1), _smoothed(w0, n0)),
        "tokens_0": n0,
        "tokens_1": n1,
    }


class PerClassMemoryUsage:
    """Memory usage of every memory layer, counted separately for the tokens of each class (a context manager).

    Before each forward, tell it the batch's labels and attention mask with `set_batch(labels, attention_mask)`;
    the hooks see only the real tokens, flattened batch-major (the memory drops padding before the lookup), so each
    token gets the label of its example by repeating the labels by the examples' token counts.

    Args:
        model: A sequence classifier holding `ProductKeyMemory` layers.
        num_labels: The number of classes (examples with another label, e.g. -100, are not counted).

    Attributes:
        accumulators: `{layer name: [MemoryUsageAccumulator of class 0, of class 1, ...]}`, layer names as in
            `memory_usage` (`layer_{i}`).
    """

    def __init__(self, model: nn.Module, num_labels: int):
        self.memories = MemoryUsageTracker(model).memories
        self.num_labels = num_labels
        self.accumulators = {
            name: [MemoryUsageAccumulator(memory.mem_size, memory.values.weight.device) for _ in range(num_labels)]
            for name, memory in self.memories.items()
        }
        self._token_labels = None
        self._hooks = []

    def set_batch(self, labels: torch.Tensor, attention_mask: torch.Tensor | None, sequence_length: int | None = None):
        """The labels `(batch,)` and attention mask `(batch, seq)` of the next forward (no mask: all real)."""
        if attention_mask is None:
            if sequence_length is None:
                raise ValueError("without an attention mask, give the sequence length")
            lengths = torch.full_like(labels, sequence_length)
        else:
            lengths = attention_mask.sum(-1)
        self._token_labels = labels.long().repeat_interleave(lengths.to(labels.device))

    def _hook(self, name: str):
        def count(values: nn.EmbeddingBag, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            indices = args[0] if args else kwargs["input"]
            if indices.shape[0] == 0:  # a padding-only batch (evaluation.shard_batches evens out forwards with them)
                return
            if self._token_labels is None:
                raise RuntimeError("PerClassMemoryUsage.set_batch(labels, attention_mask) must precede each forward")
            weights = kwargs.get("per_sample_weights", args[2] if len(args) > 2 else None)
            token_labels = self._token_labels.to(indices.device)
            if token_labels.shape[0] != indices.shape[0]:
                raise RuntimeError(
                    f"the memory looked up {indices.shape[0]} tokens but the batch's attention mask has "
                    f"{token_labels.shape[0]} real tokens"
                )
            for label, accumulator in enumerate(self.accumulators[name]):
                rows = token_labels == label
                accumulator.update(indices[rows], weights[rows])

        return count

    def attach(self) -> "PerClassMemoryUsage":
        if not self._hooks:
            for name, memory in self.memories.items():
                self._hooks.append(memory.values.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._token_labels = None

    def __enter__(self) -> "PerClassMemoryUsage":
        return self.attach()

    def __exit__(self, *exc_info) -> None:
        self.detach()

    def gather(self, accelerator=None) -> "PerClassMemoryUsage":
        """Sums the counts of all processes (once, on every process); see `memory_usage.gather`."""
        for accumulators in self.accumulators.values():
            for accumulator in accumulators:
                gather(accumulator, accelerator)
        return self

    def results(self, label_names: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
        """`{layer: class_usage_divergence(class 1, class 0)}` for two classes (when both have tokens); plus each
        class's own usage (`mu`, `top1_mu`, `kl_u`, `kl_w`) as `<metric>_<class name>`."""
        names = list(label_names) if label_names is not None else [str(i) for i in range(self.num_labels)]
        results = {}
        for layer, accumulators in self.accumulators.items():
            both_seen = self.num_labels == 2 and all(int(accumulator.tokens) for accumulator in accumulators)
            metrics = class_usage_divergence(accumulators[1], accumulators[0]) if both_seen else {}
            for name, accumulator in zip(names, accumulators):
                if int(accumulator.tokens):
                    own = accumulator.compute()
                    metrics.update({f"{key}_{name}": own[key] for key in ("mu", "top1_mu", "kl_u", "kl_w")})
            results[layer] = metrics
        return results


def format_class_usage(results: dict[str, dict[str, float]]) -> str:
    """A log table of the per-class IOU and KL, one row per memory layer."""
    columns = ("top1_iou", "top1_set_iou", "top1_kl", "weight_iou", "weight_kl", "tokens_0", "tokens_1")
    rows = [["layer", *columns]]
    for layer, metrics in results.items():
        rows.append(
            [
                layer,
                *(
                    f"{metrics[c]:.4f}" if isinstance(metrics.get(c), float) else str(metrics.get(c, "-"))
                    for c in columns
                ),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)



__all__ = ["PerClassMemoryUsage", "class_usage_divergence", "format_class_usage"]
