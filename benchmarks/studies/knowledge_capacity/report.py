"""`KNOWLEDGE_CAPACITY.md` and its figures from the runs of `benchmarks/knowledge_capacity.py` (its JSON alone)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from benchmarks.studies.knowledge_capacity.config import ARMS, BASE, LABELS, MEMORY, PLAN_ARMS, RESULTS


HERE_NOTES = Path(__file__).resolve().parent / "knowledge_capacity_notes.md"  # the findings, written by hand
VALUES_RESULTS = RESULTS / "knowledge_capacity_values.json"  # `--masking values`'s committed runs


def _mean_spread(values: list[float], digits: int = 0) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:,.{digits}f}"
    return f"{statistics.mean(values):,.{digits}f} ± {statistics.stdev(values):,.{digits}f}"


def _runs(data: dict, **where) -> list[dict]:
    """The scratch arms' runs (not the known-answer checks, not MiniLM's: their own sections) matching `where`."""
    templates = where.pop("templates", None)  # the runs of the `templates` stage only when asked for
    return [r for k, r in sorted(data["runs"].items()) if not k.startswith("sanity") and r.get("templates") == templates
            and not r["arm"].startswith("minilm") and all(r.get(f) == v for f, v in where.items())]  # fmt: skip


def best_learning_rates(data: dict, plan: dict) -> dict:
    best = {}
    for run in _runs(data, size=plan["sweep_size"], seed=0):
        key = (run["final"]["train"]["bits"], run["final"]["heldout"]["bits"])
        if run["arm"] not in best or key > best[run["arm"]][0]:
            best[run["arm"]] = (key, run["lr"])
    return {arm: lr for arm, (_, lr) in best.items()}


def minilm_best_rates(data: dict, minilm: list[dict]) -> dict:
    """Arm (h): each arm's chosen rates ({"lr": ..., "memory_lr": ...}): those `tune` recorded, else (runs before it) the
    best learning rate of the sweep (the smallest size, seed 0), by the scratch arms' rule."""
    tuned = {key.split("/")[0]: entry["best"] for key, entry in data.get("tuning", {}).items() if key.startswith("minilm")}
    if tuned:
        return tuned
    sweep_size = min(r["size"] for r in minilm)
    best = {}
    for run in minilm:
        if run["size"] == sweep_size and run["seed"] == 0:
            score = (run["final"]["train"]["bits"], run["final"]["heldout"]["bits"])
            best[run["arm"]] = max(best.get(run["arm"], (score, run["lr"])), (score, run["lr"]))
    return {arm: {"lr": lr} for arm, (_, lr) in best.items()}


def at_rates(run: dict, rates: dict) -> bool:
    return all(run.get(name) == value for name, value in rates.items())


def rates_label(rates: dict) -> str:
    return ", ".join(f"{'values lr' if name == 'memory_lr' else name} {value:g}" for name, value in rates.items())


def swept_before_tuning(data: dict) -> dict:
    """The tuning entries of runs made before `tune` recorded them: each arm's learning rates swept at seed 0 at its
    sweep's size (the most common size at seed 0 with more than one rate), the best by the same rule."""
    entries = {}
    for arm in sorted({r["arm"] for k, r in data["runs"].items() if not k.startswith("sanity") and "memory_lr" not in r}):
        runs = [r for k, r in data["runs"].items() if r["arm"] == arm and r["seed"] == 0 and not k.startswith("sanity")
                and r.get("templates") is None and "memory_lr" not in r]  # fmt: skip
        sizes = [n for n in {r["size"] for r in runs} if len({r["lr"] for r in runs if r["size"] == n}) > 1]
        if not sizes:
            continue
        size = max(sizes, key=lambda n: len({r["lr"] for r in runs if r["size"] == n}))
        swept = [r for r in runs if r["size"] == size]
        grid = sorted({r["lr"] for r in swept})
        best = max(swept, key=lambda r: (r["final"]["train"]["bits"], r["final"]["heldout"]["bits"]))["lr"]
        entries[f"{arm}/n{size}"] = {"best": {"lr": best}, "grids": {"lr": grid}, "at_edge": ["lr"] if best in (grid[0], grid[-1]) else []}
    return entries


def tuning_lines(data: dict, labels: dict) -> list[str]:
    """The tuning table: each arm's grids (as grown), the rates chosen, and whether one still sits at an edge."""
    tuning = {**swept_before_tuning(data), **data.get("tuning", {})}
    if not tuning:
        return []
    lines = ["## Tuning", "",
             "One budget for every arm: each of its learning rates on a grid of the same size, every combination at seed "
             "0, the best by stored bits; a best rate at a grid's edge grows that grid (up to 3 steps). **bold**: "
             "chosen; ⚠ still at an edge (runs made before this rule swept a fixed grid of the learning rate alone, the "
             "values at 1e-2: each shows whether its choice sat at an edge).", "",
             "| arm | people | lr grid | values lr grid | chosen | at an edge |", "|---|---|---|---|---|---|"]  # fmt: skip
    for key, entry in sorted(tuning.items()):
        arm, size = key.split("/")

        def grid(name):
            values = entry["grids"].get(name)
            if not values:
                return "—"
            return ", ".join(f"**{v:g}**" if v == entry["best"].get(name) else f"{v:g}" for v in values)

        edge = ", ".join(f"⚠ {name}" for name in entry["at_edge"]) or "no"
        lines.append(f"| {labels.get(arm, arm)} | {size[1:]} | {grid('lr')} | {grid('memory_lr')} | {rates_label(entry['best'])} | {edge} |")
    return [*lines, ""]


