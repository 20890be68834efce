"""Teaching a model new facts: sparse memory finetuning against full finetuning and LoRA: the entry of the study in benchmarks/studies/knowledge_editing/, its report benchmarks/KNOWLEDGE_EDITING.md
(`--help`: the protocol and every flag).

    python benchmarks/knowledge_editing.py --quick --output_dir /tmp/knowledge_editing
    python -m benchmarks.knowledge_editing --quick --output_dir /tmp/knowledge_editing    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/knowledge_editing.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.knowledge_editing.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
