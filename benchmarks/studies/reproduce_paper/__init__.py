"""The study behind benchmarks/REPRODUCTION.md; its entry: benchmarks/reproduce_paper.py."""
