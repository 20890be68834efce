"""What int8 and 4-bit value tables cost in accuracy on TRAINED models, and what they save: fp32, bf16, int8 and 4-bit
values side by side on the same masks and the same dev set; writes benchmarks/QUANTIZED.md.

    # 1. a trained ResM-MiniLM masked LM (the demo's recipe, shorter) and an SST-2 classifier fine-tuned from it
    python run_scripts/run_mlm.py --model_name_or_path MINILM --pkm_layers 2 4 --pkm_mode resm --pkm_n_keys 512 \
        --memory_optimizer sparse_row_adam --max_seq_length 64 --per_device_train_batch_size 8 --learning_rate 3e-4 \
        --num_warmup_steps 25 --max_train_steps 200 --seed 0 --output_dir outputs/q_mlm
    python run_scripts/run_glue.py --model_name_or_path outputs/q_mlm --task_name sst2 \
        --train_file $PKM_SHARED_DATA/glue/SST-2/train.tsv --validation_file $PKM_SHARED_DATA/glue/SST-2/dev.tsv ...
    # 2. the comparison
    python benchmarks/quantized_accuracy.py --mlm_model outputs/q_mlm --glue_model outputs/q_sst2

Perplexity: the MLM loss on `--eval_file` (held-out text) cut into 128-token sequences, 15% of the tokens (seeded, the
same for every variant) replaced by [MASK], exp of the mean loss over them. Accuracy: SST-2 dev (872 sentences).
Sizes: each variant saved with `save_pretrained`; peak RSS growth while `from_pretrained` loads it, in a fresh process.
"""

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from benchmarks.harness import BENCHMARKS as HERE  # the report's folder
from benchmarks.harness import cpu_name, loadavg
from modeling_pkm_bert.utils.output_folders import check_command_paths

import torch

from modeling_pkm_bert import BertPkmForMaskedLM, BertPkmForSequenceClassification, quantize_memory_values
from modeling_pkm_bert.methods.optimizers.memory_optimizer import cast_pkm_values


VARIANTS = ("fp32", "bf16", "int8", "4bit")
SHARED_DATA = Path(os.environ.get("PKM_SHARED_DATA", HERE.parent.parent / "shared" / "data"))


def load_variant(model_class, folder, variant):
    model = model_class.from_pretrained(folder).eval()
    if variant == "bf16":
        cast_pkm_values(model, torch.bfloat16)
    elif variant in ("int8", "4bit"):
        quantize_memory_values(model, bits=8 if variant == "int8" else 4)
    return model


def masked_batches(tokenizer, text_file, sequences, seed):
    ids = tokenizer(Path(text_file).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    length = 126
    chunks = [ids[i : i + length] for i in range(0, len(ids) - length, length)][:sequences]
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for start in range(0, len(chunks), 16):
        block = torch.tensor([[tokenizer.cls_token_id, *c, tokenizer.sep_token_id] for c in chunks[start : start + 16]])
        chosen = torch.rand(block.shape, generator=generator) < 0.15
        chosen[:, 0] = chosen[:, -1] = False
        labels = torch.where(chosen, block, -100)
        inputs = torch.where(chosen, tokenizer.mask_token_id, block)
        batches.append((inputs, labels))
    return batches


@torch.inference_mode()
def perplexity(model, batches):
    total, count = 0.0, 0
    for inputs, labels in batches:
        logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits
        n = int((labels != -100).sum())
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
        count += n
    return math.exp(total / count), count


@torch.inference_mode()
def accuracy(model, tokenizer, dev_file):
    rows = [line.rstrip("\n").split("\t") for line in Path(dev_file).read_text(encoding="utf-8").splitlines()[1:]]
    correct = 0
    for start in range(0, len(rows), 32):
        block = rows[start : start + 32]
        encoded = tokenizer([r[0] for r in block], padding=True, truncation=True, max_length=128, return_tensors="pt")
        predictions = model(**encoded).logits.argmax(-1)
        correct += int((predictions == torch.tensor([int(r[1]) for r in block])).sum())
    return 100.0 * correct / len(rows), len(rows)


# peak RSS growth while a process without the package loads a folder: benchmarks/speed/load_rss.py measures it
LOAD_RSS = HERE / "speed" / "load_rss.py"  # run by path: a process without the package


def folder_sizes(model, folder):
    from safetensors import safe_open

    model.save_pretrained(folder)
    values = total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                nbytes = f.get_tensor(key).nbytes
                total += nbytes
                values += nbytes if "memory.values" in key else 0
    on_disk = sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(Path(folder) / ".hf_home"))
    completed = subprocess.run([sys.executable, str(LOAD_RSS), str(folder)], env=env, capture_output=True, text=True,
                               timeout=600, cwd=str(Path(folder).parent))
    rss = json.loads(completed.stdout.strip().splitlines()[-1]) if completed.returncode == 0 else None
    if rss is None:
        print(completed.stderr[-2000:], file=sys.stderr)
    return values, on_disk, rss


