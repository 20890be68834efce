"""Support for the training scripts (run_scripts/), one job per module:

- `arguments`: the command-line flags the scripts share (standard library only: a fast `--help`);
- `loading`: the model a run trains (+Init conversion, from scratch), `--pkm_*` flags as config fields;
- `optimization`: the memory values' own optimizer group, SparseRowAdam, clipping, freezing;
- `checks`: the arguments, output folder, data files and freezing, checked before a run starts;
- `checkpoints`: atomic checkpoints, resume position, the run settings a resume must match;
- `results`: final outputs, model card with results, tracker config, peak memory;
- `preparation` (accelerator, seed, output folder; training dataloader, optimizers, `accelerator.prepare`), `loop` (the
  training loop and the end of a run), `evaluation` (each process's shard, in eval mode, the random streams kept);
- `lm_data`, `glue_data`: data; `glue_metrics`, `squad_metrics`: task metrics;
- `trime` (TRIME losses), `sparse_finetuning` (sparse memory finetuning).

Importing this package imports nothing heavy: `from modeling_pkm_bert.training import X` resolves X on first use in
the module that defines it (the names that module `training` of release 0.2.0 gave included).
"""

import importlib


# where `from modeling_pkm_bert.training import X` looks, in order
_MODULES = ("loading", "optimization", "checks", "checkpoints", "results", "arguments")


def __getattr__(name):
    if not name.startswith("__"):
        for module in _MODULES:
            value = getattr(importlib.import_module(f".{module}", __name__), name, None)
            if value is not None:
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
