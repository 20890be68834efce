"""The study behind benchmarks/KNOWLEDGE_CAPACITY.md; its entry: benchmarks/knowledge_capacity.py."""
