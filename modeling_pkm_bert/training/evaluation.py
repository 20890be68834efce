"""The evaluation plumbing of the training scripts: each process runs its own contiguous shard of the evaluation set
through the unwrapped model, in evaluation mode, without touching the training random streams.

    with evaluating(accelerator, model) as unwrapped:
        for batch in shard_batches(accelerator, dataset, collate_fn, args.per_device_eval_batch_size):
            logits = unwrapped(**batch).logits
    predictions = gather_object(predictions)

Why shards rather than a prepared dataloader: a prepared dataloader repeats examples to even out the last batch
(harmless for `gather_for_metrics`, but memory usage trackers would count their lookups twice), and it would run a
collective per batch. Why the random streams are kept: an evaluation during training (`--eval_steps`, epoch ends)
must not move the dropout and data-order streams, or a resumed run would not end with the uninterrupted run's weights.

Shards differ in size (9 examples on 2 processes: 5 and 4), yet under FSDP2 every layer's forward and under memory
parallel every memory lookup is a collective that all processes must enter: inside `evaluating`, a process whose shard
has fewer batches than the largest runs the model on padding-only batches (outputs discarded, no token looked up or
counted) until it has run as many forwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import math


# the unwrapped model of the innermost `evaluating` block: the model `shard_batches` evens the forwards out with
_EVALUATED_MODEL = contextvars.ContextVar("evaluated_model", default=None)
# batch keys that are targets, not model inputs: left out of the padding-only batches (no loss to compute)
_TARGET_KEYS = ("labels", "start_positions", "end_positions")


@contextlib.contextmanager
def evaluating(accelerator, model):
    """The unwrapped `model` in evaluation mode under `torch.no_grad()` and the accelerator's autocast (mixed
    precision), the CPU random state forked (restored on exit); a model that was training trains again after."""
    import torch

    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    token = _EVALUATED_MODEL.set(unwrapped)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), accelerator.autocast():
            yield unwrapped
    finally:
        _EVALUATED_MODEL.reset(token)
        if was_training:
            unwrapped.train()


def shard_batches(accelerator, dataset, collate_fn, batch_size: int):
    """The batches of this process's contiguous shard of `dataset`, on the accelerator's device: every example is seen
    by exactly one process (a shard may be empty: fewer examples than processes). With several processes, call it
    inside `evaluating` and consume every batch: after this process's last batch it runs the evaluated model on
    padding-only batches until it has run as many forwards as the process with the most batches (module docstring)."""
    from torch.utils.data import DataLoader

    processes, index = accelerator.num_processes, accelerator.process_index
    # datasets' contiguous shards (whose `shard` and `select` refuse an empty one past the last example)
    size, extra = divmod(len(dataset), processes)
    start, length = index * size + min(index, extra), size + (index < extra)
    shard = dataset.select(range(start, start + length)) if length else []
    batches = 0
    for batch in DataLoader(shard, collate_fn=collate_fn, batch_size=batch_size):
        batches += 1
        yield {key: value.to(accelerator.device) for key, value in batch.items()}
    most = math.ceil((size + (extra > 0)) / batch_size)  # the batches of the largest shard (the first)
    if batches < most:
        model = _EVALUATED_MODEL.get()
        if model is None:
            raise RuntimeError(
                "shard_batches on several processes runs inside `with evaluating(accelerator, model)`: a process with "
                "fewer batches must run the model as often as the others (FSDP2 and memory parallel forwards are "
                "collectives)"
            )
        padding = padding_batch(collate_fn([dataset[0]]))
        for _ in range(most - batches):
            model(**{key: value.to(accelerator.device) for key, value in padding.items()})


def padding_batch(batch: dict) -> dict:
    """The first sequence of `batch` with every token padding (attention_mask 0) and without targets: a forward that
    enters every collective of the model (each layer; each memory, which reads its 0 real tokens) and counts nothing."""
    import torch

    inputs = {key: value[:1] for key, value in batch.items() if key not in _TARGET_KEYS}
    reference = inputs.get("input_ids", inputs.get("inputs_embeds"))
    inputs["attention_mask"] = torch.zeros(reference.shape[:2], dtype=torch.long, device=reference.device)
    return inputs
