"""BertPkm with the tools transformers users combine it with: torch.export / ONNX, PEFT LoRA, Trainer,
sentence-transformers. Each submodule imports its library only when used:

- `export`: `export_program`, `export_onnx`, `run_onnx`;
- `lora`: `pkm_lora_config` (peft);
- `trainer`: `PkmTrainer`, `pkm_optimizers`, `pkm_trainer_class` (transformers.Trainer, SentenceTransformerTrainer).
"""

from ..utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".export": ("dynamic_shapes", "export_onnx", "export_program", "run_onnx"),
        ".lora": ("pkm_lora_config",),
        ".trainer": (
            "PkmCombinedOptimizer",
            "PkmTrainer",
            "pkm_optimizer",
            "pkm_optimizers",
            "pkm_scheduler",
            "pkm_trainer_class",
        ),
    },
)
