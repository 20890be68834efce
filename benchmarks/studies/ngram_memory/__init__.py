"""The study behind benchmarks/NGRAM_MEMORY.md; its entry: benchmarks/ngram_memory.py."""
