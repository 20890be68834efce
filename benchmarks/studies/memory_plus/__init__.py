"""The study behind benchmarks/MEMORY_PLUS.md; its entry: benchmarks/memory_plus.py."""
