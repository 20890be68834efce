"""The memory values' own optimizer (XLM; Kim & Jung 2020): `memory_optimizer` (their parameter group, `SparseRowAdam`,
sparse gradients, clipping, freezing, fp16 loss scaling), `arguments` (its flags, standard library only), `scripts`
(the optimizer a training script makes from the flags, the clipping, the log line), `training_method` (the clipping and
the log line as the scripts' registry sees them). Names resolve on first use."""

from ...utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".arguments": ("MEMORY_OPTIMIZERS", "add_memory_optimizer_arguments"),
        ".memory_optimizer": (
            "PKM_VALUES_GROUP",
            "SparseRowAdam",
            "cast_pkm_values",
            "clip_grad_norm_",
            "freeze_memory",
            "pkm_lr_lambdas",
            "pkm_param_groups",
            "pkm_value_parameters",
            "set_sparse_values",
            "step_optimizers",
            "unscale_once",
        ),
        ".scripts": (
            "clip_memory_gradients",
            "create_memory_optimizer",
            "memory_optimizer_summary",
            "optimizer_param_groups",
            "sparse_gradients_supported",
        ),
        ".training_method": ("MemoryOptimizerMethod",),
    },
)
