"""Serving: smaller and faster models for inference (compact value tables). Names resolve on first use."""

from ..utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__, {".quantization": ("check_not_quantized", "quantize_memory_values", "quantized_tables")}
)
