"""The text data of the language-modeling scripts (run_mlm.py, run_clm.py): data files checked before anything runs,
`--dataset_name` / `--train_file` / `--validation_files` loaded as datasets with one `text` column, and their
evaluation on every set (`evaluate_language_model`: the script scores a batch, this counts every token once)."""

import contextlib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import datasets
from datasets import load_dataset

from ..utils.input_errors import InputError


TEXT_EXTENSIONS = ("txt", "text", "raw", "tokens")
DATA_EXTENSIONS = (*TEXT_EXTENSIONS, "csv", "json", "jsonl")


def parse_validation_sets(parser, args) -> dict[str, str]:
    """{name: path} of the evaluation files: `NAME=FILE` or `FILE` (named after the file, e.g. `wiki_test`)."""
    specs = args.validation_files or ([args.validation_file] if args.validation_file else [])
    sets = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or os.path.exists(spec):
            name, path = Path(spec).name.rsplit(".", 1)[0] if "." in Path(spec).name else Path(spec).name, spec
        name = re.sub(r"\W+", "_", name).strip("_") or "validation"
        if name in sets:
            parser.error(f"two evaluation sets are named {name!r}: name them with NAME=FILE")
        sets[name] = path
    return sets


def check_language_modeling_arguments(parser, args, embedded_train: Path, embedded_validation: dict, model_types):
    """The data and model flags of `arguments.add_language_modeling_arguments`, checked together before any work
    (`parser.error`). Without data arguments the run uses the embedded excerpt: `embedded_train` and
    `embedded_validation` ({name: path}). Sets `args.embedded_data` and `args.validation_sets` ({name: path})."""
    from .checks import check_data_files

    args.embedded_data = args.dataset_name is None and not any(
        (args.train_file, args.validation_file, args.validation_files)
    )
    if args.validation_file is not None and args.validation_files is not None:
        parser.error("give the evaluation sets either with --validation_file or with --validation_files, not both")
    if args.dataset_name is not None and args.train_file is not None:
        parser.error("give the training data either with --dataset_name or with --train_file, not both")
    args.validation_sets = parse_validation_sets(parser, args)
    if args.embedded_data:
        args.train_file = str(embedded_train)
        args.validation_sets = {name: str(path) for name, path in embedded_validation.items()}
    files = [("--train_file", args.train_file)] + [
        (f"--validation_files {n}", p) for n, p in args.validation_sets.items()
    ]
    for option, path in files:
        if path is not None:
            check_data_file(parser, option, path)
    check_data_files(parser, files)  # UTF-8, well-formed json / csv, before any work
    if args.model_type is not None and args.model_type not in model_types:
        parser.error(f"unknown --model_type {args.model_type!r} (one of {', '.join(sorted(model_types))})")
    if args.model_name_or_path is None and args.config_name is None and args.model_type is None:
        parser.error("give --model_name_or_path, or --config_name / --model_type to train a model from scratch")
    if args.model_name_or_path is None and args.tokenizer_name is None:
        parser.error("training from scratch needs --tokenizer_name (this script does not train tokenizers)")


def check_data_file(parser, option: str, path: str) -> None:
    """A clear error, before any training, for a data file that is missing, empty or of an unknown kind."""
    extension = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if extension not in DATA_EXTENSIONS:
        parser.error(f"{option} {path!r}: expected a {', '.join(DATA_EXTENSIONS)} file")
    if not os.path.isfile(path):
        parser.error(f"{option} {path!r} does not exist")
    with open(path, "rb") as handle:
        if not handle.read(1 << 16).strip():
            parser.error(f"{option} {path!r} is empty")


def load_text_file(
    path: str, split: str, text_column_name: str | None, span_column: str | None = None
) -> datasets.Dataset:
    """One data file as a dataset with a `text` column, and a `spans` column where `span_column` names one the file
    has (salient-span masking: `training.masking`); empty lines dropped."""
    extension = path.rsplit(".", 1)[-1].lower()
    if extension in TEXT_EXTENSIONS:
        dataset = load_dataset("text", data_files={split: path}, split=split)
        column = "text"
    else:
        builder = "json" if extension in ("json", "jsonl") else extension
        dataset = load_dataset(builder, data_files={split: path}, split=split)
        column = text_column(dataset.column_names, text_column_name, path)
    dataset = select_text_and_spans(dataset, column, span_column)
    dataset = dataset.filter(
        lambda texts: [bool(t and t.strip()) for t in texts],
        batched=True,
        input_columns="text",
        desc=f"Dropping empty lines of {split}",
    )
    if len(dataset) == 0:
        raise InputError(f"{path} holds no text (every line of column {column!r} is empty)")
    return dataset


def select_text_and_spans(dataset: datasets.Dataset, column: str, span_column: str | None) -> datasets.Dataset:
    """`dataset` with its text `column` as `text`, and its `span_column` as `spans` where it has that column."""
    columns = {column: "text"}
    if span_column is not None and span_column in dataset.column_names:
        columns[span_column] = "spans"
    dataset = dataset.select_columns(list(columns))
    return dataset.rename_columns({old: new for old, new in columns.items() if old != new})


def text_column(column_names: list[str], requested: str | None, where: str) -> str:
    """The text column: `requested` (which must exist), else `text`, else the only column; else a clear error."""
    if requested is not None:
        if requested not in column_names:
            raise InputError(f"{where} has no column {requested!r} (--text_column_name); its columns: {column_names}")
        return requested
    if "text" in column_names:
        return "text"
    if len(column_names) == 1:
        return column_names[0]
    raise InputError(
        f"{where} has no 'text' column; name the text column with --text_column_name (columns: {column_names})"
    )


