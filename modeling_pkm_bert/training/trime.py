"""TRIME's command line for the training scripts (`--trime`, `--trime_eval`, `--trime_chunk_size`: their parsed values
resolved) and the perplexity the scripts log. The objective itself (Zhong, Lei & Chen 2022) is a library method:
`modeling_pkm_bert.methods.trime`.
"""

import math

from ..utils.input_errors import InputError


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


def perplexity(loss: float) -> float:
    """exp(loss), inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


__all__ = ["perplexity", "resolve_trime_arguments"]
