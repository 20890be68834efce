"""The benchmarks: each study and the speed sections as a package, its reports beside it.

    benchmarks/<study>.py        the entry of a study (`python benchmarks/<study>.py --quick`, or from the repository
                                 root `python -m benchmarks.<study> --quick`); run_benchmarks.py: the speed sections
    benchmarks/<STUDY>.md        the study's one report (RESULTS.md: the speed sections'), what a reader opens
    benchmarks/harness.py        what every benchmark shares: interleaved timing and paired ratios, RSS, the machine,
                                 files written atomically (a results JSON, RESULTS.md's sections)
    benchmarks/speed/            the speed sections, a module each, listed in `benchmarks.speed.SECTIONS`, and the GPU
                                 and layer tools (gpu_check.sh runs them)
    benchmarks/studies/<study>/  a study's code: config.py (its arms, plans and paths), runner.py (the runs), report.py
                                 (the report from the results); config.py imports neither of the others
    benchmarks/results/<study>/  the committed results of a study (JSON, figures) that its report is written from

Run by path, an entry finds this package through `_package.py` (no `sys.path` edit anywhere); the entries import
nothing that imports them (tests/repo/test_benchmarks_package.py checks both).
"""
