#!/usr/bin/env python
# Copyright the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Runs one fine-tuning recipe over several seeds and reports the median of every metric (Kim & Jung 2020 report the
median of 5 runs with different seeds).

Everything after `--` is the command of one run (run_glue.py, run_squad.py, a torchrun line, ...); for seed `s` it
runs with `--seed s --output_dir OUTPUT_DIR/seed_s` (replacing any `--seed`/`--output_dir` of the command), one seed
after the other, each logging to `OUTPUT_DIR/seed_s.log`. The runs' `all_results.json` are collected into
`OUTPUT_DIR/sweep_summary.json` (per-seed values, median, mean, min, max of every numeric result) and
`OUTPUT_DIR/sweep_summary.md` (a table). A seed whose `all_results.json` already exists is not run again unless
`--overwrite`, so an interrupted sweep continues where it stopped. OUTPUT_DIR is new, empty or an earlier sweep's
(its marker file `.seed_sweep`); any other folder only with `--overwrite_output_dir`.

    python run_scripts/seed_sweep.py --seeds 1 2 3 4 5 --output_dir out/sst2_sweep -- \
        python run_scripts/run_glue.py --model_name_or_path bert-base-uncased --pkm_layers 4 8 \
        --task_name sst2 --train_file SST-2/train.tsv --validation_file SST-2/dev.tsv --per_device_train_batch_size 32
"""

import argparse
import json
import math
import os
import statistics
import shutil
import subprocess
import sys
import textwrap
import time


from modeling_pkm_bert.hub.card_command import redact_argv  # noqa: E402 (the package's import is lazy: no torch)
from modeling_pkm_bert.utils.input_errors import usage_errors  # noqa: E402 (standard library only)
from modeling_pkm_bert.utils.output_folders import (  # noqa: E402
    check_command_paths,
    check_output_folder,
    mark_output_folder,
)


TOOL = "seed_sweep"


REPLACED_OPTIONS = ("--seed", "--output_dir")
USAGE = "seed_sweep.py --seeds S [S ...] --output_dir DIR [options] -- COMMAND OF ONE RUN ..."


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=USAGE,
    )
    parser.add_argument("--seeds", type=int, nargs="+", required=True, help="The seeds, e.g. 1 2 3 4 5.")
    parser.add_argument("--output_dir", type=str, required=True, help="Holds seed_<s>/ per run and the summaries.")
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Write into a non-empty --output_dir no sweep wrote."
    )
    parser.add_argument(
        "--metrics",
        type=str,
        nargs="*",
        default=None,
        help="Results shown in the markdown table (default: the eval_* task metrics and train_runtime); the json "
        "summary always holds every numeric result.",
    )
    parser.add_argument("--overwrite", action="store_true", help="Run again the seeds that already have results.")
    parser.add_argument("--stop_on_error", action="store_true", help="Stop at the first failing run.")
    parser.add_argument(
        "--fail_fast_seconds",
        type=float,
        default=120.0,
        help="When the first run fails within this many seconds (it could not even start: a missing module, a wrong "
        "flag, a missing file), stop with its error instead of running every seed into the same failure; 0: never.",
    )
    parser.add_argument("--dry_run", action="store_true", help="Print the commands without running them.")
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1 :]
    if not args.command:
        parser.error("no command after `--` (the command of one run, e.g. -- python run_scripts/run_glue.py ...)")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    if args.fail_fast_seconds < 0:
        parser.error(f"--fail_fast_seconds must be >= 0, got {args.fail_fast_seconds}")
    if shutil.which(args.command[0]) is None and not os.path.isfile(args.command[0]):
        parser.error(f"the command's program {args.command[0]!r} is not found (not on PATH, not a file)")
    with usage_errors(parser):
        check_output_folder(args.output_dir, TOOL, overwrite=args.overwrite_output_dir)
    check_command_paths(parser, args, TOOL)
    return args


def log_tail(path: str, lines: int = 15) -> str:
    """The last lines of a run's log: the child's error, shown where the sweep reports the failure."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no log)"


def seed_command(command: list[str], seed: int, output_dir: str) -> list[str]:
    """`command` without its own --seed/--output_dir (`--x v` or `--x=v`), plus the seed's."""
    kept, skip_next = [], False
    for word in command:
        if skip_next:
            skip_next = False
            continue
        if word in REPLACED_OPTIONS:
            skip_next = True
            continue
        if word.split("=", 1)[0] in REPLACED_OPTIONS and "=" in word:
            continue
        kept.append(word)
    return [*kept, "--seed", str(seed), "--output_dir", output_dir]


