"""Hashed n-gram memory on the real MiniLM: plain, +ResM PKM, +n-gram memory and both, same budget: the entry of the study in benchmarks/studies/ngram_memory/, its report benchmarks/NGRAM_MEMORY.md
(`--help`: the protocol and every flag).

    python benchmarks/ngram_memory.py --tiny --output_dir /tmp/ngram_memory
    python -m benchmarks.ngram_memory --tiny --output_dir /tmp/ngram_memory    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/ngram_memory.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.ngram_memory.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
