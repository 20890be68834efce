"""`transformers.Trainer` (and `SentenceTransformerTrainer`) with the memory values in their own optimizer group.

The plain Trainer puts the value tables in its decayed group, at the main learning rate with warm-up and decay. Here
the values get what XLM and Kim & Jung 2020 give them: Adam at a constant learning rate (1e-3), no weight decay, no
warm-up, while everything else follows the Trainer's `TrainingArguments` (AdamW, `learning_rate`, `weight_decay`,
`lr_scheduler_type`, warm-up). Trainer holds one optimizer and one scheduler: the values are a param group
(`"pkm_values"`) of that optimizer whose schedule multiplier is constant (`methods.optimizers.pkm_lr_lambdas`), so Trainer's
checkpoints (`optimizer.pt`, `scheduler.pt`) save and restore it as any other group.

    trainer = PkmTrainer(model=model, args=training_args, train_dataset=dataset)            # one line
    trainer = Trainer(..., optimizers=pkm_optimizers(model, training_args, num_training_steps))  # or this
"""

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer, TrainingArguments
from transformers.optimization import get_scheduler

from ..methods.optimizers.memory_optimizer import (
    PKM_VALUES_GROUP,
    SparseRowAdam,
    clip_grad_norm_,
    pkm_lr_lambdas,
    pkm_param_groups,
    set_sparse_values,
)
from ..utils.memories import memory_modules, ngram_memory_modules


MEMORY_OPTIMIZERS = ("adam", "sparse_row_adam")
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


class PkmCombinedOptimizer(torch.optim.Optimizer):
    """One optimizer (Trainer holds one) made of two: `main` for every group but the values, `memory` for the values.

    Its `param_groups` are the two optimizers' own group dicts, so a scheduler setting a group's lr sets it where the
    step reads it; `state_dict()` holds both optimizers' state dicts.
    """

    def __init__(self, main: torch.optim.Optimizer, memory: torch.optim.Optimizer):
        self.optimizers = (main, memory)
        super().__init__(main.param_groups + memory.param_groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def state_dict(self) -> dict:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"optimizers"} or len(state_dict["optimizers"]) != len(self.optimizers):
            raise ValueError(f"not a {type(self).__name__} state dict: keys {sorted(state_dict)}")
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"]):
            optimizer.load_state_dict(state)
        # torch's load_state_dict makes new group dicts: share them again
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]


def pkm_optimizer(
    model: torch.nn.Module,
    args: TrainingArguments,
    memory_learning_rate: float = 1e-3,
    memory_optimizer: str = "adam",
) -> torch.optim.Optimizer:
    """The optimizer of a Trainer run: torch AdamW with `args`' learning rate, betas, epsilon and weight decay (none on
    biases and norms) for everything but the memory values (and n-gram tables), which get their own group `"pkm_values"` at
    `memory_learning_rate` without weight decay: Adam (`memory_optimizer="adam"`, the same AdamW with weight decay 0)
    or `optimization.SparseRowAdam` (`"sparse_row_adam"`: only the rows a step read are updated; [`PkmTrainer`] also
    makes their gradient sparse, the plain Trainer keeps it dense since its gradient clipping cannot take a sparse one)."""
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be a transformers.TrainingArguments, got {type(args).__name__}")
    if memory_optimizer not in MEMORY_OPTIMIZERS:
        raise ValueError(f"memory_optimizer={memory_optimizer!r}; expected one of {MEMORY_OPTIMIZERS}")
    if not memory_learning_rate > 0:
        raise ValueError(f"memory_learning_rate={memory_learning_rate} must be > 0")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _ADAMW_OPTIMS:
        raise ValueError(
            f"TrainingArguments.optim={optim!r}: the memory-aware optimizer is torch AdamW; use optim in {_ADAMW_OPTIMS}"
        )
    if not memory_modules(model) and not ngram_memory_modules(model):
        raise ValueError(
            f"{type(model).__name__} has no product key memory and no n-gram memory: nothing to put in the "
            f"{PKM_VALUES_GROUP!r} group (use the plain Trainer)"
        )
    groups = pkm_param_groups(
        model, lr=args.learning_rate, weight_decay=args.weight_decay, memory_lr=memory_learning_rate
    )
    adam = dict(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    fused = {"fused": True} if optim == "adamw_torch_fused" else {}
    if memory_optimizer == "adam":
        return torch.optim.AdamW(groups, lr=args.learning_rate, **adam, **fused)
    main = torch.optim.AdamW(
        [g for g in groups if g["name"] != PKM_VALUES_GROUP], lr=args.learning_rate, **adam, **fused
    )
    memory = SparseRowAdam([g for g in groups if g["name"] == PKM_VALUES_GROUP], **adam)
    return PkmCombinedOptimizer(main, memory)


def pkm_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, num_training_steps: int) -> LambdaLR:
    """`args.lr_scheduler_type` with its warm-up for every group of `optimizer` except `"pkm_values"`, which keeps its
    learning rate (a `LambdaLR` whose multiplier is 1 for that group)."""
    if not isinstance(num_training_steps, int) or num_training_steps < 1:
        raise ValueError(f"num_training_steps={num_training_steps!r} must be a positive int")
    reference = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.get_warmup_steps(num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )
    if type(reference) is not LambdaLR:
        raise ValueError(
            f"lr_scheduler_type={str(args.lr_scheduler_type)!r} is not a per-step multiplier (LambdaLR): the memory "
            "values' constant rate cannot be kept apart in it; use linear, cosine, constant_with_warmup, ..."
        )
    # the first LambdaLR set every group's `initial_lr`; this one multiplies it by the right schedule per group
    return LambdaLR(optimizer, pkm_lr_lambdas(optimizer, reference.lr_lambdas[0]))


