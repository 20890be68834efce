"""Continual learning with sparse memory finetuning (SMF) against full finetuning and LoRA: the entry of the study in benchmarks/studies/continual_learning/, its report benchmarks/CONTINUAL_LEARNING.md
(`--help`: the protocol and every flag).

    python benchmarks/continual_learning.py --quick --output_dir /tmp/continual_learning
    python -m benchmarks.continual_learning --quick --output_dir /tmp/continual_learning    # the same, from the repository root
"""

if not __package__:  # run by path (python benchmarks/continual_learning.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.studies.continual_learning.runner import main  # noqa: E402


if __name__ == "__main__":
    main()
