"""Kim & Jung (2020) at small scale on all-MiniLM-L6-v2: Table 2, Figures 2-4, Tables 4-6: the entry of the study in benchmarks/studies/reproduce_paper/, its report benchmarks/REPRODUCTION.md
(`--help`: the protocol and every flag).

    python benchmarks/reproduce_paper.py --help
    python -m benchmarks.reproduce_paper --help    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/reproduce_paper.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.reproduce_paper.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
