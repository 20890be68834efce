"""The study behind benchmarks/MEMORY_PARALLEL.md; its entry: benchmarks/memory_parallel.py."""
