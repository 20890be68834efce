"""The study behind benchmarks/CONTINUAL_LEARNING.md; its entry: benchmarks/continual_learning.py."""
