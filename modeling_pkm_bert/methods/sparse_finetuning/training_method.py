"""Sparse memory finetuning as a training method of the scripts (`--sparse_memory_finetuning`, `--smf_*`): its flags
(`arguments`), its setup (`scripts.setup_from_args`), the row masks before the clipping and the background statistics
in every checkpoint. Standard library only at import, as `arguments`."""

from ..base import TrainingMethod
from .arguments import add_smf_arguments, check_smf_arguments


class SparseMemoryFinetuningMethod(TrainingMethod):
    name = "sparse_memory_finetuning"
    # the background file by its content, not its path (`training.checkpoints.run_settings`): a resume takes the
    # statistics from the checkpoint, so another file would be ignored
    resume_settings = (
        "sparse_memory_finetuning",
        "smf_ranker",
        "smf_top_t",
        "smf_train_rest",
        "smf_background_batches",
        "smf_background_dataset",
        "smf_background_file",
    )

    @classmethod
    def run_resume_settings(cls, args) -> tuple[str, ...]:
        return cls.resume_settings if getattr(args, "sparse_memory_finetuning", False) else ()

    def __init__(self, accelerator, smf):
        self.accelerator, self.smf = accelerator, smf  # smf: a `method.SparseMemoryFinetuning`

    @classmethod
    def add_arguments(cls, parser, task: str) -> None:
        add_smf_arguments(parser)

    @classmethod
    def check_arguments(cls, args, task: str) -> None:
        check_smf_arguments(args)

    @classmethod
    def setup(cls, args, accelerator, model, *, tokenizer, max_seq_length, causal=False, checkpoint=None, logger=None,
              **context):  # fmt: skip
        from . import scripts  # at call time: a test may wrap scripts.setup_from_args

        smf = scripts.setup_from_args(args, accelerator, model, tokenizer, max_seq_length, checkpoint, logger, causal)
        return cls(accelerator, smf) if smf is not None else None

    def prepared(self, accelerator, model, memory_optimizer) -> None:
        self.smf.attach(memory_optimizer)  # each value step trains only the chosen rows

    def after_backward(self) -> None:
        self.smf.mask_gradients()  # before the clipping: its norm counts only the rows the step trains

    def save_state(self, folder: str) -> None:
        if self.accelerator.is_main_process:
            self.smf.save_state(folder)

    def load_state(self, folder: str) -> None:
        self.smf.load_state(folder)


__all__ = ["SparseMemoryFinetuningMethod"]
