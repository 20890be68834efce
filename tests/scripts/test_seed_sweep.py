"""seed_sweep.py: a full --help, a fast stop with the child's error when a run cannot even start, and a valid
summary table when every seed fails."""

import subprocess
import sys

from helpers import REPO_ROOT


SWEEP = REPO_ROOT / "run_scripts" / "seed_sweep.py"


def sweep(*args):
    return subprocess.run([sys.executable, str(SWEEP), *map(str, args)], capture_output=True, text=True, timeout=120)


def table_is_valid(markdown: str) -> bool:
    """Every row of each markdown table has as many cells as its header."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    widths = {line.count("|") for line in rows}
    return bool(rows) and len(widths) == 1


def test_help_prints_every_option_and_exits_0():
    done = sweep("--help")
    assert done.returncode == 0, done.stderr
    for option in ("--seeds", "--output_dir", "--metrics", "--overwrite", "--stop_on_error", "--fail_fast_seconds"):
        assert option in done.stdout
    assert "Everything after `--` is the command of one run" in done.stdout  # the description, not only the usage
    missing = sweep("--seeds", 1, "--output_dir", "x")
    assert missing.returncode == 2 and "no command after `--`" in missing.stderr
    absent = sweep("--seeds", 1, "--output_dir", "x", "--", "no-such-program-xyz")
    assert absent.returncode == 2 and "'no-such-program-xyz' is not found" in absent.stderr


def test_a_run_that_cannot_start_stops_the_sweep_with_its_error(tmp_path):
    out = tmp_path / "sweep"
    done = sweep("--seeds", 1, 2, 3, "--output_dir", out, "--", sys.executable, "-c", "import no_such_module_xyz")
    assert done.returncode != 0
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in done.stdout  # the child's error, shown
    assert "every seed would fail the same way" in done.stderr
    assert (out / "seed_1.log").is_file() and not (out / "seed_2").exists()  # seeds 2 and 3 never ran


def test_summary_table_is_valid_when_every_seed_fails(tmp_path):
    out = tmp_path / "sweep"
    failing = [sys.executable, "-c", "import sys; print('bad flag', sys.argv[1:]); sys.exit(3)"]
    done = sweep("--seeds", 1, 2, "--output_dir", out, "--fail_fast_seconds", 0, "--", *failing)
    assert done.returncode != 0 and "2 of 2 runs failed" in done.stderr
    assert done.stdout.count("bad flag ['--seed'") == 2  # each seed's error on the console
    markdown = (out / "sweep_summary.md").read_text()
    assert table_is_valid(markdown), markdown
    assert "| 1 | failed (3) |" in markdown and "No run produced results" in markdown


def test_summary_of_successful_runs(tmp_path):
    out = tmp_path / "sweep"
    write = (
        "import json, os, sys; d = sys.argv[sys.argv.index('--output_dir') + 1]; s = int(sys.argv[sys.argv.index("
        "'--seed') + 1]); json.dump({'eval_accuracy': s / 10}, open(os.path.join(d, 'all_results.json'), 'w'))"
    )
    done = sweep("--seeds", 1, 2, 3, "--output_dir", out, "--", sys.executable, "-c", write)
    assert done.returncode == 0, done.stderr
    markdown = (out / "sweep_summary.md").read_text()
    assert table_is_valid(markdown) and "| **median** | | | **0.2000** |" in markdown
