"""The command-line flags of sparse memory finetuning (`--sparse_memory_finetuning`, `--smf_*`), the names they share
with the method (`STATISTICS_NAME`, `SMF_RANKERS`) and their check (`check_smf_arguments`). Standard library only, as
`training.arguments`: a script's `--help` imports no torch.
"""

import argparse
import os

from ...utils.input_errors import InputError


STATISTICS_NAME = "smf_background_statistics.safetensors"
SMF_RANKERS = ("tfidf", "kl", "unread", "gradient", "gradient_kl")
GRADIENT_RANKERS = ("gradient", "gradient_kl")  # rank the step's value gradient


def add_smf_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--sparse_memory_finetuning` and its `--smf_*` options (the value optimizer is `--memory_optimizer`)."""
    group = parser.add_argument_group(
        "sparse memory finetuning",
        "Lin et al. 2025: train only the memory value rows that each step reads much more than background text "
        "does (everything else frozen unless --smf_train_rest). Use with --memory_optimizer sgd and "
        "--memory_learning_rate (the paper: plain SGD, lr up to ~2) or adam / sparse_row_adam.",
    )
    group.add_argument("--sparse_memory_finetuning", action="store_true", help="Turn sparse memory finetuning on.")
    group.add_argument(
        "--smf_background_file",
        type=str,
        default=None,
        help="Background text (.txt/.raw: one text per line; .csv/.json/.jsonl with a 'text' column) whose statistics "
        f"are computed before training, or a statistics file (.safetensors, e.g. {STATISTICS_NAME} written by an "
        f"earlier run). Default: {STATISTICS_NAME} beside the model, if there is one.",
    )
    group.add_argument(
        "--smf_background_dataset",
        type=str,
        default=None,
        help="A datasets name (`name` or `name:config`, its train split, column 'text') as background text.",
    )
    group.add_argument(
        "--smf_background_batches",
        type=int,
        default=1000,
        help="Number N of background documents, each as many sequences of the training length (--max_seq_length, "
        "run_clm's --block_size) as one optimizer step's batch (per-device batch x gradient accumulation x "
        "processes), the unit a step's reads are ranked in (the re-implementations: 1000).",
    )
    group.add_argument("--smf_top_t", type=int, default=500, help="Value rows trained per memory layer and step.")
    group.add_argument(
        "--smf_ranker",
        choices=SMF_RANKERS,
        default="tfidf",
        help="tfidf (Lin et al.), kl, unread: the step's most read rows among those the background never reads, "
        "gradient: the read rows of largest value gradient in the step (no background), or gradient_kl: kl with the "
        "step's gradient mass in place of its reads.",
    )
    group.add_argument(
        "--smf_train_rest",
        action="store_true",
        help="Keep every other parameter trainable (by default only the chosen value rows change); needed when the "
        "task head is new, e.g. run_glue/run_squad from a masked-LM checkpoint.",
    )
    return parser



def check_smf_arguments(args: argparse.Namespace) -> None:
    """Clear errors for bad SMF flags before anything is loaded."""
    if not getattr(args, "sparse_memory_finetuning", False):
        return
    if args.smf_top_t < 1:
        raise InputError(f"--smf_top_t {args.smf_top_t} must be >= 1")
    if args.smf_background_batches < 1:
        raise InputError(f"--smf_background_batches {args.smf_background_batches} must be >= 1")
    if args.smf_ranker == "gradient" and (args.smf_background_file or args.smf_background_dataset):
        raise InputError(
            "--smf_ranker gradient ranks each step's value gradient and reads no background: drop "
            "--smf_background_file / --smf_background_dataset"
        )
    if args.smf_background_file and args.smf_background_dataset:
        raise InputError("give --smf_background_file or --smf_background_dataset, not both")
    if args.smf_background_file and not os.path.isfile(args.smf_background_file):
        raise InputError(f"--smf_background_file {args.smf_background_file!r} does not exist")
    if getattr(args, "freeze_memory", False):
        raise InputError("--sparse_memory_finetuning trains memory values: it cannot be combined with --freeze_memory")


__all__ = ["GRADIENT_RANKERS", "SMF_RANKERS", "STATISTICS_NAME", "add_smf_arguments", "check_smf_arguments"]
