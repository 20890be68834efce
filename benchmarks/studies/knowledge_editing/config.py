"""The knowledge-editing study's plans, methods and paths, and how a run's curve is read: what its runner (runner.py)
and its report (report.py) share. Its entry: `python benchmarks/knowledge_editing.py` (the protocol: runner.py's
docstring)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from benchmarks.harness import BENCHMARKS, REPO_ROOT, results_dir
from benchmarks.studies.knowledge_capacity import config as kcc
from modeling_pkm_bert.ngram_memory import largest_primes_below


HERE = Path(__file__).resolve().parent  # the study's code and each plan's hand-written findings (<plan>_notes.md)
ENTRY = BENCHMARKS / "knowledge_editing.py"  # what the runs' worker processes (`--train_lora`) run
RESULTS = results_dir("knowledge_editing")  # the committed runs' JSON and the reports' figures
# each plan's report: the study's (the default plan) among the benchmarks' reports, the MiniLM plan's beside its results
REPORTS = {"knowledge_editing": BENCHMARKS / "KNOWLEDGE_EDITING.md",
           "knowledge_editing_minilm": RESULTS / "KNOWLEDGE_EDITING_MINILM.md"}  # fmt: skip

TOOL = "knowledge_editing"  # its run folders hold the marker `.knowledge_editing` (utils.output_folders)
WIKITEXT = Path(os.environ.get("PKM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")) / "wikitext-2-raw" / "wiki.test.raw"
SLOTS = kcc.MEMORY["pkm_n_keys"] ** 2
# the n-gram A model's table rows: 2 orders x 2 directions x 4 hash heads, each table of the largest primes <= its size
NGRAM_ROWS = sum(largest_primes_below(kcc.ARMS["ngram"][0]["ngram_table_size"], 2 * 2 * 4))
LORA_TARGETS = ["query", "key", "value", "dense"]
METHODS = {  # name -> (A model, how B is learned, learning rates swept: the network's, or the values' for SMF)
    "full": ("resm", dict(kind="full"), [3e-4, 1e-3, 3e-3]),
    "lora": ("resm", dict(kind="lora"), [1e-3, 3e-3, 1e-2]),
    "values": ("resm", dict(kind="smf", ranker="tfidf", top_t=SLOTS), [1e-2, 3e-2, 1e-1]),
    "smf_tfidf_t100": ("resm", dict(kind="smf", ranker="tfidf", top_t=100), [1e-2, 3e-2, 1e-1]),
    "smf_tfidf_t1000": ("resm", dict(kind="smf", ranker="tfidf", top_t=1000), [1e-2, 3e-2, 1e-1]),
    "smf_kl_t100": ("resm", dict(kind="smf", ranker="kl", top_t=100), [1e-2, 3e-2, 1e-1]),
    "smf_kl_t1000": ("resm", dict(kind="smf", ranker="kl", top_t=1000), [1e-2, 3e-2, 1e-1]),
    "plain_full": ("plain", dict(kind="full"), [3e-4, 1e-3, 3e-3]),
    "plain_lora": ("plain", dict(kind="lora"), [1e-3, 3e-3, 1e-2]),
    # the same on an A model whose memory is keyed by the input's n-grams, hence by the person (the fix the ResM
    # model's diagnosis calls for): SMF ranks the n-gram memory's table rows
    "ngram_full": ("ngram", dict(kind="full"), [3e-4, 1e-3, 3e-3]),
    "ngram_values": ("ngram", dict(kind="smf", ranker="tfidf", top_t=NGRAM_ROWS), [1e-2, 3e-2, 1e-1]),
    "ngram_smf_tfidf_t1000": ("ngram", dict(kind="smf", ranker="tfidf", top_t=1000), [1e-2, 3e-2, 1e-1]),
    "ngram_smf_kl_t1000": ("ngram", dict(kind="smf", ranker="kl", top_t=1000), [1e-2, 3e-2, 1e-1]),
    # a probe of the n-gram model's diagnosis (its tables are full: A reads 98% of the rows): 4 tables of 65,521 rows,
    # room for each of A's 14k bigrams and 20k trigrams in a row of its own; one learning rate each, run apart
    # (`--methods ngram_large_* --stages base sweep --results <its own file>`)
    "ngram_large_full": ("ngram_large", dict(kind="full"), [1e-3]),
    "ngram_large_smf_tfidf_t1000": ("ngram_large", dict(kind="smf", ranker="tfidf", top_t=1000), [3e-2]),
    "ngram_large_smf_kl_t1000": ("ngram_large", dict(kind="smf", ranker="kl", top_t=1000), [3e-2]),
    # t = 100: fewer rows than a batch reads (~2,000), so that TF-IDF keeps to the rows A's text never reads
    "ngram_large_smf_tfidf_t100": ("ngram_large", dict(kind="smf", ranker="tfidf", top_t=100), [3e-2, 1e-1]),
}
# A models converted from the real all-MiniLM-L6-v2 with +Init (`--minilm`): the knowledge-capacity benchmark's arm
# (h), whose memory stored 1.9x plain MiniLM's bits
PRETRAINED_ARMS = dict(kcc.MINILM_ARMS)
MINILM_SLOTS = kcc.MINILM_N_KEYS**2
# room for B: A's text reads 14k of each 16k-row memory of ResM-MiniLM (88%), so a new fact's rows are old facts' rows;
# the demo's 512^2 slots a memory (its values step with SparseRowAdam, a step reading a small part of the table)
LARGE_N_KEYS = 512
PRETRAINED_ARMS["minilm_resm_large"] = [*kcc.MINILM_ARMS["minilm_resm"][:-1], str(LARGE_N_KEYS), "--memory_optimizer", "sparse_row_adam"]
METHODS.update({
    "minilm_full": ("minilm_resm", dict(kind="full"), [1e-4, 3e-4, 1e-3]),
    "minilm_lora": ("minilm_resm", dict(kind="lora"), [1e-3, 3e-3, 1e-2]),
    "minilm_values": ("minilm_resm", dict(kind="smf", ranker="tfidf", top_t=MINILM_SLOTS), [1e-2, 3e-2, 1e-1]),
    # TF-IDF at t = 100 left out: on the scratch ResM model it held 0.2% of B's gradient and learnt 0.02-0.10 of B.
    # Swept first at 1e-2-1e-1 (the scratch model's rates), where all three peaked at the top: the range moved up one
    # step (the runs at 1e-2 are kept in the JSON; never the best)
    **{f"minilm_smf_{ranker}_t{t}": ("minilm_resm", dict(kind="smf", ranker=ranker, top_t=t), [3e-2, 1e-1, 3e-1])
       for ranker, t in (("tfidf", 1000), ("kl", 100), ("kl", 1000))},
    # the rows of largest gradient on the step (the diagnosis: the best 100 rows a layer hold 73% of B's gradient and
    # 4.4% of A's reads), no background
    **{f"minilm_smf_gradient_t{t}": ("minilm_resm", dict(kind="smf", ranker="gradient", top_t=t), [3e-2, 1e-1, 3e-1])
       for t in (100, 1000)},
    # the KL ranker with the step's gradient mass in place of its reads: B's gradient, away from the rows A's text reads
    # (swept first at 1e-2-1e-1, where it learned nothing below 1e-1: moved up one step as the other rankers' range)
    **{f"minilm_smf_gradient_kl_t{t}": ("minilm_resm", dict(kind="smf", ranker="gradient_kl", top_t=t), [3e-2, 1e-1, 3e-1])
       for t in (100, 1000)},
    # plain SGD (Lin et al.'s optimizer): a row moves with its gradient, where Adam moves every chosen row by about the
    # learning rate whatever its gradient (B's gradient is 1e-4-1e-3 an element on the top rows, the values 0.18)
    **{f"minilm_smf_gradient_t{t}_sgd": ("minilm_resm", dict(kind="smf", ranker="gradient", top_t=t, optimizer="sgd"),
                                         [10.0, 30.0, 100.0]) for t in (100, 1000)},
    "minilm_values_sgd": ("minilm_resm", dict(kind="smf", ranker="gradient", top_t=MINILM_SLOTS, optimizer="sgd"), [10.0, 30.0, 100.0]),
    # the same A and B on memories of 512^2 slots (the large arm; every method's values with SparseRowAdam); KL left out:
    # on the 128^2 memories it forgot as much as full finetuning
    "minilm_large_full": ("minilm_resm_large", dict(kind="full", optimizer="sparse_row_adam"), [1e-4, 3e-4, 1e-3]),
    **{f"minilm_large_smf_{ranker}_t{t}": ("minilm_resm_large", dict(kind="smf", ranker=ranker, top_t=t, optimizer="sparse_row_adam"), lrs)
       for ranker, t, lrs in (("tfidf", 1000, [3e-2, 1e-1, 3e-1]), ("gradient_kl", 1000, [3e-2, 1e-1, 3e-1]))},
    # only rows A's text never reads (TF-IDF's IDF over A's 36 documents hardly tells a row read once from a free one):
    # B's facts read 2% of their rows there, so the values of those rows must grow far (rates up to 1)
    "minilm_large_smf_unread_t1000": ("minilm_resm_large", dict(kind="smf", ranker="unread", top_t=1000, optimizer="sparse_row_adam"),
                                      [1e-1, 3e-1, 1.0]),
    # the same two rankers against A's text masked as its training steps saw it (200 documents, ~5.5 passes): A's facts
    # are recalled at [MASK] positions, whose rows the unmasked text does not read (the unread ranker at lr 0.3
    # lost 8.3 points writing rows the unmasked background never read)
    **{f"minilm_large_smf_{ranker}_t1000_masked": ("minilm_resm_large", dict(kind="smf", ranker=ranker, top_t=1000,
                                                   optimizer="sparse_row_adam", background="masked"), lrs)
       for ranker, lrs in (("tfidf", [1e-1, 3e-1, 1.0]), ("unread", [3e-1, 1.0, 3.0]))},
    "minilm_plain_full": ("minilm_plain", dict(kind="full"), [1e-4, 3e-4, 1e-3]),
    "minilm_plain_lora": ("minilm_plain", dict(kind="lora"), [1e-3, 3e-3, 1e-2]),
})  # fmt: skip
MEMORY_ARMS = ("resm", "ngram", "ngram_large", "minilm_resm", "minilm_resm_large")  # the A models with a memory SMF ranks
# One tuning budget: full finetuning of a model with a memory sweeps the values' rate on a grid of its own, as large as
# its learning rate's, centred on the earlier rule (the values at 5x the network's rate) and grown past an edge alike
for _method, (_arm, _how, _grid) in METHODS.items():
    if _how["kind"] == "full" and _arm in MEMORY_ARMS:
        _how["memory_lrs"] = [float(f"{5 * lr:.3g}") for lr in _grid]
EDIT_ARMS = {"ngram_large": {"ngram_layers": [1], "ngram_table_size": 65536, "ngram_heads": 1, "ngram_dim": 32}}
PROBE_METHODS = [m for m in METHODS if METHODS[m][0] in EDIT_ARMS]
MINILM_METHODS = [m for m in METHODS if METHODS[m][0] in PRETRAINED_ARMS]
FULL = dict(  # the committed plan
    people=24, edit_share=0.5, new_people=6, per_fact=8, wiki_train=800, wiki_heldout=200, a_steps=3000, a_lr=2e-3,
    a_memory_lr=1e-2, b_steps=400, checkpoints=16, batch_size=32, seeds=[0, 1, 2], target=0.9, background_documents=200,
    lora_rank=16, a_rates={},  # a_rates: an A model's own rates ({arm: {"lr", "memory_lr"}}), e.g. a capacity sweep's choice
)
QUICK = dict(
    people=6, edit_share=0.5, new_people=2, per_fact=2, wiki_train=24, wiki_heldout=16, a_steps=16, a_lr=3e-3,
    a_memory_lr=1e-2, b_steps=6, checkpoints=3, batch_size=8, seeds=[0], target=0.9, background_documents=4,
    lora_rank=4, a_rates={},
)

# `--minilm`: a pretrained encoder learns A in fewer steps, at the rate its knowledge-capacity sweep found best for both;
# with A's 800 WikiText sentences (two thirds of the masked tokens) 500 steps left both A models at 0.20-0.22 of A
MINILM = {**FULL, "a_steps": 600, "a_lr": 1e-3, "wiki_train": 200, "b_steps": 200, "checkpoints": 8}
MINILM_QUICK = {**QUICK, "a_steps": 8, "a_lr": 1e-3, "b_steps": 4, "checkpoints": 2}

QUICK_METHODS = ["full", "lora", "values", "smf_kl_t100", "plain_lora", "ngram_smf_tfidf_t1000"]  # every code path once: the suite's minutes
MINILM_QUICK_METHODS = ["minilm_smf_kl_t100", "minilm_smf_gradient_t100_sgd", "minilm_plain_lora"]


def plan_stem(minilm: bool) -> str:
    """The name of a plan's files: its JSON, its report (upper case) and its hand-written notes (`_notes.md`)."""
    return "knowledge_editing_minilm" if minilm else "knowledge_editing"