def pkm_optimizers(
    model: torch.nn.Module,
    args: TrainingArguments,
    num_training_steps: int | None = None,
    memory_learning_rate: float = 1e-3,
    memory_optimizer: str = "adam",
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """`(optimizer, scheduler)` for `Trainer(..., optimizers=pkm_optimizers(model, args))`: [`pkm_optimizer`] and
    [`pkm_scheduler`]. `num_training_steps` defaults to `args.max_steps` (set one of them; [`PkmTrainer`] needs
    neither)."""
    if num_training_steps is None:
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(
                "pkm_optimizers needs num_training_steps (or TrainingArguments.max_steps > 0) for the schedule; "
                "PkmTrainer computes it itself"
            )
        num_training_steps = args.max_steps
    optimizer = pkm_optimizer(model, args, memory_learning_rate, memory_optimizer)
    return optimizer, pkm_scheduler(optimizer, args, num_training_steps)


class PkmOptimizersMixin:
    """Makes a Trainer class build [`pkm_optimizer`] and [`pkm_scheduler`] (see [`pkm_trainer_class`])."""

    def __init__(self, *args, memory_learning_rate: float = 1e-3, memory_optimizer: str = "adam", **kwargs):
        if memory_optimizer not in MEMORY_OPTIMIZERS:
            raise ValueError(f"memory_optimizer={memory_optimizer!r}; expected one of {MEMORY_OPTIMIZERS}")
        if not memory_learning_rate > 0:
            raise ValueError(f"memory_learning_rate={memory_learning_rate} must be > 0")
        self.memory_learning_rate, self.memory_optimizer = memory_learning_rate, memory_optimizer
        super().__init__(*args, **kwargs)

    def _optimized_module(self, model=None) -> torch.nn.Module:
        # SentenceTransformerTrainer optimizes its loss module(s), which hold the model and any loss weights
        loss = getattr(self, "loss", None)
        if model is None and isinstance(loss, dict):
            return torch.nn.ModuleDict(loss)
        if model is None and isinstance(loss, torch.nn.Module):
            return loss
        return self.model if model is None else model

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            module = self._optimized_module(model)
            self.optimizer = pkm_optimizer(module, self.args, self.memory_learning_rate, self.memory_optimizer)
            if self.memory_optimizer == "sparse_row_adam" and self.args.world_size == 1:
                # the values' gradient then holds only the rows a step read, not the whole table (DDP keeps it dense:
                # NCCL has no sparse all-reduce)
                set_sparse_values(module, True)
        return self.optimizer

    def _clip_grad_norm(self, model):
        # torch's clip_grad_norm_ raises on a sparse gradient: the same total norm over every parameter, sparse-aware
        parameters = list(model.parameters())
        if not any(p.grad is not None and p.grad.is_sparse for p in parameters):
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return clip_grad_norm_(parameters, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        # with clipping off (max_grad_norm=0) Trainer still measures the norm for its log, through the same torch path
        if grad_norm is None and any(p.grad is not None and p.grad.is_sparse for p in model.parameters()):
            self.accelerator.unscale_gradients()
            grad_norm = clip_grad_norm_(model.parameters(), float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = pkm_scheduler(self.optimizer if optimizer is None else optimizer, self.args, num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler


def pkm_trainer_class(trainer_class: type) -> type:
    """`trainer_class` (a subclass of `transformers.Trainer`, e.g. `SentenceTransformerTrainer`) with the memory
    values in their own group; its constructor takes `memory_learning_rate` (1e-3) and `memory_optimizer`."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"trainer_class must be a subclass of transformers.Trainer, got {trainer_class!r}")
    if issubclass(trainer_class, PkmOptimizersMixin):
        return trainer_class
    return type(f"Pkm{trainer_class.__name__}", (PkmOptimizersMixin, trainer_class), {"__module__": __name__})


class PkmTrainer(PkmOptimizersMixin, Trainer):
    """`transformers.Trainer` whose optimizer keeps the memory values apart: Adam at a constant
    `memory_learning_rate` (1e-3), no weight decay, no warm-up (`memory_optimizer="sparse_row_adam"`: row-wise lazy
    `SparseRowAdam` on a sparse gradient of the rows a step read, clipped with the rest by `max_grad_norm`); the rest
    follows `TrainingArguments`. Checkpoints and `resume_from_checkpoint` as Trainer's."""


__all__ = [
    "MEMORY_OPTIMIZERS",
    "PkmCombinedOptimizer",
    "PkmOptimizersMixin",
    "PkmTrainer",
    "pkm_optimizer",
    "pkm_optimizers",
    "pkm_scheduler",
    "pkm_trainer_class",
]