def load_raw_datasets(args) -> tuple[datasets.Dataset | None, dict[str, datasets.Dataset]]:
    """(training set or None, {name: evaluation set}), each with one `text` column."""
    train, validation = None, {}
    if args.dataset_name is not None:
        # Downloading and loading a dataset from the hub.
        try:
            raw = load_dataset(args.dataset_name, args.dataset_config_name, trust_remote_code=args.trust_remote_code)
        except Exception as error:  # offline: ConnectionError / LocalEntryNotFoundError / OfflineModeIsEnabled
            raise InputError(
                f"could not load {args.dataset_name!r} from the Hub: {type(error).__name__}: {error}. Offline, give "
                "local files instead: --train_file and --validation_files (txt, csv or json)."
            ) from error
        if "train" not in raw:
            raise InputError(f"{args.dataset_name} has no 'train' split (splits: {list(raw)})")
        column = text_column(raw["train"].column_names, args.text_column_name, args.dataset_name)
        train = raw["train"]
        if not args.validation_sets:
            if "validation" in raw:
                validation["validation"] = raw["validation"]
            else:
                cut = args.validation_split_percentage
                validation["validation"] = load_dataset(
                    args.dataset_name,
                    args.dataset_config_name,
                    split=f"train[:{cut}%]",
                    trust_remote_code=args.trust_remote_code,
                )
                train = load_dataset(
                    args.dataset_name,
                    args.dataset_config_name,
                    split=f"train[{cut}%:]",
                    trust_remote_code=args.trust_remote_code,
                )
        train = select_text_and_spans(train, column, getattr(args, "span_column", None))
        validation = {
            name: select_text_and_spans(dataset, column, getattr(args, "span_column", None)) for name, dataset in validation.items()
        }
    elif args.train_file is not None:
        train = load_text_file(args.train_file, "train", args.text_column_name, getattr(args, "span_column", None))
        if not args.validation_sets:
            cut = len(train) * args.validation_split_percentage // 100
            if cut == 0:
                raise InputError(
                    f"{args.train_file} has too few lines ({len(train)}) to hold out "
                    f"{args.validation_split_percentage}% for validation: give --validation_files"
                )
            validation["validation"] = train.select(range(cut))
            train = train.select(range(cut, len(train)))
    for name, path in args.validation_sets.items():
        validation[name] = load_text_file(path, name, args.text_column_name, getattr(args, "span_column", None))
    check_spans_loaded(args, train, validation)
    return train, validation


def check_spans_loaded(args, train, validation: dict) -> None:
    """With `--span_column`: the training data holds the spans, and an evaluation set without them has random masks
    to score (`--mlm_probability` > 0)."""
    if getattr(args, "span_column", None) is None:
        return
    where = args.dataset_name or args.train_file
    if train is not None and "spans" not in train.column_names:
        raise InputError(f"{where} has no column {args.span_column!r} (--span_column)")
    for name, dataset in validation.items():
        if "spans" not in dataset.column_names and args.mlm_probability == 0:
            raise InputError(
                f"the evaluation set {name!r} has no column {args.span_column!r} (--span_column) and "
                "--mlm_probability is 0: it would have no masked token to score"
            )


def perplexity(loss: float) -> float:
    """exp(loss), inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


def evaluate_language_model(
    accelerator,
    model,
    eval_datasets: dict,
    collate_fn,
    batch_size: int,
    score: Callable,
    trime: bool = False,
    measure_memory_usage: bool = False,
) -> tuple[dict, dict]:
    """Loss and perplexity of every evaluation set (with `trime`, also the TRIME loss and perplexity), and the memory
    usage of every memory layer on the first set: (metrics, {layer: usage}). `score(model, batch)` gives a batch's
    (summed loss, summed TRIME loss, scored tokens); a batch without a scored token is skipped.

    Each process scores its own contiguous shard with the unwrapped model (`training.evaluation`: every example, and
    its memory lookups, counted once; the training random streams untouched); the sums are reduced across processes
    at the end of each set.
    """
    import torch

    from ..analysis.memory_usage import gather, track_memory_usage
    from .evaluation import evaluating, shard_batches
    from ..utils.memories import memory_modules

    metrics, usage = {}, {}
    with evaluating(accelerator, model) as unwrapped:
        for index, (name, dataset) in enumerate(eval_datasets.items()):
            track = measure_memory_usage and index == 0 and memory_modules(unwrapped)
            totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # (loss, TRIME loss, tokens)
            with track_memory_usage(unwrapped) if track else contextlib.nullcontext() as tracker:
                for batch in shard_batches(accelerator, dataset, collate_fn, batch_size):
                    loss, trime_loss, tokens = score(unwrapped, batch)
                    if tokens > 0:
                        totals += torch.stack([loss.double(), trime_loss.double(), tokens.double()])
            totals = accelerator.reduce(totals, reduction="sum")
            metrics[f"eval_{name}_loss"] = (totals[0] / totals[2]).item()
            metrics[f"eval_{name}_perplexity"] = perplexity(metrics[f"eval_{name}_loss"])
            if trime:  # the same positions scored with the TRIME memory
                metrics[f"eval_{name}_trime_loss"] = (totals[1] / totals[2]).item()
                metrics[f"eval_{name}_trime_perplexity"] = perplexity(metrics[f"eval_{name}_trime_loss"])
            if track:
                gather(tracker, accelerator)
                usage = tracker.results()
    return metrics, usage
