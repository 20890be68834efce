"""The training scripts' harness (run_scripts/), one job per module:

- `arguments`: the command-line flags the scripts share (standard library only: a fast `--help`);
- `loading`: the model a run trains (+Init conversion, from scratch), `--pkm_*` flags as config fields;
- `checks`: the arguments, output folder, data files and freezing, checked before a run starts;
- `checkpoints`: atomic checkpoints, resume position, the run settings a resume must match;
- `results`: final outputs, model card with results, tracker config, peak memory;
- `preparation` (accelerator, seed, output folder; training dataloader, optimizers, `accelerate.prepare`), `loop` (the
  training loop and the end of a run), `evaluation` (each process's shard, in eval mode, the random streams kept);
- task data and metrics: `lm_data`, `glue_data` (also the per-class report's examples), `glue_metrics`, `squad`,
  `squad_metrics`.

The methods' flags and their use in a run (the memory optimizer, TRIME, sparse memory finetuning) live with each
method in `modeling_pkm_bert.methods`. Importing this package imports nothing heavy: `from modeling_pkm_bert.training
import X` resolves X on first use from the one module that defines it.
"""

from ..utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".arguments": (
            "LR_SCHEDULER_TYPES",
            "PKM_CHOICES",
            "PKM_FLAG_FIELDS",
            "TARGET_CLASSES",
            "add_language_modeling_arguments",
            "add_model_card_arguments",
            "add_pkm_arguments",
            "add_reliability_arguments",
            "add_training_arguments",
            "help_requested",
            "hub_model_id",
        ),
        ".checkpoints": (
            "CHECKPOINT_NAME",
            "LOSS_STATE_FILE",
            "RESUME_SETTINGS",
            "RUN_SETTINGS_FILE",
            "check_checkpoint",
            "dataset_signature",
            "latest_checkpoint",
            "read_loss_state",
            "resolve_checkpoint",
            "resume_position",
            "run_settings",
            "save_checkpoint",
        ),
        ".checks": (
            "check_data_file_contents",
            "check_data_files",
            "check_freeze_memory",
            "check_parallel_arguments",
            "memory_width",
            "output_dir_problem",
            "prepare_output_dir",
            "validate_training_arguments",
        ),
        ".loading": (
            "PKM_FIELDS",
            "RUNTIME_PKM_FIELDS",
            "TASK_CLASSES",
            "config_from_scratch",
            "in_process_memory",
            "load_model",
            "pkm_kwargs_from_args",
        ),
        ".results": (
            "FINAL_STAGING",
            "WEIGHT_FILE",
            "atomic_write_json",
            "peak_memory_mb",
            "save_final_outputs",
            "tracker_config",
            "write_results_model_card",
        ),
    },
)
