"""The memory report: what a model's product key memories do, in figures and one markdown file.

Per memory layer, on held-out text (and, for a classification task, its labelled examples):

* slot usage as heat maps over the `n_keys x n_keys` grid of product keys (log colour scale), top-1 and weighted;
* the sorted usage curve (share of slots vs share of lookups) with MU, top-1 MU, KL_u, KL_w and Gini in the legend;
* per-class top-1 usage and the IOU / KL between the two classes (Kim & Jung 2020, Figure 4);

and from a training run's output directory:

* the staleness histogram (Figure 2: slots by the step range of their last top-1 pick), from `staleness.safetensors`
  or the newest `step_N` / `epoch_N` checkpoint;
* the training curves (Figure 3: loss, and perplexity per validation set) from `metrics.jsonl`.

Every number is computed by `memory_usage.MemoryUsageTracker` / `class_usage.PerClassMemoryUsage` (the metrics the
scripts log); this module only counts through them and draws. The report is written into a temporary folder beside
`output_dir` and renamed into place when complete, so a failure leaves no half-written report.
"""

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..hub.conversion import replace_folder, staging_folder
from ..utils.input_errors import InputError
from ..utils.memories import memory_modules, ngram_memory_modules
from ..utils.output_folders import check_output_folder, mark_output_folder, model_folder
from ..utils.positions import sequence_length
from .class_usage import PerClassMemoryUsage
from .figures import plot_class_usage, plot_slot_heatmaps, plot_staleness, plot_training_curves, plot_usage_curve
from .memory_usage import MemoryUsageTracker
from .ngram_usage import NgramUsageTracker, ngram_report_lines, plot_ngram_usage
from .metrics_log import METRICS_LOG_NAME, read_metrics_log


TOOL = "memory_report"  # its output folders hold the marker `.memory_report` (`utils.output_folders`)
REPORT_NAME = "memory_report.md"
DEFAULT_SEQUENCE_LENGTH = 128
STALENESS_FILE = "staleness.safetensors"
CHECKPOINT_DIR = re.compile(r"^(step|epoch)_(\d+)$")


class MemoryReportError(InputError):
    """Input the memory report cannot use: it names what is missing."""


def sequence_length_of(model, max_seq_length: int | None = None, error: type[Exception] = MemoryReportError) -> int:
    """The report's (and the explorer's) tokens per sequence: `max_seq_length`, by default 128 capped at the model's
    positions (`utils.positions.sequence_length`); `error` where a given length exceeds them."""
    return sequence_length(getattr(model, "config", None), max_seq_length, DEFAULT_SEQUENCE_LENGTH, "max_seq_length", error)


@dataclass
class ClassData:
    """Labelled, tokenized examples for the per-class usage: rows with `input_ids`, `labels` (class ids) and optionally
    `attention_mask` / `token_type_ids` (e.g. run_glue.py's processed evaluation set); `label_names` in id order, None
    for a regression task (then the examples only count towards the overall usage)."""

    dataset: Sequence
    label_names: list[str] | None = None


# ---- data ----


def read_texts(path: str) -> list[str]:
    """The text of a .txt/.raw/.tokens file (one string), or the text column of a csv/tsv/json(l) file."""
    if not os.path.isfile(path):
        raise MemoryReportError(f"validation file {path!r} does not exist")
    extension = path.rsplit(".", 1)[-1].lower()
    if extension in ("txt", "text", "raw", "tokens"):
        with open(path, encoding="utf-8") as handle:
            return [handle.read()]
    if extension not in ("csv", "tsv", "json", "jsonl"):
        raise MemoryReportError(f"validation file {path!r}: expected txt, raw, tokens, csv, tsv, json or jsonl")
    import datasets

    kwargs = {"delimiter": "\t"} if extension == "tsv" else {}
    builder = "csv" if extension in ("csv", "tsv") else "json"
    dataset = datasets.load_dataset(builder, data_files={"validation": path}, split="validation", **kwargs)
    columns = [c for c in dataset.column_names if c in ("text", "sentence", "context")] or [
        c for c in dataset.column_names if dataset.features[c].dtype in ("string", "large_string")
    ]
    if not columns:
        raise MemoryReportError(f"validation file {path!r} has no text column (columns: {dataset.column_names})")
    return [text for text in dataset[columns[0]] if text]


