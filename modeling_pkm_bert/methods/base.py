"""What a training method is to the scripts and to `training.loop.TrainingLoop` (peft's `BaseTuner`, in small): its
flags and their check, whether a run uses it, its setup, its hooks around the optimizer step, its share of every
checkpoint and of the settings a resume must match. `methods.registry.METHODS` lists the methods; the scripts and the
loop go through it and name none. Standard library only: a script's `--help` builds its parser from the registry.

    class MyMethod(TrainingMethod):
        name = "my_method"
        resume_settings = ("my_method_rate",)          # args a resumed run must share with the checkpoint

        @classmethod
        def add_arguments(cls, parser, task):          # task: "masked-lm", "causal-lm", "sequence-classification", ...
            parser.add_argument("--my_method", action="store_true")

        @classmethod
        def setup(cls, args, accelerator, model, **context):  # before the optimizers are made
            return cls() if args.my_method else None

        def before_optimizer_step(self):               # the step's gradients are complete
            ...
"""

from __future__ import annotations


class TrainingMethod:
    """A training method: class methods for the flags and the setup, instance hooks for the run it takes part in.

    In a training step (`TrainingLoop.step`), once the accumulated gradients are complete: every method's
    `after_backward` (where a method edits the gradients, e.g. sparse memory finetuning masks the rows it does not
    train), then every `before_optimizer_step` (where one reads them, e.g. the memory values' clipping), the optimizers
    step, then every `after_optimizer_step`. `save_state` / `load_state` write and read the method's own files in
    every checkpoint folder (`accelerator.save_state` / `load_state`)."""

    name: str = ""
    # the flags whose change makes a resumed run differ from the uninterrupted one (`training.checkpoints.run_settings`)
    resume_settings: tuple[str, ...] = ()

    @classmethod
    def run_resume_settings(cls, args) -> tuple[str, ...]:
        """The `resume_settings` this run records (a method may record its own only where it is on, so that the
        checkpoints of runs without it compare as before)."""
        return cls.resume_settings

    @classmethod
    def add_arguments(cls, parser, task: str) -> None:
        """Adds the method's flags for a script of `task` (none where the method does not apply to it)."""

    @classmethod
    def check_arguments(cls, args, task: str) -> None:
        """Checks (and normalises) the parsed flags before any work; raises `InputError` naming a wrong flag (the
        script ends with it as a usage error)."""

    @classmethod
    def setup(cls, args, accelerator, model, **context) -> TrainingMethod | None:
        """Before the optimizers are made (it may freeze parameters): the method as this run uses it, or None when
        the flags leave it off. `context`: `tokenizer`, `max_seq_length`, `causal`, `checkpoint` (the folder being
        resumed, or None), `logger`."""
        return None

    def prepared(self, accelerator, model, memory_optimizer) -> None:
        """After `accelerator.prepare`: the prepared model and the memory values' optimizer (None without one)."""

    def summary(self) -> list[str]:
        """Lines for the "Running training" block."""
        return []

    def after_backward(self) -> None:
        """The accumulated gradients are complete: edit them here."""

    def before_optimizer_step(self) -> None:
        """After every method's `after_backward`, before the optimizers step."""

    def after_optimizer_step(self) -> None:
        """After the optimizers stepped (or skipped the step under fp16 loss scaling), before the gradients are
        zeroed."""

    def save_state(self, folder: str) -> None:
        """Writes the method's state into a checkpoint folder (on every process: write on the main one only)."""

    def load_state(self, folder: str) -> None:
        """Reads it back from a checkpoint folder being resumed."""


def register_for_checkpointing(accelerator, methods: list[TrainingMethod]) -> None:
    """Every `accelerator.save_state` folder gets the methods' state and every `load_state` reads it back."""
    if not methods:
        return

    def save(models, weights, output_dir):
        for method in methods:
            method.save_state(output_dir)

    def load(models, input_dir):
        for method in methods:
            method.load_state(input_dir)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


__all__ = ["TrainingMethod", "register_for_checkpointing"]
