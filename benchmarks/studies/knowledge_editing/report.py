"""The report of `knowledge_editing.py`: KNOWLEDGE_EDITING.md and its figure, from the runs' JSON alone."""

from __future__ import annotations

import datetime
import os
import statistics
from pathlib import Path

from benchmarks.studies.knowledge_capacity import config as kc
from benchmarks.studies.knowledge_editing import config as ke


ARM_STYLES = {  # the A model a method starts from: its name in the figure and its line
    "resm": ("ResM", "-"), "plain": ("plain", "--"), "ngram": ("n-gram", ":"), "ngram_large": ("large n-gram", "-."),
    "minilm_resm": ("ResM-MiniLM", "-"), "minilm_plain": ("plain MiniLM", "--"), "minilm_resm_large": ("ResM-MiniLM 512^2", ":"),
}
LINE_NAMES = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
LOWER_TARGETS = (0.5, 0.25)  # more matching points: the goal's 90% is reached by few methods in the plan's steps


def spread(values: list[float], digits: int = 1) -> str:
    """`mean` alone, or `mean (min-max)` over several seeds."""
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    return f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summary(data: dict, target: float) -> dict:
    """Per method, at its best learning rate (seed 0's sweep): the seeds' points at matched recall of B and at the end."""
    bases = {arm: b["metrics"] for arm, b in data.get("bases", {}).items()}
    rows = {}
    for method in ke.METHODS:
        runs = [r for r in data["runs"].values() if r["method"] == method and r["base"] in bases]
        if not runs:
            continue
        first_seed = min(r["seed"] for r in runs)
        rates = ke.run_rates(ke.best_run([r for r in runs if r["seed"] == first_seed], bases, target))
        chosen = sorted((r for r in runs if ke.run_rates(r) == rates), key=lambda r: r["seed"])
        curves = [ke.curve_of(r, bases[r["base"]]) for r in chosen]
        rows[method] = {"lr": rates["lr"], "rates": rates, "runs": chosen, "curves": curves,
                        "at": [ke.matched(c, target) for c in curves]}  # fmt: skip
    return rows


def verdict(rows: dict, target: float) -> list[str]:
    """The goal, decided from the table for each A model with a memory: SMF >= target recall of B with A falling <= 5
    points, full finetuning of the same model losing >= 5x more of A at the same recall."""
    lines = []
    for prefix, label in (("", "ResM"), ("ngram_", "n-gram"), ("ngram_large_", "large n-gram"), ("minilm_", "ResM-MiniLM"), ("minilm_large_", "ResM-MiniLM 512^2")):
        smf = {m: r for m, r in rows.items() if m.startswith(f"{prefix}smf_") and all(r["at"])}
        if not smf:
            if any(m.startswith(f"{prefix}smf_") for m in rows):
                lines.append(f"- {label} model: **not met**: no SMF setting reached {target:.0%} recall of B in every seed.")
            continue
        best = min(smf, key=lambda m: statistics.fmean(a["a_drop"] for a in smf[m]["at"]))
        drop = statistics.fmean(a["a_drop"] for a in smf[best]["at"])
        lines.append(f"- {label} model: the best SMF setting, `{best}`, reaches {target:.0%} of B losing {drop:.1f} points "
                     f"of A ({'<=' if drop <= 5 else '>'} 5: {'met' if drop <= 5 else 'not met'}).")  # fmt: skip
        full = rows.get(f"{prefix}full")
        if full and all(full["at"]):
            full_drop = statistics.fmean(a["a_drop"] for a in full["at"])
            ratio = full_drop / drop if drop > 0 else float("inf")
            lines.append(f"  Full finetuning loses {full_drop:.1f} points at the same recall of B: {ratio:.1f}x SMF's "
                         f"({'met' if ratio >= 5 else 'not met'}: the goal is >= 5x).")  # fmt: skip
        else:
            lines.append(f"  Full finetuning did not reach {target:.0%} of B in every seed: the ratio is not decided.")
    return lines or [f"- **Not met**: no SMF setting reached {target:.0%} recall of B in every seed."]


