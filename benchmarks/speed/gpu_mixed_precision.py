"""A few training steps of run_mlm.py and run_glue.py in fp32, bf16 and fp16, compared: the GPU check of mixed
precision (benchmarks/gpu_check.sh runs it on a lent GPU; it runs on CPU too, where fp16 has no loss scaler).

    python -m benchmarks.speed.gpu_mixed_precision --output_dir /tmp/mixed_precision [--steps 30]

A small BertPkm (hidden 128, 4 layers, a ResM memory of 32² slots at layer 2) and a word-level tokenizer are built
from the bundled book excerpts (no Hub, no shared data); run_mlm trains it on Pride and Prejudice, run_glue on a
two-class task made of the same lines (does the line hold a quotation mark?), both with the memory values in their own
Adam and `--memory_max_grad_norm 1` (the path where fp16 loss scaling unscaled the values twice). For each precision:
the final training loss, the evaluation result, and how far the memory values and the other weights moved, as ratios
to the fp32 run's. A ratio far from 1 (0.5, 1e-3: the loss-scaling defects of issue 32) or a non-finite loss fails
the check (exit status 1). Writes `mixed_precision.md` and `mixed_precision.json` into --output_dir.
"""

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path


from benchmarks.harness import REPO_ROOT as REPO
from modeling_pkm_bert.utils.output_folders import check_command_paths


DATA = REPO / "run_scripts" / "data"
PRECISIONS = ("no", "bf16", "fp16")


def parse_args():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each run")
    parser.add_argument("--tolerance", type=float, default=0.25, help="largest accepted |ratio - 1| of the updates")
    args = parser.parse_args()
    check_command_paths(parser, args, "gpu_mixed_precision")
    return args


def build_model(folder: Path):
    """The tiny BertPkmForMaskedLM (saved to `folder` with its tokenizer) both scripts start from."""
    import torch
    from transformers import BertTokenizer

    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    text = (DATA / "pride_and_prejudice_train.txt").read_text(encoding="utf-8").lower()
    words = collections.Counter(re.findall(r"\w+|[^\w\s]", text))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in words.most_common(2043)]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True).save_pretrained(folder)
    config = BertPkmConfig(
        vocab_size=len(vocab), hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=128, pkm_layers=[2], pkm_n_keys=32, pkm_heads=4, pkm_knn=16, pkm_k_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    BertPkmForMaskedLM(config).save_pretrained(folder)


def classification_files(folder: Path) -> tuple[Path, Path]:
    """A two-class csv task from the book's lines: label 1 where the line holds a quotation mark."""
    files = []
    for split in ("train", "validation"):
        lines = [line.strip() for line in (DATA / f"pride_and_prejudice_{split}.txt").read_text(encoding="utf-8").splitlines()]
        rows = [(line.replace('"', "").replace("“", "").replace("”", ""), int('"' in line or "“" in line))
                for line in lines if len(line.split()) >= 4][:800]  # fmt: skip
        path = folder / f"{split}.csv"
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("sentence,label\n")
            for sentence, label in rows:
                handle.write('"' + sentence.replace('"', "") + f'",{label}\n')
        files.append(path)
    return files[0], files[1]


def run(script: str, arguments: list[str], log: Path) -> int:
    with open(log, "w") as handle:
        return subprocess.run([sys.executable, str(REPO / "run_scripts" / script), *arguments], stdout=handle,
                              stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode  # fmt: skip


def movement(initial: dict, folder: Path) -> tuple[float, float]:
    """(norm of the memory values' change, norm of every other weight's change) of the trained folder."""
    from safetensors.torch import load_file

    trained = load_file(folder / "model.safetensors")
    values = other = 0.0
    for name, before in initial.items():
        if name not in trained or not before.is_floating_point():
            continue
        change = (trained[name].float() - before.float()).norm().item() ** 2
        if name.endswith("memory.values.weight"):
            values += change
        elif "running_" not in name:
            other += change
    return math.sqrt(values), math.sqrt(other)


def main():
    import torch
    from safetensors.torch import load_file

    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base"
    build_model(base)
    initial = load_file(base / "model.safetensors")
    train_csv, validation_csv = classification_files(out)
    common = ["--model_name_or_path", str(base), "--max_train_steps", str(args.steps), "--seed", "7",
              "--memory_max_grad_norm", "1.0", "--learning_rate", "5e-4", "--num_warmup_steps", "0"]  # fmt: skip
    jobs = {
        "run_mlm": ("run_mlm.py", ["--train_file", str(DATA / "pride_and_prejudice_train.txt"),
                                   "--validation_file", str(DATA / "pride_and_prejudice_validation.txt"),
                                   "--max_seq_length", "64", "--per_device_train_batch_size", "16",
                                   "--max_eval_samples", "64"]),
        "run_glue": ("run_glue.py", ["--train_file", str(train_csv), "--validation_file", str(validation_csv),
                                     "--max_length", "64", "--per_device_train_batch_size", "16"]),
    }  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA: fp16 runs without a loss scaler)"
    results, failures = {}, []
    for job, (script, extra) in jobs.items():
        for precision in PRECISIONS:
            folder = out / f"{job}_{precision}"
            rc = run(script, [*common, *extra, "--mixed_precision", precision, "--output_dir", str(folder)],
                     out / f"{job}_{precision}.log")  # fmt: skip
            if rc != 0:
                failures.append(f"{job} --mixed_precision {precision}: exit status {rc} (see {job}_{precision}.log)")
                continue
            metrics = json.loads((folder / "all_results.json").read_text())
            values, other = movement(initial, folder)
            evaluation = {k: v for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, float)}
            results[(job, precision)] = dict(train_loss=metrics["train_loss"], values=values, other=other, **evaluation)
    lines = [f"# Mixed precision: {args.steps} steps of run_mlm.py and run_glue.py in fp32, bf16 and fp16", "",
             f"Device: {device}; torch {torch.__version__}. Command: `python -m benchmarks.speed.gpu_mixed_precision "
             f"--output_dir {out.name} --steps {args.steps}`", "",
             "| script | precision | train loss | loss / fp32 | values moved / fp32 | other weights moved / fp32 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for (job, precision), row in results.items():
        reference = results.get((job, "no"))
        if reference is None:
            continue
        ratios = [row["train_loss"] / reference["train_loss"], row["values"] / reference["values"],
                  row["other"] / reference["other"]]  # fmt: skip
        lines.append(f"| {job} | {precision} | {row['train_loss']:.4f} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")
        if not math.isfinite(row["train_loss"]) or any(abs(r - 1) > args.tolerance for r in ratios[1:]):
            failures.append(f"{job} {precision}: ratios {ratios} beyond {args.tolerance} (or a non-finite loss)")
    lines += ["", *(f"- FAILED: {failure}" for failure in failures)] if failures else ["", "All runs within tolerance."]
    (out / "mixed_precision.md").write_text("\n".join(lines) + "\n")
    (out / "mixed_precision.json").write_text(json.dumps({f"{j}/{p}": r for (j, p), r in results.items()}, indent=2))
    print("\n".join(lines))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
