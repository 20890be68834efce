"""Training methods for product key memories, as a library (what the training scripts, `integrations.PkmTrainer` and
your own loop use), one folder a method, each with its algorithm, its command-line flags (`arguments.py`, standard
library only) and, where the scripts need more than the flags, their use in the scripts (`scripts.py`):

- `optimizers/`: the memory values' own optimizer group and `SparseRowAdam` (row-wise lazy Adam), sparse value
  gradients, clipping that takes them, freezing a memory, fp16 loss scaling with several optimizers
  (`memory_optimizer.py`); `--memory_optimizer`, `--memory_learning_rate`, `--memory_max_grad_norm`, `--freeze_memory`;
- `trime/`: TRIME's training objective with in-batch memory (Zhong, Lei & Chen 2022; `objective.py`); `--trime*`;
- `sparse_finetuning/`: sparse memory finetuning (Lin et al. 2025), with a `transformers.Trainer` callback
  (`method.py`); `--sparse_memory_finetuning`, `--smf_*`.

Each folder's `training_method.py` is the method as the training scripts see it, a `base.TrainingMethod` (flags, checks,
setup, hooks around the optimizer step, checkpoint state); `registry.METHODS` lists them, and the scripts and
`training.TrainingLoop` go through it (`add_method_arguments`, `check_method_arguments`, `setup_methods`) naming none.

Names resolve on first use:

    from modeling_pkm_bert.methods import SparseRowAdam, pkm_value_parameters
    values = SparseRowAdam(pkm_value_parameters(model), lr=1e-3)
"""

from ..utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".base": ("TrainingMethod", "register_for_checkpointing"),
        ".optimizers.memory_optimizer": (
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
        ".registry": (
            "METHODS",
            "add_method_arguments",
            "check_method_arguments",
            "method_resume_settings",
            "prepare_methods",
            "setup_methods",
        ),
        ".sparse_finetuning.method": (
            "BackgroundStatistics",
            "ReadCounter",
            "SparseMemoryFinetuning",
            "SparseMemoryFinetuningCallback",
            "background_batches",
            "compute_background_statistics",
            "freeze_all_but_values",
        ),
        ".trime.objective": ("causal_targets", "model_trime_losses", "trime_log_probs", "trime_loss"),
    },
)
