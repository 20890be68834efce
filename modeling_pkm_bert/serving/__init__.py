"""Serving: smaller and faster models for inference (compact value tables)."""

from .quantization import check_not_quantized, quantize_memory_values, quantized_tables


__all__ = ["check_not_quantized", "quantize_memory_values", "quantized_tables"]
