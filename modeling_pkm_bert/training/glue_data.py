"""The GLUE tasks: their columns and labels as on the Hub (`nyu-mll/glue`), readers of GLUE's own TSV files, and the
labelled examples of a GLUE TSV (or any labelled file) for the memory report's per-class usage.

`load_raw_datasets` (for `run_scripts/run_glue.py`) gets every task into one shape, whatever the source (the Hub,
GLUE's TSV files, csv/json files): the Hub dataset's column names (`task.sentence_keys`) and a `label` column holding
the Hub's class ids (`task.label_names` gives their order; a float score for STS-B). The TSV reader turns the files of GLUE's `download_glue_data.py` into that shape:

| task | file layout (train.tsv / dev.tsv) | label |
|---|---|---|
| cola | no header; source, label, original mark, sentence (4 columns) | 0 unacceptable, 1 acceptable |
| sst2 | header `sentence  label` | 0 negative, 1 positive |
| mrpc | header `Quality  #1 ID  #2 ID  #1 String  #2 String`, UTF-8 byte-order mark | Quality: 0/1 |
| qqp | header `id  qid1  qid2  question1  question2  is_duplicate` | is_duplicate: 0/1 |
| stsb | header `index genre filename year old_index source1 source2 sentence1 sentence2 score` | score, 0-5 |
| mnli | header `index ... sentence1 sentence2 label1 ... gold_label`; dev_matched/mismatched | gold_label |
| qnli | header `index  question  sentence  label` | entailment/not_entailment |
| rte | header `index  sentence1  sentence2  label` | entailment/not_entailment |
| wnli | header `index  sentence1  sentence2  label` | 0 not_entailment, 1 entailment |

Files are read as tab-separated text without quote handling (`csv.QUOTE_NONE`: RTE and MRPC sentences contain
`"`), as UTF-8 with an optional byte-order mark. Columns are found by header name, so extra columns (MNLI's
label1..label5) do not matter. Rows too short to hold the needed columns are skipped with a warning (the GLUE
processors of transformers skip malformed QQP rows the same way). GLUE's test files (no labels) are not read.
"""

from __future__ import annotations  # `datasets` is imported where it is used: the scripts' --help reads GLUE_TASKS

import csv
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from ..utils.input_errors import InputError


if TYPE_CHECKING:
    import datasets

    from ..analysis.report import ClassData


logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GlueTask:
    name: str
    sentence_keys: tuple[str, str | None]  # the Hub's text columns
    label_names: tuple[str, ...] | None  # class names in the Hub's id order; None: regression
    metrics: tuple[str, ...]  # what `glue_metrics.glue_compute_metrics` returns for the task
    tsv_columns: dict  # Hub column -> TSV header name, or column index when the file has no header
    tsv_label: str | int  # the TSV's label column (header name or index)
    tsv_has_header: bool = True
    validation_splits: tuple[str, ...] = ("validation",)  # Hub split names evaluated, in order

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)


_ENTAILMENT2 = ("entailment", "not_entailment")

GLUE_TASKS = {
    task.name: task
    for task in (
        GlueTask("cola", ("sentence", None), ("unacceptable", "acceptable"), ("matthews_correlation",),
                 {"sentence": 3}, 1, tsv_has_header=False),
        GlueTask("sst2", ("sentence", None), ("negative", "positive"), ("accuracy",),
                 {"sentence": "sentence"}, "label"),
        GlueTask("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("accuracy", "f1"),
                 {"sentence1": "#1 String", "sentence2": "#2 String"}, "Quality"),
        GlueTask("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), ("accuracy", "f1"),
                 {"question1": "question1", "question2": "question2"}, "is_duplicate"),
        GlueTask("stsb", ("sentence1", "sentence2"), None, ("pearson", "spearmanr"),
                 {"sentence1": "sentence1", "sentence2": "sentence2"}, "score"),
        GlueTask("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), ("accuracy",),
                 {"premise": "sentence1", "hypothesis": "sentence2"}, "gold_label",
                 validation_splits=("validation_matched", "validation_mismatched")),
        GlueTask("qnli", ("question", "sentence"), _ENTAILMENT2, ("accuracy",),
                 {"question": "question", "sentence": "sentence"}, "label"),
        GlueTask("rte", ("sentence1", "sentence2"), _ENTAILMENT2, ("accuracy",),
                 {"sentence1": "sentence1", "sentence2": "sentence2"}, "label"),
        GlueTask("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment"), ("accuracy",),
                 {"sentence1": "sentence1", "sentence2": "sentence2"}, "label"),
    )
}  # fmt: skip