def text_sequences(tokenizer, texts: Sequence[str], max_seq_length: int, max_sequences: int | None) -> list[dict]:
    """The texts tokenized, concatenated and cut into full sequences of `max_seq_length` tokens ([CLS] ... [SEP])."""
    if max_seq_length < 3:
        raise MemoryReportError(f"max_seq_length={max_seq_length} must be >= 3")
    special = tokenizer("", add_special_tokens=True)["input_ids"]  # BERT: [CLS] [SEP]
    prefix, suffix = special[:1], special[1:]
    body = max_seq_length - len(special)
    ids = [i for text in texts for i in tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]]
    if len(ids) < body:
        raise MemoryReportError(
            f"the validation text has {len(ids)} tokens, too short for one sequence of {max_seq_length} tokens "
            f"({body} without special tokens): give a longer text or a smaller max_seq_length"
        )
    count = len(ids) // body if max_sequences is None else min(len(ids) // body, max_sequences)
    return [
        {"input_ids": prefix + ids[i * body : (i + 1) * body] + suffix} for i in range(count)
    ]


def model_batches(tokenizer, rows: Sequence[dict], batch_size: int, device):
    """`(padded batch on device, labels or None)` of `batch_size` rows at a time (the report's and the explorer's)."""
    for start in range(0, len(rows), batch_size):
        chunk = [dict(row) for row in rows[start : start + batch_size]] if not hasattr(rows, "select") else list(
            rows.select(range(start, min(start + batch_size, len(rows))))
        )
        labels = [row.pop("labels", None) for row in chunk]
        keys = ("input_ids", "attention_mask", "token_type_ids")
        features = [{k: v for k, v in row.items() if k in keys} for row in chunk]
        batch = tokenizer.pad(features, return_tensors="pt")
        labels = torch.tensor(labels) if labels[0] is not None else None
        yield {k: v.to(device) for k, v in batch.items()}, labels


