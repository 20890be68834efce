"""What the memory is worth: facts stored per parameter and per unit of compute: the entry of the study in benchmarks/studies/knowledge_capacity/, its report benchmarks/KNOWLEDGE_CAPACITY.md
(`--help`: the protocol and every flag).

    python benchmarks/knowledge_capacity.py --quick --output_dir /tmp/knowledge_capacity
    python -m benchmarks.knowledge_capacity --quick --output_dir /tmp/knowledge_capacity    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/knowledge_capacity.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.knowledge_capacity.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
