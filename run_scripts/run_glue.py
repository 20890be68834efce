#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Fine-tunes a BERT or BertPkm model on a GLUE task (or on your own csv/tsv/json files) with 🤗 Accelerate.

Follows the transformers `run_glue_no_trainer.py` example and adds: the product key memory options (convert a plain
BERT checkpoint on load with any `--pkm_*` flag, the memory values' own optimizer, `--freeze_memory` for the paper's
Table 5), GLUE's own TSV files (`--task_name` + `--train_file train.tsv`), the GLUE metrics computed locally with
scikit-learn and scipy, the memory usage after fine-tuning (Table 6) and, for two-class tasks, the IOU and KL between
the memory usage of the two classes (Figure 4), atomic checkpoints with exact resume, and `all_results.json`.

The defaults are the paper's recipe for GLUE (Kim & Jung 2020, Table 3): learning rate 2e-5, 10 epochs, warm-up
ratio 0.06, weight decay 0.1, max sequence length 128; the memory values train with Adam at a constant 1e-3; results
are the median of 5 seeds (`seed_sweep.py`). The table's batch size is blank in our copy of the paper: the example
uses 32. For ResM-BERT (+Init) from a plain BERT checkpoint (drop the --pkm_* flags for the baseline, add
--freeze_memory for Table 5):

    python run_glue.py --model_name_or_path bert-base-uncased --pkm_layers 4 8 --pkm_mode resm \
        --task_name sst2 --train_file glue_data/SST-2/train.tsv --validation_file glue_data/SST-2/dev.tsv \
        --per_device_train_batch_size 32 --seed 1 --output_dir out/sst2

Data sources:
* `--task_name` alone: the task from the Hub (`nyu-mll/glue`; needs network access).
* `--task_name` with `--train_file/--validation_file`: `.tsv` files in GLUE's own layout of that task (CoLA without a
  header, MRPC with a byte-order mark, ...; see `modeling_pkm_bert/glue_data.py`; MNLI: `--validation_file
  dev_matched.tsv --validation_mismatched_file dev_mismatched.tsv`), or `.csv`/`.json` files with the Hub's column
  names (`sentence`, `sentence1`/`sentence2`, `question1`/`question2`, `premise`/`hypothesis`, ... and `label`).
* files without `--task_name`: `.csv`, `.tsv` (tab-separated, header, no quoting) or `.json` (json lines) with a
  `label` column and one or two text columns (`sentence1`/`sentence2` if present, else the first one or two
  non-label columns); float labels mean regression.
