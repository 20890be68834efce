"""Support for the training scripts (run_scripts/): command-line flags (`arguments`, standard library only),
optimizer grouping (`optimization`), data (`lm_data`, `glue_data`), metrics (`glue_metrics`, `squad_metrics`),
TRIME (`trime`), sparse memory finetuning (`sparse_finetuning`) and model loading, checkpoints and checks (`runtime`).

Importing this package imports nothing heavy: the names that `from modeling_pkm_bert.training import X` gave in
release 0.2.0 (when `training` was one module) resolve on first use.
"""

import importlib


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    runtime = importlib.import_module(".runtime", __name__)
    try:
        return getattr(runtime, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
