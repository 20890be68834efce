"""Masked-LM comparison on the same budget: ResM against ResM with Memory+ options: the entry of the study in benchmarks/studies/memory_plus/, its report benchmarks/MEMORY_PLUS.md
(`--help`: the protocol and every flag).

    python benchmarks/memory_plus.py --help
    python -m benchmarks.memory_plus --help    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/memory_plus.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.memory_plus.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