def portable(command: list[str]) -> list[str]:
    """A run's command as the JSON keeps it: paths from the checkout on (`benchmarks/...`, `outputs/...`), not this
    machine's folders."""
    return [re.sub(r'[^\s"]*?/(?=(?:benchmarks|run_scripts|outputs)/)', "", part) for part in command]


def learning_rates(args, method: str) -> list[float]:
    """The learning rates swept for `method`: its own (--quick: the middle one), or --learning_rates."""
    return args.learning_rates or (METHODS[method][2] if not args.quick else METHODS[method][2][1:2])


# ---------------------------------------------------------------------------------------------------------------------
# Matched learning


def matched(curve: list[dict], target: float, key: str = "b") -> dict | None:
    """The metrics where `curve` (points sorted by "step", step 0 the A model) first reaches `target` on `key`, each
    interpolated linearly between the two points around the crossing; None if it never does."""
    for index, point in enumerate(curve):
        if point[key] >= target:
            if index == 0:
                return dict(point)
            before = curve[index - 1]
            share = (target - before[key]) / (point[key] - before[key])
            return {name: before[name] + share * (point[name] - before[name]) for name in point if isinstance(point[name], (int, float))}
    return None


def curve_of(run: dict, base: dict) -> list[dict]:
    """A run's points, step 0 the A model, each with `a_drop`: A's untouched facts' recall lost, in points."""
    points = [{"step": 0, **base}] + [{"step": int(s), **m} for s, m in sorted(run["curve"].items(), key=lambda i: int(i[0]))]
    if points[-1]["step"] != run["steps"]:  # run_mlm.py also checkpoints the last step; LoRA's loop does not
        points.append({"step": run["steps"], **run["final"]})
    return [{**p, "a_drop": 100 * (base["a"] - p["a"]), "ppl_change": 100 * (p["ppl"] / base["ppl"] - 1)} for p in points]


def best_run(runs: list[dict], bases: dict, target: float) -> dict:
    """The run that reaches `target` with the least loss of A (if none reaches it: the most B)."""

    def score(run):
        at = matched(curve_of(run, bases[run["base"]]), target)
        return (1, -at["a_drop"]) if at else (0, run["final"]["b"])

    return max(runs, key=score)


def best_lr(runs: list[dict], bases: dict, target: float) -> float:
    """The learning rate of `best_run`."""
    return best_run(runs, bases, target)["lr"]


def run_rates(run: dict) -> dict:
    """A run's swept rates: {"lr"} and, where the values had a rate of their own, {"memory_lr"}."""
    return {"lr": run["lr"], **({"memory_lr": run["memory_lr"]} if "memory_lr" in run else {})}
