#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Fine-tunes a BERT or BertPkm model on SQuAD v1.1 (or v2.0 with `--version_2_with_negative`) with 🤗 Accelerate.

Follows the transformers `run_qa_no_trainer.py` example; adds the product key memory options (convert a plain BERT
checkpoint on load with any `--pkm_*` flag, the memory values' own optimizer, `--freeze_memory`), the official SQuAD
evaluation computed locally (no Hub metric), the memory usage after fine-tuning, atomic checkpoints and exact resume.

    python run_squad.py --model_name_or_path bert-base-uncased --pkm_layers 4 8 \
        --train_file train-v1.1.json --validation_file dev-v1.1.json --output_dir out/squad
"""

from __future__ import annotations  # annotations name numpy/datasets types that `--help` does not import

import argparse
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


if HELP:
    SchedulerType = str  # parse_args() only prints the help
else:
    import datasets
    import numpy as np
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.logging import get_logger
    from accelerate.utils import gather_object, set_seed
    from datasets import Dataset, DatasetDict, load_dataset
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from modeling_pkm_bert.training.squad import (
        SquadFormatError,
        check_answers,
        postprocess_qa_predictions,
        read_squad_json,
        squad_features,
    )

    import transformers
    from transformers import AutoTokenizer, DataCollatorWithPadding, SchedulerType, default_data_collator, get_scheduler

    from modeling_pkm_bert.hub.model_card import card_base_model, card_license
    from modeling_pkm_bert.analysis.memory_usage import (
        flatten_memory_usage,
        format_memory_usage,
        gather,
        track_memory_usage,
    )
    from modeling_pkm_bert.training.squad_metrics import squad_scores
    from modeling_pkm_bert.training.sparse_finetuning import check_smf_arguments
    from modeling_pkm_bert.training.sparse_finetuning import setup_from_args as setup_sparse_memory_finetuning
    from modeling_pkm_bert.parallel import prepare_memory_parallel, register_sharded_checkpointing, save_sharded_model
    from modeling_pkm_bert.analysis import MetricsLog, write_run_memory_report
    from modeling_pkm_bert.training import (
        atomic_write_json,
        check_checkpoint,
        check_data_files,
        check_freeze_memory,
        clip_memory_gradients,
        create_memory_optimizer,
        freeze_memory,
        load_model,
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

REQUIRED_COLUMNS = ("id", "question", "context", "answers")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Fine-tune a BERT or BertPkm model on SQuAD (extractive QA)")
    parser.add_argument(
        "--dataset_name", type=str, default=None, help="A Hub dataset in the SQuAD layout (squad, squad_v2)."
    )
    parser.add_argument("--dataset_config_name", type=str, default=None, help="The configuration name of the dataset.")
    parser.add_argument(
        "--train_file", type=str, default=None, help="Training data: a json file in the official nested SQuAD layout."
    )
    parser.add_argument(
        "--validation_file", type=str, default=None, help="Evaluation data: a json file in the official SQuAD layout."
    )
    parser.add_argument(
        "--fix_answer_starts",
        action="store_true",
        help="Move an answer whose text is not at its answer_start to the nearest occurrence of the text in the "
        "context (default: such an answer is an error naming the question).",
    )
    parser.add_argument("--preprocessing_num_workers", type=int, default=None, help="Processes for the tokenization.")
    parser.add_argument(
        "--overwrite_cache", action="store_true", help="Overwrite the cached training and evaluation sets."
    )
    parser.add_argument(
        "--max_seq_length",
        type=int,
        default=384,
        help="The maximum total input sequence length after tokenization; longer contexts are split into features.",
    )
    parser.add_argument(
        "--doc_stride", type=int, default=128, help="Tokens shared by two consecutive features of a long context."
    )
    parser.add_argument(
        "--pad_to_max_length",
        action="store_true",
        help="Pad all features to `max_seq_length`. Otherwise, dynamic padding is used.",
    )
    parser.add_argument(
        "--n_best_size", type=int, default=20, help="Start and end logits considered per feature when post-processing."
    )
    parser.add_argument("--max_answer_length", type=int, default=30, help="The longest answer, in tokens.")
    parser.add_argument(
        "--version_2_with_negative", action="store_true", help="SQuAD v2: some questions have no answer."
    )
    parser.add_argument(
        "--null_score_diff_threshold",
        type=float,
        default=0.0,
        help="v2: predict no answer when the null score exceeds the best span's score by more than this.",
    )
    parser.add_argument("--max_train_samples", type=int, default=None, help="Truncate the training examples (debug).")
    parser.add_argument("--max_eval_samples", type=int, default=None, help="Truncate the evaluation examples (debug).")
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
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="Peak learning rate (paper, Table 3: 5e-5).")
    parser.add_argument("--weight_decay", type=float, default=0.01, help="Weight decay (paper, Table 3: 0.01).")
    parser.add_argument("--num_train_epochs", type=int, default=3, help="Training epochs (paper, Table 3: 3).")
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
    if args.dataset_name is None and args.train_file is None and args.validation_file is None:
        parser.error("Need either a dataset name or a training/validation file.")
    for name in ("train_file", "validation_file"):
        path = getattr(args, name)
        if path is not None and not path.endswith(".json"):
            parser.error(f"--{name} must be a .json file in the official SQuAD layout, got {path!r}")
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{name} {path!r} does not exist")
    if args.doc_stride >= args.max_seq_length:
        parser.error(f"--doc_stride ({args.doc_stride}) must be smaller than --max_seq_length ({args.max_seq_length})")
    if args.checkpointing_steps is not None and not (
        args.checkpointing_steps == "epoch" or args.checkpointing_steps.isdigit()
    ):
        parser.error(f"--checkpointing_steps must be an integer or 'epoch', got {args.checkpointing_steps!r}")
    if args.push_to_hub and args.output_dir is None:
        parser.error("Need an `output_dir` to create a repo when `--push_to_hub` is passed.")
    if args.memory_report and args.output_dir is None:
        parser.error("--memory_report writes into <output_dir>/memory_report: give an --output_dir")
    if (args.checkpointing_steps or args.resume_from_checkpoint == "latest") and args.output_dir is None:
        parser.error("--checkpointing_steps and --resume_from_checkpoint latest need an --output_dir")
    check_data_files(parser, [(f"--{name}", getattr(args, name)) for name in ("train_file", "validation_file")])
    try:
        check_smf_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def load_raw_datasets(args) -> DatasetDict:
    """The train/validation examples, from the Hub or from json files in the official nested layout; checks the
    columns and, for SQuAD v1.1, that every question has an answer."""
    if args.dataset_name is not None:
        raw_datasets = load_dataset(
            args.dataset_name, args.dataset_config_name, trust_remote_code=args.trust_remote_code
        )
        raw_datasets = DatasetDict({k: v for k, v in raw_datasets.items() if k in ("train", "validation")})
    else:
        raw_datasets = DatasetDict()
    for split, path in (("train", args.train_file), ("validation", args.validation_file)):
        if path is not None:
            raw_datasets[split] = Dataset.from_list(read_squad_json(path), features=squad_features())
    if not raw_datasets:
        raise ValueError(f"{args.dataset_name} has neither a 'train' nor a 'validation' split")

    for split, dataset in raw_datasets.items():
        missing = [column for column in REQUIRED_COLUMNS if column not in dataset.column_names]
        if missing:
            raise SquadFormatError(
                f"the {split} data lacks the column(s) {missing}; SQuAD examples need {list(REQUIRED_COLUMNS)}"
            )
        if not args.version_2_with_negative:
            unanswered = [i for i, answers in zip(dataset["id"], dataset["answers"]) if len(answers["text"]) == 0]
            if unanswered:
                raise SquadFormatError(
                    f"the {split} data has {len(unanswered)} question(s) without an answer (e.g. {unanswered[:3]}); "
                    "SQuAD v1.1 needs one per question: pass --version_2_with_negative for unanswerable questions"
                )
    return raw_datasets


def predict_logits(args, accelerator, model, features, collate_fn) -> tuple[np.ndarray, np.ndarray]:
    """Start and end logits of every evaluation feature, as `(len(features), longest batch)` arrays padded with -100.

    Each process runs its own contiguous shard through the unwrapped model, so that every feature is seen exactly once
    (a prepared dataloader repeats features to even out the last batch: harmless for `gather_for_metrics`, but memory
    usage trackers would count their lookups twice) and no collective runs per batch.
    """
    model = accelerator.unwrap_model(model)
    model.eval()
    inputs = features.remove_columns(["example_id", "offset_mapping"])
    shard = inputs.shard(num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True)
    dataloader = DataLoader(shard, collate_fn=collate_fn, batch_size=args.per_device_eval_batch_size)
    start_logits, end_logits = [], []
    for batch in dataloader:
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        with torch.no_grad(), accelerator.autocast():
            outputs = model(**batch)
        # rows as wide as their batch: post-processing never reads beyond a feature's own offsets
        start_logits += list(outputs.start_logits.float().cpu().numpy())
        end_logits += list(outputs.end_logits.float().cpu().numpy())
    start_logits, end_logits = gather_object(start_logits), gather_object(end_logits)

    longest = max(len(row) for row in start_logits)
    start_array = np.full((len(start_logits), longest), -100, dtype=np.float64)
    end_array = np.full((len(end_logits), longest), -100, dtype=np.float64)
    for i, (start, end) in enumerate(zip(start_logits, end_logits)):
        start_array[i, : len(start)], end_array[i, : len(end)] = start, end
    return start_array, end_array


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

    # Get the datasets: a Hub dataset in the SQuAD layout, or json files in the official nested layout.
    with accelerator.main_process_first():
        raw_datasets = load_raw_datasets(args)
    do_train, do_eval = "train" in raw_datasets, "validation" in raw_datasets

    # Load pretrained model and tokenizer
    pkm_kwargs = pkm_kwargs_from_args(args)
    model = load_model(
        "question-answering",
        args.model_name_or_path,
        pkm_kwargs,
        trust_remote_code=args.trust_remote_code,
        logger=logger,
    )
    if model.config.num_labels != 2:
        raise ValueError(
            f"{args.model_name_or_path} has a head of {model.config.num_labels} labels; extractive QA needs 2 "
            "(start and end logits): fine-tune from the encoder checkpoint instead"
        )
    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
    )
    if args.freeze_memory:
        check_freeze_memory(model)
        logger.info(f"Froze {freeze_memory(model)} memory parameters (--freeze_memory).")

    # Preprocessing the datasets.
    # Padding side determines if we do (question|context) or (context|question).
    pad_on_right = tokenizer.padding_side == "right"
    if args.max_seq_length > tokenizer.model_max_length:
        logger.warning(
            f"The max_seq_length passed ({args.max_seq_length}) is larger than the maximum length for the "
            f"model ({tokenizer.model_max_length}). Using max_seq_length={tokenizer.model_max_length}."
        )
    max_seq_length = min(args.max_seq_length, tokenizer.model_max_length)

    def tokenize(examples):
        # Some questions have lots of white space on the left, which would take room from the context.
        questions = [q.lstrip() for q in examples["question"]]
        # Long contexts give several features, each overlapping the previous by `doc_stride` tokens.
        return tokenizer(
            questions if pad_on_right else examples["context"],
            examples["context"] if pad_on_right else questions,
            truncation="only_second" if pad_on_right else "only_first",
            max_length=max_seq_length,
            stride=args.doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length" if args.pad_to_max_length else False,
        )

    # Training preprocessing: label each feature with the token span of the first answer, or the CLS token when the
    # answer is not inside the feature (or the question has none).
    def prepare_train_features(examples):
        tokenized_examples = tokenize(examples)
        sample_mapping = tokenized_examples.pop("overflow_to_sample_mapping")
        offset_mapping = tokenized_examples.pop("offset_mapping")
        tokenized_examples["start_positions"] = []
        tokenized_examples["end_positions"] = []
        context_index = 1 if pad_on_right else 0

        for i, offsets in enumerate(offset_mapping):
            input_ids = tokenized_examples["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
            sequence_ids = tokenized_examples.sequence_ids(i)
            answers = examples["answers"][sample_mapping[i]]
            if len(answers["answer_start"]) == 0:
                tokenized_examples["start_positions"].append(cls_index)
                tokenized_examples["end_positions"].append(cls_index)
                continue
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])

            # The first and last tokens of the context in this feature.
            token_start_index = sequence_ids.index(context_index)
            token_end_index = len(sequence_ids) - 1 - sequence_ids[::-1].index(context_index)
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                tokenized_examples["start_positions"].append(cls_index)
                tokenized_examples["end_positions"].append(cls_index)
            else:
                # Move token_start_index and token_end_index to the two ends of the answer.
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                tokenized_examples["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                tokenized_examples["end_positions"].append(token_end_index + 1)
        return tokenized_examples

    # Validation preprocessing: keep the example id of each feature and the offsets of its context tokens (None
    # elsewhere), to map the predicted spans back to the text.
    def prepare_validation_features(examples):
        tokenized_examples = tokenize(examples)
        sample_mapping = tokenized_examples.pop("overflow_to_sample_mapping")
        tokenized_examples["example_id"] = []
        context_index = 1 if pad_on_right else 0
        for i in range(len(tokenized_examples["input_ids"])):
            sequence_ids = tokenized_examples.sequence_ids(i)
            tokenized_examples["example_id"].append(examples["id"][sample_mapping[i]])
            tokenized_examples["offset_mapping"][i] = [
                (o if sequence_ids[k] == context_index else None)
                for k, o in enumerate(tokenized_examples["offset_mapping"][i])
            ]
        return tokenized_examples

    def check(example):
        return check_answers(example, fix_answer_starts=args.fix_answer_starts)

    with accelerator.main_process_first():
        if do_train:
            train_examples = raw_datasets["train"]
            if args.max_train_samples is not None:
                train_examples = train_examples.select(range(min(args.max_train_samples, len(train_examples))))
            train_examples = train_examples.map(check, desc="Checking the training answers")
            train_dataset = train_examples.map(
                prepare_train_features,
                batched=True,
                num_proc=args.preprocessing_num_workers,
                remove_columns=train_examples.column_names,
                load_from_cache_file=not args.overwrite_cache,
                desc="Running tokenizer on train dataset",
            )
        if do_eval:
            eval_examples = raw_datasets["validation"]
            if args.max_eval_samples is not None:
                eval_examples = eval_examples.select(range(min(args.max_eval_samples, len(eval_examples))))
            eval_examples = eval_examples.map(check, desc="Checking the evaluation answers")
            eval_dataset = eval_examples.map(
                prepare_validation_features,
                batched=True,
                num_proc=args.preprocessing_num_workers,
                remove_columns=eval_examples.column_names,
                load_from_cache_file=not args.overwrite_cache,
                desc="Running tokenizer on validation dataset",
            )

    if do_train:
        # Log a few random samples from the training set:
        for index in random.Random(0).sample(range(len(train_dataset)), min(3, len(train_dataset))):
            logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    # DataLoaders creation:
    if args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        # Tensor cores want multiples of 8 (16 for fp8) under mixed precision.
        if accelerator.mixed_precision == "fp8":
            pad_to_multiple_of = 16
        elif accelerator.mixed_precision != "no":
            pad_to_multiple_of = 8
        else:
            pad_to_multiple_of = None
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
    if do_train:
        # Sparse memory finetuning: background statistics, everything but the memory values frozen (--smf_*).
        checkpoint = None
        if args.resume_from_checkpoint:
            checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        smf = setup_sparse_memory_finetuning(
            args, accelerator, model, tokenizer, args.max_seq_length, checkpoint, logger
        )

        # Optimizer: the main AdamW on a warm-up + decay schedule; the memory values in their own Adam at a constant
        # learning rate without weight decay (XLM and the paper).
        main_groups, memory_groups = optimizer_param_groups(model, args.weight_decay)
        optimizer = torch.optim.AdamW(main_groups or [{"params": []}], lr=args.learning_rate)  # empty: all frozen (SMF)
        memory_optimizer = create_memory_optimizer(memory_groups, args, model)

        # Scheduler and math around the number of training steps.
        overrode_max_train_steps = False
        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        if args.max_train_steps is None:
            args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
            overrode_max_train_steps = True
        # The prepared scheduler steps once per process at each optimizer step: count in those ticks.
        scheduler_steps = args.max_train_steps * (1 if overrode_max_train_steps else accelerator.num_processes)
        if args.num_warmup_steps is not None:
            scheduler_warmup_steps = args.num_warmup_steps * accelerator.num_processes
        else:
            scheduler_warmup_steps = math.ceil(args.warmup_ratio * scheduler_steps)
        lr_scheduler = get_scheduler(
            name=args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=scheduler_warmup_steps,
            num_training_steps=scheduler_steps,
        )

        # Prepare everything with our `accelerator`.
        model, optimizer, lr_scheduler, train_dataloader = accelerator.prepare(
            model, optimizer, lr_scheduler, train_dataloader
        )
        if memory_optimizer is not None:
            memory_optimizer = accelerator.prepare(memory_optimizer)
        optimizers = [o for o in (optimizer, memory_optimizer) if o is not None]
        register_sharded_checkpointing(accelerator, model, optimizers, args)  # --fsdp2: model and optimizers via DCP
        if smf is not None:  # each value step trains only the chosen rows; the statistics go into every checkpoint
            smf.attach(memory_optimizer)
            smf.register_for_checkpointing(accelerator)

        # We need to recalculate our total training steps as the size of the training dataloader may have changed.
        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        if overrode_max_train_steps:
            args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        # Afterwards we recalculate our number of training epochs
        args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    else:
        model = accelerator.prepare(model)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    # what an exact resume depends on, saved in every checkpoint and compared on resume
    settings = run_settings(args, accelerator, train_dataset) if do_train else None

    # We need to initialize the trackers we use, and also store our configuration.
    if args.with_tracking:
        accelerator.init_trackers("squad_no_trainer", tracker_config(args))  # secrets removed

    # Train!
    completed_steps, starting_epoch, resume_batches, train_loss = 0, 0, 0, None
    train_start = time.perf_counter()
    if do_train:
        total_batch_size = (
            args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
        )
        logger.info("***** Running training *****")
        logger.info(f"  Num examples = {len(train_examples)} ({len(train_dataset)} features)")
        logger.info(f"  Num Epochs = {args.num_train_epochs}")
        logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
        logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
        logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        logger.info(f"  Total optimization steps = {args.max_train_steps}")
        logger.info(f"  Warm-up steps = {scheduler_warmup_steps // accelerator.num_processes}")
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

        metrics_log = MetricsLog(args.output_dir, accelerator.is_main_process, resume=bool(args.resume_from_checkpoint))
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
            metrics_log.log({"train_loss": epoch_losses[-1], "epoch": epoch}, step=completed_steps)
            if args.with_tracking:
                accelerator.log({"train_loss": epoch_losses[-1], "epoch": epoch}, step=completed_steps)
            if args.checkpointing_steps == "epoch":
                save_checkpoint(accelerator, args.output_dir, f"epoch_{epoch}", settings)
            if completed_steps >= args.max_train_steps:
                break
        progress_bar.close()
        train_loss = epoch_losses[-1] if epoch_losses else None
    train_runtime = time.perf_counter() - train_start

    results = {}
    if do_train:
        results.update(
            {
                "train_loss": train_loss,
                "train_runtime": round(train_runtime, 2),
                "train_samples": len(train_examples),
                "train_features": len(train_dataset),
                "epoch": args.num_train_epochs,
                "step": completed_steps,
            }
        )

    # Evaluation, with the memory usage of the fine-tuned model on the evaluation features (paper, Table 6).
    if do_eval:
        eval_start = time.perf_counter()
        logger.info("***** Running Evaluation *****")
        logger.info(f"  Num examples = {len(eval_examples)} ({len(eval_dataset)} features)")
        logger.info(f"  Batch size = {args.per_device_eval_batch_size}")
        with track_memory_usage(accelerator.unwrap_model(model)) as tracker:
            start_logits, end_logits = predict_logits(args, accelerator, model, eval_dataset, data_collator)

        # Post-processing: the best span of each example; predictions json {question id: answer text}.
        predictions, null_odds = postprocess_qa_predictions(
            examples=eval_examples,
            features=eval_dataset,
            predictions=(start_logits, end_logits),
            version_2_with_negative=args.version_2_with_negative,
            n_best_size=args.n_best_size,
            max_answer_length=args.max_answer_length,
            null_score_diff_threshold=args.null_score_diff_threshold,
            output_dir=args.output_dir if accelerator.is_main_process else None,
            prefix="eval",
        )
        references = [{"id": i, "answers": a} for i, a in zip(eval_examples["id"], eval_examples["answers"])]
        eval_metric = squad_scores(
            predictions,
            references,
            version_2_with_negative=args.version_2_with_negative,
            na_probs=null_odds,
            na_prob_thresh=args.null_score_diff_threshold,
        )
        logger.info(f"Evaluation metrics: {eval_metric}")
        results.update({f"eval_{k}": v for k, v in eval_metric.items()})
        results["eval_samples"] = len(eval_examples)
        results["eval_features"] = len(eval_dataset)

        gather(tracker, accelerator)
        if tracker.accumulators:
            memory_usage = tracker.results()
            logger.info(f"Memory usage on the evaluation data:\n{format_memory_usage(memory_usage)}")
            results.update(flatten_memory_usage(memory_usage, prefix="eval_memory"))
        results["eval_runtime"] = round(time.perf_counter() - eval_start, 2)

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
            if args.memory_report:  # the memory usage over the evaluation contexts (or the training ones)
                examples = eval_examples if do_eval else train_examples
                contexts = list(dict.fromkeys(examples["context"]))
                write_run_memory_report(args, unwrapped_model, tokenizer, texts=contexts)
            if args.push_to_hub:
                push_to_hub(args, results, command)
    return results


def push_to_hub(args, results, command=None):
    """Writes a model card carrying the results into output_dir and uploads the folder (no checkpoints)."""
    from modeling_pkm_bert.hub.upload import push_folder_to_hub

    repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    default_dataset = "squad_v2" if args.version_2_with_negative else "squad"
    write_results_model_card(
        args.output_dir,
        results,
        repo_id=repo_id,
        base_model=card_base_model(args.model_name_or_path, args.base_model),
        license=card_license(args.model_name_or_path, args.license),
        dataset=args.dataset_name or args.train_file or args.validation_file or default_dataset,
        task="question-answering",
        command=command,
    )
    push_folder_to_hub(
        args.output_dir, repo_id, private=args.hub_private_repo, token=args.hub_token, commit_message="End of training"
    )


if __name__ == "__main__":
    main()
