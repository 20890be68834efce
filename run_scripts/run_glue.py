#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Fine-tunes a BERT or BertPkm model on a GLUE task (or on your own csv/tsv/json files) with 🤗 Accelerate.

Follows the transformers `run_glue_no_trainer.py` example and adds: the product key memory options (convert a plain
BERT checkpoint on load with any `--pkm_*` flag, the memory values' own optimizer, `--freeze_memory` for the paper's
Table 5), GLUE's own TSV files (`--task_name` + `--train_file train.tsv`), the GLUE metrics computed locally with
scikit-learn and scipy, the memory usage after fine-tuning (Table 6) and, for two-class tasks, the IOU and KL between
the memory usage of the two classes (Figure 4), and the training loop the four scripts share (`training/loop.py`:
evaluation at each epoch's end or every `--eval_steps`, `--track_staleness`, `--mixed_precision`, atomic checkpoints
with exact resume, `metrics.jsonl`, `all_results.json`, a saved folder with a model card carrying the results).

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
  header, MRPC with a byte-order mark, ...; see `modeling_pkm_bert/training/glue_data.py`; MNLI: `--validation_file
  dev_matched.tsv --validation_mismatched_file dev_mismatched.tsv`), or `.csv`/`.json` files with the Hub's column
  names (`sentence`, `sentence1`/`sentence2`, `question1`/`question2`, `premise`/`hypothesis`, ... and `label`).
* files without `--task_name`: `.csv`, `.tsv` (tab-separated, header, no quoting) or `.json` (json lines) with a
  `label` column and one or two text columns (`sentence1`/`sentence2` if present, else the first one or two
  non-label columns); float labels mean regression.