def get_glue_task(name: str) -> GlueTask:
    if name not in GLUE_TASKS:
        raise InputError(f"unknown GLUE task {name!r}; expected one of {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[name]


def glue_features(task: GlueTask) -> datasets.Features:
    """The Hub's features of a task (text columns, `label` as ClassLabel or float32, `idx`)."""
    import datasets

    features = {key: datasets.Value("string") for key in task.sentence_keys if key is not None}
    features["label"] = (
        datasets.Value("float32") if task.is_regression else datasets.ClassLabel(names=list(task.label_names))
    )
    features["idx"] = datasets.Value("int32")
    return datasets.Features(features)


def _parse_label(task: GlueTask, text: str, where: str):
    text = text.strip()
    if task.is_regression:
        try:
            return float(text)
        except ValueError:
            raise InputError(f"{where}: the {task.name} score {text!r} is not a number") from None
    if text in task.label_names:
        return task.label_names.index(text)
    if text.isdigit() and int(text) < len(task.label_names):
        return int(text)
    raise InputError(
        f"{where}: label {text!r} is not a {task.name} label (expected one of {list(task.label_names)} "
        f"or their ids 0..{len(task.label_names) - 1})"
    )


def read_glue_tsv(path: str | os.PathLike, task: GlueTask | str) -> dict[str, list]:
    """Reads a GLUE train/dev TSV of `task` into Hub-shaped columns: the task's sentence keys, `label`, `idx`."""
    task = get_glue_task(task) if isinstance(task, str) else task
    wanted = {**task.tsv_columns, "label": task.tsv_label}
    columns = {key: [] for key in wanted}
    columns["idx"] = []
    skipped = []
    with open(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        if task.tsv_has_header:
            header = next(reader, None)
            if header is None:
                raise InputError(f"{path} is empty; expected a {task.name} TSV with a header")
            missing = [name for name in wanted.values() if name not in header]
            if missing:
                raise InputError(
                    f"{path} does not have the GLUE {task.name} layout: header {header} lacks {missing} "
                    f"(expected columns {sorted(wanted.values(), key=str)})"
                )
            positions = {key: header.index(name) for key, name in wanted.items()}
        else:
            positions = dict(wanted)
        needed = max(positions.values()) + 1
        first_line = 2 if task.tsv_has_header else 1
        for line_number, row in enumerate(reader, start=first_line):
            if not row:
                continue
            if len(row) < needed:
                skipped.append(line_number)
                continue
            for key, position in positions.items():
                value = row[position]
                columns[key].append(_parse_label(task, value, f"{path}:{line_number}") if key == "label" else value)
            columns["idx"].append(len(columns["idx"]))
    if not columns["idx"]:
        raise InputError(
            f"{path} holds no {task.name} rows in the GLUE {task.name} layout ({len(skipped)} rows too short)"
        )
    if skipped:
        logger.warning(
            f"{path}: skipped {len(skipped)} malformed rows (first at line {skipped[0]}; fewer than {needed} fields)"
        )
    return columns


def load_glue_tsv(path: str | os.PathLike, task: GlueTask | str) -> datasets.Dataset:
    """`read_glue_tsv` as a `datasets.Dataset` with the Hub's features (so `features["label"].names` works)."""
    import datasets

    task = get_glue_task(task) if isinstance(task, str) else task
    return datasets.Dataset.from_dict(read_glue_tsv(path, task), features=glue_features(task))


def load_raw_datasets(args) -> datasets.DatasetDict:
    """Splits `train`, `validation` (and MNLI's `validation_mismatched`), with a `label` column of class ids/scores.

    With a task, the columns and labels are the Hub's (`task.sentence_keys`, ClassLabel ids in `task.label_names`
    order); without one, as the files have them. `args`: run_glue.py's `task_name`, `train_file`, `validation_file`,
    `validation_mismatched_file`.
    """
    import datasets

    task = get_glue_task(args.task_name) if args.task_name else None
    files = {
        split: path
        for split, path in (
            ("train", args.train_file),
            ("validation", args.validation_file),
            ("validation_mismatched", args.validation_mismatched_file),
        )
        if path is not None
    }
    if task is not None and not files:
        # Downloading and loading a dataset from the hub.
        try:
            raw = datasets.load_dataset("nyu-mll/glue", task.name)
        except Exception as error:  # offline: ConnectionError / LocalEntryNotFoundError / OfflineModeIsEnabled
            raise InputError(
                f"could not load GLUE {task.name} from the Hub (nyu-mll/glue): {type(error).__name__}: {error}. "
                "Offline (HF_HUB_OFFLINE=1, no network) give the task's files instead: --train_file train.tsv "
                "--validation_file dev.tsv (GLUE's own TSV layout)."
            ) from error
        splits = {"train": raw["train"]}
        for split in task.validation_splits:
            splits["validation" if split == "validation_matched" else split] = raw[split]
        return datasets.DatasetDict(splits)

    splits = {}
    for split, path in files.items():
        extension = path.rsplit(".", 1)[-1]
        if task is not None and extension == "tsv":
            splits[split] = load_glue_tsv(path, task)
            continue
        if extension == "tsv":
            dataset = datasets.load_dataset(
                "csv", data_files={split: path}, delimiter="\t", quoting=csv.QUOTE_NONE, split=split
            )
        else:
            dataset = datasets.load_dataset(
                "json" if extension == "jsonl" else extension, data_files={split: path}, split=split
            )
        if "label" not in dataset.column_names:
            raise InputError(
                f"{path} has no 'label' column (columns: {dataset.column_names}); every file needs its gold labels "
                "in a column named 'label'"
            )
        if task is not None:
            dataset = to_task_columns(dataset, task, path)
        splits[split] = dataset
    return datasets.DatasetDict(splits)


def to_task_columns(dataset: datasets.Dataset, task, path: str) -> datasets.Dataset:
    """A csv/json file of a GLUE task: checks the Hub's column names, turns label names into class ids."""
    import datasets
    import numpy as np

    needed = [key for key in task.sentence_keys if key is not None]
    missing = [key for key in needed if key not in dataset.column_names]
    if missing:
        raise InputError(
            f"{path}: GLUE {task.name} needs the columns {needed + ['label']}, missing {missing} "
            f"(columns: {dataset.column_names})"
        )
    if task.is_regression:
        return dataset.cast_column("label", datasets.Value("float32"))
    names = list(task.label_names)

    def label_id(example):
        label = example["label"]
        if isinstance(label, str) and label in names:
            return {"label": names.index(label)}
        if isinstance(label, (int, np.integer)) or (isinstance(label, str) and label.isdigit()):
            if 0 <= int(label) < len(names):
                return {"label": int(label)}
        raise InputError(f"{path}: label {label!r} is not a {task.name} label ({names} or 0..{len(names) - 1})")

    dataset = dataset.map(label_id)
    return dataset.cast_column("label", datasets.ClassLabel(names=names))


# ---- labelled examples for the memory report's per-class usage ----


def class_data_from_files(
    tokenizer, train_file: str, task_name: str | None = None, max_seq_length: int = 128, max_examples: int = 512
) -> ClassData:
    """Labelled examples for the per-class usage: a GLUE TSV of `task_name`, or a csv/tsv/json(l) with a `label`
    column and one or two text columns (`run_scripts/memory_report.py --task_name/--train_file`)."""
    from ..analysis.report import ClassData, MemoryReportError

    if not os.path.isfile(train_file):
        raise MemoryReportError(f"--train_file {train_file!r} does not exist")
    if task_name is not None:
        task = get_glue_task(task_name)
        if task.is_regression:
            raise MemoryReportError(f"task {task_name!r} is a regression task: it has no classes to compare")
        if not train_file.endswith(".tsv"):
            raise MemoryReportError(
                f"--task_name {task_name}: --train_file must be the task's GLUE TSV, got {train_file}"
            )
        dataset = load_glue_tsv(train_file, task)
        keys, label_names = task.sentence_keys, list(task.label_names)
    else:
        import datasets

        extension = train_file.rsplit(".", 1)[-1].lower()
        kwargs = {"delimiter": "\t"} if extension == "tsv" else {}
        builder = "csv" if extension in ("csv", "tsv") else "json"
        dataset = datasets.load_dataset(builder, data_files={"train": train_file}, split="train", **kwargs)
        if "label" not in dataset.column_names:
            raise MemoryReportError(
                f"{train_file} has no 'label' column (columns: {dataset.column_names}): the per-class usage needs "
                "labelled examples"
            )
        texts = [
            c
            for c in dataset.column_names
            if c not in ("label", "idx") and dataset.features[c].dtype in ("string", "large_string")
        ]
        if not texts:
            raise MemoryReportError(f"{train_file} has no text column beside 'label' ({dataset.column_names})")
        keys = (texts[0], texts[1] if len(texts) > 1 else None)
        label_names = sorted({str(label) for label in dataset["label"] if label is not None})
        ids = {name: i for i, name in enumerate(label_names)}
        dataset = dataset.map(lambda row: {"label": ids.get(str(row["label"]), -1)})
    dataset = dataset.select(range(min(max_examples, len(dataset))))
    present = sorted({label for label in dataset["label"] if label is not None and label >= 0})
    if len(present) < 2:
        raise MemoryReportError(
            f"{train_file}: the per-class usage needs labelled examples of at least two classes, found labels "
            f"{[label_names[i] for i in present]} in the first {len(dataset)} examples"
        )
    first, second = keys
    rows = []
    for example in dataset:
        pair = (example[first],) if second is None else (example[first], example[second])
        encoded = tokenizer(*pair, truncation=True, max_length=max_seq_length)
        rows.append({**encoded, "labels": example["label"]})
    return ClassData(rows, label_names)


__all__ = [
    "GLUE_TASKS",
    "GlueTask",
    "class_data_from_files",
    "get_glue_task",
    "glue_features",
    "load_glue_tsv",
    "load_raw_datasets",
    "read_glue_tsv",
]
