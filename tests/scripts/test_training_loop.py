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

    def evaluate(when):
        evaluations.append((when, loop.completed_steps))
        return {"eval_score": float(torch.rand(()))}  # draws from torch's RNG, as run_mlm's masking of the eval set

    loop = TrainingLoop(
        accelerator, args, model, [optimizer], scheduler, dataloader,
        steps_per_epoch=steps_per_epoch, settings=run_settings(args, accelerator), logger=LOGGER, evaluate=evaluate,
    )  # fmt: skip
    loop.resume()
    for epoch in loop.epochs():
        for _, (inputs, targets) in loop.batches(epoch):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                loop.step(loss)
            loop.after_batch()
            if stop_after is not None and loop.completed_steps == stop_after and accelerator.sync_gradients:
                return None, loop, evaluations, len(optimizer_steps)
        loop.after_epoch(epoch)
    results = loop.results()
    loop.log_evaluation(evaluate("final"), final=True)  # the scripts' final evaluation, after results()
    assert results["step"] == loop.completed_steps
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return weights, loop, evaluations, len(optimizer_steps)


@pytest.mark.parametrize("accumulation, steps", [(1, 20), (3, 8)])  # 10 batches: 4 steps an epoch, the last short
def test_one_optimizer_step_per_accumulation_and_a_log_line_each(tmp_path, accumulation, steps):
    weights, loop, evaluations, taken = train(make_args(tmp_path, gradient_accumulation_steps=accumulation))
    assert loop.completed_steps == taken == steps
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    # not after the last epoch: the script evaluates at the end
    assert evaluations == [("epoch 0", steps // 2), ("final", steps)]
    results = loop.results()
    assert results["step"] == steps and results["train_steps_per_second"] > 0 and results["train_loss"] > 0


def test_evaluation_cadence_and_max_train_steps(tmp_path):
    _, loop, evaluations, taken = train(make_args(tmp_path, eval_steps=3, max_train_steps=13))
    assert taken == loop.completed_steps == 13 and loop.args.num_train_epochs == 2
    assert evaluations == [("step 3", 3), ("step 6", 6), ("step 9", 9), ("step 12", 12), ("final", 13)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_score" in r] == [3, 6, 9, 12, 13]  # and the final one
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


# ---------------------------------------------------------------------------------------------- fp16 loss scaling
# CUDA's fp16 path simulated on CPU: a GradScaler("cpu") where accelerate keeps its scaler (`accelerator.scaler`), the
# loop's step otherwise as the scripts run it. With two optimizers (main AdamW, the memory values' own) accelerate's
# prepared optimizers each ran `scaler.step` and `scaler.update()`: a values' update 1/scale of the right one with
# --memory_max_grad_norm, half of it when the scale grew that step.


def fp16_run(output_dir, memory_optimizer, max_norm, scaler=None, steps=2, poison_step=None):
    """`steps` optimizer steps of a tiny BertPkmForMaskedLM through `TrainingLoop.step`, the values in their own
    optimizer; with `scaler` injected where accelerate puts its own. `poison_step`: that step's gradient of one main
    weight is made inf. Returns (value tables before, after, the other weights before, after, the loop)."""
    from helpers import tiny_config
    from helpers import reset_accelerate_state
    from modeling_pkm_bert import BertPkmForMaskedLM
    from modeling_pkm_bert.methods.optimizers import MemoryOptimizerMethod
    from modeling_pkm_bert.methods.optimizers.scripts import create_memory_optimizer, optimizer_param_groups

    reset_accelerate_state()  # each run builds its own Accelerator (and a test compares two runs)
    accelerator = Accelerator(cpu=True)
    if scaler is not None:  # where accelerate keeps the scaler of --mixed_precision fp16 on CUDA (no fp16 autocast
        accelerator.scaler = scaler  # on CPU: the scaled and the plain run compute the same gradients)
    torch.manual_seed(0)
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[1]))
    args = make_args(output_dir, memory_optimizer=memory_optimizer, memory_max_grad_norm=max_norm, max_train_steps=steps)
    main_groups, memory_groups = optimizer_param_groups(model, 0.01)
    optimizer = torch.optim.AdamW(main_groups, lr=1e-3)
    memory = create_memory_optimizer(memory_groups, args, model)
    model, optimizer, memory = accelerator.prepare(model, optimizer, memory)
    scheduler = create_scheduler(accelerator, args, optimizer, num_warmup_steps=0)
    loop = TrainingLoop(
        accelerator, args, model, [optimizer, memory], scheduler, None, steps_per_epoch=steps, settings={},
        logger=LOGGER, methods=[MemoryOptimizerMethod(args, accelerator, model, memory)],
    )  # fmt: skip
    unwrapped = accelerator.unwrap_model(model)
    table = unwrapped.bert.encoder.layer[1].memory.values.weight
    other = unwrapped.bert.encoder.layer[0].attention.self.query.weight
    before = table.detach().clone(), other.detach().clone()
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        input_ids = torch.randint(5, 99, (4, 8), generator=generator)
        handle = None
        if step == poison_step:
            handle = other.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        with accelerator.accumulate(model):
            loop.step(model(input_ids=input_ids, labels=input_ids).loss)
        if handle is not None:
            handle.remove()
    return before[0], table.detach().clone(), before[1], other.detach().clone(), loop


@pytest.mark.parametrize("memory_optimizer", ["adam", "sgd", "sparse_row_adam"])
@pytest.mark.parametrize("max_norm", [None, 1e-3])
def test_fp16_loss_scaling_steps_every_optimizer_with_one_scale(tmp_path, memory_optimizer, max_norm):
    """Under an injected GradScaler whose scale grows at every step (growth_interval=1), every optimizer's update equals
    the scaler-free run's (to rounding), with and without --memory_max_grad_norm, for every memory optimizer; the scale
    is updated once a step."""
    table0, table, other0, other, _ = fp16_run(tmp_path, memory_optimizer, max_norm)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaled0, scaled, scaled_other0, scaled_other, _ = fp16_run(tmp_path, memory_optimizer, max_norm, scaler)
    assert torch.equal(table0, scaled0) and torch.equal(other0, scaled_other0)
    assert (table - table0).abs().max() > 0
    torch.testing.assert_close(scaled - scaled0, table - table0, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(scaled_other - scaled_other0, other - other0, rtol=1e-4, atol=1e-7)
    assert scaler.get_scale() == 1024.0 * 2**2  # two steps, each one growth: one update a step


@pytest.mark.parametrize("memory_optimizer", ["adam", "sparse_row_adam"])
@pytest.mark.parametrize("max_norm", [None, 1e-3])
def test_fp16_overflow_skips_every_optimizer_and_the_schedule(tmp_path, memory_optimizer, max_norm):
    """One non-finite gradient of a main weight: neither the main optimizer nor the memory's steps, the schedule stays,
    the scale is halved once; the next step trains again."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    table0, table, other0, other, loop = fp16_run(tmp_path, memory_optimizer, max_norm, scaler, steps=1, poison_step=0)
    assert torch.equal(table, table0) and torch.equal(other, other0)
    assert scaler.get_scale() == 512.0
    assert loop.lr_scheduler.scheduler.last_epoch == 0  # not advanced by the skipped step
    table0, table, other0, other, loop = fp16_run(tmp_path, memory_optimizer, max_norm, scaler, steps=2, poison_step=0)
    assert not torch.equal(table, table0) and not torch.equal(other, other0)


def test_max_train_steps_mid_epoch_writes_a_step_checkpoint_and_resumes_from_it(tmp_path):
    """--checkpointing_steps epoch with --max_train_steps 13 (10 steps an epoch): epoch_0, then step_13 for the unfinished
    epoch (an epoch_1 would say 20 steps were trained); `latest` picks it, and a resume with a larger budget trains the
    7 batches left of epoch 1."""
    _, loop, _, taken = train(make_args(tmp_path, checkpointing_steps="epoch", max_train_steps=13))
    assert taken == 13
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["epoch_0", "step_13"]
    resumed = make_args(
        tmp_path, checkpointing_steps="epoch", max_train_steps=20, resume_from_checkpoint="latest",
        allow_inexact_resume=True,  # the schedule's length changed
    )  # fmt: skip
    _, loop, _, taken = train(resumed)
    assert taken == 7 and loop.completed_steps == 20
    assert (tmp_path / "epoch_1").is_dir()


@pytest.mark.parametrize(
    "checkpointing, eval_steps, epochs, accumulation, resume_at, killed_at",
    [
        ("4", 3, 1, 1, "step_4", 6),  # the cadences never meet
        ("3", 3, 1, 1, "step_3", 5),  # a step evaluation and a checkpoint at the same step
        ("2", 4, 1, 1, "step_4", 5),
        ("2", 2, 2, 3, "step_4", 6),  # under gradient accumulation (4 steps an epoch): step 4 ends epoch 0 too
        ("5", None, 2, 1, "step_10", 12),  # the epoch-end evaluation and a step checkpoint at the epoch's last step
        ("epoch", None, 2, 1, "epoch_0", 12),
        ("epoch", 5, 2, 1, "epoch_0", 12),
    ],
)
def test_a_resumed_run_logs_as_the_uninterrupted_one(
    tmp_path, checkpointing, eval_steps, epochs, accumulation, resume_at, killed_at
):
    """metrics.jsonl after a resume from a checkpoint of a run killed a few steps later: the killed run's later steps
    are gone, each step and evaluation is logged once, in order, as in the uninterrupted run (a torn last line is
    dropped too) — the training loss of every evaluation included, also where a checkpoint falls on an evaluation's
    step (a step evaluation, or the epoch-end one at the epoch's last step)."""
    options = dict(
        checkpointing_steps=checkpointing, eval_steps=eval_steps, num_train_epochs=epochs,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    reference = train(make_args(tmp_path / "full", **options))[0]
    train(make_args(tmp_path / "cut", **options), stop_after=killed_at)
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as log:
        log.write('{"step": 99, "lo')  # killed while writing
    checkpoint = tmp_path / "cut" / resume_at
    assert checkpoint.is_dir()
    weights = train(make_args(tmp_path / "cut", resume_from_checkpoint=str(checkpoint), **options))[0]
    assert torch.equal(weights, reference)  # the evaluations' draws from the RNG included

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]

    full, resumed = records("full"), records("cut")
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == sorted(r["step"] for r in full)
    assert resumed == full
