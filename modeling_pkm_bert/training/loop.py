"""The training loop of the four scripts: everything around the loss that each script computes in its own `main()`.

    loop = TrainingLoop(accelerator, args, model, optimizers, lr_scheduler, train_dataloader, ...)
    loop.resume()                                  # --resume_from_checkpoint: state, position, running loss
    for epoch in loop.epochs():                    # the epochs left; stops at --max_train_steps
        for step, batch in loop.batches(epoch):    # training mode; a resumed epoch skips the batches it trained
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                loop.step(loss)                    # backward; at an optimizer step: the methods' hooks, optimizers
            loop.after_batch()                     # after an optimizer step: log, --eval_steps, step checkpoint
        loop.after_epoch(epoch)                    # evaluation (not after the last epoch), then its checkpoint
    results.update(loop.results())

`TrainingLoop` owns what the scripts share: the exact resume (`--resume_from_checkpoint`: state, staleness, position
in the epoch, the running loss), gradient accumulation's optimizer steps (the training methods' hooks around them,
every optimizer stepped, under fp16 loss scaling all or none, and zeroed), the evaluation cadence (`--eval_steps`, else
at every epoch's end but the last, which the script evaluates itself), atomic checkpoints (`--checkpointing_steps
N|epoch`), the metrics log and trackers, the progress bar and the step timer.
"""

from __future__ import annotations

import collections
import math
import os
import time
from typing import Callable

from ..analysis.metrics_log import MetricsLog
from ..methods import step_optimizers
from ..utils.input_errors import InputError
from .checks import mark_run_output
from .checkpoints import check_checkpoint, read_loss_state, resolve_checkpoint, resume_position, save_checkpoint


def plan_training_steps(args, train_dataloader) -> int:
    """The optimizer steps of an epoch, from the prepared (per-process) dataloader, and `args.max_train_steps` /
    `args.num_train_epochs` made consistent (`--max_train_steps` wins). No dataloader: no training."""
    if train_dataloader is None:
        args.max_train_steps = 0
        return 1
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    return steps_per_epoch


def warmup_steps(args) -> int:
    """The main schedule's warm-up: `--num_warmup_steps`, else (run_glue, run_squad) `--warmup_ratio` of the steps."""
    if args.num_warmup_steps is not None:
        return args.num_warmup_steps
    return math.ceil(args.warmup_ratio * args.max_train_steps)


def create_scheduler(accelerator, args, optimizer, num_warmup_steps: int | None = None):
    """The main optimizer's learning-rate schedule (`--lr_scheduler_type`, warm-up `warmup_steps(args)` unless given),
    prepared. A prepared scheduler advances once per process at each optimizer step, hence the factor num_processes."""
    from transformers import get_scheduler

    if num_warmup_steps is None:
        num_warmup_steps = warmup_steps(args)
    return accelerator.prepare(
        get_scheduler(
            name=args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=num_warmup_steps * accelerator.num_processes,
            num_training_steps=max(args.max_train_steps, 1) * accelerator.num_processes,
        )
    )


