"""TRIME's command-line flags (`--trime`, `--trime_eval`, `--trime_chunk_size`) and their parsed values resolved
(`resolve_trime_arguments`). Standard library only, as `training.arguments`: a script's `--help` imports no torch.
"""

from ...utils.input_errors import InputError


# the memories of a causal model
CAUSAL_MEMORY_KINDS = ("local", "long")


def add_trime_arguments(parser, causal: bool = True):
    """`--trime` and `--trime_eval` for run_clm.py (causal: none/local/long) and run_mlm.py (masked: `--trime`
    none/batch, `--trime_eval` none/context; `--trime_eval batch` is refused by `resolve_trime_arguments`)."""
    kinds = ("none", *CAUSAL_MEMORY_KINDS) if causal else ("none", "batch")
    # "batch" stays a choice of --trime_eval so that it gets a clear error rather than argparse's list
    eval_kinds = kinds if causal else ("none", "batch", "context")
    default_kind = "local" if causal else "batch"
    group = parser.add_argument_group(
        "TRIME (in-batch memory objective)",
        "Zhong et al. 2022: the other positions of the batch act as a memory; p(w|t) ∝ exp(E_w·h_t + b_w) + "
        "sum over memory entries j with target w of exp(h_t·h_j / sqrt(d)), normalised over the vocabulary and "
        "every memory entry (modeling_pkm_bert/methods/trime/objective.py).",
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


def resolve_trime_arguments(args, causal: bool = True) -> None:
    """Normalises `args.trime` / `args.trime_eval` to a memory kind or None (after parsing). A masked LM evaluates with
    the "context" memory (the default after `--trime batch`): the "batch" memory's entries are credited to the masked
    positions' labels, which a test-time score may not read."""
    args.trime = None if args.trime in (None, "none") else args.trime
    if not causal and args.trime_eval == "batch":
        raise InputError(
            "--trime_eval batch would credit every other masked position to its label, and at test time those labels "
            "are what is hidden from the model (the perplexity would read the answers); use --trime_eval context "
            "(the visible positions, each credited to its own token). --trime batch still trains with it."
        )
    if args.trime_eval is None:
        args.trime_eval = args.trime if causal or args.trime is None else "context"
    args.trime_eval = None if args.trime_eval == "none" else args.trime_eval
    if args.trime_chunk_size < 1:
        raise InputError(f"--trime_chunk_size must be >= 1, got {args.trime_chunk_size}")


__all__ = ["CAUSAL_MEMORY_KINDS", "add_trime_arguments", "resolve_trime_arguments"]
