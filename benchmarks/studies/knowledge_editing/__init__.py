"""The study behind benchmarks/KNOWLEDGE_EDITING.md; its entry: benchmarks/knowledge_editing.py."""
