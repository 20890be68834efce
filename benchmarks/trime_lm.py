"""TRIME (Zhong et al. 2022) against plain cross-entropy on the same budget: the entry of the study in benchmarks/studies/trime_lm/, its report benchmarks/TRIME.md
(`--help`: the protocol and every flag).

    python benchmarks/trime_lm.py --help
    python -m benchmarks.trime_lm --help    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/trime_lm.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.trime_lm.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
