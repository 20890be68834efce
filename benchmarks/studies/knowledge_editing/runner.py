"""Teaching a model new facts without forgetting: sparse memory finetuning against full finetuning and LoRA, on facts.

A small encoder (the knowledge-capacity benchmark's: hidden 128, 2 layers; ResM with a 16,384-slot memory, and the
plain model without one) learns knowledge base A (`modeling_pkm_bert.analysis.knowledge`, a fact a line, mixed with
sentences of WikiText-2 so that it also models real text) with `run_scripts/run_mlm.py`, as that benchmark trains its
arms. Then each method learns new knowledge B alone: (i) edits, a changed attribute for a share of A's people
(`edit_facts`), (ii) new people (the generator's next people). At every checkpoint we measure B recalled (a training
template, and a held-out one: does the edit generalise beyond the sentences trained on?), A's untouched facts still
recalled (retention), the edited facts' old values, and the masked-LM pseudo-perplexity of held-out WikiText-2
sentences (fixed masks). Methods are compared at matched learning: where a curve first crosses `target` recall of B
(linear interpolation between checkpoints, from step 0, the A model).

    python benchmarks/knowledge_editing.py                  # the full plan (resumable run by run), then the report
    python benchmarks/knowledge_editing.py --report_only    # the report from the finished runs
    python benchmarks/knowledge_editing.py --quick          # the suite's version: a tiny base, a few steps
    python benchmarks/knowledge_editing.py --methods full smf_tfidf_t1000 --stages base sweep   # a part of it

Stages (each run is kept in `benchmarks/results/knowledge_editing/knowledge_editing.json` as it finishes; a stopped plan continues):
1. `base`: the A models (ResM and plain) trained and measured; the ResM model's SMF background statistics, counted
   on A's training text in documents of one training batch (32 lines, as a step ranks them);
2. `sweep`: every method at each of its learning rates (one budget of steps), seed 0;
3. `seeds`: every method at its best learning rate (the one reaching the target with the least loss of A; if none
   does, the highest recall of B), more seeds (B's data order, masks and LoRA's initialisation; the A model is one).
4. `diagnose`: where SMF's update can go at all. On the ResM A model and B's training batches (masked as run_mlm.py
   masks them), the share of the values' full gradient (squared norm) that lies in the rows each ranker and top-t
   chooses, against the best any `t` rows could hold (the rows of largest gradient), and with the reads counted only at
   the masked positions (the only ones whose output has a loss).

Methods: `full` (every parameter, the memory values at 5x the network's rate as in training A), `lora` (peft, r 16 on
the attention and FFN projections; a loop of this script, since run_mlm.py has no LoRA flag: same data, batch, masking
rate, AdamW and schedule), `values` (the memory values only, every row a step reads: `--sparse_memory_finetuning
--smf_top_t <all slots>`), `smf_<ranker>_t<T>` (Lin et al. 2025's sparse memory finetuning; the rankers `tfidf`, `kl`,
`unread`, `gradient` and `gradient_kl`, Adam on the values unless the name ends in `_sgd`; against A's text masked as
its training steps saw it where the name ends in `_masked`), `plain_full` and `plain_lora` (the model without memory).
`--minilm` adds `minilm_large_*`: the same A model with 512^2 slots a memory (room for B: the A text reads 22-28% of its
rows, 82-87% of the 128^2 ones). The diagnose stage also measures what each background protects
(`background_coverage`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


from benchmarks.studies.knowledge_capacity import config as kcc  # its arms and MiniLM's conversion
from benchmarks.studies.knowledge_capacity import runner as kc
from benchmarks.studies.knowledge_editing.config import (  # the plans, methods and paths (the report's too)
    EDIT_ARMS,
    ENTRY,
    FULL,
    LORA_TARGETS,
    MEMORY_ARMS,
    METHODS,
    MINILM,
    MINILM_METHODS,
    MINILM_QUICK,
    MINILM_QUICK_METHODS,
    PRETRAINED_ARMS,
    PROBE_METHODS,
    QUICK,
    QUICK_METHODS,
    REPORTS,
    REPO_ROOT,
    RESULTS,
    TOOL,
    WIKITEXT,
    best_run,
    learning_rates,
    plan_stem,
    portable,
    run_rates,
)
from modeling_pkm_bert.utils.output_folders import check_command_paths
from modeling_pkm_bert.analysis.knowledge import (
    apply_edits,
    edit_facts,
    fact_probes,
    fact_sentences,
    generate_knowledge_base,
    probe_facts,
    probe_text,
    read_knowledge_base,
    sentences,
    tokenize_probes,
    write_knowledge_base,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default=str(REPO_ROOT / "outputs" / "knowledge_editing"))
    parser.add_argument("--results", default=None, help="default: benchmarks/results/knowledge_editing/knowledge_editing.json (--quick: in --output_dir)")
    parser.add_argument("--report", default=None, help="default: benchmarks/KNOWLEDGE_EDITING.md (--quick: in --output_dir)")
    parser.add_argument("--quick", action="store_true", help="the suite's version: a tiny base, a few steps")
    parser.add_argument("--minilm", action="store_true",
                        help="the A models converted from all-MiniLM-L6-v2 (the minilm_* methods; knowledge_editing_minilm.json)")
    parser.add_argument("--stages", nargs="+", default=["base", "sweep", "seeds", "diagnose"],
                        choices=["base", "sweep", "seeds", "diagnose"])
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS), help=f"default: all (--quick: {QUICK_METHODS})")
    parser.add_argument(
        "--masking", choices=["random", "values"], default="random",
        help="random: 15%% of the tokens (the committed runs); values: every value of a fact's line masked in every "
        "exposure, the other tokens at 15%% (run_mlm.py --span_column; LoRA's loop alike); needs its own --results",
    )  # fmt: skip
    parser.add_argument("--learning_rates", nargs="+", type=float, default=None, help="sweep these instead of each method's")
    parser.add_argument("--seed_learning_rates", nargs="+", type=float, default=None,
                        help="the seeds stage runs these rates instead of each method's best (e.g. a lower bar's best)")
    parser.add_argument("--workers", type=int, default=2, help="runs trained side by side, one thread each")
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override a plan entry (a probe)")
    # the script's own pieces, run as subprocesses
    parser.add_argument("--measure", default=None, help="measure a model folder and its step_N checkpoints (--data)")
    parser.add_argument("--data", default=None, help="the data folder of --measure")
    parser.add_argument("--train_lora", default=None, help="LoRA-train the model folder BASE (the `lora` methods)")
    parser.add_argument("--lora_args", default=None, help="the JSON of --train_lora's settings")
    args = parser.parse_args(argv)
    plan = dict((MINILM_QUICK if args.quick else MINILM) if args.minilm else (QUICK if args.quick else FULL))
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in plan or not value:
            parser.error(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(plan)}")
        plan[key] = json.loads(value)
    args.plan = plan
    if args.masking == "values" and args.results is None and not args.quick:
        parser.error("--masking values needs its own --results file (the default one holds the random-masking runs)")
    if args.minilm:
        default_methods = MINILM_QUICK_METHODS if args.quick else MINILM_METHODS
        if args.methods and set(args.methods) - set(MINILM_METHODS):
            parser.error(f"--minilm runs the minilm_* methods only, got {sorted(set(args.methods) - set(MINILM_METHODS))}")
    else:
        default_methods = QUICK_METHODS if args.quick else [m for m in METHODS if m not in PROBE_METHODS + MINILM_METHODS]
        if args.methods and set(args.methods) & set(MINILM_METHODS):
            parser.error("the minilm_* methods run with --minilm (their own plan and results)")
    args.methods = args.methods or default_methods
    out = Path(args.output_dir)
    stem = plan_stem(args.minilm)
    args.results = Path(args.results) if args.results else (out if args.quick else RESULTS) / f"{stem}.json"
    args.report = Path(args.report) if args.report else (out / f"{stem.upper()}.md" if args.quick else REPORTS[stem])
    if args.measure and not args.data:
        parser.error("--measure needs --data FOLDER (the benchmark's data folder)")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    check_command_paths(parser, args, TOOL)
    return args


# ---------------------------------------------------------------------------------------------------------------------
# The data: A, B (edits and new people), WikiText-2 sentences, one tokenizer


def wiki_sentences(path: Path, train: int, heldout: int) -> tuple[list[str], list[str]]:
    """Sentences of 8-40 words of WikiText-2's test split (the one in ../shared/data), headings left out: `train` from
    its first 80% of lines (A's training mix and SMF's background), `heldout` from the last 20% (the pseudo-perplexity):
    different articles."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    cut = len(lines) * 4 // 5

    def pick(part: list[str], n: int) -> list[str]:
        found = []
        for line in part:
            if not line or line.startswith("="):
                continue
            for sentence in line.split(" . "):
                if 8 <= len(sentence.split()) <= 40:
                    found.append(sentence.rstrip(" .") + " .")
                    if len(found) == n:
                        return found
        raise RuntimeError(f"{path} has fewer than {n} usable sentences there")

    return pick(lines[:cut], train), pick(lines[cut:], heldout)


