"""The studies, a folder each: config.py (arms, plans, paths), runner.py (the runs, `main`), report.py (the
report from the results), as far as the study has them; the entries are benchmarks/<study>.py."""