def _save(figure, plt, folder: Path, name: str) -> str:
    figure.tight_layout()
    figure.savefig(folder / name, dpi=110)
    plt.close(figure)
    return name


def write_figures(data: dict, plan: dict, labels: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_learning_rates(data, plan)
    finished = [r["size"] for r in _runs(data) if r["size"] in plan["sizes"]]
    largest = max(finished or plan["sizes"])  # the largest size run so far (the plan's, once finished)
    names = []
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for index, (arm, lr) in enumerate(best.items()):
        color = f"C{index}"  # one colour an arm in every panel (the legend is on the first)
        runs = sorted(_runs(data, arm=arm, seed=0, lr=lr), key=lambda r: r["size"])
        runs = [r for r in runs if r["size"] in plan["sizes"]]
        if runs:
            axes[0].plot([r["size"] for r in runs], [r["final"]["train"]["bits"] for r in runs], "o-", color=color, label=labels[arm])
        at_largest = [r for r in runs if r["size"] == largest]
        if at_largest and at_largest[0]["curve"]:
            curve = sorted((int(s), v["train"]) for s, v in at_largest[0]["curve"].items())
            curve.append((at_largest[0]["steps"], at_largest[0]["final"]["train"]["bits"]))
            axes[1].plot(*zip(*curve), "o-", color=color, label=labels[arm])
        seconds = data.get("speed", {}).get("arms", {}).get(arm)
        if at_largest and seconds:
            axes[2].scatter([seconds * 1000], [at_largest[0]["final"]["train"]["bits"]], color=color, label=labels[arm])
            axes[2].annotate(labels[arm].split(" ", 1)[0], (seconds * 1000, at_largest[0]["final"]["train"]["bits"]))
    axes[0].set(xlabel="people in the knowledge base", ylabel="stored bits (training template)", xscale="log", title="bits against size")
    axes[1].set(xlabel="training steps", ylabel="stored bits", title=f"bits against steps ({largest} people)")
    axes[2].set(xlabel="training step time (ms, one thread)", ylabel="stored bits", title=f"bits against compute ({largest} people)")
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    names.append(_save(figure, plt, folder, "knowledge_capacity.png"))

    minilm = [r for r in data["runs"].values() if r["arm"].startswith("minilm")]
    if minilm:  # arm (h): each arm at its best learning rate of the sweep (the smallest size), mean ± sd over seeds
        best = minilm_best_rates(data, minilm)
        figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for arm, color in (("minilm_plain", "C0"), ("minilm_resm", "C1")):
            if arm not in best:
                continue
            chosen = [r for r in minilm if r["arm"] == arm and at_rates(r, best[arm])]
            sizes = sorted({r["size"] for r in chosen})
            for axis, split in zip(axes, ("train", "heldout")):
                values = [[r["final"][split]["bits"] for r in chosen if r["size"] == n] for n in sizes]
                means = [statistics.mean(v) for v in values]
                spreads = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
                axis.errorbar(sizes, means, yerr=spreads, fmt="o-", capsize=3, color=color, label=f"{labels[arm]} ({rates_label(best[arm])})")
        for axis, title in zip(axes, ("training template", "held-out template")):
            axis.set(xlabel="people in the knowledge base (5 facts each)", ylabel="stored bits", xscale="log",
                     title=f"MiniLM +Init, {'/'.join(map(str, sorted({r['steps'] for r in minilm})))} steps: {title}")  # fmt: skip
            axis.set_xticks(sorted({r["size"] for r in minilm}), [str(n) for n in sorted({r["size"] for r in minilm})])
            axis.minorticks_off()
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        names.append(_save(figure, plt, folder, "knowledge_capacity_minilm.png"))
    return names


def write_report(args, data: dict) -> None:
    plan = args.plan
    report = Path(args.report)
    lines = ["# Knowledge capacity: what the memory is worth", ""]
    if getattr(args, "masking", "random") == "values":  # a value-masking plan's own report: its section alone
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text("\n".join(lines + values_lines(data, LABELS, Path(args.results).parent, report.parent)), encoding="utf-8")
        print(f"wrote {report}")
        return
    if VALUES_RESULTS.exists():  # the current regime first; the random-masking runs below are its history
        import json

        lines += values_lines(json.loads(VALUES_RESULTS.read_text(encoding="utf-8")), LABELS, VALUES_RESULTS.parent, report.parent)
        lines += ["## History: the earlier runs, 15% random masking", "",
                  "A fact's value was supervised in about one exposure of seven: the rows below measure little storage "
                  "(see the value-masking section above for the regime that decides).", ""]  # fmt: skip
    lines += [
        "Facts stored per parameter and per unit of compute (`benchmarks/knowledge_capacity.py`): a synthetic knowledge "
        "base of people with five attributes of exactly known information (40.3 bits a person), written as "
        f"{'biographies' if plan.get('training_text') == 'biographies' else 'the sentences of biographies, a fact a line'} "
        "(several per person, four paraphrase templates per attribute, two more held out), trained on with "
        "`run_scripts/run_mlm.py` from scratch: the same tokenizer (MiniLM's WordPiece "
        "restricted to the base's pieces), data order, masks and steps for every arm. A fact is recalled when every "
        "token of its value is predicted (greedy, left to right) in a sentence naming the person, so the name is the "
        "only key; bits = log2 |values| summed over recalled facts; the estimator of Physics of LMs 3.3 "
        "(per attribute max(0, N log2 |values| - the values' cross-entropy in bits)) beside it.",
        "",
        f"Base encoder: hidden {BASE['hidden_size']}, {BASE['num_hidden_layers']} layers, FFN "
        f"{BASE['intermediate_size']}, no dropout; memories at layer {MEMORY['pkm_layers']} with "
        f"{MEMORY['pkm_n_keys']}² slots, {MEMORY['pkm_heads']} heads, knn {MEMORY['pkm_knn']}, values in their own Adam "
        f"at {plan['memory_learning_rate']:g}. Plan: sizes {plan['sizes']} people, learning rates "
        f"{plan['learning_rates']} swept at {plan['sweep_size']} people, {plan['steps']} steps of "
        f"{plan['batch_size']} biographies, seeds {plan['seeds']} at the largest size.",
        "",
        "```",
        "python benchmarks/knowledge_capacity.py            # resumable: finished runs are kept in knowledge_capacity.json",
        "python benchmarks/knowledge_capacity.py --report_only",
        "```",
        "",
    ]
    expected = len(PLAN_ARMS) * (len(plan["learning_rates"]) + len(plan["sizes"]) + len(plan["seeds"]) - 2)
    finished = len([r for r in _runs(data) if r["arm"] in PLAN_ARMS])
    lines += [f"**Status: {finished} of about {expected} scratch runs finished.**" + (
        " The tables below hold what has run; the claims are decided only on the finished plan." if finished < expected else ""), ""]  # fmt: skip

    sanity = sorted((r for k, r in data["runs"].items() if k.startswith("sanity/")),
                    key=lambda r: (r.get("exposures", data.get("sanity_exposures")), r["lr"]))  # fmt: skip
    if sanity or "sanity_untrained" in data:
        lines += ["## Known answers", "", "| check | recall (training template) | recall (held-out) |", "|---|---|---|"]
        for run in sanity:
            seen = run.get("exposures", data.get("sanity_exposures"))
            lines.append(f"| {run['final']['train']['facts']} facts seen {seen} times, value masked ~{0.15 * seen:.0f} ({run['steps']} steps, "
                         f"lr {run['lr']:g}) | {run['final']['train']['recall']:.3f} | {run['final']['heldout']['recall']:.3f} |")  # fmt: skip
        if "sanity_untrained" in data:
            untrained = data["sanity_untrained"]
            chance = statistics.mean(a["chance"] for a in untrained["train"]["attributes"].values())
            lines.append(f"| untrained model (chance: {chance:.3f} a fact) | {untrained['train']['recall']:.3f} | "
                         f"{untrained['heldout']['recall']:.3f} |")  # fmt: skip
        lines.append("")

    speed = data.get("speed")
    params = {}
    for run in _runs(data):
        params.setdefault(run["arm"], run["params"])
    if speed:
        plain = speed["arms"]["plain"]
        lines += ["## Cost", "", f"A training step of {speed['batch'][0]} lines ({speed['batch'][1]} positions), "
                  f"one thread, the arms interleaved in one process ({speed['machine']}); FFN widths: equal parameters "
                  f"{speed['wide_params_width']}, equal step time {speed['wide_time_width']}.", "",
                  "| arm | step (ms) | / plain | dense params | memory params | embeddings |", "|---|---|---|---|---|---|"]  # fmt: skip
        for arm, seconds in speed["arms"].items():
            p = params.get(arm, {})
            lines.append(f"| {LABELS[arm]} | {seconds * 1000:.1f} | {seconds / plain:.2f} | {p.get('dense', 0):,} | "
                         f"{p.get('memory', 0):,} | {p.get('embeddings', 0):,} |")  # fmt: skip
        lines.append("")

    best = best_learning_rates(data, plan)
    sweep = _runs(data, size=plan["sweep_size"], seed=0)
    if sweep:
        lines += [f"## Learning-rate sweep ({plan['sweep_size']} people, seed 0): stored bits, training / held-out template", ""]
        lines += ["| arm | " + " | ".join(f"lr {lr:g}" for lr in plan["learning_rates"]) + " | best |",
                  "|---|" + "---|" * (len(plan["learning_rates"]) + 1)]  # fmt: skip
        for arm in ARMS:
            cells = []
            for lr in plan["learning_rates"]:
                run = [r for r in sweep if r["arm"] == arm and r["lr"] == lr]
                cells.append(f"{run[0]['final']['train']['bits']:,.0f} / {run[0]['final']['heldout']['bits']:,.0f}" if run else "—")
            if any(c != "—" for c in cells):
                lines.append(f"| {LABELS[arm]} | " + " | ".join(cells) + f" | {best.get(arm, '—'):g} |")
        lines.append("")

    if best:
        lines += ["## Stored knowledge against size (best learning rate, seed 0)", "",
                  "Recall in a training template / a held-out one; bits (training template) and Physics of LMs 3.3's "
                  "estimator; bits per parameter count the dense and memory parameters (not the embeddings).", "",
                  "| arm | " + " | ".join(f"{n} people ({n * 5} facts)" for n in plan["sizes"]) + " | bits / param at the largest |",
                  "|---|" + "---|" * (len(plan["sizes"]) + 1)]  # fmt: skip
        for arm, lr in best.items():
            cells, per_param = [], "—"
            for size in plan["sizes"]:
                run = _runs(data, arm=arm, size=size, seed=0, lr=lr)
                if not run:
                    cells.append("—")
                    continue
                final = run[0]["final"]
                cells.append(f"{final['train']['recall']:.2f} / {final['heldout']['recall']:.2f}, "
                             f"{final['train']['bits']:,.0f} b (est. {final['train']['bits_estimator']:,.0f})")  # fmt: skip
                if size == max(plan["sizes"]):
                    counted = run[0]["params"]["dense"] + run[0]["params"]["memory"]
                    per_param = f"{final['train']['bits'] / counted:.4f}"
            lines.append(f"| {LABELS[arm]} | " + " | ".join(cells) + f" | {per_param} |")
        lines.append("")

        largest = max(plan["sizes"])
        seeded = {arm: [r["final"]["train"]["bits"] for r in _runs(data, arm=arm, size=largest, lr=lr)] for arm, lr in best.items()}
        if any(len(v) > 1 for v in seeded.values()):
            lines += [f"## Seeds at {largest} people: stored bits, mean ± standard deviation", "", "| arm | seeds | training template | held-out |", "|---|---|---|---|"]
            for arm, lr in best.items():
                runs = _runs(data, arm=arm, size=largest, lr=lr)
                lines.append(f"| {LABELS[arm]} | {len(runs)} | {_mean_spread([r['final']['train']['bits'] for r in runs])} | "
                             f"{_mean_spread([r['final']['heldout']['bits'] for r in runs])} |")  # fmt: skip
            lines.append("")

        if speed and all(a in seeded and seeded[a] for a in ("plain", "resm", "wide_params")):
            bits = {a: statistics.mean(v) for a, v in seeded.items() if v}
            times = speed["arms"]
            lines += ["## The goal", "", "| goal | measured | met |", "|---|---|---|"]
            ratio, time_ratio = bits["resm"] / max(bits["plain"], 1e-9), times["resm"] / times["plain"]
            lines.append(f"| ResM >= 2x plain's bits at <= 1.2x its step time | {ratio:.2f}x at {time_ratio:.2f}x | "
                         f"{'yes' if ratio >= 2 and time_ratio <= 1.2 else 'no'} |")  # fmt: skip
            share, time_share = bits["resm"] / max(bits["wide_params"], 1e-9), times["resm"] / times["wide_params"]
            lines.append(f"| ResM >= 80% of the equal-parameter arm's bits at <= 1/3 of its step time | {share:.0%} at "
                         f"{time_share:.2f}x | {'yes' if share >= 0.8 and time_share <= 1 / 3 else 'no'} |")  # fmt: skip
            lines.append("")

    one_template = _runs(data, templates=1)
    if one_template:
        lines += [f"## A fact always said the same way ({one_template[0]['size']} people, one training template per "
                  "attribute, seed 0)", "", "The same people, steps and learning rates as the sweep's best; recall in "
                  "the one training template / the two held-out ones; beside it the four-template run of the sweep.",
                  "", "| arm | one template: recall, bits | four templates: recall, bits |", "|---|---|---|"]  # fmt: skip
        for run in one_template:
            four = _runs(data, arm=run["arm"], size=run["size"], seed=0, lr=run["lr"])
            cell = lambda r: f"{r['final']['train']['recall']:.2f} / {r['final']['heldout']['recall']:.2f}, {r['final']['train']['bits']:,.0f} b"  # noqa: E731
            lines.append(f"| {LABELS[run['arm']]} | {cell(run)} | {cell(four[0]) if four else '—'} |")
        lines.append("")

    diagnosed = [(k, r) for k, r in sorted(data["runs"].items()) if "diagnosis" in r]
    if diagnosed:
        lines += ["## What the memory's layer reads at a masked value", "",
                  "At the first position of a masked value, the layer input the FFN and the memory read, for each person "
                  "and attribute in all six templates (`keying_diagnosis`): *person nn* = the share whose nearest "
                  "neighbour among the other templates' inputs is the same person (chance 1 / people); with a memory, "
                  "the slots read for one fact in two templates (*same fact*) against two people in one template "
                  "(*same template*), mean Jaccard overlap; *mu* = the share of slots read over the training lines.",
                  "", "| run | person nn (held-out templates) | slots: same fact / same template | memory / input norm | mu |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for key, run in diagnosed:
            d = run["diagnosis"]
            slots = f"{d['slots_same_fact']:.3f} / {d['slots_same_template']:.3f}" if "slots_same_fact" in d else "—"
            norm = f"{d['memory_to_input']:.2f}" if "memory_to_input" in d else "—"
            mu = f"{d['usage']['mu']:.3f}" if "usage" in d else "—"
            lines.append(f"| {key} | {d['person_nn']:.2f} ({d['person_nn_heldout']:.2f}; chance {d['chance']:.3f}) | "
                         f"{slots} | {norm} | {mu} |")  # fmt: skip
        lines.append("")

    quantized = [(k, r) for k, r in sorted(data["runs"].items()) if "quantized" in r]
    if quantized:
        lines += ["## Packed values after training (ResM)", "", "| run | fp32 bits | int8 | 4-bit |", "|---|---|---|---|"]
        for key, run in quantized:
            q = run["quantized"]
            lines.append(f"| {key} | {run['final']['train']['bits']:,.0f} | {q['int8']['train']['bits']:,.0f} | {q['int4']['train']['bits']:,.0f} |")
        lines.append("")

    minilm = [r for r in data["runs"].values() if r["arm"].startswith("minilm")]
    if minilm:
        sweep_size = min(r["size"] for r in minilm)
        lines += ["## The real MiniLM, +Init (vocabulary trimmed to the base's pieces)", "",
                  f"Learning rates swept at {sweep_size} people (seed 0):", "",
                  "| arm | rates | people | recall train / held-out | bits |", "|---|---|---|---|---|"]  # fmt: skip
        for run in sorted(minilm, key=lambda r: (r["arm"], r["lr"], r.get("memory_lr") or 0)):
            if run["size"] == sweep_size and run["seed"] == 0:
                rates = rates_label({"lr": run["lr"], **({"memory_lr": run["memory_lr"]} if run["arm"] == "minilm_resm" and "memory_lr" in run else {})})
                lines.append(f"| {LABELS[run['arm']]} | {rates} | {run['size']} | {run['final']['train']['recall']:.2f} / "
                             f"{run['final']['heldout']['recall']:.2f} | {run['final']['train']['bits']:,.0f} |")  # fmt: skip
        lines.append("")
        best = minilm_best_rates(data, minilm)  # each arm at it, at every size (mean ± sd over seeds)
        lines += ["Each arm at its best learning rate, by size: stored bits (training template / held-out), "
                  "mean ± standard deviation over seeds; ResM / plain the ratio of the means:", "",
                  "| people | facts | (h) MiniLM plain | (h) MiniLM ResM | seeds | ResM / plain |", "|---|---|---|---|---|---|"]  # fmt: skip
        for size in sorted({r["size"] for r in minilm}):
            cells, means = [], {}
            for arm in ("minilm_plain", "minilm_resm"):
                runs = [r for r in minilm if r["arm"] == arm and r["size"] == size and arm in best and at_rates(r, best[arm])]
                train, held = [r["final"]["train"]["bits"] for r in runs], [r["final"]["heldout"]["bits"] for r in runs]
                cells.append(f"{_mean_spread(train)} / {_mean_spread(held)}" if runs else "—")
                means[arm] = (statistics.mean(train), statistics.mean(held), len(runs)) if runs else None
            plain, resm = means["minilm_plain"], means["minilm_resm"]
            ratio = (f"{resm[0] / plain[0]:.2f}x / {resm[1] / plain[1]:.2f}x" if plain and resm and plain[0] and plain[1] else "—")
            seeds = "/".join(str(m[2]) for m in (plain, resm) if m)
            facts = next(r["final"]["train"]["facts"] for r in minilm if r["size"] == size)
            lines.append(f"| {size} | {facts} | {cells[0]} | {cells[1]} | {seeds} | {ratio} |")
        lines.append("")

    lines += tuning_lines(data, LABELS)
    findings = HERE_NOTES.read_text(encoding="utf-8") if HERE_NOTES.exists() else ""
    if findings:
        lines += [findings.strip(), ""]
    if _runs(data):
        figures = Path(args.results).parent  # beside the results JSON
        for name in write_figures(data, plan, LABELS, figures):
            lines += [f"![{name}]({os.path.relpath(figures / name, report.parent)})", ""]
    loads = [r["load"] for r in data["runs"].values() if "load" in r]
    if loads:
        lines += [f"Machine load (1-minute average) when runs finished: {min(loads):.1f}–{max(loads):.1f}.", ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {report}")


# ---------------------------------------------------------------------------------------------------------------------
# Value masking, the pretrained regime (`--masking values --stages minilm minilm_speed`): its own JSON, its own section

VALUES_ARMS = ("minilm_plain", "minilm_resm")


def _paired_ratio(resm: dict, plain: dict, key) -> str:
    """ResM / plain of `key(run)`, seed by seed (the same data order and masks): mean (min-max)."""
    ratios = [key(resm[s]) / key(plain[s]) for s in sorted(set(resm) & set(plain)) if key(plain[s])]
    if not ratios:
        return "—"
    mean = statistics.fmean(ratios)
    return f"{mean:.2f}x" if len(ratios) == 1 else f"{mean:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _cell(runs: list[dict], key, digits: int = 2) -> str:
    return _mean_spread([key(r) for r in runs], digits)


def values_chosen(data: dict) -> dict:
    """{arm: {size: {seed: run}}} of the value-masking MiniLM runs at each arm's tuned rates."""
    best = minilm_best_rates(data, [r for r in data["runs"].values() if r["arm"] in VALUES_ARMS])
    chosen = {arm: {} for arm in VALUES_ARMS}
    for run in data["runs"].values():
        if run["arm"] in VALUES_ARMS and run["arm"] in best and at_rates(run, best[run["arm"]]):
            chosen[run["arm"]].setdefault(run["size"], {})[run["seed"]] = run
    return chosen


def values_points(run: dict) -> dict[int, dict]:
    """{step: {"train", "heldout" (bits), "train_recall", "heldout_recall"}}: the run's measured checkpoints (those
    with their recall) and its final step."""
    points = {int(step): point for step, point in run.get("curve", {}).items() if "train_recall" in point}
    final = run["final"]
    points[run["steps"]] = {**{s: final[s]["bits"] for s in ("train", "heldout")},
                            **{f"{s}_recall": final[s]["recall"] for s in ("train", "heldout")}}  # fmt: skip
    return points


def values_steps(plain: dict, resm: dict) -> list[int]:
    """The steps measured in every seed of both arms ({seed: run} each), in order."""
    runs = [*plain.values(), *resm.values()]
    return sorted(set.intersection(*(set(values_points(run)) for run in runs))) if runs else []


def decisive_step(plain: dict, steps: list[int]) -> int:
    """The step the goal is decided at, fixed before looking at ResM: the last measured step where plain's recall
    (training template, mean over seeds) is still under half (plain has learned the most there while it still leaves
    room to double); where plain is at half or more at every step, the first."""
    under = [step for step in steps
             if statistics.fmean(values_points(run)[step]["train_recall"] for run in plain.values()) < 0.5]  # fmt: skip
    return under[-1] if under else steps[0]


def values_pairs(data: dict):
    """(size, plain, resm, steps) for every size both arms ran at their tuned rates: {seed: run} of the seeds both
    have, and the steps measured in all of them (`values_steps`)."""
    chosen = values_chosen(data)
    for size in sorted(set(chosen["minilm_plain"]) & set(chosen["minilm_resm"])):
        seeds = sorted(set(chosen["minilm_plain"][size]) & set(chosen["minilm_resm"][size]))
        plain = {s: chosen["minilm_plain"][size][s] for s in seeds}
        resm = {s: chosen["minilm_resm"][size][s] for s in seeds}
        yield size, plain, resm, values_steps(plain, resm)


def values_verdict(data: dict) -> list[str]:
    """The goal, decided per size at `decisive_step`: ResM >= 2x plain's bits at equal steps (training template, every
    seed's pair), step time <= 1.3x (the interleaved timing), where plain recalls under half, >= 500 people, held-out
    no worse, 3 seeds."""
    speed = data.get("minilm_speed")
    lines = []
    for size, plain, resm, steps in values_pairs(data):
        seeds = sorted(plain)
        if not steps:
            continue
        step = decisive_step(plain, steps)
        point = lambda run: values_points(run)[step]  # noqa: E731
        ratios = [point(resm[s])["train"] / point(plain[s])["train"] for s in seeds if point(plain[s])["train"]]
        plain_recall = statistics.fmean(point(run)["train_recall"] for run in plain.values())
        held = [point(resm[s])["heldout"] >= point(plain[s])["heldout"] for s in seeds]
        checks = {
            ">= 500 people": size >= 500,
            "3 seeds": len(seeds) >= 3,
            f"plain recalls under half ({plain_recall:.2f})": plain_recall < 0.5,
            f"ResM >= 2x plain's bits in every seed ({', '.join(f'{r:.2f}x' for r in ratios)})": bool(ratios) and min(ratios) >= 2,
            f"step time <= 1.3x ({speed['ratio']:.2f}x)" if speed else "step time <= 1.3x (not timed)": bool(speed) and speed["ratio"] <= 1.3,
            "held-out no worse in every seed": bool(held) and all(held),
        }  # fmt: skip
        met = all(checks.values())
        lines.append(f"- {size} people: **{'met' if met else 'not met'}** at step {step:,}: "
                     + "; ".join(f"{'✓' if ok else '✗'} {name}" for name, ok in checks.items()) + ".")  # fmt: skip
    return lines


def values_curve_lines(data: dict, labels: dict) -> list[str]:
    """Recall and the paired bits ratio at every step measured in every seed of both arms (each at its tuned rates)."""
    rows = []
    for size, plain, resm, steps in values_pairs(data):
        decisive = decisive_step(plain, steps) if steps else None
        for step in steps:
            at = lambda run, key: values_points(run)[step][key]  # noqa: E731
            rows.append(
                f"| {size:,} | {step:,} | {len(plain)} | "
                + " | ".join(f"{_cell(list(arm.values()), lambda r: at(r, 'train_recall'))} / "
                             f"{_cell(list(arm.values()), lambda r: at(r, 'heldout_recall'))}" for arm in (plain, resm))
                + f" | {_paired_ratio(resm, plain, lambda r: at(r, 'train'))} | {_paired_ratio(resm, plain, lambda r: at(r, 'heldout'))} |"
                + (" decisive |" if step == decisive else " |")
            )  # fmt: skip
    if not rows:
        return []
    return ["Along the training (each arm at its tuned rates; recall: greedy, mean ± standard deviation over seeds; bits: "
            "ResM / plain seed by seed, mean (min-max); the decisive step: the last where plain recalls under half):", "",
            f"| people | step | seeds | {labels['minilm_plain']} recall train / held-out | {labels['minilm_resm']} recall "
            "train / held-out | bits train ResM / plain | bits held-out ResM / plain | |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]  # fmt: skip


def values_lines(data: dict, labels: dict, folder: Path | None = None, report_dir: Path | None = None) -> list[str]:
    """The section of the value-masking pretrained regime: setup, tuning, results by size, curves, step time, verdict;
    its figure written in `folder` and linked from `report_dir` (default: the same folder)."""
    runs = [r for r in data["runs"].values() if r["arm"] in VALUES_ARMS and r.get("masking") == "values"]
    if not runs:
        return []
    steps = sorted({r["steps"] for r in runs})
    sizes = sorted({r["size"] for r in runs})
    batch = data.get("minilm_speed", {}).get("batch", [32])[0]
    sample = sorted({r.get("measured_people") for r in runs} - {None})
    exposures = ", ".join(f"{s * batch / (n * 5):.1f} times at {n:,} people" for n in sizes for s in steps[-1:])
    lines = [
        "## Value masking: the pretrained regime (all-MiniLM-L6-v2 +Init, plain against ResM)", "",
        "Every value is masked (shown as [MASK]) in every exposure, the other tokens at 15% (`run_mlm.py --span_column`), "
        f"a fact a line: {'/'.join(map(str, steps))} steps of {batch} lines supervise each fact about {exposures}. "
        "ResM: memories at layers 2 and 4 (128² slots, values from zero, their own Adam). Recall: greedy (every value "
        "token predicted) and ranked (the true value scores first among all the attribute's values, each with its own "
        "number of masks: blind to the answer's length); bits = log2 |values| summed over recalled facts (greedy). "
        + (f"Measured on the first {', '.join(map(str, sample))} people of every base (the same facts for every run and "
           "checkpoint)." if sample else ""), "",
        "```",
        data.get("command", "python benchmarks/knowledge_capacity.py --masking values --stages minilm minilm_speed "
                 "--results benchmarks/results/knowledge_capacity/knowledge_capacity_values.json"),
        "```", "",
    ]  # fmt: skip
    tuning = {key: entry for key, entry in data.get("tuning", {}).items() if key.split("/")[0] in VALUES_ARMS}
    tuned = {key.split("/")[0] for key in tuning}
    # a probe: every rate of every arm at one point (--minilm_set), so nothing was tuned
    probe = bool(tuning) and all(len(grid) < 2 for entry in tuning.values() for grid in entry["grids"].values())
    if tuned != set(VALUES_ARMS):
        lines += [f"**Status: the tuning has not finished ({len(runs)} runs; tuned: {', '.join(sorted(tuned)) or 'none'}). "
                  "The rows below are each arm's best so far at the sweep's size, seed 0; the verdict waits for the plan.**", ""]  # fmt: skip
    elif probe:
        rates = "; ".join(f"{labels[key.split('/')[0]]} {rates_label(entry['best'])}" for key, entry in sorted(tuning.items()))
        lines += [f"**Status: a probe, each rate at one point ({rates}), {len({r['seed'] for r in runs})} seed(s): not tuned. "
                  "The verdict waits for the plan's grids and seeds; the command above continues it (the probe's runs are "
                  "its grids' middles).**", ""]  # fmt: skip
    if data.get("history"):
        lines += ["Earlier tries of this plan:", "", *[f"- {entry}" for entry in data["history"]], ""]
    lines += tuning_lines({"runs": {k: r for k, r in data["runs"].items() if r["arm"] in VALUES_ARMS},
                           "tuning": data.get("tuning", {})}, labels)[2:]  # fmt: skip
    if tuned != set(VALUES_ARMS):  # every run so far, each arm's rates side by side
        lines += ["Every run so far (seed 0):", "", "| arm | rates | people | recall train / held-out | ranked recall train / held-out | bits train |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for run in sorted(runs, key=lambda r: (r["arm"], r["size"], r["lr"], r.get("memory_lr") or 0)):
            rates = rates_label({"lr": run["lr"], **({"memory_lr": run["memory_lr"]} if run["arm"] == "minilm_resm" else {})})
            f = run["final"]
            lines.append(f"| {labels[run['arm']]} | {rates} | {run['size']:,} | {f['train']['recall']:.3f} / {f['heldout']['recall']:.3f} | "
                         f"{f['train'].get('ranked_recall', float('nan')):.3f} / {f['heldout'].get('ranked_recall', float('nan')):.3f} | "
                         f"{f['train']['bits']:,.0f} |")  # fmt: skip
        lines.append("")
    chosen = values_chosen(data)
    chance = [statistics.fmean(a["chance"] for a in r["final"]["train"]["attributes"].values()) for r in runs
              if r["final"]["train"].get("attributes") and all("chance" in a for a in r["final"]["train"]["attributes"].values())]  # fmt: skip
    if chance:
        lines += [f"Chance (a uniform guess of each value, averaged over the five attributes): {chance[0]:.3f} of the facts.", ""]
    lines += ["Each arm at its tuned rates; mean ± standard deviation over seeds; ResM / plain seed by seed, mean (min-max):", "",
              "| people | arm | seeds | recall train / held-out | ranked recall train / held-out | bits train (sample) | bits held-out (sample) |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for size in sizes:
        for arm in VALUES_ARMS:
            found = list(chosen[arm].get(size, {}).values())
            if not found:
                continue
            lines.append(
                f"| {size:,} | {labels[arm]} | {len(found)} | {_cell(found, lambda r: r['final']['train']['recall'])} / "
                f"{_cell(found, lambda r: r['final']['heldout']['recall'])} | "
                f"{_cell(found, lambda r: r['final']['train'].get('ranked_recall', float('nan')))} / "
                f"{_cell(found, lambda r: r['final']['heldout'].get('ranked_recall', float('nan')))} | "
                f"{_cell(found, lambda r: r['final']['train']['bits'], 0)} | {_cell(found, lambda r: r['final']['heldout']['bits'], 0)} |"
            )  # fmt: skip
        plain, resm = chosen["minilm_plain"].get(size, {}), chosen["minilm_resm"].get(size, {})
        if plain and resm:
            lines.append(f"| {size:,} | ResM / plain | {len(set(plain) & set(resm))} | | | "
                         f"{_paired_ratio(resm, plain, lambda r: r['final']['train']['bits'])} | "
                         f"{_paired_ratio(resm, plain, lambda r: r['final']['heldout']['bits'])} |")  # fmt: skip
    lines.append("")
    lines += values_curve_lines(data, labels)
    speed = data.get("minilm_speed")
    if speed:
        s = speed["seconds"]
        lines += ["Training step (forward, backward, Adam; one thread; the two arms interleaved round by round in one process, "
                  f"{s['minilm_plain']['steps']} steps each; batch {speed['batch'][0]} x {speed['batch'][1]} tokens; "
                  f"{speed['machine']['cpu']}, {speed['machine']['cores']} cores, load {speed['machine'].get('load_before', '?')} "
                  f"before, {speed['machine']['load']} after):", "",
                  "| arm | median ms (quartiles) |", "|---|---|",
                  *[f"| {labels[a]} | {s[a]['median'] * 1e3:.0f} ({s[a]['q1'] * 1e3:.0f}-{s[a]['q3'] * 1e3:.0f}) |" for a in VALUES_ARMS],
                  f"| ResM / plain | {speed['ratio']:.2f}x |", ""]  # fmt: skip
    lines += ["### Verdict", "",
              "The goal: ResM-MiniLM >= 2x plain MiniLM's bits at equal steps and <= 1.3x its step time, where plain recalls "
              "under half of the facts, at >= 500 people, held-out no worse, 3 seeds.", "",
              *(values_verdict(data) if tuned == set(VALUES_ARMS) and not probe else
                ["- Not decided: the plan has not finished.",
                 *(f"  - where the probe stands: {line[2:]}" for line in (values_verdict(data) if probe else []))]), ""]  # fmt: skip
    if folder is not None:
        name = values_figure(data, labels, folder)
        if name:
            lines += [f"![{name}]({os.path.relpath(folder / name, report_dir or folder)})", ""]
    loads = [r["load"] for r in runs if "load" in r]
    if loads:
        lines += [f"Machine load (1-minute average) when these runs finished: {min(loads):.1f}–{max(loads):.1f} "
                  "(runs trained two at a time, one thread each).", ""]  # fmt: skip
    return lines


def values_figure(data: dict, labels: dict, folder: Path, name: str = "knowledge_capacity_values.png") -> str | None:
    """Bits against steps and against training time (steps x the interleaved step time), each arm at its tuned rates,
    mean over seeds with the seeds' range, one line a size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen, speed = values_chosen(data), data.get("minilm_speed")
    if not any(chosen.values()):
        return None
    figure, axes = plt.subplots(1, 3 if speed else 2, figsize=(15 if speed else 10, 4.2))
    styles = {n: style for n, style in zip(sorted({n for arm in chosen.values() for n in arm}), ("-", "--", ":", "-."))}
    for arm, color in zip(VALUES_ARMS, ("C0", "C1")):
        for size, by_seed in sorted(chosen[arm].items()):
            curves = []
            for run in by_seed.values():
                points = sorted((int(step), point) for step, point in run["curve"].items())
                curves.append([(0, {"train": 0.0, "heldout": 0.0})] + points if points and points[-1][0] == run["steps"]
                              else [(0, {"train": 0.0, "heldout": 0.0}), *points, (run["steps"], {s: run["final"][s]["bits"] for s in ("train", "heldout")})])  # fmt: skip
            steps = [step for step, _ in curves[0]]
            if any([step for step, _ in c] != steps for c in curves):
                continue
            for axis, split in zip(axes[:2], ("train", "heldout")):
                values = [[c[i][1][split] for c in curves] for i in range(len(steps))]
                mean = [statistics.fmean(v) for v in values]
                axis.plot(steps, mean, styles[size], color=color, marker="o", label=f"{labels[arm]}, {size:,} people")
                axis.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.15)
            if speed:
                seconds = speed["seconds"][arm]["median"]
                mean = [statistics.fmean(c[i][1]["train"] for c in curves) for i in range(len(steps))]
                axes[2].plot([step * seconds / 60 for step in steps], mean, styles[size], color=color, marker="o",
                             label=f"{labels[arm]}, {size:,} people")  # fmt: skip
    axes[0].set(xlabel="training steps", ylabel="stored bits (sample)", title="training template")
    axes[1].set(xlabel="training steps", ylabel="stored bits (sample)", title="held-out template")
    if speed:
        axes[2].set(xlabel="minutes on one thread (steps x interleaved step time)", ylabel="stored bits (sample)",
                    title="training template, against time")  # fmt: skip
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(figure, plt, folder, name)