def build_tokenizer(texts: list[str], folder: Path, check: list[str]):
    """MiniLM's WordPiece tokenizer restricted to the pieces of `texts` (as knowledge_capacity.build_tokenizer, with the
    WikiText sentences too): every piece the full tokenizer chose is kept, so greedy longest-match splits alike."""
    from transformers import AutoTokenizer, BertTokenizer

    full = AutoTokenizer.from_pretrained(kc.minilm_path())
    pieces = sorted({piece for text in texts for piece in full.tokenize(text)} - set(kcc.SPECIAL_TOKENS))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(kcc.SPECIAL_TOKENS + pieces) + "\n", encoding="utf-8")
    small = BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=True)
    small.model_max_length = 128
    for text in check:
        if small.tokenize(text) != full.tokenize(text):
            raise RuntimeError(f"the restricted vocabulary splits {text!r} differently")
    small.save_pretrained(folder)
    return small


def prepare_data(plan: dict, data: Path) -> None:
    """Writes the data folder: the knowledge bases, the training texts of A and B, the held-out sentences, the
    tokenizer. Deterministic: a second call writes the same files."""
    data.mkdir(parents=True, exist_ok=True)
    everyone = generate_knowledge_base(plan["people"] + plan["new_people"], seed=0)
    kb_a = {**everyone, "people": everyone["people"][: plan["people"]]}
    kb_new = {**everyone, "people": everyone["people"][plan["people"] :]}
    edits = edit_facts(kb_a, plan["edit_share"], seed=0)
    kb_edited = apply_edits(kb_a, edits)
    wiki_train, wiki_heldout = wiki_sentences(WIKITEXT, plan["wiki_train"], plan["wiki_heldout"])
    a_lines = sentences(kb_a, plan["per_fact"]) + wiki_train
    b_lines = fact_sentences(kb_edited, [(e["person"], e["attribute"]) for e in edits], plan["per_fact"])
    b_lines += sentences(kb_new, plan["per_fact"])
    probes = [probe_text(p) for kb in (kb_a, kb_edited, kb_new) for s in ("train", "heldout") for p in fact_probes(kb, s, context="sentence")]
    tokenizer = build_tokenizer(a_lines + b_lines + probes + wiki_heldout, data / "tokenizer", a_lines[::7] + b_lines + probes)
    longest = max(len(tokenizer(line)["input_ids"]) for line in a_lines + b_lines + wiki_heldout)
    if longest > 126:
        raise RuntimeError(f"a training line of {longest} tokens does not fit the 128 positions")
    write_knowledge_base(kb_a, data / "kb_a.json")
    write_knowledge_base(kb_edited, data / "kb_a_edited.json")
    write_knowledge_base(kb_new, data / "kb_new.json")
    (data / "edits.json").write_text(json.dumps(edits, indent=1) + "\n")
    for name, lines in (("a_train", a_lines), ("b_train", b_lines), ("wiki_heldout", wiki_heldout), ("validation", wiki_heldout[:32])):
        (data / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# What a model knows: B, A's untouched facts, the edits' old values, held-out text


class Probes:
    """Every probe of a checkpoint's measurement, built once from the data folder."""

    def __init__(self, data: Path):
        kb_a, kb_edited, kb_new = (read_knowledge_base(data / f"{n}.json") for n in ("kb_a", "kb_a_edited", "kb_new"))
        edited = {(e["person"], e["attribute"]) for e in json.loads((data / "edits.json").read_text())}
        self.sets = {}  # (group, split) -> probes
        for split in ("train", "heldout"):
            on_edited = fact_probes(kb_edited, split, context="sentence")
            self.sets["a", split] = [p for p in on_edited if (p["person"], p["attribute"]) not in edited]
            self.sets["edits", split] = [p for p in on_edited if (p["person"], p["attribute"]) in edited]
            self.sets["old", split] = [p for p in fact_probes(kb_a, split, context="sentence") if (p["person"], p["attribute"]) in edited]
            self.sets["new", split] = fact_probes(kb_new, split, context="sentence")
        self.heldout_text = [line for line in (data / "wiki_heldout.txt").read_text(encoding="utf-8").splitlines() if line]

    def measure(self, model, tokenizer) -> dict:
        keys = list(self.sets)
        outcomes = probe_facts(model, tokenizer, [p for key in keys for p in self.sets[key]])
        result, position = {}, 0
        for group, split in keys:
            n = len(self.sets[group, split])
            hits = sum(c for c, _ in outcomes[position : position + n])
            position += n
            name = group if split == "train" else f"{group}_heldout"
            result[name], result[f"{name}_n"] = (hits / n if n else 0.0), n
        for suffix in ("", "_heldout"):  # B: the edits and the new people's facts together
            n = result[f"edits{suffix}_n"] + result[f"new{suffix}_n"]
            hits = result[f"edits{suffix}"] * result[f"edits{suffix}_n"] + result[f"new{suffix}"] * result[f"new{suffix}_n"]
            result[f"b{suffix}"] = hits / n if n else 0.0
        result["ppl"] = pseudo_perplexity(model, tokenizer, self.heldout_text)
        return result


@torch.no_grad()
def pseudo_perplexity(model, tokenizer, lines: list[str], probability: float = 0.15, seed: int = 0) -> float:
    """exp of the mean cross-entropy of masked tokens of `lines`: 15% of each line's tokens (at least one; never a
    special token or [UNK]) replaced by [MASK], the same positions every call (a fixed generator)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for start in range(0, len(lines), 64):
        encoded = [tokenizer(line, truncation=True, max_length=128)["input_ids"] for line in lines[start : start + 64]]
        ids = torch.full((len(encoded), max(map(len, encoded))), tokenizer.pad_token_id)
        for row, line in enumerate(encoded):
            ids[row, : len(line)] = torch.tensor(line)
        maskable = ~torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
        chosen = (torch.rand(ids.shape, generator=generator) < probability) & maskable
        first = maskable.float().argmax(1)  # every line at least one masked token
        chosen[torch.arange(len(ids)), first] |= maskable[torch.arange(len(ids)), first]
        inputs = ids.masked_fill(chosen, tokenizer.mask_token_id)
        logits = model(input_ids=inputs, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
        losses = torch.nn.functional.cross_entropy(logits[chosen].float(), ids[chosen], reduction="sum")
        total, count = total + losses.item(), count + int(chosen.sum())
    return math.exp(total / count)


def measure_folder(folder: str, data: str) -> dict:
    """{"final": metrics, "curve": {step: metrics}} of a run's model folder and its step_N checkpoints."""
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from modeling_pkm_bert import register_auto_classes

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    register_auto_classes()
    probes = Probes(Path(data))
    tokenizer = AutoTokenizer.from_pretrained(Path(data) / "tokenizer")
    model = AutoModelForMaskedLM.from_pretrained(folder)
    result = {"final": probes.measure(model, tokenizer), "curve": {}}
    for checkpoint in sorted(Path(folder).glob("step_*"), key=lambda p: int(p.name.split("_")[1])):
        state = load_file(checkpoint / "model.safetensors")
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any("decoder" not in name and "num_batches" not in name for name in missing):
            raise RuntimeError(f"{checkpoint}: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        result["curve"][checkpoint.name.split("_")[1]] = probes.measure(model, tokenizer)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Diagnosis: where SMF's rows lie against the gradient of B


SMF_CHOICES = [(ranker, t) for ranker in ("tfidf", "kl", "unread", "gradient", "gradient_kl") for t in (100, 1000)]


def hook_value_lookups(memories: dict) -> tuple[dict, list]:
    """`(reads, hooks)`: after each forward `reads[layer]` holds the rows the layer's value lookup read (real tokens x
    heads x knn); remove the hooks when done."""
    reads = {}
    hooks = [memory.values.register_forward_hook(lambda module, args, output, name=name: reads.__setitem__(name, args[0].detach()))
             for name, memory in memories.items()]  # fmt: skip
    return reads, hooks


@torch.no_grad()
def reads_at_masked_values(model, memories: dict, reads: dict, tokenizer, probes: list[dict]) -> dict:
    """`{layer: counts}`: how often each row is read at the probes' values, each value masked in its sentence (one
    probe a forward: no padding, so the reads' rows are the sequence's positions)."""
    counts = {name: torch.zeros(memory.n_keys**2, dtype=torch.long) for name, memory in memories.items()}
    for ids, start, value in tokenize_probes(tokenizer, probes):
        model(input_ids=torch.tensor([ids[:start] + [tokenizer.mask_token_id] * len(value) + ids[start + len(value) :]]))
        for name in memories:
            counts[name] += torch.bincount(reads[name][start : start + len(value)].reshape(-1), minlength=len(counts[name]))
    return counts


def smf_diagnosis(model_dir: Path, data: Path, background: Path, batch_size: int, batches: int, seed: int = 0) -> dict:
    """Per (ranker, top-t): the mean over `batches` B training batches of the share of the values' gradient (squared
    norm, every memory layer's together) in the rows SMF chooses from the step's reads (`t` a layer), of all positions
    (as SMF counts) and of the masked ones only; and the share of the best `t` rows a layer (largest gradient). Eval
    mode, as an SMF step runs its forwards. Row counts are summed over the layers.

    `a_reads_in_chosen`: the share of what A's untouched facts read (their value masked in a training template, the
    reads at the value's positions, every layer's heads and knn) that lies in the rows chosen, which an SMF step on B
    overwrites (`rows_chosen` of them), and `a_reads_in_best` the same for the best rows: can any choice learn B
    without writing A's rows?"""
    from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.methods.sparse_finetuning.method import BackgroundStatistics, memory_layers, rank_slots

    register_auto_classes()
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    statistics = BackgroundStatistics.load(background)
    memories = memory_layers(model)
    reads, hooks = hook_value_lookups(memories)
    a_reads = {name: counts.double() for name, counts in reads_at_masked_values(model, memories, reads, tokenizer, Probes(data).sets["a", "train"]).items()}
    a_total = sum(counts.sum().item() for counts in a_reads.values())
    lines = [line for line in (data / "b_train.txt").read_text(encoding="utf-8").splitlines() if line]
    random.Random(seed).shuffle(lines)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    torch.manual_seed(seed)
    shares = {f"{ranker}_t{t}": {"all_positions": [], "masked_positions": [], "best_rows": [], "a_reads_in_chosen": [], "rows_chosen": [],
                                   "a_reads_in_best": []}
              for ranker, t in SMF_CHOICES}  # fmt: skip
    touched = {"rows_read": [], "rows_with_gradient": [], "rows_read_at_masked": []}
    for start in range(0, min(batches * batch_size, len(lines)), batch_size):
        batch = collator([tokenizer(line, truncation=True, max_length=128) for line in lines[start : start + batch_size]])
        reads.clear()
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        labelled = batch["labels"].reshape(-1)[batch["attention_mask"].reshape(-1).bool()] != -100
        layers = {}  # name -> (reads at every position, reads at masked positions, each row's squared gradient)
        for name, memory in memories.items():
            indices = reads[name]  # (real tokens, heads * knn): padding is not looked up
            rows = memory.n_keys**2
            layers[name] = (torch.bincount(indices.reshape(-1), minlength=rows), torch.bincount(indices[labelled].reshape(-1), minlength=rows),
                            memory.values.weight.grad.detach().double().pow(2).sum(1))  # fmt: skip
        total = sum(gradient.sum().item() for _, _, gradient in layers.values())
        for key, count in (("rows_read", lambda c, m, g: c > 0), ("rows_read_at_masked", lambda c, m, g: m > 0),
                           ("rows_with_gradient", lambda c, m, g: g > 0)):  # fmt: skip
            touched[key].append(sum(int(count(*entry).sum()) for entry in layers.values()))
        for ranker, t in SMF_CHOICES:
            entry = shares[f"{ranker}_t{t}"]
            for key, which in (("all_positions", 0), ("masked_positions", 1)):
                chosen = {name: rank_slots(layer[which], statistics, name, t, ranker, layer[2]) for name, layer in layers.items()}
                entry[key].append(sum(layers[name][2][rows].sum().item() for name, rows in chosen.items()) / total)
                if key == "all_positions":  # the rows an SMF step writes
                    entry["a_reads_in_chosen"].append(sum(a_reads[name][rows].sum().item() for name, rows in chosen.items()) / a_total)
                    entry["rows_chosen"].append(sum(len(rows) for rows in chosen.values()))
            best = {name: gradient.topk(min(t, len(gradient))) for name, (_, _, gradient) in layers.items()}
            entry["best_rows"].append(sum(top.values.sum().item() for top in best.values()) / total)
            entry["a_reads_in_best"].append(sum(a_reads[name][top.indices].sum().item() for name, top in best.items()) / a_total)
    for hook in hooks:
        hook.remove()
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "batches": len(touched["rows_read"]), "batch_size": batch_size, "layers": len(memories),
        "rows": sum(memory.n_keys**2 for memory in memories.values()),
        "touched": {key: mean(values) for key, values in touched.items()},
        "shares": {choice: {key: mean(values) for key, values in entry.items()} for choice, entry in shares.items()},
    }


def background_coverage(model_dir: Path, data: Path, backgrounds: dict[str, Path]) -> dict:
    """`{background: {layer: {...}}}`: per background statistics file and memory layer, the rows its documents read and
    the share of what each probe set reads at its masked values (A's untouched facts, the edits, the new people's
    facts: the value masked in a training template, every head's knn) that lies in rows no document read. For A that is
    what the background fails to protect (the unread ranker may write there); for B, the room an update that writes
    only rows the background never read has."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.methods.sparse_finetuning.method import BackgroundStatistics, memory_layers

    register_auto_classes()
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    memories = memory_layers(model)
    reads, hooks = hook_value_lookups(memories)
    probes = Probes(data)
    counts = {group: reads_at_masked_values(model, memories, reads, tokenizer, probes.sets[group, "train"]) for group in ("a", "edits", "new")}
    for hook in hooks:
        hook.remove()
    found = {}
    for background, path in backgrounds.items():
        statistics = BackgroundStatistics.load(path)
        found[background] = {"documents": statistics.num_batches}
        for name in memories:
            unread = statistics.document_frequency[name] == 0
            found[background][name] = {"rows_read": int((~unread).sum()), "rows": int(unread.numel()),
                                       **{f"{group}_outside": counts[group][name][unread].sum().item() / counts[group][name].sum().item()
                                          for group in counts}}  # fmt: skip
    return found


# ---------------------------------------------------------------------------------------------------------------------
# LoRA: run_mlm.py has no LoRA flag, so this loop (the same data, batch, masking rate, AdamW and schedule)


class ValueMaskingCollator:
    """LoRA's batches masked as run_mlm.py masks them with `kc.VALUE_MASKING_FLAGS`: each row's spans (values) in every
    exposure, the other tokens at 15%, every masked token shown as [MASK] (`training.masking`)."""

    def __init__(self, tokenizer, seed: int):
        from transformers import DataCollatorWithPadding

        from modeling_pkm_bert.training.masking import PaddingWithUnits

        self.tokenizer, self.generator = tokenizer, torch.Generator().manual_seed(seed)
        self.pad = PaddingWithUnits(DataCollatorWithPadding(tokenizer))  # run_mlm.py's training collator

    def encode(self, row: dict) -> dict:
        from modeling_pkm_bert.training.masking import unit_codes

        encoding = self.tokenizer(
            row["text"], truncation=True, max_length=128, return_special_tokens_mask=True, return_offsets_mapping=True
        )
        units = unit_codes(encoding.pop("offset_mapping"), spans=row["spans"])
        return {**encoding, "mask_units": units}

    def __call__(self, features: list[dict]) -> dict:
        from modeling_pkm_bert.training.masking import mask_tokens

        batch = self.pad(features)
        batch["input_ids"], batch["labels"] = mask_tokens(
            batch["input_ids"], batch.pop("special_tokens_mask"), units=batch.pop("mask_units"),
            mask_token_id=self.tokenizer.mask_token_id,
            vocab_size=len(self.tokenizer), generator=self.generator, mlm_probability=0.15, mask_replace_prob=1.0,
        )  # fmt: skip
        return batch


def train_lora(base: str, settings: dict) -> None:
    """LoRA on `base` (peft; `pkm_lora_config` where it has a memory, so its query BatchNorms' statistics travel),
    the merged model saved at every `checkpoint_every` steps (step_N/) and at the end, as run_mlm.py's folders."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling, get_scheduler

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.integrations.lora import pkm_lora_config
    from modeling_pkm_bert.utils.memories import memory_modules

    torch.set_num_threads(1)
    register_auto_classes()
    random.seed(settings["seed"])
    torch.manual_seed(settings["seed"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForMaskedLM.from_pretrained(base)
    fields = dict(r=settings["rank"], lora_alpha=2 * settings["rank"], lora_dropout=0.0)
    config = pkm_lora_config(model, LORA_TARGETS, **fields) if memory_modules(model) else LoraConfig(target_modules=LORA_TARGETS, **fields)
    model = get_peft_model(model, config)
    lines = [line for line in Path(settings["train_file"]).read_text(encoding="utf-8").splitlines() if line.strip()]
    if settings.get("masking", "random") == "values":  # as run_mlm.py with kc.VALUE_MASKING_FLAGS
        collator = ValueMaskingCollator(tokenizer, settings["seed"])
        encoded = [collator.encode(json.loads(line)) for line in lines]
    else:
        encoded = [tokenizer(line, truncation=True, max_length=128, return_special_tokens_mask=True) for line in lines]
        collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
        collator.generator = torch.Generator().manual_seed(settings["seed"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings["lr"], weight_decay=0.01)
    steps = settings["steps"]
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=max(1, steps // 20), num_training_steps=steps)
    output = Path(settings["output_dir"])

    def save(folder: Path) -> None:
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(folder)

    order, step = [], 0
    model.train()
    while step < steps:
        if len(order) < settings["batch_size"]:
            order += random.sample(range(len(encoded)), len(encoded))  # an epoch's shuffle
        batch = collator([encoded[i] for i in order[: settings["batch_size"]]])
        del order[: settings["batch_size"]]
        loss = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % settings["checkpoint_every"] == 0 and step < steps:
            save(output / f"step_{step}")
    save(output)
    tokenizer.save_pretrained(output)
    (output / "all_results.json").write_text(json.dumps({"train_loss": loss.item()}) + "\n")


def ngram_row_sharing(model_dir: Path, data: Path) -> dict:
    """How many of the n-gram memory's table rows B's lines read that A's text reads too: the rows an SMF step on B
    can only share with A's facts (hash collisions and common n-grams), from the memory's hash alone."""
    from collections import Counter

    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.utils.memories import ngram_memory_modules

    register_auto_classes()
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    (memory,) = ngram_memory_modules(AutoModelForMaskedLM.from_pretrained(model_dir)).values()

    def rows_of(name: str) -> list[set[int]]:
        lines = [line for line in (data / name).read_text(encoding="utf-8").splitlines() if line]
        ids = [torch.tensor([tokenizer(line, truncation=True, max_length=128)["input_ids"]]) for line in lines]
        return [set(memory.bucket_indices(memory.context_tokens(i)).reshape(-1).tolist()) for i in ids]

    a_lines, b_lines = rows_of("a_train.txt"), rows_of("b_train.txt")
    readers = Counter(row for rows in a_lines for row in rows)  # A lines reading each row
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "rows": memory.tables.weight.shape[0],
        "rows_read_by_a": len(readers),
        "rows_per_b_line": mean([len(rows) for rows in b_lines]),
        "b_rows_read_by_a": mean([sum(readers[r] > 0 for r in rows) / len(rows) for rows in b_lines]),
        "b_rows_read_by_10_a_lines": mean([sum(readers[r] >= 10 for r in rows) / len(rows) for rows in b_lines]),
        "b_rows_a_never_reads": mean([sum(readers[r] == 0 for r in rows) for rows in b_lines]),
    }


def rows_read(statistics) -> dict:
    """`{layer: [rows A's text reads, rows]}` from an A model's background statistics: the room left for B."""
    return {layer: [int((reads > 0).sum()), reads.numel()] for layer, reads in statistics.reads.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Runs


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONWARNINGS": "ignore"}  # fmt: skip


LOADING = threading.Lock()
BACKGROUND = "smf_background.safetensors"  # beside the A model's folder: the statistics every SMF run ranks with
# A's text masked as its training steps saw it (the `background="masked"` methods): a masked LM's step reads rows at its
# [MASK] positions that the unmasked text never reads, and A's facts are recalled at such positions
BACKGROUND_MASKED = "smf_background_masked.safetensors"


def run_key(method: str, lr: float, seed: int, memory_lr: float | None = None) -> str:
    """A B run's key in the results: the values' own rate only where it has one (older runs keep their keys)."""
    return f"{method}/lr{lr:g}" + (f"/mlr{memory_lr:g}" if memory_lr is not None else "") + f"/seed{seed}"


class Benchmark:
    def __init__(self, args):
        self.args, self.plan = args, args.plan
        self.out = Path(args.output_dir)
        self.data = self.out / ("data_minilm" if args.minilm else "data")  # each plan its own: A's text differs
        self.results = kc.Results(args.results)

    def base_folder(self, arm: str) -> Path:
        return self.out / "runs" / f"base_{arm}" / "model"

    def trained(self, folder: Path, command: list[str]) -> float | None:
        """The seconds of an earlier training of `folder` by the same command that finished (the session ended before
        it was measured), else None."""
        done = folder / "trained.json"
        if done.exists() and json.loads(done.read_text())["command"] == command:
            return json.loads(done.read_text())["seconds"]
        return None

    def train(self, folder: Path, command: list[str], log: str = "train.log") -> float:
        start = time.perf_counter()
        with open(folder / log, "w") as handle:
            completed = subprocess.run(command, env=ENV, stdout=handle, stderr=subprocess.STDOUT)
        if completed.returncode != 0:
            raise RuntimeError(f"{command[1]} failed ({completed.returncode}); see {folder / log}")
        seconds = time.perf_counter() - start
        (folder / "trained.json").write_text(json.dumps({"command": command, "seconds": seconds}) + "\n")
        return seconds

    def measure(self, model_dir: Path) -> dict:
        # in this process (a subprocess would spend more on its imports than on measuring), one at a time: loading a
        # model builds it on the meta device, which a forward in another thread would see
        with LOADING:
            return json.loads(json.dumps(measure_folder(str(model_dir), str(self.data))))

    def mlm_command(self, model_dir: Path, train_file: Path, lr: float, memory_lr: float, steps: int, seed: int) -> list[str]:
        masking = ()
        if self.args.masking == "values":  # the facts' lines get their values as spans; WikiText lines get none
            train_file, masking = kc.value_masking_file(train_file, self.data / "kb_a.json", strict=False), kc.VALUE_MASKING_FLAGS
        return [
            sys.executable, str(kcc.RUN_MLM), "--train_file", str(train_file),
            "--validation_file", str(self.data / "validation.txt"), "--max_eval_samples", "32",
            "--line_by_line", "--max_seq_length", "128", "--per_device_train_batch_size", str(self.plan["batch_size"]),
            "--learning_rate", f"{lr:g}", "--memory_learning_rate", f"{memory_lr:g}", "--weight_decay", "0.01",
            "--lr_scheduler_type", "linear", "--num_warmup_steps", str(max(1, steps // 20)), "--max_train_steps", str(steps),
            "--seed", str(seed), "--output_dir", str(model_dir), "--mixed_precision", "no", *masking,
        ]  # fmt: skip

    # stage 1: the A models
    def base(self):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.data / "tokenizer")
        arms = sorted({METHODS[m][0] for m in self.args.methods}, key=lambda arm: arm not in MEMORY_ARMS)  # SMF's first
        jobs = [arm for arm in arms if arm not in self.results.read().get("bases", {})]
        with concurrent.futures.ThreadPoolExecutor(self.args.workers) as pool:
            list(pool.map(lambda arm: self.train_base(arm, len(tokenizer)), jobs))

    def train_base(self, arm: str, vocab_size: int) -> dict:
        folder = self.base_folder(arm).parent
        plan = self.plan
        rates = {"lr": plan["a_lr"], "memory_lr": plan["a_memory_lr"], **plan.get("a_rates", {}).get(arm, {})}
        command = self.mlm_command(self.base_folder(arm), self.data / "a_train.txt", rates["lr"], rates["memory_lr"], plan["a_steps"], 0)
        config_file = folder / "config" / "config.json"
        if arm in PRETRAINED_ARMS:
            command += ["--model_name_or_path", str(self.pretrained_source()), *PRETRAINED_ARMS[arm]]
            config = None
        else:
            command += ["--config_name", str(folder / "config"), "--tokenizer_name", str(self.data / "tokenizer")]
            if arm in EDIT_ARMS:
                config = {"model_type": "bert_pkm", **kcc.BASE, **EDIT_ARMS[arm], "vocab_size": vocab_size, "pkm_layers": []}
            else:
                config = kc.arm_config(arm, vocab_size, {})
        seconds = self.trained(folder, command)
        if seconds is None or (config is not None and (not config_file.exists() or json.loads(config_file.read_text()) != config)):
            kc.prepare_own_folder(folder, TOOL)
            if config is not None:
                config_file.parent.mkdir()
                config_file.write_text(json.dumps(config, indent=1))
            seconds = self.train(folder, command)
        metrics = self.measure(self.base_folder(arm))["final"]
        entry = {"metrics": metrics, "train_seconds": round(seconds, 1), "command": portable(command[1:]), "machine": kc.machine()}
        if arm in MEMORY_ARMS:
            with LOADING:
                statistics = self.background_statistics(self.base_folder(arm))
            # the room left for B: the rows A's text reads, per memory layer
            entry["rows_read_by_a"] = rows_read(statistics)
        with self.results.locked() as data:
            data.setdefault("bases", {})[arm] = entry
        print(f"base {arm}: A recall {metrics['a']:.3f} (held-out {metrics['a_heldout']:.3f}), ppl {metrics['ppl']:.1f} ({seconds:.0f} s)", flush=True)
        return metrics

    def pretrained_source(self) -> Path:
        """all-MiniLM-L6-v2 with its embedding trimmed to the data's vocabulary (the same ids as its tokenizer), written
        once (under the lock: two A models start together)."""
        trimmed = self.data / "minilm_trimmed"
        with LOADING:
            if not (trimmed / "config.json").exists():
                kc.trim_vocabulary(kc.minilm_path(), self.data / "tokenizer", trimmed)
        return trimmed

    def background_statistics(self, model_dir: Path, masked: bool = False):
        """SMF's background: A's training text, shuffled, in documents of one training batch of lines (a step ranks one
        such batch), padded (padding is never looked up). `masked`: as A's training steps saw it, each document masked
        as run_mlm.py masks a batch, passes over the text (each shuffled anew, fresh masks) up to
        `background_documents` documents."""
        from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling

        from modeling_pkm_bert import register_auto_classes
        from modeling_pkm_bert.methods import sparse_finetuning as smf  # the module, not a name: where each name lives may move

        register_auto_classes()
        torch.set_num_threads(1)
        tokenizer = AutoTokenizer.from_pretrained(self.data / "tokenizer")
        model = AutoModelForMaskedLM.from_pretrained(model_dir)
        lines = [line for line in (self.data / "a_train.txt").read_text(encoding="utf-8").splitlines() if line]
        random.Random(0).shuffle(lines)
        size, limit = self.plan["batch_size"], self.plan["background_documents"]
        if not masked:
            documents = [tokenizer(lines[i : i + size], padding=True, return_tensors="pt") for i in range(0, len(lines) - size + 1, size)]
        else:
            collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=0)
            documents, order = [], list(lines)
            while len(documents) < limit:
                documents += [collator([tokenizer(line) for line in order[i : i + size]]) for i in range(0, len(order) - size + 1, size)]
                random.Random(len(documents)).shuffle(order)
        documents = [{k: d[k] for k in ("input_ids", "attention_mask")} for d in documents]
        statistics = smf.compute_background_statistics(model, documents, max_batches=limit)
        statistics.save(model_dir.parent / (BACKGROUND_MASKED if masked else BACKGROUND))
        return statistics

    def masked_background(self, model_dir: Path) -> Path:
        """The masked background's file beside the A model, computed the first time it is asked for."""
        path = model_dir.parent / BACKGROUND_MASKED
        with LOADING:
            if not path.exists():
                self.background_statistics(model_dir, masked=True)
        return path

    # stages 2 and 3: B
    def run(self, method: str, lr: float, seed: int, memory_lr: float | None = None) -> dict:
        """One B run; `memory_lr`: the values' own rate (else full finetuning's earlier rule, 5x `lr`)."""
        key = run_key(method, lr, seed, memory_lr)
        done = self.results.read()["runs"].get(key)
        if done is not None:
            return done
        arm, how, _ = METHODS[method]
        base_dir, plan = self.base_folder(arm), self.plan
        folder = self.out / "runs" / key.replace("/", "_")
        model_dir, steps = folder / "model", plan["b_steps"]
        every = max(1, steps // plan["checkpoints"])
        if how["kind"] == "lora":
            train_file = self.data / "b_train.txt"
            if self.args.masking == "values":
                train_file = kc.value_masking_file(train_file, self.data / "kb_a.json", strict=False)
            settings = dict(train_file=str(train_file), lr=lr, steps=steps, seed=seed, batch_size=plan["batch_size"],
                            checkpoint_every=every, output_dir=str(model_dir), rank=plan["lora_rank"],
                            masking=self.args.masking)  # fmt: skip
            command = [sys.executable, str(ENTRY), "--train_lora", str(base_dir), "--lora_args", json.dumps(settings)]
        else:
            values_lr = memory_lr if memory_lr is not None else 5 * lr if how["kind"] == "full" else lr
            command = self.mlm_command(model_dir, self.data / "b_train.txt", lr, values_lr, steps, seed)
            command += ["--model_name_or_path", str(base_dir), "--checkpointing_steps", str(every)]
            if how["kind"] == "smf":
                command += ["--sparse_memory_finetuning", "--smf_ranker", how["ranker"], "--smf_top_t", str(how["top_t"])]
                if how.get("background") == "masked":
                    command += ["--smf_background_file", str(self.masked_background(base_dir))]
                elif how["ranker"] != "gradient":  # the one ranker that reads no background
                    command += ["--smf_background_file", str(base_dir.parent / BACKGROUND)]
            if "optimizer" in how:
                command += ["--memory_optimizer", how["optimizer"]]
        seconds = self.trained(folder, command)
        if seconds is None:
            kc.prepare_own_folder(folder, TOOL)
            seconds = self.train(folder, command)
        result = self.measure(model_dir)
        for checkpoint in model_dir.glob("step_*"):  # measured: the optimizer states are not needed
            shutil.rmtree(checkpoint)
        result.update(method=method, base=arm, lr=lr, seed=seed, steps=steps, train_seconds=round(seconds, 1),
                      load=round(os.getloadavg()[0], 2), command=portable(command[1:]))  # fmt: skip
        if memory_lr is not None:
            result["memory_lr"] = memory_lr
        with self.results.locked() as data:
            data["runs"][key] = result
        final = result["final"]
        print(f"{key}: B {final['b']:.3f} (held-out {final['b_heldout']:.3f}), A kept {final['a']:.3f}, ppl {final['ppl']:.1f} "
              f"({seconds:.0f} s)", flush=True)  # fmt: skip
        return result

    def run_all(self, jobs: list[tuple]) -> None:
        with concurrent.futures.ThreadPoolExecutor(self.args.workers) as pool:
            list(pool.map(lambda job: self.run(*job), jobs))

    def learning_rates(self, method: str) -> list[float]:
        return learning_rates(self.args, method)

    # stage 4: the diagnosis of SMF's choice
    def diagnose(self):
        base = self.base_folder("minilm_resm" if self.args.minilm else "resm")
        result = None
        if base.exists():  # a probe of the large memory alone has no 128^2 A model
            with LOADING:
                result = smf_diagnosis(base, self.data, base.parent / BACKGROUND, self.plan["batch_size"],
                                       batches=8 if not self.args.quick else 2)  # fmt: skip
            with self.results.locked() as data:
                data["diagnosis"] = result
        # what each background protects: A's reads at its masked values outside the background's rows
        arms = [arm for arm in dict.fromkeys(METHODS[m][0] for m in self.args.methods)
                if arm in MEMORY_ARMS and not arm.startswith("ngram") and self.base_folder(arm).exists()]  # product keys: a query's rows
        for arm in arms:
            folder = self.base_folder(arm)
            masked = self.masked_background(folder)
            with LOADING:
                coverage = background_coverage(folder, self.data, {"unmasked": folder.parent / BACKGROUND, "masked": masked})
            with self.results.locked() as data:
                data.setdefault("background_coverage", {})[arm] = coverage
            print(f"background coverage {arm}: {coverage}", flush=True)
        if self.args.minilm:  # is the memory keyed by the person or by the template? (the capacity benchmark's measure)
            with LOADING:
                keying = self.keying()
            with self.results.locked() as data:
                data["keying"] = keying
            print(f"keying: {keying}", flush=True)
        if not self.args.minilm and self.base_folder("ngram").exists():
            with LOADING:
                sharing = ngram_row_sharing(self.base_folder("ngram"), self.data)
            with self.results.locked() as data:
                data["ngram_rows"] = sharing
            print(f"n-gram rows: A reads {sharing['rows_read_by_a']:,} of {sharing['rows']:,}; of a B line's rows "
                  f"{sharing['b_rows_read_by_a']:.1%} are read by A", flush=True)  # fmt: skip
        for choice, entry in (result or {"shares": {}})["shares"].items():
            print(f"{choice}: gradient share {entry['all_positions']:.3f} (reads at masked positions only "
                  f"{entry['masked_positions']:.3f}; best rows {entry['best_rows']:.3f})", flush=True)  # fmt: skip

    def keying(self) -> dict:
        """`knowledge_capacity.keying_diagnosis` of the MiniLM A models on A's people, at each memory layer of ResM
        (the same layers of plain MiniLM: only the person's nearest neighbour)."""
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        from modeling_pkm_bert import register_auto_classes

        register_auto_classes()
        tokenizer = AutoTokenizer.from_pretrained(self.data / "tokenizer")
        kb = read_knowledge_base(self.data / "kb_a.json")
        found = {}
        for arm in PRETRAINED_ARMS:
            if self.base_folder(arm).exists():
                model = AutoModelForMaskedLM.from_pretrained(self.base_folder(arm))
                found[arm] = {f"layer_{i}": kc.keying_diagnosis(model, tokenizer, kb, people=len(kb["people"]), layer_index=i)
                              for i in kcc.MINILM_MEMORY_LAYERS}  # fmt: skip
        return found

    def grids(self, method: str) -> dict[str, list[float]]:
        """The rates `method` sweeps: its learning rate's grid, and the values' own where it has one (not with
        --learning_rates, which sets the one grid swept)."""
        how = METHODS[method][1]
        grids = {"lr": sorted(self.learning_rates(method))}
        if "memory_lrs" in how and not self.args.learning_rates:
            grids["memory_lr"] = sorted(how["memory_lrs"] if not self.args.quick else how["memory_lrs"][1:2])
        return grids

    def sweep(self):
        """One tuning budget for every method: each of its rates swept on its grid at the first seed, one rate at a
        time (the others at their best so far; first, their grid's middle), the methods side by side; a best rate at
        an edge of its grid grows that grid one step (its ratio), up to kcc.MAX_GRID_EXTENSIONS, so no method is
        compared at a rate its grid cut short. The choice (`best_run`) is recorded under "tuning"."""
        seed = self.plan["seeds"][0]
        state = {}
        for method in self.args.methods:
            grids = self.grids(method)
            state[method] = dict(grids=grids, names=list(grids), coordinate=0, extensions=dict.fromkeys(grids, 0),
                                 best={name: grid[len(grid) // 2] for name, grid in grids.items()})  # fmt: skip

        def points(entry):
            name = entry["names"][entry["coordinate"]]
            return [{**entry["best"], name: rate} for rate in entry["grids"][name]]

        def job(method, point):
            memory_lr = point.get("memory_lr")
            return (method, point["lr"], seed) + ((memory_lr,) if memory_lr is not None else ())

        while active := [m for m, entry in state.items() if entry["coordinate"] < len(entry["names"])]:
            round_jobs = {m: [job(m, point) for point in points(state[m])] for m in active}
            self.run_all([j for m in active for j in round_jobs[m]])
            data = self.results.read()
            bases = {arm: b["metrics"] for arm, b in data["bases"].items()}
            for method in active:
                entry = state[method]
                name = entry["names"][entry["coordinate"]]
                swept = [self.swept_run(data, *j) for j in round_jobs[method]]
                if not all(swept):  # a run missing from the results: no choice is recorded for this method
                    entry["coordinate"], entry["missing"] = len(entry["names"]), True
                    continue
                entry["best"] = run_rates(best_run(swept, bases, self.plan["target"]))
                grid, rate = entry["grids"][name], kc.rate_past_edge(entry["grids"][name], entry["best"][name])
                if rate is not None and entry["extensions"][name] < kcc.MAX_GRID_EXTENSIONS:
                    entry["grids"][name] = sorted([*grid, rate])
                    entry["extensions"][name] += 1
                else:
                    entry["coordinate"] += 1
        with self.results.locked() as data:
            for method, entry in state.items():
                if entry.get("missing"):
                    continue
                grids, best = entry["grids"], entry["best"]
                edge = {name: len(grid) > 1 and best[name] in (grid[0], grid[-1]) for name, grid in grids.items()}
                tuning = {"grid": grids["lr"], "best": best["lr"], "at_edge": edge["lr"]}
                if "memory_lr" in grids:
                    tuning |= {"memory_grid": grids["memory_lr"], "memory_best": best["memory_lr"], "memory_at_edge": edge["memory_lr"]}
                data.setdefault("tuning", {})[method] = tuning

    @staticmethod
    def swept_run(data: dict, method: str, lr: float, seed: int, memory_lr: float | None = None) -> dict | None:
        return data["runs"].get(run_key(method, lr, seed, memory_lr))

    def seeds(self):
        data = self.results.read()
        bases = {arm: b["metrics"] for arm, b in data.get("bases", {}).items()}
        jobs = []
        for method in self.args.methods:  # at the best rates swept (the grown grids' included)
            swept = [r for r in data["runs"].values() if r["method"] == method and r["seed"] == self.plan["seeds"][0]]
            if not swept:
                continue
            if self.args.seed_learning_rates:
                points = [{"lr": lr} for lr in self.args.seed_learning_rates]
            else:
                points = [run_rates(best_run(swept, bases, self.plan["target"]))]
            jobs += [(method, point["lr"], seed, *([point["memory_lr"]] if "memory_lr" in point else []))
                     for point in points for seed in self.plan["seeds"][1:]]  # fmt: skip
        self.run_all(jobs)


def main(argv=None):
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure_folder(args.measure, args.data)))
        return
    if args.train_lora:
        train_lora(args.train_lora, json.loads(args.lora_args))
        return
    if not WIKITEXT.exists() and not args.report_only:
        raise SystemExit(f"error: {WIKITEXT} does not exist (WikiText-2's test split: see ../shared/data/SOURCES.md)")
    bench = Benchmark(args)
    torch.set_num_threads(1)  # the measurements run here, one thread per worker
    if not args.report_only:
        bench.out.mkdir(parents=True, exist_ok=True)
        prepare_data(args.plan, bench.data)
        with bench.results.locked() as data:
            if data.setdefault("plan", args.plan) != args.plan:
                raise SystemExit(f"error: {args.results} holds runs of another plan ({data['plan']}): give another --results")
        for stage in args.stages:
            print(f"== {stage}", flush=True)
            getattr(bench, stage)()
    from benchmarks.studies.knowledge_editing.report import write_report

    write_report(args, bench.results.read())


if __name__ == "__main__":
    main()
