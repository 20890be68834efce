"""The command-line flags of training across processes (standard library only: `--help` imports no torch)."""

import argparse
import re


# torch.distributed.fsdp.fully_shard (FSDP2) is public from torch 2.6 on
FSDP2_MIN_TORCH = (2, 6)


def fsdp2_torch_problem(torch_version: str) -> str | None:
    """Why a torch of version `torch_version` (e.g. `torch.__version__`) cannot run FSDP2 / memory parallel, or None."""
    found = re.match(r"(\d+)\.(\d+)", torch_version)
    if found and tuple(map(int, found.groups())) >= FSDP2_MIN_TORCH:
        return None
    minimum = ".".join(map(str, FSDP2_MIN_TORCH))
    return f"FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= {minimum}; this is torch {torch_version}"


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """`--fsdp2` and `--memory_parallel` (the latter implies the former)."""
    group = parser.add_argument_group("training across processes")
    group.add_argument(
        "--fsdp2",
        action="store_true",
        help="Shard the model's parameters, gradients and optimizer states across the processes with FSDP2 "
        "(torch.distributed.fsdp.fully_shard on each layer and on the model) instead of DDP.",
    )
    group.add_argument(
        "--memory_parallel",
        action="store_true",
        help="FSDP2 with memory-parallel value tables: each process keeps all rows but v_dim / world columns of every "
        "value table (and its optimizer state); lookups exchange the tokens' slot indices and output slices "
        "(docs/distributed.md). Implies --fsdp2.",
    )
