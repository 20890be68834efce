"""The command-line flags of the library methods, TRIME (`--trime`, ...) and sparse memory finetuning
(`--sparse_memory_finetuning`, `--smf_*`), with the names they share with the methods' code. Standard library only, as
`training.arguments`: a script's `--help` imports no torch. The scripts check the parsed values in
`training.trime.resolve_trime_arguments` and `training.sparse_finetuning.check_smf_arguments`.
"""

import argparse


# TRIME (methods/trime.py): the memories of a causal model
CAUSAL_MEMORY_KINDS = ("local", "long")


def add_trime_arguments(parser, causal: bool = True):
    """`--trime` and `--trime_eval` for run_clm.py (causal: none/local/long) and run_mlm.py (masked: `--trime`
    none/batch, `--trime_eval` none/context; `--trime_eval batch` is refused by `trime.resolve_trime_arguments`)."""
    kinds = ("none", *CAUSAL_MEMORY_KINDS) if causal else ("none", "batch")
    # "batch" stays a choice of --trime_eval so that it gets a clear error rather than argparse's list
    eval_kinds = kinds if causal else ("none", "batch", "context")
    default_kind = "local" if causal else "batch"
    group = parser.add_argument_group(
        "TRIME (in-batch memory objective)",
        "Zhong et al. 2022: the other positions of the batch act as a memory; p(w|t) ∝ exp(E_w·h_t + b_w) + "
        "sum over memory entries j with target w of exp(h_t·h_j / sqrt(d)), normalised over the vocabulary and "
        "every memory entry (modeling_pkm_bert/methods/trime.py).",
    )
    help_kinds = (
        "local: the earlier positions of the same block (TRIME_local); long: also every position of the previous "
        "blocks of the batch, which are then consecutive blocks of the text (TRIME_long)"
        if causal
        else "batch: the other masked positions of the batch (never a position itself), each credited to its label"
    )
    group.add_argument(
        "--trime",
        nargs="?",
        const=default_kind,
        default="none",
        choices=kinds,
        help=f"Train with TRIME's loss and this memory (`--trime` alone: {default_kind}); {help_kinds}.",
    )
    group.add_argument(
        "--trime_eval",
        default=None,
        choices=eval_kinds,
        help="The memory of the evaluation's second perplexity (`eval_<set>_trime_perplexity`, beside the ordinary "
        "one); default: the --trime memory"
        + (
            ""
            if causal
            else " for a causal LM; here `context`, the visible (unmasked) positions of the batch, each credited to its "
            "own token: the masked positions' labels are what the model must predict, so no test-time memory reads "
            "them (`batch` is refused)"
        )
        + ". Give it to a model trained without --trime to measure the test-time memory alone.",
    )
    group.add_argument(
        "--trime_chunk_size", type=int, default=1024, help="Queries per block of the memory computation."
    )
    return parser


# sparse memory finetuning (methods/sparse_finetuning.py)
STATISTICS_NAME = "smf_background_statistics.safetensors"
SMF_RANKERS = ("tfidf", "kl")


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
    group.add_argument("--smf_ranker", choices=SMF_RANKERS, default="tfidf", help="tfidf (Lin et al.) or kl.")
    group.add_argument(
        "--smf_train_rest",
        action="store_true",
        help="Keep every other parameter trainable (by default only the chosen value rows change); needed when the "
        "task head is new, e.g. run_glue/run_squad from a masked-LM checkpoint.",
    )
    return parser


__all__ = ["CAUSAL_MEMORY_KINDS", "SMF_RANKERS", "STATISTICS_NAME", "add_smf_arguments", "add_trime_arguments"]
