"""BertPkm with the tools transformers users combine it with: torch.export / ONNX, PEFT LoRA, Trainer,
sentence-transformers. Each submodule imports its library only when used:

- `export`: `export_program`, `export_onnx`, `run_onnx`;
- `lora`: `pkm_lora_config` (peft);
- `trainer`: `PkmTrainer`, `pkm_optimizers`, `pkm_trainer_class` (transformers.Trainer, SentenceTransformerTrainer).
"""

import importlib


_NAMES = {
    "export": ("dynamic_shapes", "export_onnx", "export_program", "run_onnx"),
    "lora": ("pkm_lora_config",),
    "trainer": ("PkmCombinedOptimizer", "PkmTrainer", "pkm_optimizer", "pkm_optimizers", "pkm_scheduler", "pkm_trainer_class"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


__all__ = sorted(_MODULE_OF)
