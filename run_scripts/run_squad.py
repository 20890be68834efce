#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Fine-tunes a BERT or BertPkm model on SQuAD v1.1 (or v2.0 with `--version_2_with_negative`) with 🤗 Accelerate.

Follows the transformers `run_qa_no_trainer.py` example; adds the product key memory options (convert a plain BERT
checkpoint on load with any `--pkm_*` flag, the memory values' own optimizer, `--freeze_memory`), the official SQuAD
evaluation computed locally (no Hub metric), the memory usage after fine-tuning, and the training loop the four
scripts share (`training/loop.py`: `--eval_steps` for SQuAD scores during training, `--track_staleness`,
`--mixed_precision`, atomic checkpoints with exact resume, `metrics.jsonl`, a saved folder with a results model card).

    python run_squad.py --model_name_or_path bert-base-uncased --pkm_layers 4 8 \
        --train_file train-v1.1.json --validation_file dev-v1.1.json --output_dir out/squad
"""

from __future__ import annotations  # annotations name numpy/datasets types that `--help` does not import

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
from modeling_pkm_bert.utils.input_errors import InputError, exits_with_usage_errors  # noqa: E402


if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    import numpy as np
    from accelerate.logging import get_logger
    from accelerate.utils import gather_object
    from datasets import Dataset, DatasetDict, load_dataset

    from transformers import DataCollatorWithPadding, default_data_collator

    from modeling_pkm_bert.analysis.memory_usage import flatten_memory_usage, format_memory_usage, gather, track_memory_usage
    from modeling_pkm_bert.analysis.report import write_run_memory_report
    from modeling_pkm_bert.methods.optimizers.memory_optimizer import freeze_memory
    from modeling_pkm_bert.training.checkpoints import run_settings
    from modeling_pkm_bert.training.checks import (
        check_data_files,
        check_freeze_memory,
        check_model_config,
        validate_training_arguments,
    )
    from modeling_pkm_bert.training.evaluation import evaluating, shard_batches
    from modeling_pkm_bert.training.loading import load_model, load_tokenizer, pkm_kwargs_from_args
    from modeling_pkm_bert.training.loop import (
        TrainingLoop,
        create_scheduler,
        finish_run,
        plan_training_steps,
        warmup_steps,
    )
    from modeling_pkm_bert.training.preparation import prepare_training, start_run
    from modeling_pkm_bert.training.results import tracker_config
    from modeling_pkm_bert.training.squad import (
        SquadFormatError,
        check_answers,
        postprocess_qa_predictions,
        read_squad_json,
        squad_features,
    )
    from modeling_pkm_bert.training.squad_metrics import squad_scores
    from modeling_pkm_bert.utils.positions import sequence_length

    logger = get_logger(__name__)

REQUIRED_COLUMNS = ("id", "question", "context", "answers")


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__), description="Fine-tune a BERT or BertPkm model on SQuAD (extractive QA)"
    )
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
        default=None,
        help="The maximum total input sequence length after tokenization (default: 384, at most the model's "
        "positions); longer contexts are split into features.",
    )
    parser.add_argument(
        "--doc_stride",
        type=int,
        default=None,
        help="Tokens shared by two consecutive features of a long context (default: 128, at most a third of "
        "--max_seq_length).",
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
    # batch sizes, optimisation, checkpoints, evaluation cadence, staleness, Hub; the paper's SQuAD recipe (Table 3)
    add_training_arguments(parser, warmup_ratio=0.06, weight_decay=0.01)
    add_pkm_arguments(parser)
    add_parallel_arguments(parser)  # --fsdp2, --memory_parallel
    add_reliability_arguments(parser)
    add_model_card_arguments(parser)
    add_method_arguments(parser, task="question-answering")  # sparse memory finetuning
    add_memory_report_arguments(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    # Sanity checks, before any work
    validate_training_arguments(parser, args)
    if args.dataset_name is None and args.train_file is None and args.validation_file is None:
        parser.error("Need either a dataset name or a training/validation file.")
    for name in ("train_file", "validation_file"):
        path = getattr(args, name)
        if path is not None and not path.endswith(".json"):
            parser.error(f"--{name} must be a .json file in the official SQuAD layout, got {path!r}")
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{name} {path!r} does not exist")
    if args.doc_stride is not None and args.max_seq_length is not None and args.doc_stride >= args.max_seq_length:
        parser.error(f"--doc_stride ({args.doc_stride}) must be smaller than --max_seq_length ({args.max_seq_length})")
    check_data_files(parser, [(f"--{name}", getattr(args, name)) for name in ("train_file", "validation_file")])
    check_method_arguments(args, "question-answering")
    check_model_config(parser, args, "question-answering")  # the config the flags ask for, before any loading
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
        raise InputError(f"{args.dataset_name} has neither a 'train' nor a 'validation' split")

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
    Each process predicts its own shard (`training.evaluation`: every feature seen once, memory usage counted once);
    the training random streams are left as they were."""
    inputs = features.remove_columns(["example_id", "offset_mapping"])
    start_logits, end_logits = [], []
    with evaluating(accelerator, model) as unwrapped:
        for batch in shard_batches(accelerator, inputs, collate_fn, args.per_device_eval_batch_size):
            outputs = unwrapped(**batch)
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


@exits_with_usage_errors(build_parser)  # what only the model or data shows (a head of 3 labels): a usage error
def main(argv=None):
    args = parse_args(argv)
    # secrets (by flag name and by parsed destination) and paths removed
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir, parser=build_parser())
    start_time = time.perf_counter()

    # Initialize the accelerator (a resumed run sees the batches the uninterrupted one would), the logging, the seed
    # (drawn and logged without --seed) and the output folder (proven writable before any work).
    accelerator = start_run(args, logger)

    # Get the datasets: a Hub dataset in the SQuAD layout, or json files in the official nested layout.
    with accelerator.main_process_first():
        raw_datasets = load_raw_datasets(args)
    do_train = "train" in raw_datasets and args.max_train_steps != 0 and args.num_train_epochs > 0
    do_eval = "validation" in raw_datasets

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
        raise InputError(
            f"{args.model_name_or_path} has a head of {model.config.num_labels} labels; extractive QA needs 2 "
            "(start and end logits): fine-tune from the encoder checkpoint instead"
        )
    tokenizer = load_tokenizer(
        args.tokenizer_name or args.model_name_or_path,
        "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path",
        trust_remote_code=args.trust_remote_code,
    )
    if args.freeze_memory:
        check_freeze_memory(model)
        logger.info(f"Froze {freeze_memory(model)} memory parameters (--freeze_memory).")

    # Preprocessing the datasets.
    # Padding side determines if we do (question|context) or (context|question).
    pad_on_right = tokenizer.padding_side == "right"
    # SQuAD's 384 and 128 tokens by default, at most what the model's positions take (a given length must fit them)
    args.max_seq_length = sequence_length(model.config, args.max_seq_length, 384)
    if args.doc_stride is None:
        args.doc_stride = min(128, args.max_seq_length // 3)
    elif args.doc_stride >= args.max_seq_length:
        raise InputError(f"--doc_stride ({args.doc_stride}) must be smaller than --max_seq_length ({args.max_seq_length})")
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

    def examples_and_features(split, max_samples, prepare_features):
        examples = raw_datasets[split]
        if max_samples is not None:
            examples = examples.select(range(min(max_samples, len(examples))))
        examples = examples.map(check, desc=f"Checking the {split} answers")
        features = examples.map(
            prepare_features,
            batched=True,
            num_proc=args.preprocessing_num_workers,
            remove_columns=examples.column_names,
            load_from_cache_file=not args.overwrite_cache,
            desc=f"Running tokenizer on {split} dataset",
        )
        return examples, features

    train_dataset = None
    with accelerator.main_process_first():
        if do_train:
            train_examples, train_dataset = examples_and_features("train", args.max_train_samples, prepare_train_features)
        if do_eval:
            eval_examples, eval_dataset = examples_and_features(
                "validation", args.max_eval_samples, prepare_validation_features
            )

    if do_train:
        # Log a few random samples from the training set:
        for index in random.Random(0).sample(range(len(train_dataset)), min(3, len(train_dataset))):
            logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    # The collator: dynamic padding unless everything was padded to max_length.
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

    # The training dataloader; the optimizer: the main AdamW with a warm-up + decay schedule, the memory values in
    # their own optimizer at a constant learning rate without weight decay (XLM and the paper). Prepare everything
    # with our `accelerator` (the model sharded first with --fsdp2 / --memory_parallel; SMF set up with --smf_*).
    model, optimizer, memory_optimizer, train_dataloader, methods = prepare_training(
        accelerator, args, model, train_dataset, data_collator,
        tokenizer=tokenizer, max_seq_length=max_seq_length, logger=logger,
    )

    # Scheduler and math around the number of training steps (from the prepared, per-process dataloader).
    steps_per_epoch = plan_training_steps(args, train_dataloader)
    lr_scheduler = create_scheduler(accelerator, args, optimizer)  # warm-up: --num_warmup_steps or --warmup_ratio

    # We need to initialize the trackers we use, and also store our configuration (secrets removed).
    if args.with_tracking:
        accelerator.init_trackers("squad_no_trainer", tracker_config(args))

    # The evaluation: the best span of each example from the start and end logits of its features, scored with the
    # official SQuAD script (predictions json {question id: answer text} in output_dir with `save_predictions`).
    def evaluate(when, save_predictions=False):
        start_logits, end_logits = predict_logits(args, accelerator, model, eval_dataset, data_collator)
        predictions, null_odds = postprocess_qa_predictions(
            examples=eval_examples,
            features=eval_dataset,
            predictions=(start_logits, end_logits),
            version_2_with_negative=args.version_2_with_negative,
            n_best_size=args.n_best_size,
            max_answer_length=args.max_answer_length,
            null_score_diff_threshold=args.null_score_diff_threshold,
            output_dir=args.output_dir if save_predictions and accelerator.is_main_process else None,
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
        logger.info(f"Evaluation metrics ({when}): {eval_metric}")
        return {f"eval_{k}": v for k, v in eval_metric.items()}

    # The training loop's bookkeeping (resume, evaluation cadence, checkpoints, metrics log, staleness): the loop
    # below computes the loss. A SQuAD evaluation is costly: during training only with --eval_steps (the official
    # script evaluates once, at the end).
    loop = TrainingLoop(
        accelerator, args, model, [o for o in (optimizer, memory_optimizer) if o is not None], lr_scheduler,
        train_dataloader,
        steps_per_epoch=steps_per_epoch,
        settings=run_settings(args, accelerator, train_dataset) if do_train else None,  # what a resume must match
        evaluate=evaluate if do_eval and args.eval_steps else None,
        methods=methods, logger=logger,
    )  # fmt: skip
    results = {}

    # Train!
    if do_train:
        loop.announce(
            f"{len(train_examples)} ({len(train_dataset)} features)", f"Warm-up steps = {warmup_steps(args)}"
        )
        loop.resume()  # Potentially load in the weights and states from a previous save
        for epoch in loop.epochs():
            for step, batch in loop.batches(epoch):
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    loop.step(loss)  # backward; at an optimizer step: SMF rows, memory clipping, every optimizer
                loop.after_batch()  # after an optimizer step: metrics log, step checkpoint, --eval_steps evaluation
            loop.after_epoch(epoch)  # evaluation (but after the last epoch), epoch checkpoint
        results.update(loop.results(), train_samples=len(train_examples), train_features=len(train_dataset))

    # Evaluation, with the memory usage of the fine-tuned model on the evaluation features (paper, Table 6).
    if do_eval:
        eval_start = time.perf_counter()
        logger.info("***** Running Evaluation *****")
        logger.info(f"  Num examples = {len(eval_examples)} ({len(eval_dataset)} features)")
        logger.info(f"  Batch size = {args.per_device_eval_batch_size}")
        with track_memory_usage(accelerator.unwrap_model(model)) as tracker:
            metrics = evaluate("after training" if do_train else "evaluation", save_predictions=True)
        loop.log_evaluation(metrics, final=True)
        results.update(metrics, eval_samples=len(eval_examples), eval_features=len(eval_dataset))
        gather(tracker, accelerator)
        if tracker.accumulators:
            memory_usage = tracker.results()
            logger.info(f"Memory usage on the evaluation data:\n{format_memory_usage(memory_usage)}")
            results.update(flatten_memory_usage(memory_usage, prefix="eval_memory"))
        results["eval_runtime"] = round(time.perf_counter() - eval_start, 2)

    # Save the model (a BertPkm folder is a complete Hub repository: code files, auto_map, tokenizer, model card with
    # the results), all_results.json, the memory report (over the evaluation contexts, or the training ones); push to
    # the Hub.
    def memory_report(trained_model):
        examples = eval_examples if do_eval else train_examples if do_train else raw_datasets["train"]
        write_run_memory_report(args, trained_model, tokenizer, texts=list(dict.fromkeys(examples["context"])))

    card = dict(
        dataset=args.dataset_name
        or args.train_file
        or args.validation_file
        or ("squad_v2" if args.version_2_with_negative else "squad"),
        task="question-answering",
        command=command,
    )
    return finish_run(
        accelerator, args, model, tokenizer, results,
        loop=loop, card=card, start_time=start_time, logger=logger, memory_report=memory_report,
    )  # fmt: skip


if __name__ == "__main__":
    main()
