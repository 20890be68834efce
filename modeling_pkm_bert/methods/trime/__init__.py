"""TRIME (Zhong, Lei & Chen 2022): `objective` (the loss with in-batch memory, for causal and masked LMs), `arguments`
(`--trime`, `--trime_eval`, `--trime_chunk_size` and their resolution, standard library only), `training_method` (the
method as the scripts' registry sees it). Names resolve on first
use."""

from ...utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".arguments": ("CAUSAL_MEMORY_KINDS", "add_trime_arguments", "resolve_trime_arguments"),
        ".objective": (
            "MEMORY_KINDS",
            "capture_output_layer",
            "causal_targets",
            "check_logits_match",
            "check_trime_model",
            "model_trime_losses",
            "output_layer",
            "trime_log_probs",
            "trime_loss",
        ),
        ".training_method": ("LANGUAGE_MODELING_TASKS", "TrimeMethod"),
    },
)