"""

from __future__ import annotations  # annotations name torch/datasets types that `--help` does not import

import argparse
import os
import random
import sys
import time


from modeling_pkm_bert.analysis.arguments import add_memory_report_arguments  # noqa: E402
from modeling_pkm_bert.hub.card_command import card_command  # noqa: E402
from modeling_pkm_bert.methods.registry import add_method_arguments, check_method_arguments  # noqa: E402
from modeling_pkm_bert.parallel.arguments import add_parallel_arguments  # noqa: E402
from modeling_pkm_bert.training.arguments import (  # noqa: E402
    add_model_card_arguments,
    add_pkm_arguments,
    add_reliability_arguments,
    add_training_arguments,
    help_requested,
)
from modeling_pkm_bert.training.glue_data import GLUE_TASKS  # noqa: E402  (standard library only until its loaders run)
from modeling_pkm_bert.utils.input_errors import InputError, exits_with_usage_errors  # noqa: E402


if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    from accelerate.logging import get_logger
    from accelerate.utils import gather_object
    from datasets import DatasetDict
    from transformers import DataCollatorWithPadding

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.analysis.class_usage import PerClassMemoryUsage, format_class_usage
    from modeling_pkm_bert.analysis.memory_usage import flatten_memory_usage, format_memory_usage, gather, track_memory_usage
    from modeling_pkm_bert.analysis.report import ClassData, write_run_memory_report
    from modeling_pkm_bert.methods.optimizers.memory_optimizer import freeze_memory
    from modeling_pkm_bert.training.checkpoints import run_settings
    from modeling_pkm_bert.training.checks import (
        check_data_files,
        check_freeze_memory,
        check_model_config,
        validate_training_arguments,
    )
    from modeling_pkm_bert.training.evaluation import evaluating, shard_batches
    from modeling_pkm_bert.training.glue_data import get_glue_task, load_raw_datasets
    from modeling_pkm_bert.training.glue_metrics import classification_metrics, glue_compute_metrics
    from modeling_pkm_bert.training.loading import load_model, load_tokenizer, pkm_kwargs_from_args, read_config
    from modeling_pkm_bert.training.loop import (
        TrainingLoop,
        create_scheduler,
        finish_run,
        plan_training_steps,
        warmup_steps,
    )
    from modeling_pkm_bert.training.preparation import prepare_training, start_run
    from modeling_pkm_bert.training.results import tracker_config
    from modeling_pkm_bert.utils.memories import memory_modules
    from modeling_pkm_bert.utils.positions import sequence_length

    logger = get_logger(__name__)

DATA_EXTENSIONS = ("csv", "tsv", "json", "jsonl")


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__),
        description="Fine-tune a BERT or BertPkm model on a GLUE task (text classification)",
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
        default=None,
        help="The maximum total input sequence length after tokenization (default: the paper's 128, Table 3, at most "
        "the model's positions); longer inputs are truncated, shorter ones padded per batch unless --pad_to_max_length.",
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
    # batch sizes, optimisation, checkpoints, evaluation cadence, staleness, Hub; the paper's GLUE recipe (Table 3)
    add_training_arguments(parser, warmup_ratio=0.06, learning_rate=2e-5, weight_decay=0.1, num_train_epochs=10)
    add_pkm_arguments(parser)
    add_parallel_arguments(parser)  # --fsdp2, --memory_parallel
    add_reliability_arguments(parser)
    add_model_card_arguments(parser)
    add_method_arguments(parser, task="sequence-classification")  # sparse memory finetuning
    add_memory_report_arguments(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    # Sanity checks, before any work
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
    data_files = ("train_file", "validation_file", "validation_mismatched_file")
    check_data_files(parser, [(f"--{name}", getattr(args, name)) for name in data_files])
    check_method_arguments(args, "sequence-classification")
    check_model_config(parser, args, "sequence-classification")  # the config the flags ask for, before any loading
    return args


def check_classification_head(args, num_labels: int, label_list, is_regression: bool):
    """Refuses a checkpoint whose fine-tuned classification head does not fit the task's labels; returns the
    checkpoint's label name -> id map when its labels are the task's in another order (used to remap), else None."""
    config = read_config(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    has_head = any(name.endswith("ForSequenceClassification") for name in (config.architectures or []))
    if not has_head:
        return None
    if config.num_labels != num_labels and not args.ignore_mismatched_sizes:
        checkpoint_labels = [config.id2label[i] for i in sorted(config.id2label)]
        raise InputError(
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
    (memory trackers attached to the model count whatever runs). Each process predicts its own shard
    (`training.evaluation`); the training random streams are left as they were."""
    predictions, references = [], []
    with evaluating(accelerator, model) as unwrapped:
        for batch in shard_batches(accelerator, dataset, collate_fn, args.per_device_eval_batch_size):
            if class_usage is not None:
                class_usage.set_batch(batch["labels"], batch.get("attention_mask"), batch["input_ids"].shape[-1])
            logits = unwrapped(**batch).logits
            predictions += (logits.squeeze(-1) if is_regression else logits.argmax(dim=-1)).float().tolist()
            references += batch["labels"].float().tolist()
    predictions, references = gather_object(predictions), gather_object(references)
    if not is_regression:
        predictions, references = [int(p) for p in predictions], [int(r) for r in references]
    return compute_metrics(predictions, references)


def measure_memory_usage(accelerator, model, label_names: list[str] | None, run):
    """`run(class_usage)` (an evaluation) with the memory usage of every memory layer counted (Table 6) and, for two
    classes (`label_names`; None: regression), the per-class IOU and KL (Figure 4): (the metrics `run` returns,
    memory usage, per-class usage), the usages empty without memories."""
    unwrapped = accelerator.unwrap_model(model)
    per_class = label_names is not None and len(label_names) == 2 and memory_modules(unwrapped)
    class_usage = PerClassMemoryUsage(unwrapped, 2) if per_class else None
    with track_memory_usage(unwrapped) as tracker:
        if class_usage is not None:
            class_usage.attach()
        try:
            metrics = run(class_usage)
        finally:
            if class_usage is not None:
                class_usage.detach()
    gather(tracker, accelerator)
    usage = tracker.results() if tracker.accumulators else {}
    class_results = class_usage.gather(accelerator).results(label_names) if class_usage is not None else {}
    return metrics, usage, class_results