def figure(rows: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(11, 5.5))
    colours = plt.get_cmap("tab20").colors
    for index, (method, row) in enumerate(rows.items()):
        curve = row["curves"][0]
        ax.plot([100 * p["b"] for p in curve], [p["a_drop"] for p in curve], marker=".", color=colours[index % 20],
                linestyle=ARM_STYLES[ke.METHODS[method][0]][1], label=f"{method} (lr {row['lr']:g})")
    ax.set_xlabel("recall of B, training template (%)")
    ax.set_ylabel("A's untouched facts lost (points)")
    arms = {ke.METHODS[method][0] for method in rows}
    legend = ", ".join(f"{name} {LINE_NAMES[style]}" for arm, (name, style) in ARM_STYLES.items() if arm in arms)
    ax.set_title(f"learning B against forgetting A (best learning rate, first seed)\nA model: {legend}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def tuning_lines(data: dict, target: float) -> list[str]:
    """Each method's learning rates swept at the first seed, the one chosen (`ke.best_lr`) and whether it sits at an
    edge of the grid: recorded by the sweep (which grows a grid past an edge), else read from the runs."""
    bases = {arm: b["metrics"] for arm, b in data.get("bases", {}).items()}
    seed = min((r["seed"] for r in data["runs"].values()), default=0)
    rows = []
    for method in sorted({r["method"] for r in data["runs"].values()}):
        entry = data.get("tuning", {}).get(method)
        if entry is None:
            swept = [r for r in data["runs"].values() if r["method"] == method and r["seed"] == seed and r["base"] in bases]
            grid = sorted({r["lr"] for r in swept})
            if len(grid) < 2:
                continue
            best = ke.best_lr(swept, bases, target)
            entry = {"grid": grid, "best": best, "at_edge": best in (grid[0], grid[-1])}
        cells = ", ".join(f"**{lr:g}**" if lr == entry["best"] else f"{lr:g}" for lr in entry["grid"])
        values = ", ".join(f"**{lr:g}**" if lr == entry["memory_best"] else f"{lr:g}" for lr in entry["memory_grid"]) if "memory_grid" in entry else "—"
        seeded = sorted({r["lr"] for r in data["runs"].values() if r["method"] == method and r["seed"] != seed})
        edges = [lr for lr in seeded if lr in (entry["grid"][0], entry["grid"][-1])]
        flag = "⚠ " + ", ".join(f"{lr:g}" for lr in edges) if edges else ("⚠ the best" if entry["at_edge"] else "no")
        if entry.get("memory_at_edge"):
            flag = ("" if flag == "no" else flag + "; ") + "⚠ the values' best"
        rows.append(f"| {method} | {cells} | {values} | {', '.join(f'{lr:g}' for lr in seeded) or '—'} | {flag} |")
    if not rows:
        return []
    return ["## Tuning", "",
            f"Each method's rates swept at the first seed, **bold** the best at {target:.0%} of B (`best_lr`: the least "
            "loss of A where B is reached, else the most B), and the rates its other seeds ran (`--seed_learning_rates` "
            "picks those of a lower bar); ⚠ a rate that sits at an edge of the grid: the method may be under-tuned there. "
            "The sweep now grows a grid whose best sits at an edge, one step at a time (up to three); full finetuning of "
            "a model with a memory sweeps the values' rate on a grid of its own (earlier runs: 5x the network's rate).", "",
            "| method | rates swept | values' rates swept | seeds ran | at an edge |", "|---|---|---|---|---|", *rows, ""]  # fmt: skip


def write_report(args, data: dict) -> None:
    plan = data.get("plan", args.plan)
    target = plan["target"]
    rows = summary(data, target)
    reference = ke.MINILM if args.minilm else ke.FULL  # the committed plan of this part
    full_plan = plan == reference
    expected = sum(len(ke.learning_rates(args, m)) + len(plan["seeds"]) - 1 for m in args.methods)
    lines = ["# Teaching a model new facts: sparse memory finetuning against full finetuning and LoRA", ""]
    if not full_plan or len(data["runs"]) < expected:
        changed = {k: v for k, v in plan.items() if reference.get(k) != v}
        lines += [f"**The plan has not been run yet.** This report holds {len(data['runs'])} runs "
                  f"(the plan: {expected}){f' of a probe with the plan entries changed: `{changed}`' if changed else ''}.", ""]  # fmt: skip
    loads = [r["load"] for r in data["runs"].values()]
    machine = next(iter(data.get("bases", {}).values()), {}).get("machine", {})
    lines += [
        f"Produced by `benchmarks/knowledge_editing.py` (its docstring has the protocol), {datetime.date.today()}, "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores shared with other jobs, torch {machine.get('torch', '?')}, "
        f"one thread per run; load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f} at the runs' ends.",
        "",
        *([f"- The A models: all-MiniLM-L6-v2 (6 layers, hidden 384; its embedding trimmed to the data's word pieces) "
            f"converted with +Init, ResM with memories of {kc.MINILM_N_KEYS}^2 slots at layers "
            f"{' and '.join(map(str, kc.MINILM_MEMORY_LAYERS))} (values from zero)"
            + (f"; `minilm_resm_large` the same with {ke.LARGE_N_KEYS}^2 slots (its values step with SparseRowAdam, in A and "
               "in B)" if "minilm_resm_large" in data.get("bases", {}) else "")
            + "; and plain (no memory); each trained on A as below."] if args.minilm else []),
        f"- A: {plan['people']} people x 5 facts, each fact in {plan['per_fact']} lines (random training templates), "
        f"mixed with {plan['wiki_train']} WikiText-2 sentences; {plan['a_steps']} steps of {plan['batch_size']} lines "
        f"(lr {plan['a_lr']:g}, memory values {plan['a_memory_lr']:g}), seed 0.",
        f"- B: edits of {plan['edit_share']:.0%} of A's people (one attribute each, a new value) and {plan['new_people']} new "
        f"people; {plan['per_fact']} lines a fact; {plan['b_steps']} steps of {plan['batch_size']} lines, measured every "
        f"{max(1, plan['b_steps'] // plan['checkpoints'])} steps.",
        "- Recall: every value token predicted (greedy, left to right) in a lone sentence naming the person; a training "
        "template, and a held-out one. A's retention: its facts the edits leave alone. ppl: pseudo-perplexity of "
        f"{plan['wiki_heldout']} held-out WikiText-2 sentences (15% of tokens masked, fixed).",
        "",
        "## The A models",
        "",
        "| model | A recall | held-out template | ppl | train s | rows A's text reads (a memory layer) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for arm, base in sorted(data.get("bases", {}).items()):
        m = base["metrics"]
        room = ", ".join(f"{read:,} of {rows:,} ({read / rows:.0%})" for read, rows in base.get("rows_read_by_a", {}).values()) or "n/a"
        lines.append(f"| {arm} | {m['a']:.3f} | {m['a_heldout']:.3f} | {m['ppl']:.1f} | {base['train_seconds']:.0f} | {room} |")
    lines += [
        "",
        f"## At matched learning: {target:.0%} recall of B",
        "",
        "Each method at its best learning rate (the one reaching the target with the least loss of A, else the most B; "
        "from the first seed's sweep); mean (min-max) over the seeds that reached the target; interpolated linearly "
        "between checkpoints.",
        "",
        "| method | lr | seeds reaching | step | A lost (points) | ppl change % | B held-out | edits' old value | final B | final A lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in rows.items():
        reached = [a for a in row["at"] if a]
        finals = [c[-1] for c in row["curves"]]
        lines.append(
            f"| {method} | {row['lr']:g} | {len(reached)}/{len(row['at'])} | {spread([a['step'] for a in reached], 0)} | "
            f"{spread([a['a_drop'] for a in reached])} | {spread([a['ppl_change'] for a in reached])} | "
            f"{spread([a['b_heldout'] for a in reached], 3)} | {spread([a['old'] for a in reached], 3)} | "
            f"{spread([f['b'] for f in finals], 3)} | {spread([f['a_drop'] for f in finals])} |"
        )
    lines += ["", *verdict(rows, target), ""]
    for low in LOWER_TARGETS:
        lower = summary(data, low)
        if not any(any(row["at"]) for row in lower.values()):
            continue
        lines += [
            f"## At a lower bar: {low:.0%} recall of B",
            "",
            f"The same matching at {low:.0%} of B, which more methods reach: the loss of A per fact learned, each method at "
            f"its best learning rate for this bar (the seeds run at that rate).",
            "",
            "| method | lr | seeds reaching | step | A lost (points) | ppl change % |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for method, row in lower.items():
            reached = [a for a in row["at"] if a]
            lines.append(f"| {method} | {row['lr']:g} | {len(reached)}/{len(row['at'])} | {spread([a['step'] for a in reached], 0)} | "
                         f"{spread([a['a_drop'] for a in reached])} | {spread([a['ppl_change'] for a in reached])} |")  # fmt: skip
        lines.append("")
    figure_path = Path(args.results).with_name(Path(args.report).stem.lower() + ".png")  # a probe does not overwrite the plan's figure
    if rows and figure(rows, figure_path):
        lines += [f"![learning B against forgetting A]({os.path.relpath(figure_path, Path(args.report).parent)})", ""]
    diagnosis = data.get("diagnosis")
    if diagnosis:
        touched = diagnosis["touched"]
        lines += [
            "## Where SMF's rows lie (`--stages diagnose`)",
            "",
            f"The {'ResM-MiniLM' if args.minilm else 'ResM'} A model on {diagnosis['batches']} of B's "
            f"training batches ({diagnosis['batch_size']} lines, masked as run_mlm.py masks), eval mode as an SMF step: a "
            f"batch reads {touched['rows_read']:.0f} of the {diagnosis['rows']:,} rows"
            f"{' of its ' + str(diagnosis['layers']) + ' memory layers' if diagnosis.get('layers', 1) > 1 else ''}, "
            f"{touched['rows_with_gradient']:.0f} of them get a gradient "
            + ("(those read at masked positions)" if diagnosis.get("layers", 1) == 1 else
               f"(layers after a memory attend to every position, so rows read at unmasked ones get some too; "
               f"{touched['rows_read_at_masked']:.0f} rows are read at masked positions)")
            + ". Share of the values' gradient (squared norm) in the rows chosen (t a layer), mean over the batches:",
            "",
        ]
        written = all("a_reads_in_chosen" in entry for entry in diagnosis["shares"].values())  # (not in the runs of 2026-12-03)
        lines += [
            "| ranker, top-t | reads of every position (SMF) | reads of masked positions only | the best t rows |"
            + (" rows SMF writes | A's reads in them | A's reads in the best rows |" if written else ""),
            "|---|---:|---:|---:|" + ("---:|---:|---:|" if written else ""),
        ]
        for choice, entry in diagnosis["shares"].items():
            lines.append(f"| {choice} | {entry['all_positions']:.3f} | {entry['masked_positions']:.3f} | {entry['best_rows']:.3f} |"
                         + (f" {entry['rows_chosen']:.0f} | {entry['a_reads_in_chosen']:.3f} | {entry['a_reads_in_best']:.3f} |" if written else ""))  # fmt: skip
        if written:
            lines += ["", "A's reads in them: the share of what A's untouched facts read at their masked values (a training "
                      "template; every layer, head and knn) that lies in the rows an SMF step on B writes; in the best "
                      "rows: the same for the t rows a layer of largest gradient on B."]  # fmt: skip
        lines.append("")
    coverage = data.get("background_coverage")
    if coverage:
        lines += [
            "## What the background protects (`background_coverage`)",
            "",
            "SMF's background is A's training text in documents of a training batch of lines: unmasked, or masked as A's "
            "training steps masked it (15%, fresh masks each pass, up to the plan's background documents). Outside: the share of what each set of facts reads at "
            "its masked value (a training template, every head's knn) that lies in rows no background document read. For "
            "A it is what an update sparing the background's rows can still damage; for B, the room such an update has.",
            "",
            "| A model | background | layer | rows it reads | A's reads outside | edits' | new people's |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for arm, by_background in coverage.items():
            for background, entry in by_background.items():
                for layer, c in entry.items():
                    if layer != "documents":
                        lines.append(f"| {arm} | {background} ({entry['documents']} documents) | {layer} | {c['rows_read']:,} of "
                                     f"{c['rows']:,} | {c['a_outside']:.2%} | {c['edits_outside']:.2%} | {c['new_outside']:.2%} |")  # fmt: skip
        lines.append("")
    keying = data.get("keying")
    if keying:
        lines += [
            "## Keyed by the person or by the template? (`knowledge_capacity.keying_diagnosis`)",
            "",
            "At each memory layer's input, every (person, attribute) of A masked in each of its six templates: how often the "
            "nearest neighbour (cosine) among the same attribute's inputs in the other templates is the same person, and "
            "with a memory the slots read (Jaccard overlap, every head's knn) for one fact in two templates against two "
            "people in one template.",
            "",
            "| model | layer | person nn (chance) | held-out templates | slots: same fact | slots: same template |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for arm, by_layer in keying.items():
            for layer, k in by_layer.items():
                slots = f"{k['slots_same_fact']:.2f} | {k['slots_same_template']:.2f}" if "slots_same_fact" in k else "n/a | n/a"
                lines.append(f"| {arm} | {layer} | {k['person_nn']:.2f} ({k['chance']:.2f}) | {k['person_nn_heldout']:.2f} | {slots} |")
        lines.append("")
    sharing = data.get("ngram_rows")
    if sharing:
        lines += [
            "## Whose rows an n-gram memory's SMF step writes",
            "",
            f"The n-gram A model's hash tables (`ngram_row_sharing`, from the hash alone): A's training text reads "
            f"{sharing['rows_read_by_a']:,} of the {sharing['rows']:,} rows. A line of B reads {sharing['rows_per_b_line']:.0f} "
            f"rows; {sharing['b_rows_read_by_a']:.1%} of them are read by A's text too, {sharing['b_rows_read_by_10_a_lines']:.1%} "
            f"by 10 or more of A's lines; {sharing['b_rows_a_never_reads']:.1f} rows a line are B's alone.",
            "",
        ]
    notes = ke.HERE / f"{ke.plan_stem(args.minilm)}_notes.md"
    own_report = Path(args.report).name == f"{ke.plan_stem(args.minilm).upper()}.md"
    if full_plan and own_report and notes.exists():  # the findings, written by hand after a run (not in a probe's report)
        lines += [notes.read_text(encoding="utf-8").strip(), ""]
    lines += tuning_lines(data, target)
    lines += [
        "## Every run",
        "",
        "| method | lr | seed | final B | B held-out | edits | new people | A kept | A lost | ppl | train s | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bases = {arm: b["metrics"] for arm, b in data.get("bases", {}).items()}
    for key, run in sorted(data["runs"].items()):
        f = run["final"]
        drop = 100 * (bases[run["base"]]["a"] - f["a"]) if run["base"] in bases else float("nan")
        lines.append(f"| {run['method']} | {run['lr']:g} | {run['seed']} | {f['b']:.3f} | {f['b_heldout']:.3f} | {f['edits']:.3f} | "
                     f"{f['new']:.3f} | {f['a']:.3f} | {drop:.1f} | {f['ppl']:.1f} | {run['train_seconds']:.0f} | {run['load']:.1f} |")  # fmt: skip
    commands = sorted({" ".join(["python", *ke.portable(r["command"])]) for r in data["runs"].values()})[:3]
    lines += ["", "Example commands of the runs (each run's is in the JSON):", "", *[f"    {c}" for c in commands], ""]
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text("\n".join(lines))
