"""The command-line flags of the memory values' own optimizer: `--memory_learning_rate`, `--memory_optimizer`,
`--memory_max_grad_norm` and `--freeze_memory`, in the "product key memory" group of `training.add_pkm_arguments`.
Standard library only, as `training.arguments`: a script's `--help` imports no torch.
"""

import argparse


MEMORY_OPTIMIZERS = ("adam", "sparse_row_adam", "sgd")


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_memory_optimizer_arguments(group) -> None:
    """Adds the memory optimizer's flags to `group` (an argparse parser or argument group); the scripts apply them with
    `methods.optimizers.scripts` and `memory_optimizer.freeze_memory`."""
    group.add_argument(
        "--memory_learning_rate",
        type=float,
        default=1e-3,
        help="Constant learning rate of the memory values, in their own Adam group without weight decay or warm-up "
        "(XLM and the paper: 1e-3).",
    )
    group.add_argument(
        "--freeze_memory", action="store_true", help="Keep all memory parameters fixed (the paper's Table 5 ablation)."
    )
    group.add_argument(
        "--memory_optimizer",
        choices=MEMORY_OPTIMIZERS,
        default="adam",
        help="adam: torch Adam on dense value gradients (XLM's published setting; works with every backend). "
        "sparse_row_adam: methods.optimizers.SparseRowAdam, a lazy row-wise Adam that updates only the rows a step "
        "read (the paper's 'sparse update' of the values; bf16 first moment and one second moment per row, 1.5x the table "
        "instead of Adam's 4x), fed sparse value gradients on one process or gloo and dense ones under NCCL, which "
        "has no sparse all-reduce. It pays off when a step reads a small part of the table "
        "(tokens per step * heads * knn well below pkm_n_keys ** 2). "
        "sgd: plain SGD without momentum or weight decay (sparse memory finetuning's choice, Lin et al. 2025, with "
        "--memory_learning_rate up to ~2): a row without gradient does not move.",
    )
    group.add_argument(
        "--memory_max_grad_norm",
        type=_positive_float,
        default=None,
        help="Clip the gradient of the memory value tables to this norm, on its own (Memory+ clips the values "
        "separately from the other parameters); dense and sparse gradients. Default: no clipping.",
    )


__all__ = ["MEMORY_OPTIMIZERS", "add_memory_optimizer_arguments"]