def summarize(runs: dict) -> dict:
    """Per numeric result: the values of the seeds that produced it, their median, mean, min and max."""
    values = {}
    for seed, run in runs.items():
        for key, value in (run.get("results") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                values.setdefault(key, {})[seed] = value
    summary = {}
    for key, per_seed in values.items():
        numbers = list(per_seed.values())
        summary[key] = {
            "values": per_seed,
            "median": statistics.median(numbers),
            "mean": statistics.fmean(numbers),
            "min": min(numbers),
            "max": max(numbers),
            "n": len(numbers),
        }
    return summary


def default_table_metrics(summary: dict) -> list[str]:
    metrics = [
        key
        for key in summary
        if key.startswith("eval_") and "/" not in key and "samples" not in key and "runtime" not in key
    ]
    return metrics + [key for key in ("train_runtime",) if key in summary]


def markdown_table(args, runs: dict, summary: dict) -> str:
    metrics = args.metrics if args.metrics else default_table_metrics(summary)
    metrics = [m for m in metrics if m in summary]

    def cell(value):
        return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    def row(cells):
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    lines = [
        f"# Seed sweep: median of {len(args.seeds)} seeds",
        "",
        "```bash",
        " ".join(redact_argv(args.command)),  # a --hub_token never reaches the summary
        "```",
        "",
        row(["seed", "status", "wall time (s)", *(f"`{m}`" for m in metrics)]),
        "|---|---|---:|" + "---:|" * len(metrics),
    ]
    for seed, run in runs.items():
        status = "ok" if run["returncode"] == 0 else f"failed ({run['returncode']})"
        lines.append(row([str(seed), status, cell(run.get("wall_time"))] + [cell(summary[m]["values"].get(seed)) for m in metrics]))
    if metrics:
        lines.append(row(["**median**", "", ""] + [f"**{cell(summary[m]['median'])}**" for m in metrics]))
        lines.append(row(["mean", "", ""] + [cell(summary[m]["mean"]) for m in metrics]))
    else:
        lines += ["", "No run produced results: see each seed's `seed_<s>.log`."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if not args.dry_run:
        mark_output_folder(args.output_dir, TOOL)
    runs, failed = {}, []
    for seed in args.seeds:
        # the run's folder is the run's alone (its script checks it, and marks it as its own): the log lies beside it
        run_dir = os.path.join(args.output_dir, f"seed_{seed}")
        log_path = os.path.join(args.output_dir, f"seed_{seed}.log")
        results_file = os.path.join(run_dir, "all_results.json")
        command = seed_command(args.command, seed, run_dir)
        print(f"[seed {seed}] {' '.join(redact_argv(command))}", flush=True)
        if args.dry_run:
            continue
        if os.path.isfile(results_file) and not args.overwrite:
            print(f"[seed {seed}] results exist, not run again (--overwrite to redo)", flush=True)
            with open(results_file) as f:
                runs[seed] = {"returncode": 0, "wall_time": None, "results": json.load(f), "reused": True}
            continue
        os.makedirs(run_dir, exist_ok=True)  # empty: any run script may write into it
        if os.path.isfile(results_file):  # --overwrite: a failed rerun must not leave the old results behind; the
            os.remove(results_file)  # file is the run's that this sweep launched into its own output folder
        start = time.time()
        with open(log_path, "w") as log:
            returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        run = {"returncode": returncode, "wall_time": round(time.time() - start, 2), "results": None}
        if returncode == 0 and os.path.isfile(results_file):
            with open(results_file) as f:
                run["results"] = json.load(f)
        elif returncode == 0:
            run["returncode"] = "no all_results.json"
        runs[seed] = run
        if run["returncode"] != 0:
            failed.append(seed)
            print(f"[seed {seed}] FAILED ({run['returncode']}) after {run['wall_time']} s; the end of {log_path}:", flush=True)
            print(textwrap.indent(log_tail(log_path), "    "), flush=True)
            if len(failed) == len(runs) == 1 and run["wall_time"] < args.fail_fast_seconds:
                sys.exit(
                    f"The first run failed after {run['wall_time']} s, before it could train: every seed would fail "
                    f"the same way, so the sweep stops (its error is above; --fail_fast_seconds 0 runs every seed)."
                )
            if args.stop_on_error:
                break
        else:
            print(f"[seed {seed}] done in {run['wall_time']} s", flush=True)
    if args.dry_run:
        return None

    summary = summarize(runs)
    report = {
        "command": redact_argv(args.command),
        "seeds": args.seeds,
        "failed_seeds": failed,
        "runs": {str(seed): {k: v for k, v in run.items() if k != "results"} for seed, run in runs.items()},
        "metrics": {
            key: {**stats, "values": {str(s): v for s, v in stats["values"].items()}} for key, stats in summary.items()
        },
        "median": {key: stats["median"] for key, stats in summary.items()},
    }
    with open(os.path.join(args.output_dir, "sweep_summary.json"), "w") as f:
        json.dump(report, f, indent=4)
    table = markdown_table(args, runs, summary)
    with open(os.path.join(args.output_dir, "sweep_summary.md"), "w") as f:
        f.write(table)
    print(table, flush=True)
    if failed:
        sys.exit(f"{len(failed)} of {len(args.seeds)} runs failed (seeds {failed})")
    return report


if __name__ == "__main__":
    main()
