"""Sparse memory finetuning (Lin et al. 2025): `method` (background statistics, ranking, the masked update, the
`transformers.Trainer` callback), `arguments` (`--sparse_memory_finetuning`, `--smf_*` and their check, standard
library only), `scripts` (the statistics and the `SparseMemoryFinetuning` a training script sets up from the flags),
`training_method` (the method as the scripts' registry sees it).
Names resolve on first use."""

from ...utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".arguments": ("GRADIENT_RANKERS", "SMF_RANKERS", "STATISTICS_NAME", "add_smf_arguments", "check_smf_arguments"),
        ".method": (
            "BackgroundStatistics",
            "ReadCounter",
            "SparseMemoryFinetuning",
            "SparseMemoryFinetuningCallback",
            "background_batches",
            "choose_slots",
            "compute_background_statistics",
            "freeze_all_but_values",
            "gradient_scores",
            "kl_scores",
            "memory_layers",
            "rank_slots",
            "row_gradient_norms",
            "tfidf_scores",
            "validate_top_t",
        ),
        ".scripts": ("setup_from_args", "statistics_from_args"),
        ".training_method": ("SparseMemoryFinetuningMethod",),
    },
)
