r"""Memory utilisation of product key memories: Kim & Jung (2020) section 3.2 plus XLM's statistics.

Usage during evaluation (the hooks cost nothing once the `with` block is left)::

    with track_memory_usage(model) as tracker:
        for batch in eval_dataloader:
            model(**batch)
    gather(tracker, accelerator)                # sums the counts of all processes (once, on every process)
    logger.info(format_memory_usage(tracker.results()))
    all_results.update(flatten_memory_usage(tracker.results()))  # {"memory/layer_4/mu": ..., ...}

How it is fed: every `ProductKeyMemory` reads its values through `self.values(indices, per_sample_weights=weights)`
(an `nn.EmbeddingBag` in sum mode) with `indices` and softmax `weights` of shape `(tokens, heads * knn)`, for real
tokens only (padding is removed before the lookup, so it is never counted). The tracker hooks that call.

Definitions, for a memory of `|K|` slots and a token `x`:

* `w(x)_i` is the total weight slot `i` receives from `x`: the values are shared by the heads, so a slot chosen by
  several heads gets the sum of their weights (what the EmbeddingBag adds up). It is normalised per token to sum to 1,
  i.e. divided by the token's total weight (= `heads`, each head's softmax summing to 1); a token whose weights are
  all zero adds nothing but its count.
* `u'_i` = number of tokens with `w(x)_i > 0`: a slot counts once per token however many heads chose it, and a
  selected slot whose weight underflowed to exactly 0 does not count. (XLM instead counts every selection, duplicates
  and zero weights included.)
* `t'_i` = number of tokens whose `argmax_j w(x)_j` is `i` (largest summed weight, not the top-1 of one head).
  Exact ties go to the lowest slot index.
* `w'_i = sum_x w(x)_i` (so `sum_i w'_i` is the number of tokens).

From these (`u`, `w` are `u'`, `w'` normalised to sum to 1; `N = |K|`; `0 log 0 = 0`; logs are natural):

* `mu` = fraction of slots with `u' > 0` (= XLM's `mem_used` / 100, which tests `w' > 0`);
  `top1_mu` = fraction with `t' > 0`. Both are fractions in [0, 1]; the paper prints them in %.
* `kl_u = log N + sum_i u_i log u_i`, `kl_w` likewise with `w`: the KL divergence from the uniform distribution,
  0 when every slot is used equally, `log N` when a single slot takes everything.
* `gini_u`, `gini_w`: the Gini coefficient of `u` and `w`, `1 + 1/N - 2 mean(cumsum(sort(p)))`, which equals the
  mean absolute difference formula `sum_ij |p_i - p_j| / (2 N)`: 0 for uniform use, `1 - 1/N` when one slot takes
  everything. XLM's `1 - 2 mean(cumsum(sort(p)))` is this minus `1/N` (negative for uniform use; the two differ by
  4e-6 at 512**2 slots).
* `top50_w`, `top90_w`, `top99_w` (and `_u`): the smallest number of most-used slots whose share of `w` (of `u`) is
  at least 50 / 90 / 99 %. XLM's `N - searchsorted(cumsum(sort(p)), [0.5, 0.1, 0.01])` asks for strictly more than
  that share; the two differ only when a top-n share equals the fraction exactly.
* `tokens`: the number of tokens counted.
"""

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..utils.memories import memory_modules, readable_name


TOP_PERCENTS = {"top50": 50, "top90": 90, "top99": 99}
_COUNT_NAMES = ("tokens", "used_counts", "top1_counts", "weight_sums")