@exits_with_usage_errors(build_parser)  # what only the model or data shows (a head that does not fit): a usage error
def main(argv=None):
    args = parse_args(argv)
    # secrets (by flag name and by parsed destination) and paths removed
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir, parser=build_parser())
    start_time = time.perf_counter()

    # Initialize the accelerator (a resumed run sees the batches the uninterrupted one would), the logging, the seed
    # (drawn and logged without --seed) and the output folder (proven writable before any work).
    accelerator = start_run(args, logger)

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
    do_train = "train" in raw_datasets and args.max_train_steps != 0 and args.num_train_epochs > 0
    eval_splits = [split for split in ("validation", "validation_mismatched") if split in raw_datasets]
    label_source = raw_datasets["train" if "train" in raw_datasets else eval_splits[0]]

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
        raise InputError(f"the training labels hold a single class {label_list}: nothing to classify")

    # Load pretrained model and tokenizer. A fine-tuned head must fit the task (or be replaced on request).
    register_auto_classes()  # BertPkm checkpoints load with this package's classes, without trust_remote_code
    checkpoint_label2id = check_classification_head(args, num_labels, label_list, is_regression)
    config_overrides = {"num_labels": num_labels}
    if not is_regression and checkpoint_label2id is None:
        config_overrides["id2label"] = {i: str(name) for i, name in enumerate(label_list)}
        config_overrides["label2id"] = {str(name): i for i, name in enumerate(label_list)}
    pkm_kwargs = pkm_kwargs_from_args(args)
    model_type = read_config(args.model_name_or_path, trust_remote_code=args.trust_remote_code).model_type
    if args.ignore_mismatched_sizes and (not pkm_kwargs or model_type in ("bert_pkm", "roberta_pkm", "modernbert_pkm")):
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
    tokenizer = load_tokenizer(
        args.tokenizer_name or args.model_name_or_path,
        "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path",
        trust_remote_code=args.trust_remote_code,
    )
    if args.freeze_memory:
        check_freeze_memory(model)
        logger.info(f"Froze {freeze_memory(model)} memory parameters (--freeze_memory).")
    # the paper's 128 tokens by default, at most what the model's positions take (a given length must fit them)
    args.max_length = sequence_length(model.config, args.max_length, 128, "--max_length")

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
            raise InputError(f"the data has a 'label' column but no text column ({label_source.column_names})")

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
                raise InputError(f"labels {sorted(map(str, unknown))} are not among the training labels {label_list}")
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
    train_dataset = processed_datasets["train"] if do_train else None
    if do_train:
        for index in random.sample(range(len(train_dataset)), min(3, len(train_dataset))):
            logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    # The collator: dynamic padding unless everything was padded to max_length.
    pad_to_multiple_of = None if args.pad_to_max_length or accelerator.mixed_precision == "no" else 8
    data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    # The training dataloader; the optimizer: the main AdamW with a warm-up + decay schedule, the memory values in
    # their own optimizer at a constant learning rate without weight decay (XLM and the paper). Prepare everything
    # with our `accelerator` (the model sharded first with --fsdp2 / --memory_parallel; SMF set up with --smf_*).
    model, optimizer, memory_optimizer, train_dataloader, methods = prepare_training(
        accelerator, args, model, train_dataset, data_collator,
        tokenizer=tokenizer, max_seq_length=args.max_length, logger=logger,
    )

    # Scheduler and math around the number of training steps (from the prepared, per-process dataloader).
    steps_per_epoch = plan_training_steps(args, train_dataloader)
    lr_scheduler = create_scheduler(accelerator, args, optimizer)  # warm-up: --num_warmup_steps or --warmup_ratio

    # We need to initialize the trackers we use, and also store our configuration (secrets removed).
    if args.with_tracking:
        accelerator.init_trackers("glue_no_trainer", tracker_config(args))

    # Get the metric function: the task's GLUE metrics, else accuracy (and F1) or correlations, computed locally.
    def compute_metrics(predictions, references):
        if head_to_class is not None:
            predictions = [head_to_class[p] for p in predictions]
            references = [head_to_class[r] for r in references]
        if task is not None:
            return glue_compute_metrics(task.name, predictions, references)
        return classification_metrics(predictions, references, is_regression=is_regression)

    def evaluate_and_report(split, when, measure_memory=False):
        """The task metrics on `split`; with `measure_memory` also the memory usage (Table 6) and, for two classes,
        the per-class usage (Figure 4): (metrics, usage, class usage)."""
        def run(class_usage=None):
            dataset = processed_datasets[split]
            return evaluate(args, accelerator, model, dataset, data_collator, compute_metrics, is_regression, class_usage)

        label_names = None if is_regression else [str(name) for name in label_list]
        metrics, usage, class_usage = (
            measure_memory_usage(accelerator, model, label_names, run) if measure_memory else (run(), {}, {})
        )
        logger.info(f"{when} ({split}): {metrics}")
        if usage:
            logger.info(f"Memory usage on {split} ({when}):\n{format_memory_usage(usage)}")
        if class_usage:
            logger.info(f"Per-class memory usage on {split} ({when}):\n{format_class_usage(class_usage)}")
        return metrics, usage, class_usage

    # The training loop's bookkeeping (resume, evaluation cadence, checkpoints, metrics log, staleness): the loop
    # below computes the loss.
    loop = TrainingLoop(
        accelerator, args, model, [o for o in (optimizer, memory_optimizer) if o is not None], lr_scheduler,
        train_dataloader,
        steps_per_epoch=steps_per_epoch,
        settings=run_settings(args, accelerator, train_dataset) if do_train else None,  # what a resume must match
        evaluate=(lambda when: eval_metrics(evaluate_and_report(eval_splits[0], when)[0])) if eval_splits else None,
        methods=methods, logger=logger,
    )  # fmt: skip
    results = {}

    # The memory usage of the model as loaded (the "pretrained" side of Figure 4), before any update.
    if args.memory_usage_before_training and eval_splits and not args.resume_from_checkpoint:
        _, usage, class_usage = evaluate_and_report(eval_splits[0], "before fine-tuning", measure_memory=True)
        results.update(flatten_memory_usage(usage, prefix="pretrained_memory"))
        results.update(flatten_memory_usage(class_usage, prefix="pretrained_class_memory"))

    # Train!
    if do_train:
        loop.announce(str(len(train_dataset)), f"Warm-up steps = {warmup_steps(args)}")
        loop.resume()  # Potentially load in the weights and states from a previous save
        for epoch in loop.epochs():
            for step, batch in loop.batches(epoch):
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    loop.step(loss)  # backward; at an optimizer step: SMF rows, memory clipping, every optimizer
                loop.after_batch()  # after an optimizer step: metrics log, step checkpoint, --eval_steps evaluation
            loop.after_epoch(epoch)  # evaluation (but after the last epoch), epoch checkpoint
        results.update(loop.results(), train_samples=len(train_dataset))

    # Evaluation, with the memory usage of the fine-tuned model on the evaluation set (paper, Table 6) and, for a
    # two-class task, the IOU and KL between the memory usage of the two classes (Figure 4).
    final_metrics = {}
    for split in eval_splits:
        eval_start = time.perf_counter()
        suffix = "_mm" if split == "validation_mismatched" else ""
        logger.info(f"***** Running evaluation on {split} *****")
        logger.info(f"  Num examples = {len(processed_datasets[split])}")
        when = "after fine-tuning" if do_train else "evaluation"
        metrics, usage, class_usage = evaluate_and_report(split, when, measure_memory=split == eval_splits[0])
        results.update(flatten_memory_usage(usage, prefix="eval_memory"))
        results.update(flatten_memory_usage(class_usage, prefix="eval_class_memory"))
        final_metrics.update(eval_metrics(metrics, suffix))
        results[f"eval_samples{suffix}"] = len(processed_datasets[split])
        results[f"eval_runtime{suffix}"] = round(time.perf_counter() - eval_start, 2)
    if eval_splits:
        loop.log_evaluation(final_metrics, final=True)
        results.update(final_metrics)

    # Save the model (a BertPkm folder is a complete Hub repository: code files, auto_map, tokenizer, model card with
    # the results), all_results.json, the memory report (usage on the evaluation set, per class: Figure 4); push to
    # the Hub.
    def memory_report(trained_model):
        names = None if is_regression else [str(name) for name in label_list]
        classes = ClassData(processed_datasets[eval_splits[0]], names) if eval_splits else None
        write_run_memory_report(args, trained_model, tokenizer, class_data=classes)

    card = dict(
        dataset=f"glue/{args.task_name}" if args.task_name else args.train_file,
        task="text-classification",
        command=command,
    )
    return finish_run(
        accelerator, args, model, tokenizer, results,
        loop=loop, card=card, start_time=start_time, logger=logger, memory_report=memory_report,
    )  # fmt: skip


def eval_metrics(metrics: dict, suffix: str = "") -> dict:
    """The task metrics as results: `eval_<metric><suffix>` (`_mm`: MNLI's mismatched set)."""
    return {f"eval_{name}{suffix}": value for name, value in metrics.items()}


if __name__ == "__main__":
    main()
