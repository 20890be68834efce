"""TRIME as a training method of the scripts: its flags (`--trime`, `--trime_eval`, `--trime_chunk_size`) for the
language-modeling scripts, resolved after parsing, and the memory a resumed run must keep. The objective replaces the
loss, which each script computes in its own step (`objective.model_trime_losses`): no hook of the loop. Standard
library only, as `arguments`."""

from ..base import TrainingMethod
from .arguments import add_trime_arguments, resolve_trime_arguments


# the scripts that train a language model, and whether it is causal
LANGUAGE_MODELING_TASKS = {"masked-lm": False, "causal-lm": True}


class TrimeMethod(TrainingMethod):
    name = "trime"
    resume_settings = ("trime",)

    @classmethod
    def add_arguments(cls, parser, task: str) -> None:
        if task in LANGUAGE_MODELING_TASKS:
            add_trime_arguments(parser, causal=LANGUAGE_MODELING_TASKS[task])

    @classmethod
    def check_arguments(cls, args, task: str) -> None:
        if task in LANGUAGE_MODELING_TASKS:
            resolve_trime_arguments(args, causal=LANGUAGE_MODELING_TASKS[task])


__all__ = ["LANGUAGE_MODELING_TASKS", "TrimeMethod"]