def machine():
    import transformers

    return (f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"python {platform.python_version()}, torch threads {torch.get_num_threads()}")


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mlm_model", required=True, help="a trained BertPkmForMaskedLM folder")
    parser.add_argument("--glue_model", default=None, help="a BertPkmForSequenceClassification fine-tuned on SST-2")
    parser.add_argument("--eval_file", default=str(HERE.parent / "run_scripts" / "data" / "pride_and_prejudice_validation.txt"))
    parser.add_argument("--sst2_dev", default=str(SHARED_DATA / "glue" / "SST-2" / "dev.tsv"))
    parser.add_argument("--sequences", type=int, default=96, help="128-token sequences of --eval_file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the masks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=str(HERE / "QUANTIZED.md"))
    parser.add_argument("--command", default=None, help="how the models were trained (written to the report)")
    args = parser.parse_args()
    check_command_paths(parser, args, "quantized_accuracy")
    torch.set_num_threads(args.threads)
    from transformers import BertTokenizerFast as AutoTokenizer  # the folders hold a BERT tokenizer (no remote code)

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.mlm_model)
    batches = masked_batches(tokenizer, args.eval_file, args.sequences, args.seed)
    glue_tokenizer = AutoTokenizer.from_pretrained(args.glue_model) if args.glue_model else None
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in VARIANTS:
            model = load_variant(BertPkmForMaskedLM, args.mlm_model, variant)
            ppl, masked = perplexity(model, batches)
            values, on_disk, rss = folder_sizes(model, Path(scratch) / variant) if variant != "bf16" else (None, None, None)
            results[variant] = {"ppl": ppl, "masked": masked, "values": values, "disk": on_disk, "rss": rss}
            print(variant, results[variant], flush=True)
            del model
            if args.glue_model:
                model = load_variant(BertPkmForSequenceClassification, args.glue_model, variant)
                results[variant]["acc"], results[variant]["dev"] = accuracy(model, glue_tokenizer, args.sst2_dev)
                print(variant, "acc", results[variant]["acc"], flush=True)
                del model
    base = results["fp32"]
    lines = [
        "# Compact value tables on trained models: accuracy, size, loading",
        "",
        f"`python benchmarks/quantized_accuracy.py --mlm_model {args.mlm_model} --glue_model {args.glue_model}` "
        f"(mask seed {args.seed}, {len(batches)} batches, {base['masked']} masked tokens). "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}; load average "
        f"{loadavg()}; took {time.perf_counter() - started:.0f} s.",
        "",
    ]
    if args.command:
        lines += ["How the models were trained:", "", "```", args.command.strip(), "```", ""]
    lines += [
        f"Masked-LM perplexity on {Path(args.eval_file).name} (held out), the same masked tokens for every variant; "
        "SST-2 dev accuracy (same sentences). Targets: int8 within 0.5% perplexity and 0.2 points accuracy.",
        "",
        "| values | MLM perplexity | vs fp32 | SST-2 dev accuracy | vs fp32 (points) | value tables in the folder (MiB) | vs fp32 | folder on disk (MiB) | peak RSS growth of `from_pretrained` / model bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        r = results[variant]
        acc = f"{r['acc']:.2f}" if "acc" in r else "-"
        dacc = f"{r['acc'] - base['acc']:+.2f}" if "acc" in r else "-"
        values = f"{r['values'] / 2**20:.0f}" if r["values"] else "-"
        ratio = f"{r['values'] / base['values']:.3f}" if r["values"] else "-"
        disk = f"{r['disk'] / 2**20:.0f}" if r["disk"] else "-"
        rss = f"{r['rss']['ratio']:.2f}" if r.get("rss") else "-"
        lines.append(f"| {variant} | {r['ppl']:.3f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f}% | {acc} | {dacc} | "
                     f"{values} | {ratio} | {disk} | {rss} |")
    lines += [
        "",
        "bf16: `cast_pkm_values(model, torch.bfloat16)` (not saved: a bf16 folder is the fp32 folder loaded in bf16). "
        "int8/4-bit: `quantize_memory_values(model, bits=8|4)`. RSS: a fresh process without the package loads the "
        "saved folder with `trust_remote_code=True`; after a warm-up load on the meta device, the peak RSS (sampled every 2 ms) during `from_pretrained` and a read of "
        "every page of every tensor, minus the RSS before, over the bytes of the loaded model's tensors (tied ones once).",
        "",
    ]
    Path(args.output).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
