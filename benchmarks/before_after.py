"""The layer of two checkouts side by side (`benchmarks/speed/before_after.py`), its table in BEFORE_AFTER.md:

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before --after . --repeats 3
"""

if not __package__:  # run by path (python benchmarks/before_after.py): this folder is the package (see _package.py)
    import _package  # noqa: F401

from benchmarks.speed.before_after import main  # noqa: E402


if __name__ == "__main__":
    main()
