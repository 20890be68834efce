"""The memory values' own optimizer as a training method of the scripts: the values' gradient clipped on its own
before each step (`--memory_max_grad_norm`) and the optimizer's line in the "Running training" block. The optimizer
itself is made with the main one (`training.preparation.prepare_training`, `scripts.create_memory_optimizer`); its flags
are in the "product key memory" group (`training.arguments.add_pkm_arguments`). Standard library only at import."""

from ..base import TrainingMethod


class MemoryOptimizerMethod(TrainingMethod):
    name = "memory_optimizer"
    resume_settings = ("memory_learning_rate", "memory_optimizer", "memory_max_grad_norm")

    def __init__(self, args, accelerator=None, model=None, memory_optimizer=None):
        self.args, self.accelerator, self.model, self.memory_optimizer = args, accelerator, model, memory_optimizer

    @classmethod
    def setup(cls, args, accelerator, model, **context):
        return cls(args, accelerator, model)  # every training run: a model without memory clips nothing

    def prepared(self, accelerator, model, memory_optimizer) -> None:
        self.accelerator, self.model, self.memory_optimizer = accelerator, model, memory_optimizer

    def summary(self) -> list[str]:
        if self.memory_optimizer is None:
            return []
        from .scripts import memory_optimizer_summary

        model = self.accelerator.unwrap_model(self.model)
        return [memory_optimizer_summary(self.memory_optimizer, model, self.args.memory_learning_rate)]

    def before_optimizer_step(self) -> None:
        from . import scripts  # at call time: a test may wrap scripts.clip_memory_gradients

        max_norm = self.args.memory_max_grad_norm
        scripts.clip_memory_gradients(self.accelerator, self.model, self.memory_optimizer, max_norm)


__all__ = ["MemoryOptimizerMethod"]
