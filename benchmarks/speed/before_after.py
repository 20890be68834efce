"""The layer of two checkouts side by side: section 1's layer step and Table 1's ResM / BERT-base ratio, each checkout's
own code in its own process, the two alternating, so that both see the same machine (a change of the layer must not
make it slower).

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before --after . --repeats 3

Each repeat runs, for before and after in turn (the order rotating): one process timing the paper-size layer
(section 1's step, 8 x 128 tokens: ours dense and sparse, lucidrains' and the XLM-style layer, interleaved rounds),
and one timing BERT-base and ResM-BERT-base at 1 x 128 (Table 1's setting: `build_encoder`, `use_huge_pages`), each
with that checkout's run_benchmarks.py and package. Times are the CPU time of the timing thread (one torch thread),
robust to other processes on the machine. Reported: medians over repeats of each checkout's paired ratios (ours /
faster peer, ResM / BERT), and after / before of ours' step time, paired per repeat.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO_ROOT
from modeling_pkm_bert.utils.output_folders import check_command_paths


# run by each checkout's python on its own code (the checkout first on PYTHONPATH, see `run`): its speed harness builds
# the layers and models (`rb`: benchmarks.harness and benchmarks.speed.common, or an older checkout's flat
# run_benchmarks.py); timed with the CPU time of this thread (one torch thread: forward and the CPU backward run on it),
# so that another process holding the core does not count
PRELUDE = """
import json, sys, time, types, torch
sys.argv = sys.argv[:1]
torch.set_num_threads(1)
try:
    from benchmarks import harness
    from benchmarks.speed import common
    from modeling_pkm_bert import use_huge_pages
    rb = types.SimpleNamespace(**{**vars(harness), **vars(common), "use_huge_pages": use_huge_pages})
except ImportError:  # a checkout from before the benchmarks package (its benchmarks/ a namespace)
    import run_benchmarks as rb
"""
LAYER = PRELUDE + """
torch.manual_seed(1)
x, g = torch.randn(8, 128, 768, requires_grad=True), torch.randn(8, 128, 768)
steps = {impl: rb.layer_step_fn(rb.build_layer(impl).train(), x, g) for impl in ("ours_dense", "ours_sparse", "lucidrains", "xlm")}
print(json.dumps({"samples": rb.interleaved(steps, rounds=ROUNDS, warmup=2, clock=time.thread_time)}))
"""
TABLE1 = PRELUDE + """
models = {kind: rb.build_encoder("base", kind) for kind in ("bert", "resm")}
for model in models.values():
    rb.use_huge_pages(model)
ids = torch.randint(1000, 30000, (1, 128), generator=torch.Generator().manual_seed(6))
def forward(model):
    def run():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return run
print(json.dumps({"samples": rb.interleaved({k: forward(m) for k, m in models.items()}, rounds=ROUNDS, warmup=1, clock=time.thread_time)}))
"""


def run(tree: Path, args: list[str]) -> dict:
    # the checkout's own code first; a checkout from before the benchmarks package imports its flat benchmarks/ folder
    paths = [tree] if (tree / "benchmarks" / "__init__.py").exists() else [tree, tree / "benchmarks"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {tree}: {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def paired(samples: dict, numerator: str, denominator: str) -> float:
    return statistics.median(a / b for a, b in zip(samples[numerator], samples[denominator]))


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before (e.g. a worktree)")
    parser.add_argument("--after", type=Path, default=REPO_ROOT)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layer_rounds", type=int, default=3)
    parser.add_argument("--table1_rounds", type=int, default=7)
    parser.add_argument("--output", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args()
    check_command_paths(parser, args, "before_after")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / "benchmarks" / "run_benchmarks.py").exists():
            parser.error(f"--{name} {tree}: not a checkout of this project (no benchmarks/run_benchmarks.py)")

    started, load_start = time.perf_counter(), os.getloadavg()
    layer, table1 = {name: [] for name in trees}, {name: [] for name in trees}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(trees)[::-1]
        for name in order:
            code = LAYER.replace("ROUNDS", str(args.layer_rounds))
            layer[name].append(run(trees[name], ["-c", code, str(trees[name])])["samples"])
            code = TABLE1.replace("ROUNDS", str(args.table1_rounds))
            table1[name].append(run(trees[name], ["-c", code, str(trees[name])])["samples"])
            print(f"[{time.perf_counter() - started:5.0f}s] repeat {repeat + 1} {name} done", flush=True)

    def per_repeat(name, f):
        return [f(samples) for samples in layer[name]]

    lines = [
        f"Before: `{trees['before'].name}`, after: `{trees['after'].name}`; {args.repeats} repeats alternating (layer: "
        f"{args.layer_rounds} interleaved rounds each, Table 1: {args.table1_rounds}); load average "
        f"{' '.join(f'{x:.2f}' for x in load_start)} at the start, {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"at the end; {time.perf_counter() - started:.0f} s.",
        "",
        "| measure | before | after |",
        "|---|---|---|",
    ]
    for impl in ("ours_dense", "ours_sparse"):
        ms = {name: statistics.median(statistics.median(s[impl]) for s in layer[name]) * 1e3 for name in trees}
        peer = {name: statistics.median(per_repeat(name, lambda s: min(
            statistics.median(s["lucidrains"]), statistics.median(s["xlm"])) / statistics.median(s[impl]))) for name in trees}
        lines.append(f"| layer {impl.removeprefix('ours_')}: ms per step (median) | {ms['before']:.0f} | {ms['after']:.0f} |")
        lines.append(f"| layer {impl.removeprefix('ours_')}: speed-up vs the faster peer | {peer['before']:.2f}x | {peer['after']:.2f}x |")
        ratio = statistics.median(statistics.median(a[impl]) / statistics.median(b[impl]) for a, b in zip(layer["after"], layer["before"]))
        lines.append(f"| layer {impl.removeprefix('ours_')}: after / before step time (paired per repeat) | 1.00 | {ratio:.2f} |")
    resm = {name: statistics.median(paired(s, "bert", "resm") for s in table1[name]) for name in trees}
    lines.append(f"| Table 1, ResM / BERT-base throughput, 1 x 128 | {resm['before']:.3f} | {resm['after']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
