"""The study behind benchmarks/TRIME.md; its entry: benchmarks/trime_lm.py."""
