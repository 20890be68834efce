"""The memory report's flags for the training scripts (`--memory_report`, `--memory_report_max_sequences`). Standard
library only, as `training.arguments`: a script's `--help` imports no torch."""

import argparse


def add_memory_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("memory report")
    group.add_argument(
        "--memory_report",
        action="store_true",
        help="After training, write the memory report of the final model into <output_dir>/memory_report/: usage "
        "heat maps and curves per memory layer on the evaluation data, per-class usage (classification), "
        "staleness (with --track_staleness) and training curves (modeling_pkm_bert.analysis).",
    )
    group.add_argument(
        "--memory_report_max_sequences",
        type=int,
        default=64,
        help="At most this many evaluation sequences are run for the memory report.",
    )
    return parser


__all__ = ["add_memory_report_arguments"]
