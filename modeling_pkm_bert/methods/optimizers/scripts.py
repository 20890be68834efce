"""The training scripts' use of the memory values' own optimizer (`--memory_optimizer`, `--memory_learning_rate`,
`--memory_max_grad_norm`): the main and memory parameter groups, the memory optimizer a run trains with, its log line
and the values' own gradient clipping. The optimizers themselves (`SparseRowAdam`, `pkm_param_groups`, ...):
`memory_optimizer`; the flags: `arguments`.
"""

import argparse

import torch

from ...utils import memories
from . import memory_optimizer as optimizers


def clip_memory_gradients(accelerator, model: torch.nn.Module, memory_optimizer, max_norm: float | None, smf=None):
    """`--memory_max_grad_norm`: clips the value tables' gradient to `max_norm` on its own (each shared table once),
    after unscaling it under fp16 loss scaling (once a step: `unscale_once`); call it between `accelerator.backward`
    and `step_optimizers`. `smf` (a `SparseMemoryFinetuning`, for callers that mask here): the step's rows chosen and
    the gradient masked first, so that the clipping norm counts only the rows the step trains.
    Returns the norm before clipping (None when there is nothing to clip)."""
    if not accelerator.sync_gradients:
        return None
    if smf is not None:
        smf.mask_gradients()
    if not max_norm:
        return None
    if memory_optimizer is not None:
        optimizers.unscale_once(getattr(accelerator, "scaler", None), memory_optimizer)
    parameters = [p for p in optimizers.pkm_value_parameters(accelerator.unwrap_model(model)) if p.grad is not None]
    return optimizers.clip_grad_norm_(parameters, max_norm) if parameters else None


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], list[dict]]:
    """(main groups, memory groups) of `methods.optimizers.pkm_param_groups`: main = everything but the values, decayed
    except biases and norms; memory = the value tables without weight decay, for their own optimizer. The groups carry
    no learning rate: each optimizer gives its own."""
    groups = optimizers.pkm_param_groups(model, lr=0.0, weight_decay=weight_decay)
    for group in groups:
        del group["lr"]
    main_groups = [group for group in groups if group["name"] != optimizers.PKM_VALUES_GROUP]
    memory_groups = [group for group in groups if group["name"] == optimizers.PKM_VALUES_GROUP]
    return main_groups, memory_groups


def sparse_gradients_supported() -> bool:
    """Whether sparse value gradients can be all-reduced here: one process, or a gloo process group (not NCCL)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_backend() == "gloo"


def create_memory_optimizer(
    memory_groups: list[dict], args: argparse.Namespace, model: torch.nn.Module | None = None
) -> torch.optim.Optimizer | None:
    """The values' own optimizer at a constant `--memory_learning_rate` (no scheduler is attached to it): Adam, plain
    SGD with `--memory_optimizer sgd`, or with `--memory_optimizer sparse_row_adam` the row-wise lazy `SparseRowAdam`.
    For the latter, pass `model` (before
    `accelerator.prepare`: DDP reads the flag when it wraps the model) to switch its value gradients to sparse where
    the process group can all-reduce them; without it, or under NCCL, the gradients stay dense (same update)."""
    if not memory_groups:
        return None
    if getattr(args, "memory_optimizer", "adam") == "sgd":
        return torch.optim.SGD(memory_groups, lr=args.memory_learning_rate)
    if getattr(args, "memory_optimizer", "adam") == "sparse_row_adam":
        if model is not None:
            # FSDP2 / memory parallel (parameters are DTensors) take dense gradients only
            dtensors = any(hasattr(p, "placements") for p in model.parameters())
            optimizers.set_sparse_values(model, sparse_gradients_supported() and not dtensors)
        return optimizers.SparseRowAdam(memory_groups, lr=args.memory_learning_rate)
    return torch.optim.Adam(memory_groups, lr=args.memory_learning_rate)


def memory_optimizer_summary(memory_optimizer, model: torch.nn.Module, learning_rate: float) -> str:
    """The log line of the optimizer the memory values train with (the one used, unwrapped from accelerate's)."""
    optimizer = getattr(memory_optimizer, "optimizer", memory_optimizer)
    sparse = any(table.sparse for table in memories.memory_tables(model).values())
    return (
        f"Memory values: {type(optimizer).__name__}, constant lr {learning_rate}, no weight decay, "
        f"{'sparse' if sparse else 'dense'} gradients"
    )


__all__ = [
    "clip_memory_gradients",
    "create_memory_optimizer",
    "memory_optimizer_summary",
    "optimizer_param_groups",
    "sparse_gradients_supported",
]
