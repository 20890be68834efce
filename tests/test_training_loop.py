"""`training.loop.TrainingLoop`, the loop of the four scripts, driven directly with a small model: optimizer steps under
gradient accumulation, the evaluation cadence, checkpoints, and a resume that ends with the uninterrupted run's
weights. (The scripts' own tests run it end to end.)"""

import argparse
import json
import logging

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from modeling_pkm_bert.training.checkpoints import run_settings
from modeling_pkm_bert.training.loop import TrainingLoop, create_scheduler, plan_training_steps


LOGGER = logging.getLogger(__name__)


def make_args(output_dir, **overrides):
    args = dict(
        output_dir=str(output_dir), gradient_accumulation_steps=1, per_device_train_batch_size=2, num_train_epochs=2,
        max_train_steps=None, learning_rate=0.1, lr_scheduler_type="linear", checkpointing_steps=None,
        resume_from_checkpoint=None, eval_steps=None, track_staleness=False, staleness_bins=5, with_tracking=False,
        memory_max_grad_norm=None, memory_learning_rate=1e-3, allow_inexact_resume=False, seed=0,
    )  # fmt: skip
    args.update(overrides)
    return argparse.Namespace(**args)


def train(args, batches=10, stop_after=None):
    """Trains a linear model on `batches` batches per epoch through TrainingLoop. Returns (weights, loop, evaluations:
    [(when, completed steps)], optimizer steps actually taken)."""
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    data = TensorDataset(torch.randn(2 * batches, 4), torch.randn(2 * batches, 1))
    dataloader = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    optimizer_steps = []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    steps_per_epoch = plan_training_steps(args, dataloader)
    scheduler = create_scheduler(accelerator, args, optimizer, num_warmup_steps=1)
    evaluations = []
    loop = TrainingLoop(
        accelerator, args, model, [optimizer], scheduler, dataloader,
        steps_per_epoch=steps_per_epoch, settings=run_settings(args, accelerator), logger=LOGGER,
        evaluate=lambda when: evaluations.append((when, loop.completed_steps)) or {"eval_score": 1.0},
    )  # fmt: skip
    loop.resume()
    for epoch in loop.epochs():
        for inputs, targets in loop.batches(epoch):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                loop.step(loss)
            if stop_after is not None and loop.completed_steps == stop_after and accelerator.sync_gradients:
                return None, loop, evaluations, len(optimizer_steps)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return weights, loop, evaluations, len(optimizer_steps)


@pytest.mark.parametrize("accumulation, steps", [(1, 20), (3, 8)])  # 10 batches: 4 steps an epoch, the last short
def test_one_optimizer_step_per_accumulation_and_a_log_line_each(tmp_path, accumulation, steps):
    weights, loop, evaluations, taken = train(make_args(tmp_path, gradient_accumulation_steps=accumulation))
    assert loop.completed_steps == taken == steps
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert evaluations == [("epoch 0", steps // 2)]  # not after the last epoch: the script evaluates at the end
    results = loop.results()
    assert results["step"] == steps and results["train_steps_per_second"] > 0 and results["train_loss"] > 0


def test_evaluation_cadence_and_max_train_steps(tmp_path):
    _, loop, evaluations, taken = train(make_args(tmp_path, eval_steps=3, max_train_steps=13))
    assert taken == loop.completed_steps == 13 and loop.args.num_train_epochs == 2
    assert evaluations == [("step 3", 3), ("step 6", 6), ("step 9", 9), ("step 12", 12)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_score" in r] == [3, 6, 9, 12]
    assert all(r["train_loss"] > 0 for r in records if "eval_score" in r)


@pytest.mark.parametrize("accumulation, checkpointing, resume_at", [(1, "3", "step_3"), (3, "5", "step_5"), (2, "epoch", "epoch_0")])
def test_resume_ends_with_the_uninterrupted_weights(tmp_path, accumulation, checkpointing, resume_at):
    """Stopped after a checkpoint and resumed from it, the run ends with bitwise the weights of the uninterrupted run
    (dropout and the shuffled order included), and resumes its step count."""
    options = dict(gradient_accumulation_steps=accumulation, checkpointing_steps=checkpointing, num_train_epochs=3)
    reference, full, _, _ = train(make_args(tmp_path / "full", **options))
    stop = int(resume_at.split("_")[1]) if resume_at.startswith("step") else full.steps_per_epoch
    train(make_args(tmp_path / "cut", **options), stop_after=stop + 1)  # killed one step after the checkpoint
    assert (tmp_path / "cut" / resume_at / "run_settings.json").is_file()
    resumed_args = make_args(tmp_path / "cut", resume_from_checkpoint=str(tmp_path / "cut" / resume_at), **options)
    weights, loop, _, taken = train(resumed_args)
    assert taken == full.completed_steps - stop  # only the steps after the checkpoint are trained again
    assert loop.completed_steps == full.completed_steps
    assert torch.equal(weights, reference)


def test_a_changed_setting_stops_the_resume(tmp_path):
    train(make_args(tmp_path, checkpointing_steps="4"))
    with pytest.raises(ValueError, match="learning_rate"):
        train(make_args(tmp_path, checkpointing_steps="4", learning_rate=0.2, resume_from_checkpoint="latest"))
