"""The command-line flags of training across processes (standard library only: `--help` imports no torch)."""

import argparse


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
