"""What int8 and 4-bit value tables cost in accuracy on trained models, and what they save: the entry of the study in benchmarks/studies/quantized_accuracy/, its report benchmarks/QUANTIZED.md
(`--help`: the protocol and every flag).

    python benchmarks/quantized_accuracy.py --help
    python -m benchmarks.quantized_accuracy --help    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/quantized_accuracy.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.quantized_accuracy.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
