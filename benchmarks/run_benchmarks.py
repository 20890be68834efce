"""The speed sections (`benchmarks/speed/`, a module each): `python benchmarks/run_benchmarks.py --sections layer table1`,
the same as `python -m benchmarks.speed ...` from the repository root; `--help` lists the sections. Updates RESULTS.md.
"""

if not __package__:  # run by path (python benchmarks/run_benchmarks.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.speed.__main__ import main  # noqa: E402


if __name__ == "__main__":
    main()
