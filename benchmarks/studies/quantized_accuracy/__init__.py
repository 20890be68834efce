"""The study behind benchmarks/QUANTIZED.md; its entry: benchmarks/quantized_accuracy.py."""
