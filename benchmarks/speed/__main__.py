"""`python -m benchmarks.speed` (from the repository root), or `python benchmarks/run_benchmarks.py` from anywhere: the
speed sections (`--sections NAME ...`, each a module of this folder, listed in `SECTIONS`); updates RESULTS.md."""

import argparse
import json
import time

import torch

import benchmarks.speed
from benchmarks.harness import BENCHMARKS
from benchmarks.speed import SECTIONS, section
from benchmarks.speed.results import header, history_row, update_results
from modeling_pkm_bert.utils.output_folders import check_command_paths


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=benchmarks.speed.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (~3-4 min)")
    extra_sections = tuple(name for name, default in SECTIONS.items() if not default)  # not in the default run
    parser.add_argument("--sections", nargs="*", default=[s for s in SECTIONS if s not in extra_sections],
                        choices=list(SECTIONS), help=f"default: all but {', '.join(extra_sections)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core machine, "
                        "2 threads make every parallel op wait on a descheduled peer thread)")
    parser.add_argument("--output", default=str(BENCHMARKS / "RESULTS.md"))
    parser.add_argument("--device", default="cuda", help="device of the gpu section (cpu: a smoke run of its code)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--kinds", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_command_paths(parser, args, "run_benchmarks")
    torch.set_num_threads(args.threads)

    if args.worker == "layer-memory":
        from benchmarks.speed.layer import worker_layer_memory

        print(json.dumps(worker_layer_memory(args.impl, args.steps)))
        return
    if args.worker == "layer-timing":
        from benchmarks.speed.layer import layer_timing

        print(json.dumps(layer_timing(args.rounds)))
        return
    if args.worker == "train-pair":
        from benchmarks.speed.train import train_pair

        print(json.dumps(train_pair(args.kinds, args.batch, args.rounds)))
        return

    started = time.perf_counter()
    machine, measured = header(args), []
    for name in args.sections:
        section_start = time.perf_counter()
        print(f"[{time.perf_counter() - started:6.0f}s] section {name} ...", flush=True)
        text = section(name)(args)
        if text is None:  # measured nothing here (the gpu section without a GPU)
            continue
        text = [*text[:2], *machine, "", *text[2:], "", f"_(section took {time.perf_counter() - section_start:.0f} s)_"]
        print("\n".join(text), flush=True)
        update_results(args.output, {name: text})  # each finished section is kept, should a later one fail
        measured.append(name)
    if measured:
        update_results(args.output, {}, history=history_row(args, measured, machine, time.perf_counter() - started))
        print(f"updated {args.output}")


if __name__ == "__main__":
    main()