"""

from __future__ import annotations  # annotations name torch/datasets types that `--help` does not import

import argparse
import csv
import importlib.util
import json
import logging
import math
import os
import random
import sys
import time


# `--help` prints every flag in a fraction of a second: it imports the flag module only (standard library; the
# package's import is lazy), not torch, transformers, datasets, accelerate (~6 s of CPU together)
HELP = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if importlib.util.find_spec("modeling_pkm_bert") is None:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from modeling_pkm_bert.parallel.arguments import add_parallel_arguments  # noqa: E402
from modeling_pkm_bert.training.arguments import (  # noqa: E402
    add_memory_report_arguments,
    add_model_card_arguments,
    add_pkm_arguments,
    add_reliability_arguments,
    add_smf_arguments,
    card_command,
)
from modeling_pkm_bert.training.glue_data import GLUE_TASKS  # noqa: E402  (standard library only until its loaders run)


if HELP:
    SchedulerType = str  # parse_args() only prints the help
else:
    import datasets
    import numpy as np
    import torch
    import transformers
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.logging import get_logger
    from accelerate.utils import gather_object, set_seed
    from datasets import ClassLabel, DatasetDict, load_dataset
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer, DataCollatorWithPadding, SchedulerType, get_scheduler

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.hub.model_card import card_base_model, card_license
    from modeling_pkm_bert.training.glue_data import get_glue_task, load_glue_tsv
    from modeling_pkm_bert.training.glue_metrics import (
        PerClassMemoryUsage,
        classification_metrics,
        format_class_usage,
        glue_compute_metrics,
    )
    from modeling_pkm_bert.analysis.memory_usage import flatten_memory_usage, format_memory_usage, gather, track_memory_usage
    from modeling_pkm_bert.training.sparse_finetuning import check_smf_arguments
    from modeling_pkm_bert.training.sparse_finetuning import setup_from_args as setup_sparse_memory_finetuning
    from modeling_pkm_bert.parallel import prepare_memory_parallel, register_sharded_checkpointing, save_sharded_model
    from modeling_pkm_bert.analysis import ClassData, MetricsLog, write_run_memory_report
    from modeling_pkm_bert.training import (
        atomic_write_json,
        check_checkpoint,
        check_data_files,
        check_freeze_memory,
        clip_memory_gradients,
        create_memory_optimizer,
        freeze_memory,
        load_model,
        memory_modules,
        memory_optimizer_summary,
        optimizer_param_groups,
        pkm_kwargs_from_args,
        prepare_output_dir,
        resolve_checkpoint,
        resume_position,
        run_settings,
        save_checkpoint,
        save_final_outputs,
        tracker_config,
        validate_training_arguments,
        write_results_model_card,
    )

    logger = get_logger(__name__)

DATA_EXTENSIONS = ("csv", "tsv", "json", "jsonl")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Fine-tune a BERT or BertPkm model on a GLUE task (text classification)"
    )
    parser.add_argument(
        "--task_name",
        type=str,
        default=None,
        help=f"The GLUE task to train on, one of {sorted(GLUE_TASKS)}: from the Hub, or from --train_file/"
        "--validation_file in GLUE's TSV layout of that task.",
    )
    parser.add_argument(
        "--train_file", type=str, default=None, help="Training data: csv, tsv or json (json lines); see the docstring."
    )
    parser.add_argument("--validation_file", type=str, default=None, help="Evaluation data, same formats.")
    parser.add_argument(
        "--validation_mismatched_file",
        type=str,
        default=None,
        help="MNLI: the mismatched evaluation set (dev_mismatched.tsv), evaluated after the matched one.",
    )
    parser.add_argument("--max_train_samples", type=int, default=None, help="Keep the first n training examples.")
    parser.add_argument(
        "--max_eval_samples", type=int, default=None, help="Keep the first n examples of each evaluation set."
    )
    parser.add_argument(
        "--max_length",
        "--max_seq_length",
        dest="max_length",
        type=int,
        default=128,
        help="The maximum total input sequence length after tokenization (paper, Table 3: 128); longer inputs are "
        "truncated, shorter ones padded per batch unless --pad_to_max_length.",
    )
    parser.add_argument(
        "--pad_to_max_length", action="store_true", help="Pad all samples to max_length (default: dynamic padding)."
    )
    parser.add_argument(
        "--model_name_or_path",
        type=str,
        required=True,
        help="A BERT/DistilBERT checkpoint (converted to BertPkm on load when any --pkm_* flag is given) or a "
        "BertPkm one.",
    )
    parser.add_argument("--tokenizer_name", type=str, default=None, help="Tokenizer name or path if not the model's.")
    parser.add_argument(
        "--per_device_train_batch_size", type=int, default=8, help="Batch size (per device) for training."
    )
    parser.add_argument(
        "--per_device_eval_batch_size", type=int, default=8, help="Batch size (per device) for evaluation."
    )
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="Peak learning rate (paper, Table 3: 2e-5).")
    parser.add_argument("--weight_decay", type=float, default=0.1, help="Weight decay (paper, Table 3: 0.1).")
    parser.add_argument("--num_train_epochs", type=int, default=10, help="Training epochs (paper, Table 3: 10).")
    parser.add_argument(
        "--max_train_steps", type=int, default=None, help="Total optimizer steps; overrides num_train_epochs."
    )
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Batches per optimizer step.")
    parser.add_argument(
        "--lr_scheduler_type",
        type=SchedulerType,
        default="linear",
        help="The scheduler type to use.",
        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"],
    )
    parser.add_argument(
        "--warmup_ratio", type=float, default=0.06, help="Warm-up fraction of the steps (paper, Table 3: 0.06)."
    )
    parser.add_argument(
        "--num_warmup_steps", type=int, default=None, help="Warm-up steps; overrides --warmup_ratio when given."
    )
    parser.add_argument("--output_dir", type=str, default=None, help="Where to store the final model and results.")
    parser.add_argument("--seed", type=int, default=None, help="A seed for reproducible training.")
    parser.add_argument(
        "--checkpointing_steps",
        type=str,
        default=None,
        help="Save the training state every n optimizer steps (an integer), or 'epoch' at the end of each epoch.",
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="A step_<N> or epoch_<E> folder to continue from, or 'latest' for the newest one in output_dir.",
    )
    parser.add_argument(
        "--ignore_mismatched_sizes",
        action="store_true",
        help="Replace the classification head of a fine-tuned checkpoint whose number of labels differs from the "
        "task's.",
    )
    parser.add_argument(
        "--memory_usage_before_training",
        action="store_true",
        help="Also measure the memory usage (and the per-class usage of a two-class task) on the evaluation set "
        "before fine-tuning: the 'pretrained' side of the paper's Figure 4.",
    )
    parser.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers.")
    parser.add_argument(
        "--report_to",
        type=str,
        default="all",
        help='Trackers for --with_tracking: "tensorboard", "wandb", "comet_ml", "clearml" or "all".',
    )
    parser.add_argument("--push_to_hub", action="store_true", help="Push the model, with a model card, to the Hub.")
    parser.add_argument(
        "--hub_model_id", type=str, default=None, help="The Hub repository (default: output_dir's name)."
    )
    parser.add_argument("--hub_token", type=str, default=None, help="The token to use to push to the Hub.")
    parser.add_argument("--hub_private_repo", action="store_true", help="Create the Hub repository as private.")
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="Allow code from the Hub for models and datasets (only for repositories you trust).",
    )
    add_pkm_arguments(parser)
    add_parallel_arguments(parser)  # --fsdp2, --memory_parallel
    add_reliability_arguments(parser)
    add_model_card_arguments(parser)
    add_smf_arguments(parser)
    add_memory_report_arguments(parser)
    args = parser.parse_args(argv)

    # Sanity checks
    validate_training_arguments(parser, args)
    if args.task_name is not None:
        args.task_name = args.task_name.lower()
        if args.task_name not in GLUE_TASKS:
            parser.error(f"unknown --task_name {args.task_name!r}; the GLUE tasks are {sorted(GLUE_TASKS)}")
    if args.task_name is None and args.train_file is None and args.validation_file is None:
        parser.error("Need either a task name or a training/validation file.")
    if args.task_name is None and args.train_file is None:
        parser.error("Without --task_name, --train_file is needed (its labels define the classes).")
    for name in ("train_file", "validation_file", "validation_mismatched_file"):
        path = getattr(args, name)
        if path is None:
            continue
        if path.rsplit(".", 1)[-1] not in DATA_EXTENSIONS:
            parser.error(f"--{name} should be a {', '.join(DATA_EXTENSIONS)} file, got {path!r}")
        if not os.path.isfile(path):
            parser.error(f"--{name} {path!r} does not exist")
    if args.validation_mismatched_file is not None and args.task_name != "mnli":
        parser.error("--validation_mismatched_file is MNLI's mismatched set: use it with --task_name mnli")
    if args.checkpointing_steps is not None and not (
        args.checkpointing_steps == "epoch" or args.checkpointing_steps.isdigit()
    ):
        parser.error(f"--checkpointing_steps must be an integer or 'epoch', got {args.checkpointing_steps!r}")
    if (args.checkpointing_steps or args.resume_from_checkpoint == "latest") and args.output_dir is None:
        parser.error("--checkpointing_steps and --resume_from_checkpoint latest need an --output_dir")
    data_files = ("train_file", "validation_file", "validation_mismatched_file")
    check_data_files(parser, [(f"--{name}", getattr(args, name)) for name in data_files])
    try:
        check_smf_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    if args.push_to_hub and args.output_dir is None:
        parser.error("Need an `output_dir` to create a repo when `--push_to_hub` is passed.")
    if args.memory_report and args.output_dir is None:
        parser.error("--memory_report writes into <output_dir>/memory_report: give an --output_dir")
    return args


def load_raw_datasets(args) -> DatasetDict:
    """Splits `train`, `validation` (and MNLI's `validation_mismatched`), with a `label` column of class ids/scores.

    With a task, the columns and labels are the Hub's (`task.sentence_keys`, ClassLabel ids in `task.label_names`
    order); without one, as the files have them.
    """
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
            raw = load_dataset("nyu-mll/glue", task.name)
        except Exception as error:  # offline: ConnectionError / LocalEntryNotFoundError / OfflineModeIsEnabled
            raise RuntimeError(
                f"could not load GLUE {task.name} from the Hub (nyu-mll/glue): {type(error).__name__}: {error}. "
                "Offline (HF_HUB_OFFLINE=1, no network) give the task's files instead: --train_file train.tsv "
                "--validation_file dev.tsv (GLUE's own TSV layout)."
            ) from error
        splits = {"train": raw["train"]}
        for split in task.validation_splits:
            splits["validation" if split == "validation_matched" else split] = raw[split]
        return DatasetDict(splits)

    splits = {}
    for split, path in files.items():
        extension = path.rsplit(".", 1)[-1]
        if task is not None and extension == "tsv":
            splits[split] = load_glue_tsv(path, task)
            continue
        if extension == "tsv":
            dataset = load_dataset(
                "csv", data_files={split: path}, delimiter="\t", quoting=csv.QUOTE_NONE, split=split
            )
        else:
            dataset = load_dataset(
                "json" if extension == "jsonl" else extension, data_files={split: path}, split=split
            )
        if "label" not in dataset.column_names:
            raise ValueError(
                f"{path} has no 'label' column (columns: {dataset.column_names}); every file needs its gold labels "
                "in a column named 'label'"
            )
        if task is not None:
            dataset = to_task_columns(dataset, task, path)
        splits[split] = dataset
    return DatasetDict(splits)


def to_task_columns(dataset: datasets.Dataset, task, path: str) -> datasets.Dataset:
    """A csv/json file of a GLUE task: checks the Hub's column names, turns label names into class ids."""
    needed = [key for key in task.sentence_keys if key is not None]
    missing = [key for key in needed if key not in dataset.column_names]
    if missing:
        raise ValueError(
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
        raise ValueError(f"{path}: label {label!r} is not a {task.name} label ({names} or 0..{len(names) - 1})")

    dataset = dataset.map(label_id)
    return dataset.cast_column("label", ClassLabel(names=names))


def check_classification_head(args, num_labels: int, label_list, is_regression: bool):
    """Refuses a checkpoint whose fine-tuned classification head does not fit the task's labels; returns the
    checkpoint's label name -> id map when its labels are the task's in another order (used to remap), else None."""
    config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    has_head = any(name.endswith("ForSequenceClassification") for name in (config.architectures or []))
    if not has_head:
        return None
    if config.num_labels != num_labels and not args.ignore_mismatched_sizes:
        checkpoint_labels = [config.id2label[i] for i in sorted(config.id2label)]
        raise ValueError(
            f"{args.model_name_or_path} has a classification head of {config.num_labels} labels {checkpoint_labels}, "
            f"but the data has {'a regression target' if is_regression else f'{num_labels} labels {label_list}'}. "
            "Pass --ignore_mismatched_sizes to replace the head with a new one, or start from the encoder checkpoint."
        )
    if is_regression or config.num_labels != num_labels:
        return None
    checkpoint_names = {str(name).lower(): i for name, i in config.label2id.items()}
    if sorted(checkpoint_names) == sorted(str(name).lower() for name in label_list):
        return checkpoint_names
    if not all(name.startswith("label_") for name in checkpoint_names):
        logger.warning(
            f"The checkpoint's labels {sorted(checkpoint_names)} are not the data's {sorted(map(str, label_list))}; "
            "keeping the checkpoint's head, class i of the data is its class i."
        )
    return None


def evaluate(args, accelerator, model, dataset, collate_fn, compute_metrics, is_regression, class_usage=None):
    """Predictions on `dataset` and their metrics; counts the per-class memory usage into `class_usage` when given
    (memory trackers attached to the model count whatever runs).

    Each process evaluates its own contiguous shard with the unwrapped model, so that every example is seen exactly
    once (a prepared dataloader repeats examples to even out the last batch: harmless for `gather_for_metrics`, but it
    would count their memory lookups twice) and no collective runs per batch.
    """
    model = accelerator.unwrap_model(model)
    model.eval()
    shard = dataset.shard(num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True)
    dataloader = DataLoader(shard, collate_fn=collate_fn, batch_size=args.per_device_eval_batch_size)
    predictions, references = [], []
    for batch in dataloader:
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        if class_usage is not None:
            class_usage.set_batch(batch["labels"], batch.get("attention_mask"), batch["input_ids"].shape[-1])
        with torch.no_grad(), accelerator.autocast():
            logits = model(**batch).logits
        predictions += (logits.squeeze(-1) if is_regression else logits.argmax(dim=-1)).float().tolist()
        references += batch["labels"].float().tolist()
    predictions, references = gather_object(predictions), gather_object(references)
    if not is_regression:
        predictions, references = [int(p) for p in predictions], [int(r) for r in references]
    return compute_metrics(predictions, references)


def measure_memory_usage(
    args, accelerator, model, dataset, collate_fn, compute_metrics, is_regression, num_labels, label_list
):
    """`evaluate` with the memory usage of every memory layer (Table 6) and, for two classes, the per-class IOU and
    KL (Figure 4); returns (task metrics, memory usage, per-class usage), the usages empty without memories."""
    unwrapped = accelerator.unwrap_model(model)
    per_class = num_labels == 2 and not is_regression and memory_modules(unwrapped)
    class_usage = PerClassMemoryUsage(unwrapped, num_labels) if per_class else None
    with track_memory_usage(unwrapped) as tracker:
        if class_usage is not None:
            class_usage.attach()
        try:
            metrics = evaluate(
                args, accelerator, model, dataset, collate_fn, compute_metrics, is_regression, class_usage=class_usage
            )
        finally:
            if class_usage is not None:
                class_usage.detach()
    gather(tracker, accelerator)
    usage = tracker.results() if tracker.accumulators else {}
    class_results = {}
    if class_usage is not None:
        class_results = class_usage.gather(accelerator).results([str(name) for name in label_list])
    return metrics, usage, class_results


def main(argv=None):
    args = parse_args(argv)
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir)  # secrets, paths removed
    start_time = time.perf_counter()

    # Initialize the accelerator. The seedable sampler draws each epoch's order from (seed, epoch), so that a resumed
    # run sees the batches the uninterrupted one would.
    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = args.report_to
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **accelerator_log_kwargs,
    )

    # Make one log on every process with the configuration for debugging.
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
    )
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()

    # If passed along, set the training seed now.
    if args.seed is not None:
        set_seed(args.seed)

    if args.output_dir is not None:
        prepare_output_dir(args.output_dir)  # before any data or step: a trained model must be savable
    accelerator.wait_for_everyone()

    # Get the datasets: a GLUE task from the Hub, GLUE's own TSV files of a task, or your csv/tsv/json files.
    with accelerator.main_process_first():
        raw_datasets = load_raw_datasets(args)
    if args.max_train_samples is not None and "train" in raw_datasets:
        raw_datasets["train"] = raw_datasets["train"].select(
            range(min(args.max_train_samples, len(raw_datasets["train"])))
        )
    if args.max_eval_samples is not None:
        for split in raw_datasets:
            if split != "train":
                raw_datasets[split] = raw_datasets[split].select(
                    range(min(args.max_eval_samples, len(raw_datasets[split])))
                )
    do_train = "train" in raw_datasets
    eval_splits = [split for split in ("validation", "validation_mismatched") if split in raw_datasets]
    label_source = raw_datasets["train" if do_train else eval_splits[0]]

    # Labels
    task = get_glue_task(args.task_name) if args.task_name else None
    if task is not None:
        is_regression = task.is_regression
        label_list = list(task.label_names or [])
    else:
        is_regression = label_source.features["label"].dtype in ("float32", "float64")
        label_list = [] if is_regression else sorted(label_source.unique("label"))
    num_labels = 1 if is_regression else len(label_list)
    if not is_regression and num_labels < 2:
        raise ValueError(f"the training labels hold a single class {label_list}: nothing to classify")

    # Load pretrained model and tokenizer. A fine-tuned head must fit the task (or be replaced on request).
    register_auto_classes()  # BertPkm checkpoints load with this package's classes, without trust_remote_code
    checkpoint_label2id = check_classification_head(args, num_labels, label_list, is_regression)
    config_overrides = {"num_labels": num_labels}
    if not is_regression and checkpoint_label2id is None:
        config_overrides["id2label"] = {i: str(name) for i, name in enumerate(label_list)}
        config_overrides["label2id"] = {str(name): i for i, name in enumerate(label_list)}
    pkm_kwargs = pkm_kwargs_from_args(args)
    model_type = AutoConfig.from_pretrained(
        args.model_name_or_path, trust_remote_code=args.trust_remote_code
    ).model_type
    if args.ignore_mismatched_sizes and (not pkm_kwargs or model_type == "bert_pkm"):
        config_overrides["ignore_mismatched_sizes"] = (
            True  # a from_pretrained argument (conversion re-initialises itself)
        )
    model = load_model(
        "sequence-classification",
        args.model_name_or_path,
        pkm_kwargs,
        config_overrides=config_overrides,
        trust_remote_code=args.trust_remote_code,
        logger=logger,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
    )
    if args.freeze_memory:
        check_freeze_memory(model)
        logger.info(f"Froze {freeze_memory(model)} memory parameters (--freeze_memory).")

    # Preprocessing the datasets
    if task is not None:
        sentence1_key, sentence2_key = task.sentence_keys
    else:
        # Again, we try to have some nice defaults but don't hesitate to tweak to your use case.
        non_label_column_names = [name for name in label_source.column_names if name != "label"]
        if "sentence1" in non_label_column_names and "sentence2" in non_label_column_names:
            sentence1_key, sentence2_key = "sentence1", "sentence2"
        elif len(non_label_column_names) >= 2:
            sentence1_key, sentence2_key = non_label_column_names[:2]
        elif non_label_column_names:
            sentence1_key, sentence2_key = non_label_column_names[0], None
        else:
            raise ValueError(f"the data has a 'label' column but no text column ({label_source.column_names})")

    # Labels of a file are mapped to ids in sorted order; a fine-tuned checkpoint's own order wins when it names them.
    # (The metrics see the data's class ids again: `head_to_class` undoes the checkpoint's order.)
    label_to_id, head_to_class = None, None
    if checkpoint_label2id is not None:
        head_ids = [checkpoint_label2id[str(name).lower()] for name in label_list]
        label_to_id = dict(zip(range(num_labels) if task is not None else label_list, head_ids))
        head_to_class = {head_id: i for i, head_id in enumerate(head_ids)}
        logger.info(f"The checkpoint's head orders the labels as {checkpoint_label2id}: using it.")
    elif task is None and not is_regression:
        label_to_id = {name: i for i, name in enumerate(label_list)}

    padding = "max_length" if args.pad_to_max_length else False

    def preprocess_function(examples):
        # Tokenize the texts
        texts = (
            (examples[sentence1_key],) if sentence2_key is None else (examples[sentence1_key], examples[sentence2_key])
        )
        result = tokenizer(*texts, padding=padding, max_length=args.max_length, truncation=True)
        if label_to_id is not None:
            unknown = {label for label in examples["label"] if label not in label_to_id}
            if unknown:
                raise ValueError(f"labels {sorted(map(str, unknown))} are not among the training labels {label_list}")
            result["labels"] = [label_to_id[label] for label in examples["label"]]
        else:
            result["labels"] = examples["label"]
        return result

    with accelerator.main_process_first():
        processed_datasets = DatasetDict(
            {
                split: dataset.map(
                    preprocess_function,
                    batched=True,
                    remove_columns=dataset.column_names,
                    desc=f"Running tokenizer on {split}",
                )
                for split, dataset in raw_datasets.items()
            }
        )

    # Log a few random samples from the training set:
    if do_train:
        train_dataset = processed_datasets["train"]
        for index in random.sample(range(len(train_dataset)), min(3, len(train_dataset))):
            logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    # DataLoaders creation: dynamic padding unless everything was padded to max_length.
    pad_to_multiple_of = None if args.pad_to_max_length or accelerator.mixed_precision == "no" else 8
    data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    train_dataloader = None
    if do_train:
        train_dataloader = DataLoader(
            train_dataset,
            shuffle=True,
            collate_fn=data_collator,
            batch_size=args.per_device_train_batch_size,
            # its own generator: creating an epoch's iterator then draws no number from the global RNG (dropout),
            # which a resumed run would otherwise draw at a different point
            generator=torch.Generator().manual_seed(args.seed if args.seed is not None else 0),
        )

    # --fsdp2 / --memory_parallel: the model sharded across the processes (FSDP2; value tables column-wise)
    model = prepare_memory_parallel(accelerator, model, args)
    # Sparse memory finetuning: background statistics, everything but the memory values frozen (--smf_*).
    smf = None
    if do_train:
        checkpoint = None
        if args.resume_from_checkpoint:
            checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        smf = setup_sparse_memory_finetuning(
            args, accelerator, model, tokenizer, args.max_length, checkpoint, logger
        )

    # Optimizer: the main AdamW on a warm-up + decay schedule; the memory values in their own Adam at a constant
    # learning rate without weight decay (XLM and the paper).
    main_groups, memory_groups = optimizer_param_groups(model, args.weight_decay)
    optimizer = torch.optim.AdamW(main_groups or [{"params": []}], lr=args.learning_rate)  # empty: all frozen (SMF)
    memory_optimizer = create_memory_optimizer(memory_groups, args, model)  # before prepare: DDP reads sparse flags

    # Prepare everything with our `accelerator`.
    model, optimizer, *rest = accelerator.prepare(
        model, optimizer, *(x for x in (memory_optimizer, train_dataloader) if x is not None)
    )
    memory_optimizer = rest.pop(0) if memory_optimizer is not None else None
    train_dataloader = rest.pop(0) if do_train else None
    optimizers = [o for o in (optimizer, memory_optimizer) if o is not None]
    register_sharded_checkpointing(accelerator, model, optimizers, args)  # --fsdp2: model and optimizers via DCP
    if smf is not None:  # each value step trains only the chosen rows; the statistics go into every checkpoint
        smf.attach(memory_optimizer)
        smf.register_for_checkpointing(accelerator)

    # Scheduler and math around the number of training steps, from the prepared (per-process) dataloader. The
    # prepared scheduler advances once per process at each optimizer step, hence the factor num_processes.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps) if do_train else 1
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch if do_train else 0
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    num_warmup_steps = (
        args.num_warmup_steps
        if args.num_warmup_steps is not None
        else math.ceil(args.warmup_ratio * args.max_train_steps)
    )
    lr_scheduler = accelerator.prepare(
        get_scheduler(
            name=args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=num_warmup_steps * accelerator.num_processes,
            num_training_steps=max(args.max_train_steps, 1) * accelerator.num_processes,
        )
    )

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    # what an exact resume depends on, saved in every checkpoint and compared on resume
    settings = run_settings(args, accelerator, train_dataset) if do_train else None

    # We need to initialize the trackers we use, and also store our configuration.
    if args.with_tracking:
        accelerator.init_trackers("glue_no_trainer", tracker_config(args))  # secrets removed

    # Get the metric function: the task's GLUE metrics, else accuracy (and F1) or correlations, computed locally.
    def compute_metrics(predictions, references):
        if head_to_class is not None:
            predictions = [head_to_class[p] for p in predictions]
            references = [head_to_class[r] for r in references]
        if task is not None:
            return glue_compute_metrics(task.name, predictions, references)
        return classification_metrics(predictions, references, is_regression=is_regression)

    results = {}
    eval_dataset = processed_datasets[eval_splits[0]] if eval_splits else None
    metrics_log = MetricsLog(args.output_dir, accelerator.is_main_process, resume=bool(args.resume_from_checkpoint))

    # The memory usage of the model as loaded (the "pretrained" side of Figure 4), before any update.
    if args.memory_usage_before_training and eval_dataset is not None and not args.resume_from_checkpoint:
        _, usage, class_usage = measure_memory_usage(
            args,
            accelerator,
            model,
            eval_dataset,
            data_collator,
            compute_metrics,
            is_regression,
            num_labels,
            label_list,
        )
        if usage:
            logger.info(f"Memory usage before fine-tuning:\n{format_memory_usage(usage)}")
            results.update(flatten_memory_usage(usage, prefix="pretrained_memory"))
        if class_usage:
            logger.info(f"Per-class memory usage before fine-tuning:\n{format_class_usage(class_usage)}")
            results.update(flatten_memory_usage(class_usage, prefix="pretrained_class_memory"))

    # Train!
    completed_steps, starting_epoch, resume_batches, train_loss = 0, 0, 0, None
    train_start = time.perf_counter()
    if do_train:
        total_batch_size = (
            args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
        )
        logger.info("***** Running training *****")
        logger.info(f"  Num examples = {len(train_dataset)}")
        logger.info(f"  Num Epochs = {args.num_train_epochs}")
        logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
        logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
        logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        logger.info(f"  Total optimization steps = {args.max_train_steps} (warm-up {num_warmup_steps})")
        if memory_optimizer is not None:
            logger.info("  " + memory_optimizer_summary(memory_optimizer, model, args.memory_learning_rate))

        # Potentially load in the weights and states from a previous save
        if args.resume_from_checkpoint:
            checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
            check_checkpoint(checkpoint, settings, args.allow_inexact_resume, accelerator.process_index, logger)
            accelerator.print(f"Resumed from checkpoint: {checkpoint}")
            accelerator.load_state(checkpoint)
            starting_epoch, completed_steps, resume_batches = resume_position(
                checkpoint, num_update_steps_per_epoch, args.gradient_accumulation_steps
            )

        # Only show the progress bar once on each machine.
        progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
        progress_bar.update(completed_steps)
        epoch_losses = []
        for epoch in range(starting_epoch, args.num_train_epochs):
            model.train()
            total_loss, counted_batches = 0.0, 0
            train_dataloader.set_epoch(epoch)
            if epoch == starting_epoch and resume_batches:
                # We skip the first `n` batches in the dataloader when resuming from a checkpoint
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_batches)
                active_dataloader.set_epoch(epoch)
            else:
                active_dataloader = train_dataloader
            for batch in active_dataloader:
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    total_loss += loss.detach().float().item()
                    counted_batches += 1
                    accelerator.backward(loss)
                    clip_memory_gradients(accelerator, model, memory_optimizer, args.memory_max_grad_norm, smf)
                    for o in optimizers:
                        o.step()
                    lr_scheduler.step()
                    for o in optimizers:
                        o.zero_grad()

                # Checks if the accelerator has performed an optimization step behind the scenes
                if accelerator.sync_gradients:
                    progress_bar.update(1)
                    completed_steps += 1
                    metrics_log.log({"loss": loss.item()}, step=completed_steps)
                    if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                        save_checkpoint(accelerator, args.output_dir, f"step_{completed_steps}", settings)

                if completed_steps >= args.max_train_steps:
                    break

            epoch_losses.append(total_loss / max(counted_batches, 1))
            last_epoch = epoch == args.num_train_epochs - 1 or completed_steps >= args.max_train_steps
            log = {"train_loss": epoch_losses[-1], "epoch": epoch, "step": completed_steps}
            if eval_dataset is not None and not last_epoch:  # the last epoch is evaluated below, with memory usage
                eval_metric = evaluate(
                    args, accelerator, model, eval_dataset, data_collator, compute_metrics, is_regression
                )
                logger.info(f"epoch {epoch}: {eval_metric}")
                log.update({f"eval_{k}": v for k, v in eval_metric.items()})
            metrics_log.log(log, step=completed_steps)
            if args.with_tracking:
                accelerator.log(log, step=completed_steps)
            if args.checkpointing_steps == "epoch":
                save_checkpoint(accelerator, args.output_dir, f"epoch_{epoch}", settings)
            if last_epoch:
                break
        progress_bar.close()
        train_loss = epoch_losses[-1] if epoch_losses else None
        results.update(
            {
                "train_loss": train_loss,
                "train_runtime": round(time.perf_counter() - train_start, 2),
                "train_samples": len(train_dataset),
                "epoch": args.num_train_epochs,
                "step": completed_steps,
            }
        )

    # Evaluation, with the memory usage of the fine-tuned model on the evaluation set (paper, Table 6) and, for a
    # two-class task, the IOU and KL between the memory usage of the two classes (Figure 4).
    for split in eval_splits:
        eval_start = time.perf_counter()
        suffix = "_mm" if split == "validation_mismatched" else ""
        logger.info(f"***** Running evaluation on {split} *****")
        logger.info(f"  Num examples = {len(processed_datasets[split])}")
        if split == eval_splits[0]:
            eval_metric, usage, class_usage = measure_memory_usage(
                args,
                accelerator,
                model,
                processed_datasets[split],
                data_collator,
                compute_metrics,
                is_regression,
                num_labels,
                label_list,
            )
            if usage:
                logger.info(f"Memory usage on the evaluation data:\n{format_memory_usage(usage)}")
                results.update(flatten_memory_usage(usage, prefix="eval_memory"))
            if class_usage:
                logger.info(f"Per-class memory usage on the evaluation data:\n{format_class_usage(class_usage)}")
                results.update(flatten_memory_usage(class_usage, prefix="eval_class_memory"))
        else:
            eval_metric = evaluate(
                args, accelerator, model, processed_datasets[split], data_collator, compute_metrics, is_regression
            )
        logger.info(f"{split}: {eval_metric}")
        results.update({f"eval_{k}{suffix}": v for k, v in eval_metric.items()})
        results[f"eval_samples{suffix}"] = len(processed_datasets[split])
        results[f"eval_runtime{suffix}"] = round(time.perf_counter() - eval_start, 2)

    metrics_log.log({k: v for k, v in results.items() if k.startswith("eval_") and "memory" not in k}, completed_steps)
    if args.with_tracking:
        accelerator.log({k: v for k, v in results.items() if isinstance(v, (int, float))}, step=completed_steps)
        accelerator.end_training()

    if args.output_dir is not None:  # staged, then renamed into place file by file (`save_final_outputs`)
        unwrapped_model = accelerator.unwrap_model(model)

        def write_final(folder):
            if not save_sharded_model(accelerator, unwrapped_model, folder, args):  # --fsdp2: consolidated
                unwrapped_model.save_pretrained(
                    folder, is_main_process=accelerator.is_main_process, save_function=accelerator.save
                )
            if accelerator.is_main_process:
                tokenizer.save_pretrained(folder)

        if do_train:
            save_final_outputs(accelerator, args.output_dir, write_final)
        if accelerator.is_main_process:
            results["total_runtime"] = round(time.perf_counter() - start_time, 2)
            atomic_write_json(os.path.join(args.output_dir, "all_results.json"), results)
            logger.info(json.dumps(results, indent=4))
            if args.memory_report:  # usage on the evaluation set, per class (Figure 4)
                names = None if is_regression else [str(name) for name in label_list]
                classes = ClassData(eval_dataset, names) if eval_dataset is not None else None
                write_run_memory_report(args, unwrapped_model, tokenizer, class_data=classes)
            if args.push_to_hub:
                push_to_hub(args, results, command)
    return results


def push_to_hub(args, results, command=None):
    """Writes a model card carrying the results into output_dir and uploads the folder (no checkpoints)."""
    from modeling_pkm_bert.hub.upload import push_folder_to_hub

    repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    write_results_model_card(
        args.output_dir,
        results,
        repo_id=repo_id,
        base_model=card_base_model(args.model_name_or_path, args.base_model),
        license=card_license(args.model_name_or_path, args.license),
        dataset=f"glue/{args.task_name}" if args.task_name else args.train_file,
        task="text-classification",
        command=command,
    )
    push_folder_to_hub(
        args.output_dir, repo_id, private=args.hub_private_repo, token=args.hub_token, commit_message="End of training"
    )


if __name__ == "__main__":
    main()
