r"""Staleness of memory slots during training (Kim & Jung 2020, section 3.1 "catastrophic drift", Figure 2).

A slot whose value is rarely updated goes stale and stops being picked. For every slot of every memory the
[`StalenessTracker`] records the last training step at which it was a **top-1 pick**: the slot with the largest
weight for some token (weights summed over the heads, the definition of `top1_mu` in `memory_usage.py`). Figure 2
of the paper is the histogram of these steps; the fraction of slots never picked since the tracking began is the
staleness of a memory.

Usage in a training loop (the hook counts forwards in training mode only; evaluation forwards are ignored)::

    staleness = StalenessTracker(model).attach()
    for batch in dataloader:
        staleness.step = completed_steps + 1             # the optimizer step this batch belongs to
        ...
    staleness.synchronize()                              # on every process, before saving or reporting
    staleness.results(completed_steps)                   # {"layer_2": {"never": ..., "steps_1-100": ...}, ...}
    staleness.save(os.path.join(checkpoint, STALENESS_FILE))  # in each checkpoint; `load` on resume

The state is saved as safetensors (`save`/`load`), never pickled: do not hand the tracker to accelerate's
`register_for_checkpointing`, which unpickles custom objects with `weights_only=False` (a tampered checkpoint would run
code).

With several processes each one sees its own tokens: `synchronize()` takes the maximum over the processes (a
collective: call it on all of them, e.g. right before `accelerator.save_state`, which saves custom objects from the
main process only).
"""

import os

import torch
from torch import nn

from ..utils.input_errors import InputError
from .memory_usage import MemoryUsageTracker, merge_duplicate_slots


STALENESS_FILE = "staleness.safetensors"
NEVER = -1  # the step of a slot that has not been a top-1 pick since the tracking began


def top1_slots(indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The top-1 slot of each token: `(tokens, heads * knn)` indices and weights -> `(tokens,)`, the slot with the
    largest weight summed over the heads (ties: the lowest slot), as `memory_usage` counts `top1_mu`."""
    slots, slot_weights = merge_duplicate_slots(indices.flatten(1), weights.detach().flatten(1).float())
    return slots.gather(1, slot_weights.argmax(1, keepdim=True)).squeeze(1)


class StalenessTracker:
    """The last training step at which each slot of each memory of `model` was a top-1 pick.

    Attributes:
        last_top1_step: `{layer name: int64 tensor (mem_size,)}`, `NEVER` (-1) for slots not picked yet; layer names
            as in `memory_usage` (`layer_4` for `bert.encoder.layer.4.memory`).
        step: The step credited to the picks of the next training forwards (set it before each batch).
    """

    def __init__(self, model: nn.Module):
        self.memories = MemoryUsageTracker(model).memories
        self.last_top1_step = {
            name: torch.full((memory.mem_size,), NEVER, dtype=torch.long, device=memory.values.weight.device)
            for name, memory in self.memories.items()
        }
        self.step = 0
        self._hooks = []
        tables = [id(memory.values) for memory in self.memories.values()]
        self._shared = {table for table in tables if tables.count(table) > 1}  # pkm_shared_values
        self._reading = {}  # shared table -> the memory whose forward runs

    def attach(self) -> "StalenessTracker":
        """Hooks the value lookup of every memory (once) and returns `self`."""
        if not self._hooks:
            for name, memory in self.memories.items():
                self._hooks.append(memory.values.register_forward_hook(self._hook(name), with_kwargs=True))
                if id(memory.values) in self._shared:  # a shared table's lookups count for the memory reading it
                    table = id(memory.values)
                    self._hooks.append(memory.register_forward_pre_hook(lambda *_, t=table, n=name: self._read(t, n)))
                    self._hooks.append(memory.register_forward_hook(lambda *_, t=table: self._read(t, None)))
        return self

    def _read(self, table: int, name: str | None) -> None:
        self._reading[table] = name

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _hook(self, name: str):
        def record(values: nn.EmbeddingBag, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if not values.training:
                return
            if id(values) in self._shared and self._reading.get(id(values)) != name:
                return  # another memory reads the shared table
            indices = args[0] if args else kwargs["input"]
            weights = kwargs.get("per_sample_weights", args[2] if len(args) > 2 else None)
            if weights is None or indices.shape[0] == 0:
                return
            last = self.last_top1_step[name]
            if last.device != indices.device:  # the model moved (accelerator.prepare)
                last = self.last_top1_step[name] = last.to(indices.device)
            last.index_fill_(0, top1_slots(indices, weights), self.step)

        return record

    def synchronize(self) -> None:
        """Makes every process hold the latest step of each slot over all processes (max; a collective)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for last in self.last_top1_step.values():
                torch.distributed.all_reduce(last, op=torch.distributed.ReduceOp.MAX)

    def histogram(self, total_steps: int, bins: int = 5) -> dict[str, dict[str, int]]:
        """Per layer, how many slots were last picked in each of `bins` equal step ranges of `1..total_steps`
        (Figure 2: the paper's ranges are its 5 checkpoints of 100k steps), and how many never (`"never"`)."""
        bins = max(1, min(bins, total_steps)) if total_steps > 0 else 1
        edges = [round(total_steps * i / bins) for i in range(bins + 1)]
        result = {}
        for name, last in self.last_top1_step.items():
            last = last.cpu()
            counts = {"never": int((last == NEVER).sum())}
            for low, high in zip(edges, edges[1:]):
                counts[f"steps_{low + 1}-{high}"] = int(((last > low) & (last <= high)).sum())
            result[name] = counts
        return result

    def results(self, total_steps: int, bins: int = 5) -> dict[str, dict[str, float]]:
        """The histogram as fractions of the memory's slots (comparable across memory sizes)."""
        return {
            name: {key: count / self.last_top1_step[name].numel() for key, count in counts.items()}
            for name, counts in self.histogram(total_steps, bins).items()
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: last.cpu().clone() for name, last in self.last_top1_step.items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        if set(state_dict) != set(self.last_top1_step):
            raise InputError(
                f"staleness state for memories {sorted(state_dict)}, this model has {sorted(self.last_top1_step)}"
            )
        for name, last in self.last_top1_step.items():
            if state_dict[name].shape != last.shape:
                shape = tuple(state_dict[name].shape)
                raise InputError(f"staleness state of {name} has shape {shape}, expected {tuple(last.shape)}")
            last.copy_(state_dict[name])

    def save(self, path: str | os.PathLike, step: int | None = None) -> None:
        """Writes the state to a safetensors file (atomically: a temporary file renamed into place)."""
        from safetensors.torch import save_file

        metadata = {"never": str(NEVER)}
        if step is not None:
            metadata["step"] = str(step)
        temporary = f"{path}.tmp"
        save_file({name: last.contiguous() for name, last in self.state_dict().items()}, temporary, metadata=metadata)
        os.replace(temporary, path)

    def load(self, path: str | os.PathLike) -> None:
        """Reads a state written by `save` (safetensors: no code runs); ValueError naming the file when it does not
        fit this model's memories."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(path)
        except (SafetensorError, OSError) as error:
            raise InputError(f"{path}: not a readable staleness state ({error})") from error
        if any(tensor.dtype != torch.long or tensor.dim() != 1 for tensor in state.values()):
            raise InputError(f"{path}: staleness state must hold 1-D int64 tensors")
        try:
            self.load_state_dict(state)
        except ValueError as error:
            raise InputError(f"{path}: {error}") from error


__all__ = ["NEVER", "STALENESS_FILE", "StalenessTracker", "top1_slots"]
