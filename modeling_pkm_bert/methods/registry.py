"""The registry of training methods, `METHODS` (name -> `base.TrainingMethod` subclass, one a method folder), and what
the scripts and the training loop do with it, naming no method: add every method's flags, check them, set up the
methods a run turns on, hand them what `accelerator.prepare` returns. A new method is a folder with its class,
listed here. Standard library only: a script's `--help` builds its parser from it."""

from .base import TrainingMethod, register_for_checkpointing
from .optimizers.training_method import MemoryOptimizerMethod
from .sparse_finetuning.training_method import SparseMemoryFinetuningMethod
from .trime.training_method import TrimeMethod


# in this order everywhere: their flags in --help, their checks, their hooks within each hook point
METHODS: dict[str, type[TrainingMethod]] = {
    method.name: method for method in (MemoryOptimizerMethod, TrimeMethod, SparseMemoryFinetuningMethod)
}


def add_method_arguments(parser, task: str):
    """Every method's flags for a script of `task` ("masked-lm", "causal-lm", "sequence-classification",
    "question-answering")."""
    for method in METHODS.values():
        method.add_arguments(parser, task=task)
    return parser


def check_method_arguments(args, task: str) -> None:
    """Every method's check (and normalisation) of the parsed flags, before any work: an `InputError` names a wrong
    flag (a script's `main`, under `exits_with_usage_errors`, ends with it as a usage error)."""
    for method in METHODS.values():
        method.check_arguments(args, task=task)


def method_resume_settings(args) -> tuple[str, ...]:
    """The flags of every method that a resumed run of `args` must share with its checkpoint."""
    return tuple(name for method in METHODS.values() for name in method.run_resume_settings(args))


def setup_methods(args, accelerator, model, **context) -> list[TrainingMethod]:
    """The methods this run uses, set up before the optimizers are made (`TrainingMethod.setup`)."""
    methods = (method.setup(args, accelerator, model, **context) for method in METHODS.values())
    return [method for method in methods if method is not None]


def prepare_methods(methods: list[TrainingMethod], accelerator, model, memory_optimizer) -> None:
    """After `accelerator.prepare`: each method gets the prepared model and the memory optimizer, and its state goes
    into every checkpoint."""
    for method in methods:
        method.prepared(accelerator, model, memory_optimizer)
    register_for_checkpointing(accelerator, methods)


__all__ = [
    "METHODS",
    "add_method_arguments",
    "check_method_arguments",
    "method_resume_settings",
    "prepare_methods",
    "setup_methods",
]