class TrainingLoop:
    """The shared loop of `run_mlm`, `run_clm`, `run_glue` and `run_squad` (see the module docstring).

    `evaluate(when)` evaluates the model during training and returns its metrics (the script logs them as it likes);
    the loop logs them with the training loss to the metrics log and the trackers. `methods`: the training methods
    the run uses (`methods.setup_methods`, each a `methods.TrainingMethod`), whose hooks run around every optimizer
    step; `settings` (`run_settings`) go into every checkpoint and are compared on resume. With `--track_staleness`
    the loop keeps a `StalenessTracker` (`loop.staleness`).
    """

    def __init__(
        self,
        accelerator,
        args,
        model,
        optimizers: list,
        lr_scheduler,
        train_dataloader,
        *,
        steps_per_epoch: int,
        settings: dict,
        logger,
        evaluate: Callable[[str], dict] | None = None,
        methods: list | None = None,
        desc: str = "steps",
    ):
        self.accelerator, self.args, self.model = accelerator, args, model
        self.optimizers, self.lr_scheduler, self.train_dataloader = optimizers, lr_scheduler, train_dataloader
        self.steps_per_epoch, self.settings, self.logger = steps_per_epoch, settings, logger
        self.evaluate, self.methods, self.desc = evaluate, list(methods or ()), desc
        # --track_staleness (Figure 2): the last step each memory slot was a top-1 pick, kept in checkpoints
        self.staleness = None
        if args.track_staleness and train_dataloader is not None:
            from ..analysis.staleness import StalenessTracker
            from ..utils.memories import memory_modules

            if memory_modules(accelerator.unwrap_model(model)):
                self.staleness = StalenessTracker(accelerator.unwrap_model(model)).attach()
        steps = args.checkpointing_steps
        self.checkpointing_steps = int(steps) if steps is not None and steps.isdigit() else steps
        self.eval_steps = getattr(args, "eval_steps", None)
        # metrics.jsonl in output_dir: every step's loss and every evaluation (continued by a resumed run)
        self.metrics_log = MetricsLog(args.output_dir, accelerator.is_main_process, resume=bool(args.resume_from_checkpoint))
        self.completed_steps, self.starting_epoch, self.resume_batches = 0, 0, 0
        self.epoch, self.progress_bar = self.starting_epoch, None  # set by epochs()
        self.train_loss = None  # the mean loss of the batches since the last evaluation (or epoch end)
        # the losses since the last evaluation (their sum and count), kept in checkpoints: a resumed run logs the same
        # train_loss at its next evaluation as the uninterrupted one
        self.loss_sum, self.loss_count, self._step_losses = 0.0, 0, []
        self._recent = collections.deque(maxlen=20)  # the progress bar's loss
        self._train_time, self._steps_timed, self._runtime = 0.0, 0, 0.0
        self._step_start = time.perf_counter()  # of the optimizer step under way (the rates count training alone)

    # ------------------------------------------------------------------------------------------------ the narrative

    def announce(self, examples: str, *extra: str) -> None:
        """The official scripts' "Running training" block; `examples` says what one example is."""
        args = self.args
        log = self.logger.info
        log("***** Running training *****")
        log(f"  Num examples = {examples}")
        log(f"  Num Epochs = {args.num_train_epochs}")
        log(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
        log(f"  Total train batch size (w. parallel, distributed & accumulation) = {self.total_batch_size}")
        log(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        log(f"  Total optimization steps = {args.max_train_steps}")
        for line in [*extra, *(line for method in self.methods for line in method.summary())]:
            log(f"  {line}")

    @property
    def total_batch_size(self) -> int:
        args = self.args
        return args.per_device_train_batch_size * self.accelerator.num_processes * args.gradient_accumulation_steps

    def resume(self) -> None:
        """`--resume_from_checkpoint`: the complete state (models, optimizers, scheduler, random states, the
        methods' state, staleness) and the position in the run, checked against this run's settings.
        Then, every check passed, `--output_dir` is marked as the script's (a run that fails before marks nothing)."""
        if self.args.resume_from_checkpoint:
            self._restore()
        mark_run_output(self.args, self.accelerator.is_main_process)

    def _restore(self) -> None:
        args, accelerator = self.args, self.accelerator
        from ..analysis.staleness import STALENESS_FILE

        checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir, self.steps_per_epoch)
        if self.staleness is not None and not os.path.isfile(os.path.join(checkpoint, STALENESS_FILE)):
            raise InputError(f"{checkpoint} holds no staleness state: resume it without --track_staleness")
        check_checkpoint(checkpoint, self.settings, args.allow_inexact_resume, accelerator.process_index, self.logger)
        accelerator.print(f"Resumed from checkpoint: {checkpoint}")
        accelerator.load_state(checkpoint)
        if self.staleness is not None:
            self.staleness.load(os.path.join(checkpoint, STALENESS_FILE))
        self.starting_epoch, self.completed_steps, self.resume_batches = resume_position(
            checkpoint, self.steps_per_epoch, args.gradient_accumulation_steps
        )
        # the interrupted run's records past the checkpoint are trained again: the log reads as the uninterrupted one
        self.metrics_log.truncate(self.completed_steps)
        loss_state = read_loss_state(checkpoint)  # absent in checkpoints of earlier versions: counted from here
        if loss_state is not None:
            self.loss_sum, self.loss_count = loss_state["loss_sum"], loss_state["loss_count"]
            self.train_loss = loss_state["train_loss"]

    def epochs(self):
        """The epochs still to run, from a resumed run's own; stops once `--max_train_steps` are done."""
        from tqdm.auto import tqdm

        args, accelerator = self.args, self.accelerator
        start = time.perf_counter()
        self.progress_bar = tqdm(
            range(args.max_train_steps), disable=not accelerator.is_local_main_process, desc=self.desc
        )
        self.progress_bar.update(self.completed_steps)
        for epoch in range(self.starting_epoch, args.num_train_epochs):
            self.epoch = epoch
            yield epoch
            if self.done:
                break
        self.progress_bar.close()
        self._runtime = time.perf_counter() - start

    def batches(self, epoch: int):
        """`(index, batch)` of `epoch` in training mode, the index counting from the epoch's start (a resumed epoch
        starts after the batches already trained); stops once `--max_train_steps` are done."""
        accelerator = self.accelerator
        self.model.train()
        self.train_dataloader.set_epoch(epoch)
        dataloader, first = self.train_dataloader, 0
        if epoch == self.starting_epoch and self.resume_batches:
            dataloader = accelerator.skip_first_batches(self.train_dataloader, self.resume_batches)
            dataloader.set_epoch(epoch)
            first = self.resume_batches
        self._step_start = time.perf_counter()
        for index, batch in enumerate(dataloader, start=first):
            if self.staleness is not None:
                self.staleness.step = self.completed_steps + 1
            yield index, batch
            if self.done:
                break

    def step(self, loss) -> None:
        """Backward, and at the end of an accumulation: the methods' `after_backward` then `before_optimizer_step`
        hooks, every optimizer stepped (under fp16 loss scaling all or none, the scale updated once), the schedule
        advanced unless the step was skipped, the methods' `after_optimizer_step`, the gradients zeroed. Call it inside
        `accelerator.accumulate`."""
        accelerator = self.accelerator
        value = loss.detach().float().item()
        self._recent.append(value)
        self._step_losses.append(value)
        self.loss_sum += value
        self.loss_count += 1
        accelerator.backward(loss)
        optimizer_step = accelerator.sync_gradients  # else the prepared optimizers skip their step
        if optimizer_step:
            for method in self.methods:  # the methods that edit the gradients before those that read them
                method.after_backward()
            for method in self.methods:
                method.before_optimizer_step()
        if step_optimizers(accelerator, self.optimizers):
            self.lr_scheduler.step()
        if optimizer_step:
            for method in self.methods:
                method.after_optimizer_step()
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def after_batch(self) -> None:
        """After a batch that ended an accumulation (an optimizer step): the step's loss into the metrics log, an
        evaluation (`--eval_steps`, not at the last step: the script's final one), then a step checkpoint
        (`--checkpointing_steps N`; at an epoch's last step `after_epoch` saves it). Nothing after the other batches.

        A checkpoint is saved after its step's evaluation: a resumed run does not evaluate that step again, so the
        checkpoint must hold what the evaluation left (the running loss it reset, the random states it drew from)."""
        if not self.accelerator.sync_gradients:
            return
        now = time.perf_counter()
        self._train_time += now - self._step_start
        self._steps_timed += 1
        self.completed_steps += 1
        self.progress_bar.update(1)
        self.progress_bar.set_postfix(loss=f"{sum(self._recent) / len(self._recent):.3f}", refresh=False)
        self.metrics_log.log({"loss": sum(self._step_losses) / len(self._step_losses)}, step=self.completed_steps)
        self._step_losses = []
        steps = self.completed_steps
        if self.eval_steps and steps % self.eval_steps == 0 and not self.done:
            self._evaluate(f"step {steps}")
        if self._step_checkpoint_due() and steps % self.steps_per_epoch:
            self._checkpoint(f"step_{steps}")
        self._step_start = time.perf_counter()  # evaluations and checkpoints are not training time

    def after_epoch(self, epoch: int) -> None:
        """After an epoch (or the part of it before `--max_train_steps`): an evaluation unless `--eval_steps` sets the
        cadence or the training ends here (the script's final evaluation), and an epoch checkpoint
        (`--checkpointing_steps epoch`; an epoch cut short is saved as `step_N`: an `epoch_E` folder would tell a
        resume that all of epoch E was trained), or the step checkpoint (`--checkpointing_steps N`) due at the epoch's
        last step, after the evaluation as in `after_batch`."""
        last_epoch = epoch == self.args.num_train_epochs - 1 or self.done
        if not self.eval_steps and not last_epoch:
            self._evaluate(f"epoch {epoch}")
        finished = self.completed_steps >= (epoch + 1) * self.steps_per_epoch
        if self.checkpointing_steps == "epoch":
            self._checkpoint(f"epoch_{epoch}" if finished else f"step_{self.completed_steps}")
        elif finished and self._step_checkpoint_due():
            self._checkpoint(f"step_{self.completed_steps}")

    @property
    def done(self) -> bool:
        return self.completed_steps >= self.args.max_train_steps

    def log_evaluation(self, metrics: dict, final: bool = False) -> None:
        """`metrics` with the training loss since the last evaluation, into the metrics log and the trackers. The
        scripts call it with `final=True` for their last evaluation, which reaches the trackers with all the results
        (`finish_run`)."""
        if self.loss_count:
            self.train_loss = self.loss_sum / self.loss_count
        self.loss_sum, self.loss_count = 0.0, 0
        record = {**metrics, "train_loss": self.train_loss} if self.train_loss is not None else dict(metrics)
        self.metrics_log.log(record, step=self.completed_steps)
        if self.args.with_tracking and not final:
            self.accelerator.log({**record, "epoch": self.epoch}, step=self.completed_steps)

    def results(self) -> dict:
        """The training figures of `all_results.json` (the loss since the last evaluation; times in seconds: the
        whole loop, and the optimizer steps alone, which the rates count)."""
        if self.loss_count:
            self.train_loss = self.loss_sum / self.loss_count
        timed = self._train_time
        return {
            "train_loss": self.train_loss,
            "epoch": self.args.num_train_epochs,
            "step": self.completed_steps,
            "train_runtime": round(self._runtime, 2),
            "train_time": round(timed, 2),
            "train_steps_per_second": round(self._steps_timed / timed, 4) if timed else None,
            "train_samples_per_second": round(self._steps_timed * self.total_batch_size / timed, 3) if timed else None,
        }

    # -------------------------------------------------------------------------------------------------- bookkeeping

    def _step_checkpoint_due(self) -> bool:
        return isinstance(self.checkpointing_steps, int) and self.completed_steps % self.checkpointing_steps == 0

    def _evaluate(self, when: str) -> None:
        self.log_evaluation(self.evaluate(when) if self.evaluate is not None else {})

    def _checkpoint(self, name: str) -> None:
        if self.staleness is not None:
            self.staleness.synchronize()
        loss_state = {"loss_sum": self.loss_sum, "loss_count": self.loss_count, "train_loss": self.train_loss}
        save_checkpoint(self.accelerator, self.args.output_dir, name, self.settings, self.staleness, loss_state)


def finish_run(
    accelerator,
    args,
    model,
    tokenizer,
    results: dict,
    *,
    loop: TrainingLoop,
    card: dict,
    start_time: float,
    logger,
    memory_report: Callable | None = None,
) -> dict:
    """The end of a run, the same in every script: the staleness histogram and the peak memory into `results`, the
    trackers closed, the trained model saved (a complete Hub folder: code files, tokenizer, staleness, a model card
    with the results, `card` giving its dataset, task and title), `all_results.json`, the memory report
    (`memory_report(model)`, with `--memory_report`) and the upload (`--push_to_hub`). Returns `results`."""
    import json

    from ..analysis.memory_usage import flatten_memory_usage
    from ..analysis.staleness import STALENESS_FILE
    from ..hub.model_card import card_base_model, card_license
    from ..parallel import save_sharded_model
    from .results import atomic_write_json, peak_memory_mb, save_final_outputs, write_results_model_card

    steps, staleness = loop.completed_steps, loop.staleness
    if staleness is not None:
        staleness.synchronize()
        histogram = staleness.results(steps, args.staleness_bins)
        logger.info(
            "Staleness (fraction of slots by the step range of their last top-1 pick):\n"
            + json.dumps(histogram, indent=2)
        )
        results.update(flatten_memory_usage(histogram, prefix="staleness"))
    peak = peak_memory_mb(accelerator.device)
    results["peak_memory_mb"] = round(peak, 1) if peak is not None else None
    if args.with_tracking:
        accelerator.log({k: v for k, v in results.items() if isinstance(v, (int, float))}, step=steps)
        accelerator.end_training()
    if args.output_dir is None:
        logger.info(json.dumps(results, indent=4))
        return results

    # The trained model, staged in output_dir/.final.tmp and renamed into place file by file: a crash never leaves a
    # torn file.
    unwrapped_model = accelerator.unwrap_model(model)

    def write_final(folder):
        if not save_sharded_model(accelerator, unwrapped_model, folder, args):  # --fsdp2: consolidated
            unwrapped_model.save_pretrained(
                folder, is_main_process=accelerator.is_main_process, save_function=accelerator.save
            )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(folder)
            if staleness is not None:
                staleness.save(os.path.join(folder, STALENESS_FILE), step=steps)
            write_results_model_card(
                folder,
                results,
                repo_id=args.hub_model_id,
                base_model=card_base_model(args.model_name_or_path, args.base_model),
                license=card_license(args.model_name_or_path, args.license),
                **card,
            )

    mark_run_output(args, accelerator.is_main_process)  # a run without training steps marks its folder here
    trained = loop.completed_steps > 0
    if trained:
        save_final_outputs(accelerator, args.output_dir, write_final)
    if accelerator.is_main_process:
        results["total_runtime"] = round(time.perf_counter() - start_time, 2)
        atomic_write_json(os.path.join(args.output_dir, "all_results.json"), results)
        if args.memory_report and memory_report is not None:
            memory_report(unwrapped_model)
        if args.push_to_hub and trained:
            from ..hub.upload import push_folder_to_hub

            repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
            push_folder_to_hub(
                args.output_dir, repo_id, private=args.hub_private_repo, token=args.hub_token,
                commit_message="End of training",
            )  # fmt: skip
    logger.info(json.dumps(results, indent=4))
    return results