class MemoryUsageAccumulator:
    """Streaming counts `u'`, `t'`, `w'` of one memory (O(mem_size) state) and the metrics computed from them.

    The state lives in int64 / float64 tensors on `device` (the memory's device, so updates never leave it; MPS has no
    float64, so it accumulates on the CPU there).

    Attributes:
        mem_size: The number of memory slots `|K|`.
        tokens: 0-d int64 tensor, the number of tokens counted.
        used_counts: `u'`, int64 of shape `(mem_size,)`.
        top1_counts: `t'`, int64 of shape `(mem_size,)`.
        weight_sums: `w'`, float64 of shape `(mem_size,)`.
    """

    def __init__(self, mem_size: int, device: torch.device | str | None = None):
        if mem_size < 1:
            raise ValueError(f"mem_size={mem_size} must be >= 1")
        self.mem_size = mem_size
        device = _accumulation_device(device)
        self.tokens = torch.zeros((), dtype=torch.long, device=device)
        self.used_counts = torch.zeros(mem_size, dtype=torch.long, device=device)
        self.top1_counts = torch.zeros(mem_size, dtype=torch.long, device=device)
        self.weight_sums = torch.zeros(mem_size, dtype=torch.float64, device=device)

    @property
    def device(self) -> torch.device:
        return self.weight_sums.device

    def to(self, device: torch.device | str) -> "MemoryUsageAccumulator":
        """Moves the state to `device` (the CPU instead of MPS) and returns `self`."""
        device = _accumulation_device(device)
        for name in _COUNT_NAMES:
            setattr(self, name, getattr(self, name).to(device))
        return self

    @torch.no_grad()
    def update(self, indices: torch.Tensor, weights: torch.Tensor) -> None:
        """Counts the lookups of a batch of tokens.

        Args:
            indices: Slot indices of shape `(tokens, heads * knn)` or `(tokens, heads, knn)`, int64 or int32.
            weights: The matching weights (softmax per head), same shape, floating point, finite and >= 0.

        Raises:
            ValueError / TypeError: On a shape, dtype, index range or weight value that is not as above.
        """
        indices, weights = self._validated(indices, weights)
        if indices.shape[0] == 0:
            return
        indices = indices.to(self.device, torch.long)
        weights = weights.detach().to(self.device, torch.float64)
        totals = weights.sum(1, keepdim=True)
        has_weight = totals.squeeze(1) > 0
        weights = weights / torch.where(has_weight[:, None], totals, 1.0)  # w(x) sums to 1 per token

        self.weight_sums.index_add_(0, indices.flatten(), weights.flatten())
        # adding 0/1 flags rather than selecting with a mask: no device sync
        slots, slot_weights = merge_duplicate_slots(indices, weights)
        self.used_counts.index_add_(0, slots.flatten(), (slot_weights > 0).long().flatten())
        # argmax returns the first maximum and the slots of a row are sorted: ties go to the lowest slot
        top1 = slots.gather(1, slot_weights.argmax(1, keepdim=True)).squeeze(1)
        self.top1_counts.index_add_(0, top1, has_weight.long())
        self.tokens += indices.shape[0]

    def _validated(self, indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if indices.shape != weights.shape:
            raise ValueError(f"indices {tuple(indices.shape)} and weights {tuple(weights.shape)} must have one shape")
        if indices.dim() not in (2, 3):
            raise ValueError(f"indices must be (tokens, heads * knn) or (tokens, heads, knn): {tuple(indices.shape)}")
        if indices.dtype not in (torch.long, torch.int):
            raise TypeError(f"indices must be int64 or int32, got {indices.dtype}")
        if not weights.is_floating_point():
            raise TypeError(f"weights must be floating point, got {weights.dtype}")
        indices, weights = indices.flatten(1), weights.flatten(1)
        if indices.numel():
            # one device sync for all checks
            below, above, bad_weight = torch.stack(
                [indices.min() < 0, indices.max() >= self.mem_size, ~(weights.isfinite() & (weights >= 0)).all()]
            ).tolist()
            if below or above:
                raise ValueError(
                    f"indices must lie in [0, mem_size={self.mem_size}), "
                    f"got [{indices.min().item()}, {indices.max().item()}]"
                )
            if bad_weight:
                raise ValueError("weights must be finite and >= 0 (softmax weights, not scores)")
        return indices, weights

    def compute(self) -> dict[str, float]:
        """The metrics of the module docstring: `mu`, `top1_mu`, `kl_u`, `kl_w`, `gini_u`, `gini_w`, `top50_u`, ...

        Raises:
            ValueError: When no token (or no token with a positive weight) has been counted.
        """
        tokens = int(self.tokens)
        if tokens == 0:
            raise ValueError("no tokens were counted: run the model on some data while the memory usage is tracked")
        if not bool((self.weight_sums > 0).any()):
            raise ValueError(f"the {tokens} tokens counted all had zero weights: there is no usage to measure")
        used, weights = self.used_counts.double(), self.weight_sums
        metrics = {
            "mu": (self.used_counts > 0).double().mean().item(),
            "top1_mu": (self.top1_counts > 0).double().mean().item(),
            "kl_u": _kl_from_uniform(used),
            "kl_w": _kl_from_uniform(weights),
            "gini_u": _gini(used),
            "gini_w": _gini(weights),
        }
        for suffix, counts in (("u", used), ("w", weights)):
            for name, held in zip(TOP_PERCENTS, _top_slots_holding(counts, TOP_PERCENTS.values())):
                metrics[f"{name}_{suffix}"] = held
        metrics["tokens"] = tokens
        return metrics

    def reset(self) -> None:
        """Forgets every count."""
        for name in _COUNT_NAMES:
            getattr(self, name).zero_()

    def state_dict(self) -> dict:
        """The counts (copies) and `mem_size`, to save, resume or merge a run."""
        return {"mem_size": self.mem_size, **{name: getattr(self, name).clone() for name in _COUNT_NAMES}}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Replaces the counts by those of `state_dict` (from `state_dict()`, on any device)."""
        if state_dict.get("mem_size") != self.mem_size:
            raise ValueError(f"state_dict is for mem_size={state_dict.get('mem_size')}, this is {self.mem_size}")
        for name in _COUNT_NAMES:
            own = getattr(self, name)
            if state_dict[name].shape != own.shape:
                raise ValueError(f"{name} has shape {tuple(state_dict[name].shape)}, expected {tuple(own.shape)}")
            own.copy_(state_dict[name])

    def merge(self, other: "MemoryUsageAccumulator") -> "MemoryUsageAccumulator":
        """Adds the counts of `other` (e.g. another process or shard) to these and returns `self`."""
        if not isinstance(other, MemoryUsageAccumulator) or other.mem_size != self.mem_size:
            raise ValueError(f"can only merge a MemoryUsageAccumulator of mem_size={self.mem_size}")
        for name in _COUNT_NAMES:
            getattr(self, name).add_(getattr(other, name).to(self.device))
        return self


def _accumulation_device(device: torch.device | str | None) -> torch.device:
    device = torch.device(device or "cpu")
    return torch.device("cpu") if device.type == "mps" else device  # MPS has no float64


def merge_duplicate_slots(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the distinct slots (ascending, then zero-padded) and their summed weights (zero on the padding)."""
    slots, order = indices.sort(dim=1)
    weights = weights.gather(1, order)
    starts_slot = torch.ones_like(slots, dtype=torch.bool)
    starts_slot[:, 1:] = slots[:, 1:] != slots[:, :-1]
    position = starts_slot.cumsum(1) - 1  # where each entry's distinct slot goes in its row
    merged_weights = torch.zeros_like(weights).scatter_add_(1, position, weights)
    merged_slots = torch.zeros_like(slots).scatter_(1, position, slots)  # equal slots write the same value
    return merged_slots, merged_weights


def _kl_from_uniform(counts: torch.Tensor) -> float:
    p = counts / counts.sum()
    return math.log(counts.numel()) + torch.special.xlogy(p, p).sum().item()


def _gini(counts: torch.Tensor) -> float:
    lorenz = counts.sort().values.cumsum(0) / counts.sum()
    return 1 + 1 / counts.numel() - 2 * lorenz.mean().item()


def _top_slots_holding(counts: torch.Tensor, percents: Iterable[int]) -> list[int]:
    """Per percentage, the smallest number of largest counts whose sum is at least that percentage of the total."""
    held = counts.sort(descending=True).values.cumsum(0)
    # 100 * held >= percent * total in unnormalised numbers: exact for counts, so a share of exactly 90 % is 90 %
    thresholds = torch.tensor(list(percents), dtype=held.dtype, device=held.device) * held[-1]
    return (torch.searchsorted(100 * held, thresholds) + 1).tolist()


class MemoryUsageTracker:
    """Counts the usage of every product key memory of a model while attached (a context manager).

    Args:
        model: Any module holding `ProductKeyMemory` layers (none: `results()` is empty; a config with `pkm_layers`
            but no memory found raises, see `utils.memory_modules`).
        eval_only: Count only the forwards run in eval mode; by default whatever runs while attached counts.

    Attributes:
        accumulators: `{layer name: MemoryUsageAccumulator}` in model order; names are `layer_{i}` from module paths
            such as `bert.encoder.layer.4.memory`, or the module paths when those would be ambiguous. A value table
            shared by several memories (`pkm_shared_values`) is counted per memory AND as a whole, under
            `shared_values` (its tokens: those of all its memories together).
    """

    SHARED_NAME = "shared_values"

    def __init__(self, model: nn.Module, eval_only: bool = False):
        found = list(memory_modules(model).items())
        names = [readable_name(path) for path, _ in found]
        if len(set(names)) < len(names):
            names = [path or "memory" for path, _ in found]
        self.memories = {name: module for name, (_, module) in zip(names, found)}
        self.accumulators = {
            name: MemoryUsageAccumulator(memory.mem_size, memory.values.weight.device)
            for name, memory in self.memories.items()
        }
        # the memories reading each value table: more than one when shared
        self._readers = {}
        for name, memory in self.memories.items():
            self._readers.setdefault(id(memory.values), []).append(name)
        shared = [names for names in self._readers.values() if len(names) > 1]
        for i, names in enumerate(shared):
            memory = self.memories[names[0]]
            name = self.SHARED_NAME if len(shared) == 1 else f"{self.SHARED_NAME}_{i}"
            self.accumulators[name] = MemoryUsageAccumulator(memory.mem_size, memory.values.weight.device)
            self._readers[id(memory.values)] = [*names, name]
        self._reading = {}  # id(values) -> the memory whose forward is running
        self.eval_only = eval_only
        self._hooks = []

    def attach(self) -> "MemoryUsageTracker":
        """Hooks the value lookup of every memory (once, however often called) and returns `self`."""
        if not self._hooks:
            tables = {}
            for name, memory in self.memories.items():
                for reader in self._readers[id(memory.values)]:  # the model may have moved
                    self.accumulators[reader] = self.accumulators[reader].to(memory.values.weight.device)
                tables[id(memory.values)] = memory.values
                if len(self._readers[id(memory.values)]) > 1:  # a shared table: which memory reads it
                    self._hooks.append(memory.register_forward_pre_hook(self._reading_hook(name, memory.values)))
                    self._hooks.append(memory.register_forward_hook(self._reading_hook(None, memory.values)))
            for key, values in tables.items():
                hook = self._counting_hook(key)
                self._hooks.append(values.register_forward_hook(hook, with_kwargs=True))
        return self

    def _reading_hook(self, name: str | None, values: nn.Module):
        def set_reader(module, *args):
            self._reading[id(values)] = name

        return set_reader

    def detach(self) -> None:
        """Removes the hooks: the model runs exactly as without a tracker. The counts stay."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _counting_hook(self, table: int):
        readers = self._readers[table]

        def count(values: nn.EmbeddingBag, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if self.eval_only and values.training:
                return
            weights = kwargs.get("per_sample_weights", args[2] if len(args) > 2 else None)
            if weights is None:
                raise ValueError("the memory values were read without per_sample_weights: no weights to count")
            indices = args[0] if args else kwargs["input"]
            if len(readers) == 1:
                self.accumulators[readers[0]].update(indices, weights)
                return
            reader = self._reading.get(table)
            if reader is None:
                raise ValueError(
                    "a shared value table was read outside the forward of one of its memories: cannot tell which"
                )
            self.accumulators[reader].update(indices, weights)
            self.accumulators[readers[-1]].update(indices, weights)  # the table as a whole

        return count

    def __enter__(self) -> "MemoryUsageTracker":
        return self.attach()

    def __exit__(self, *exc_info) -> None:
        self.detach()

    def results(self) -> dict[str, dict[str, float]]:
        """`{layer name: MemoryUsageAccumulator.compute()}`; raises ValueError where a layer counted no token."""
        return {name: accumulator.compute() for name, accumulator in self.accumulators.items()}

    def reset(self) -> None:
        """Forgets every count (e.g. before the next evaluation)."""
        for accumulator in self.accumulators.values():
            accumulator.reset()


def track_memory_usage(model: nn.Module, eval_only: bool = False) -> MemoryUsageTracker:
    """A tracker of `model`'s memories, already attached; use it in a `with` block so that it detaches."""
    return MemoryUsageTracker(model, eval_only=eval_only).attach()


def gather(
    source: MemoryUsageAccumulator | MemoryUsageTracker, accelerator=None
) -> MemoryUsageAccumulator | MemoryUsageTracker:
    """Sums the counts of all processes in place (call it once, on every process, after evaluation); returns `source`.

    Uses `accelerator.reduce` when an `accelerate.Accelerator` is given, else `torch.distributed.all_reduce` when a
    process group is initialised, else does nothing (a single process already holds every count).
    """
    accumulators = source.accumulators.values() if isinstance(source, MemoryUsageTracker) else [source]
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    for accumulator in accumulators:
        counts = {name: getattr(accumulator, name) for name in _COUNT_NAMES}
        if accelerator is not None:
            counts = accelerator.reduce(counts, reduction="sum")
        elif distributed:
            for tensor in counts.values():
                torch.distributed.all_reduce(tensor)  # in place, SUM
        for name, tensor in counts.items():
            getattr(accumulator, name).copy_(tensor)
    return source


def flatten_memory_usage(results: Mapping[str, Mapping[str, float]], prefix: str = "memory") -> dict[str, float]:
    """`{layer: {metric: value}}` -> `{"memory/layer_4/mu": value, ...}`, for trackers and `all_results.json`."""
    return {
        "/".join(part for part in (prefix, layer, metric) if part): value
        for layer, metrics in results.items()
        for metric, value in metrics.items()
    }


def format_memory_usage(results: Mapping[str, Mapping[str, float]]) -> str:
    """A table for logs, one row per memory layer: tokens, MU and top-1 MU in %, KL_u, KL_w, gini_w, top-N of w."""
    if not results:
        return "no memory layers"
    columns = {
        "tokens": lambda m: f"{int(m['tokens'])}",
        "MU %": lambda m: f"{100 * m['mu']:.2f}",
        "top-1 MU %": lambda m: f"{100 * m['top1_mu']:.2f}",
        "KL_u": lambda m: f"{m['kl_u']:.4f}",
        "KL_w": lambda m: f"{m['kl_w']:.4f}",
        "gini_w": lambda m: f"{m['gini_w']:.4f}",
        **{f"{top}_w": (lambda m, key=f"{top}_w": f"{int(m[key])}") for top in TOP_PERCENTS},
    }
    rows = [["layer", *columns]]
    rows += [[layer, *(cell(metrics) for cell in columns.values())] for layer, metrics in results.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:]))])
        for row in rows
    )


__all__ = [
    "MemoryUsageAccumulator",
    "MemoryUsageTracker",
    "flatten_memory_usage",
    "format_memory_usage",
    "gather",
    "track_memory_usage",
]
