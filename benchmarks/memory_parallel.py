"""Memory parallel: per-process memory and step time for 1 and 2 processes: the entry of the study in benchmarks/studies/memory_parallel/, its report benchmarks/MEMORY_PARALLEL.md
(`--help`: the protocol and every flag).

    python benchmarks/memory_parallel.py --help
    python -m benchmarks.memory_parallel --help    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/memory_parallel.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.memory_parallel.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