@torch.no_grad()
def measure_usage(
    model: nn.Module,
    tokenizer,
    sequences: Sequence[dict] | None,
    class_data: ClassData | None,
    batch_size: int = 8,
    ngram_tracker: NgramUsageTracker | None = None,
):
    """Runs the model (eval mode) over `sequences` and `class_data`; returns (MemoryUsageTracker, PerClassMemoryUsage
    or None). The overall usage counts `sequences` when given, else the class examples; so does `ngram_tracker`
    (the n-gram memories), when given."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tracker = MemoryUsageTracker(model)
    per_class = None
    try:
        if sequences is not None:
            with tracker, ngram_tracker or contextlib.nullcontext():
                for batch, _ in model_batches(tokenizer, sequences, batch_size, device):
                    model(**batch)
        if class_data is not None:
            classes = class_data.label_names
            per_class = PerClassMemoryUsage(model, len(classes)) if classes else None
            if sequences is None:
                tracker.attach()
                if ngram_tracker is not None:
                    ngram_tracker.attach()
            if per_class is not None:
                per_class.attach()
            try:
                for batch, labels in model_batches(tokenizer, class_data.dataset, batch_size, device):
                    if per_class is not None:
                        if labels is None:
                            raise MemoryReportError("the class examples have no 'labels': per-class usage needs them")
                        per_class.set_batch(labels, batch.get("attention_mask"), batch["input_ids"].shape[-1])
                    model(**batch)
            finally:
                tracker.detach()
                if ngram_tracker is not None:
                    ngram_tracker.detach()
                if per_class is not None:
                    per_class.detach()
    finally:
        model.train(was_training)
    return tracker, per_class


# ---- run directory: staleness and metrics log ----


def _checkpoints(run_dir: str) -> list[tuple[int, str]]:
    found = []
    for name in os.listdir(run_dir):
        match = CHECKPOINT_DIR.match(name)
        if match and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(match.group(2)), name))
    return sorted(found)


def load_staleness(run_dir: str) -> tuple[dict[str, torch.Tensor], int, list[int]] | None:
    """`({layer: last top-1 step per slot}, final step, checkpoint steps)` of a run, or None when it has none.

    From `staleness.safetensors` (run_mlm.py --track_staleness) or else the newest `step_N` checkpoint that holds the
    tracker's state (`custom_checkpoint_0.pkl`, read with `weights_only=True`). The checkpoint steps are the bin edges
    of Figure 2 (the paper: 5 checkpoints)."""
    checkpoints = _checkpoints(run_dir)
    steps = [step for step, name in checkpoints if name.startswith("step_")]
    path = os.path.join(run_dir, STALENESS_FILE)
    if os.path.isfile(path):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, "pt") as handle:
            metadata = handle.metadata() or {}
        state = load_file(path)
        final = int(metadata.get("step", max((int(t.max()) for t in state.values()), default=0)))
        return state, final, steps
    for step, name in reversed(checkpoints):
        pickle_path = os.path.join(run_dir, name, "custom_checkpoint_0.pkl")
        if name.startswith("step_") and os.path.isfile(pickle_path):
            state = torch.load(pickle_path, weights_only=True, map_location="cpu")
            if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
                return state, step, [s for s in steps if s <= step]
    return None


def staleness_histogram(state: dict[str, torch.Tensor], final_step: int, checkpoint_steps: Sequence[int], bins: int = 5):
    """Per layer, the number of slots whose last top-1 pick falls in each step range (edges: the checkpoint steps
    when the run saved any, else `bins` equal ranges of 1..final_step), and `never`; plus the range labels."""
    edges = sorted({s for s in checkpoint_steps if 0 < s < final_step} | {final_step})
    if len(edges) < 2:
        bins = max(1, min(bins, final_step)) if final_step > 0 else 1
        edges = [round(final_step * i / bins) for i in range(1, bins + 1)]
    bounds = list(zip([0, *edges[:-1]], edges))
    labels = [f"{low + 1}-{high}" for low, high in bounds]
    counts = {}
    for layer, last in state.items():
        last = last.cpu()
        counts[layer] = {"never": int((last < 0).sum())}
        for label, (low, high) in zip(labels, bounds):
            counts[layer][label] = int(((last > low) & (last <= high)).sum())
    return counts, labels


def check_run_dir(run_dir: str) -> dict:
    """What a run directory offers the report: `{"records": [...] or None, "staleness": (...) or None}`.

    Raises:
        MemoryReportError: When it does not exist or holds neither a metrics log nor staleness state.
    """
    if not os.path.isdir(run_dir):
        raise MemoryReportError(f"--run_dir {run_dir!r} is not a directory")
    records = read_metrics_log(run_dir) if os.path.isfile(os.path.join(run_dir, METRICS_LOG_NAME)) else None
    staleness = load_staleness(run_dir)
    if records is None and staleness is None:
        raise MemoryReportError(
            f"--run_dir {run_dir!r} holds neither a metrics log ({METRICS_LOG_NAME}, written by run_mlm.py / "
            f"run_glue.py / run_squad.py) nor staleness state ({STALENESS_FILE} or a step_N checkpoint of a run with "
            "--track_staleness): nothing to draw from it"
        )
    return {"records": records, "staleness": staleness}


# ---- the report ----


def _layer_table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| layer | tokens | MU (%) | top-1 MU (%) | KL_u | KL_w | Gini_u | Gini_w | top50_w | top90_w |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layer, m in results.items():
        lines.append(
            f"| {layer} | {int(m['tokens'])} | {100 * m['mu']:.2f} | {100 * m['top1_mu']:.2f} | {m['kl_u']:.4f} | "
            f"{m['kl_w']:.4f} | {m['gini_u']:.4f} | {m['gini_w']:.4f} | {int(m['top50_w'])} | {int(m['top90_w'])} |"
        )
    return lines


def check_reportable(model: nn.Module) -> None:
    """MemoryReportError where `model` has no memory to report (neither product key nor hashed n-gram)."""
    if not memory_modules(model) and not MemoryUsageTracker(model).memories and not ngram_memory_modules(model):
        raise MemoryReportError(
            f"the model ({type(model).__name__}) has no product key memory layer and no n-gram memory: nothing to "
            "report (a plain BERT, or a BertPkm config with pkm_layers=[] and no ngram_layers)"
        )


def write_memory_report(
    model: nn.Module,
    tokenizer,
    output_dir: str,
    *,
    texts: Sequence[str] | None = None,
    class_data: ClassData | None = None,
    run_dir: str | None = None,
    max_seq_length: int | None = None,
    max_sequences: int | None = 64,
    batch_size: int = 8,
    title: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Writes `output_dir/memory_report.md`, its PNG figures and `memory_report.json` (every number); returns that
    json's content. `output_dir` is new, empty or an earlier report's (its marker file `.memory_report`), any other
    folder only with `overwrite`; never the model's own folder, the run directory or a folder containing them
    (`utils.output_folders`).

    Args:
        model: Any model holding product key memories (BertPkm or loaded with `trust_remote_code=True`).
        tokenizer: Its tokenizer.
        texts: Held-out text: cut into `max_sequences` sequences of `max_seq_length` tokens for the usage figures
            (default: 128, at most the model's positions).
        class_data: Labelled examples: the per-class usage (Figure 4); also the overall usage when `texts` is None.
        run_dir: A training output folder: staleness (Figure 2) and training curves (Figure 3).

    Raises:
        MemoryReportError: The model has no memory; no data was given; the text is shorter than one sequence or
            `max_seq_length` longer than the model's positions; the examples have no labels; the run directory has
            neither a metrics log nor staleness state.
        OutputFolderError: `output_dir` may not be written (why: the message).
    """
    reads = {"the model's folder": model_folder(model), "the run directory": run_dir}
    check_output_folder(output_dir, TOOL, overwrite=overwrite, reads=reads, option="output_dir",
                        overwrite_option="overwrite=True")  # fmt: skip
    check_reportable(model)
    if texts is None and class_data is None:
        raise MemoryReportError("the memory report needs data: a validation text or labelled class examples")
    run = check_run_dir(run_dir) if run_dir is not None else None
    max_seq_length = sequence_length_of(model, max_seq_length)
    sequences = text_sequences(tokenizer, texts, max_seq_length, max_sequences) if texts is not None else None
    if class_data is not None and len(class_data.dataset) == 0:
        raise MemoryReportError("the class examples are empty")

    ngram = NgramUsageTracker(model)  # the n-gram memories, counted in the same forward passes
    tracker, per_class = measure_usage(model, tokenizer, sequences, class_data, batch_size, ngram_tracker=ngram)
    usage = tracker.results()
    class_results = per_class.results(class_data.label_names) if per_class is not None else None

    output_dir = Path(output_dir).absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output_dir)
    try:
        report = _write_report_files(str(staging), tracker, usage, per_class, class_results, class_data, run,
                                     sequences, max_seq_length, title or "Memory report", ngram.results())
        mark_output_folder(staging, TOOL)
        replace_folder(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _write_report_files(
    folder, tracker, usage, per_class, class_results, class_data, run, sequences, max_seq_length, title, ngram_usage=None
):
    lines = [f"# {title}", ""]
    if sequences is not None:
        lines.append(
            f"Usage measured on {len(sequences)} held-out sequences of {max_seq_length} tokens "
            "(every real token counts; the model in eval mode). Metrics as in `modeling_pkm_bert.analysis.memory_usage`: "
            "MU = share of slots selected at least once in a top-k, top-1 MU = share that were some token's top-1 "
            "pick, KL_u / KL_w = KL divergence from uniform use of the selection counts / weights (nats), Gini of them."
        )
    else:
        lines.append(f"Usage measured on {len(class_data.dataset)} labelled examples (the model in eval mode).")
    lines += [
        "",
        "What the slots hold (the contexts that select each slot, the tokens its value promotes, a search): the memory "
        "explorer, `python run_scripts/memory_explorer.py --model_name_or_path <model> --output_dir <folder>` "
        "(docs/memory_explorer.md), for the same texts with the same numbers.",
    ]
    lines += ["", "## Usage per memory layer", "", *_layer_table(usage), ""] if usage else [""]
    report = {"usage": usage}
    for layer, accumulator in tracker.accumulators.items():
        memory = tracker.memories[layer]
        n_keys = getattr(memory, "n_keys", None) or math.isqrt(accumulator.mem_size)
        heat = plot_slot_heatmaps(accumulator, n_keys, layer, os.path.join(folder, f"{layer}_heatmap.png"))
        curve = plot_usage_curve(accumulator, usage[layer], layer, os.path.join(folder, f"{layer}_usage_curve.png"))
        lines += [
            f"### {layer}",
            "",
            f"![{layer}: slot usage heat maps]({os.path.basename(heat)})",
            "",
            f"![{layer}: sorted usage curve]({os.path.basename(curve)})",
            "",
        ]
    if ngram_usage:
        report["ngram_usage"] = ngram_usage
        figures = {
            layer: os.path.basename(plot_ngram_usage(layer, m, os.path.join(folder, f"{layer}_ngram.png")))
            for layer, m in ngram_usage.items()
        }
        lines += ngram_report_lines(ngram_usage, figures)
    if per_class is not None and class_results:
        names = class_data.label_names
        report["class_usage"] = class_results
        lines += ["## Per-class usage (Figure 4)", ""]
        lines += [
            f"{len(class_data.dataset)} labelled examples; classes {', '.join(f'{i}={n}' for i, n in enumerate(names))}."
            " IOU and KL compare the top-1 usage of class 1 with class 0 (`class_usage.class_usage_divergence`; "
            "KL on add-1/|K| smoothed distributions).",
            "",
        ]
        header = ["layer", *[f"top-1 MU {n} (%)" for n in names]]
        two = all("top1_kl" in m for m in class_results.values())
        if two:
            header += ["top-1 KL", "top-1 IOU", "weight KL", "weight IOU"]
        lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for layer, m in class_results.items():
            cells = [f"{100 * m[f'top1_mu_{n}']:.2f}" if f"top1_mu_{n}" in m else "-" for n in names]
            if two:
                cells += [f"{m['top1_kl']:.4f}", f"{m['top1_iou']:.4f}", f"{m['weight_kl']:.4f}", f"{m['weight_iou']:.4f}"]
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        figure = plot_class_usage(class_results, names, os.path.join(folder, "class_usage.png"),
                                  "Per-class top-1 memory usage (Figure 4)")
        lines += ["", f"![per-class usage]({os.path.basename(figure)})", ""]
    if run is not None:
        lines += ["## Training run", ""]
        if run["staleness"] is not None:
            state, final, steps = run["staleness"]
            histogram, labels = staleness_histogram(state, final, steps)
            report["staleness"] = {"final_step": final, "histogram": histogram}
            figure = plot_staleness(
                {"": histogram}, labels, os.path.join(folder, "staleness.png"),
                f"Staleness (Figure 2): slots by their last top-1 pick, {final} training steps",
            )
            lines += ["### Staleness (Figure 2)", "", "| layer | never | " + " | ".join(f"steps {l}" for l in labels) + " |",
                      "|---|" + "---:|" * (len(labels) + 1)]
            for layer, counts in histogram.items():
                lines.append(f"| {layer} | {counts['never']} | " + " | ".join(str(counts[l]) for l in labels) + " |")
            lines += ["", f"![staleness]({os.path.basename(figure)})", ""]
        else:
            lines += ["No staleness state in the run directory (train with `--track_staleness`).", ""]
        if run["records"] is not None:
            figure = plot_training_curves({"run": run["records"]}, os.path.join(folder, "training_curves.png"),
                                          "Training curves (Figure 3)")
            report["training_log_records"] = len(run["records"])
            lines += ["### Training curves (Figure 3)", "", f"![training curves]({os.path.basename(figure)})", ""]
        else:
            lines += [f"No {METRICS_LOG_NAME} in the run directory: no training curves.", ""]
    with open(os.path.join(folder, "memory_report.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    with open(os.path.join(folder, REPORT_NAME), "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    return report


def write_run_memory_report(
    args, model, tokenizer, validation_file=None, texts=None, class_data=None, max_seq_length: int | None = None
) -> dict:
    """The scripts' `--memory_report`: the report of the final model into `<output_dir>/memory_report`, with the run's
    staleness and training curves; sequences of `max_seq_length` tokens (default: the script's `--max_seq_length` or
    `--max_length`, else 128 capped at the model's positions). The report's folder is replaced whatever it holds: it
    lies in the run's output folder, which the script checked before training (`utils.output_folders`)."""
    if texts is None and validation_file is not None:
        texts = read_texts(validation_file)
    max_length = max_seq_length or getattr(args, "max_seq_length", None) or getattr(args, "max_length", None)
    return write_memory_report(
        model,
        tokenizer,
        os.path.join(args.output_dir, "memory_report"),
        texts=texts,
        class_data=class_data,
        run_dir=args.output_dir,
        max_seq_length=max_length,
        max_sequences=args.memory_report_max_sequences,
        title=f"Memory report of {os.path.basename(os.path.abspath(args.output_dir))}",
        overwrite=True,
    )
