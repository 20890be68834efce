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
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def evaluating(accelerator, model):
    """The unwrapped `model` in evaluation mode under `torch.no_grad()` and the accelerator's autocast (mixed
    precision), the CPU random state forked (restored on exit); a model that was training trains again after."""
    import torch

    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), accelerator.autocast():
            yield unwrapped
    finally:
        if was_training:
            unwrapped.train()


def shard_batches(accelerator, dataset, collate_fn, batch_size: int):
    """The batches of this process's contiguous shard of `dataset`, on the accelerator's device: every example is seen
    by exactly one process."""
    from torch.utils.data import DataLoader

    shard = dataset.shard(num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True)
    for batch in DataLoader(shard, collate_fn=collate_fn, batch_size=batch_size):
        yield {key: value.to(accelerator.device) for key, value in batch.items()}
