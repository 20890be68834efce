#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Masked language modeling (continued pretraining) of BERT and BertPkm models with 🤗 Accelerate: the pretraining
recipe of Kim & Jung 2020 (sections 4-6, Table 2), runnable on a laptop or a GPU cluster.

Follows the transformers `run_mlm_no_trainer.py` example and adds:
* product key memory: any `--pkm_*` flag converts a plain BERT checkpoint on load (the paper's "+Init"), e.g.
  `--pkm_layers 4 8 --pkm_mode resm` for "+Init +ResM"; the memory values train in their own optimizer at a constant
  `--memory_learning_rate` (1e-3, no weight decay, no warm-up: XLM and the paper), optionally with the row-wise sparse
  update `--memory_optimizer sparse_row_adam`; `--freeze_memory`;
* several evaluation sets (`--validation_files wt2=wiki.test.raw pg19=book.txt`, Table 2's WikiText-2 /
  WikiText-103 / PG-19 columns), each with its masked-LM loss and perplexity, and the memory usage of every memory
  layer on the first one (MU, top-1 MU, KL_u, KL_w, ...: section 3.2) in the log, the trackers and `all_results.json`;
* `--track_staleness`: for every memory slot, the last training step at which it was a top-1 pick (section 3.1,
  Figure 2), kept in checkpoints and written to `staleness.safetensors`;
* `--sparse_memory_finetuning` (Lin et al. 2025): only the memory value rows that each step reads much more than
  background text does are trained (`--smf_background_file`, `--smf_top_t`, `--smf_ranker tfidf|kl`, with
  `--memory_optimizer sgd`), the background statistics kept in checkpoints and beside the trained model; or the rows
  of largest gradient (`--smf_ranker gradient`, no background);
* exact resume: `--checkpointing_steps` saves the complete state atomically, and a resumed run ends with the weights
  of the uninterrupted one (same `--seed`): the masks of a batch are drawn from (seed, process, epoch, batch), each
  epoch's order from (seed, epoch), evaluation never touches the training random streams;
* with no data arguments, a public-domain excerpt shipped with the project (`run_scripts/data/`, Pride and Prejudice
  chapters 1-20 for training; its last three chapters and two chapters of Moby-Dick for evaluation).

The paper's recipe (section 5.2) for BERT-base, 12 layers, memories at layers {4, 8} (0-based here: 4 8):

    accelerate launch run_mlm.py --model_name_or_path bert-base-uncased --pkm_layers 4 8 --pkm_mode resm \\
        --train_file corpus.txt --validation_files wt2=wikitext-2/wiki.test.raw wt103=wikitext-103/wiki.test.raw \\
        pg19=pg19_test.txt --max_seq_length 512 --per_device_train_batch_size 32 --gradient_accumulation_steps 1 \\
        --learning_rate 1e-4 --weight_decay 0.01 --num_warmup_steps 10000 --max_train_steps 500000 \\
        --memory_learning_rate 1e-3 --mixed_precision fp16 --checkpointing_steps 100000 --track_staleness \\
        --seed 42 --output_dir bert-base-resm-init          # 32 GPUs x 32 = the paper's 1024 sequences a step

Launchers:
* one process: `python run_mlm.py ...`;
* GPUs: `accelerate launch [--num_processes N] run_mlm.py ...` (dense value gradients: NCCL has no sparse
  all-reduce, so `--memory_optimizer sparse_row_adam` falls back to dense gradients there);
* several processes on CPU (gloo): `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 run_mlm.py ...` —
  `accelerate launch --cpu` starts several processes only through MPI.

Data: `--dataset_name` (Hub, needs the network or a cache) or `--train_file` / `--validation_file(s)`: `.txt` (also
`.raw`, `.tokens`: one text per line, empty lines dropped), `.csv` or `.json`/`.jsonl` (json lines) with a text
column (`--text_column_name`, default `text` or the only column). Lines are concatenated and cut into blocks of
`--max_seq_length` tokens unless `--line_by_line`. Validation masks are drawn once from each example's index, so
every evaluation of every run (any seed, any number of processes) scores the same masked positions.
"""

from __future__ import annotations  # annotations name torch/datasets types that `--help` does not import

import argparse
import os
import random
import sys
import time
from itertools import chain
from pathlib import Path


from modeling_pkm_bert.analysis.arguments import add_memory_report_arguments  # noqa: E402
from modeling_pkm_bert.hub.card_command import card_command  # noqa: E402
from modeling_pkm_bert.methods.registry import add_method_arguments, check_method_arguments  # noqa: E402
from modeling_pkm_bert.parallel.arguments import add_parallel_arguments  # noqa: E402
from modeling_pkm_bert.training.arguments import (  # noqa: E402
    add_language_modeling_arguments,
    add_model_card_arguments,
    add_pkm_arguments,
    add_reliability_arguments,
    add_training_arguments,
    help_requested,
)
from modeling_pkm_bert.utils.input_errors import InputError, exits_with_usage_errors  # noqa: E402


if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    import numpy as np
    import torch
    from accelerate.logging import get_logger
    from transformers import (
        MODEL_MAPPING,
        AutoModelForMaskedLM,
        DataCollatorForTokenClassification,
        DataCollatorWithPadding,
    )

    from modeling_pkm_bert import register_auto_classes
    from modeling_pkm_bert.analysis.memory_usage import flatten_memory_usage, format_memory_usage
    from modeling_pkm_bert.analysis.report import write_run_memory_report
    from modeling_pkm_bert.methods.optimizers.memory_optimizer import freeze_memory
    from modeling_pkm_bert.methods.trime.objective import check_trime_model, model_trime_losses
    from modeling_pkm_bert.training.checkpoints import run_settings
    from modeling_pkm_bert.training.checks import check_freeze_memory, check_model_config, validate_training_arguments
    from modeling_pkm_bert.training.lm_data import (
        check_language_modeling_arguments,
        evaluate_language_model,
        load_raw_datasets,
    )
    from modeling_pkm_bert.training.masking import (
        PaddingWithUnits, check_spans, cut_unit_codes, mask_tokens, unit_codes,
    )
    from modeling_pkm_bert.training.loading import config_from_scratch, load_model, load_tokenizer, pkm_kwargs_from_args
    from modeling_pkm_bert.utils.positions import usable_positions
    from modeling_pkm_bert.training.loop import TrainingLoop, create_scheduler, finish_run, plan_training_steps
    from modeling_pkm_bert.training.preparation import prepare_training, start_run
    from modeling_pkm_bert.training.results import tracker_config

    logger = get_logger(__name__)

    MODEL_TYPES = tuple(config.model_type for config in MODEL_MAPPING.keys())

# The embedded default data: public-domain excerpts (see run_scripts/data/README.md).
EMBEDDED_DATA = Path(__file__).resolve().parent / "data"
EMBEDDED_TRAIN_FILE = EMBEDDED_DATA / "pride_and_prejudice_train.txt"
EMBEDDED_VALIDATION_FILES = {
    "pride_and_prejudice": EMBEDDED_DATA / "pride_and_prejudice_validation.txt",  # held-out chapters of the book
    "moby_dick": EMBEDDED_DATA / "moby_dick_validation.txt",  # another author: the "PG-19" of the demo
}
# the validation masks depend on this and on each example's index only: comparable across runs and seeds
EVAL_MASK_SEED = 0


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__),
        description="Masked language modeling (continued pretraining) of BERT/BertPkm models",
    )
    add_language_modeling_arguments(parser)  # data, model, tokenizer
    add_training_arguments(parser)  # batch sizes, optimisation, checkpoints, evaluation cadence, staleness, Hub
    parser.add_argument(
        "--pad_to_max_length",
        action="store_true",
        help="With --line_by_line, pad all samples to `max_seq_length` (default: dynamic padding).",
    )
    parser.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="The maximum total input sequence length after tokenization. Sequences longer than this will be "
        "truncated (default: the tokenizer's maximum, at most 1024 and the model's positions).",
    )
    parser.add_argument(
        "--line_by_line",
        action="store_true",
        help="Whether distinct lines of text in the dataset are to be handled as distinct sequences.",
    )
    parser.add_argument(
        "--mlm_probability",
        type=float,
        default=0.15,
        help="Ratio of tokens (with --whole_word_masking: of words) to mask for masked language modeling loss; 0 "
        "with --span_column masks the given spans only.",
    )
    parser.add_argument(
        "--whole_word_masking",
        action="store_true",
        help="Mask whole words: all the tokens of a word or none (needs a fast tokenizer).",
    )
    parser.add_argument(
        "--span_column",
        default=None,
        help="Salient-span (value) masking: the column of the json/jsonl data files that holds each text's spans to "
        'mask as [start, end) character offsets, e.g. {"text": "Ada was born in Paris.", "spans": [[16, 21]]}. A '
        "span is masked whole, with --span_mask_probability; the other tokens with --mlm_probability.",
    )
    parser.add_argument(
        "--span_mask_probability",
        type=float,
        default=1.0,
        help="With --span_column: the probability that a span is masked in an exposure (default 1: every time).",
    )
    parser.add_argument(
        "--mask_replace_prob",
        type=float,
        default=0.8,
        help="Of the masked tokens, the share replaced by [MASK] (BERT: 0.8).",
    )
    parser.add_argument(
        "--random_replace_prob",
        type=float,
        default=None,
        help="Of the masked tokens, the share replaced by a random token (default: BERT's 0.1, at most what "
        "--mask_replace_prob leaves); the rest stays as it is.",
    )
    add_pkm_arguments(parser)
    add_parallel_arguments(parser)  # --fsdp2, --memory_parallel
    add_reliability_arguments(parser)
    add_model_card_arguments(parser)
    add_method_arguments(parser, task="masked-lm")  # TRIME, sparse memory finetuning
    add_memory_report_arguments(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    # Sanity checks, before any work
    validate_training_arguments(parser, args)
    check_language_modeling_arguments(parser, args, EMBEDDED_TRAIN_FILE, EMBEDDED_VALIDATION_FILES, MODEL_TYPES)
    check_masking_arguments(parser, args)
    check_method_arguments(args, "masked-lm")  # TRIME's memories resolved, sparse memory finetuning
    check_model_config(parser, args, "masked-lm")  # the config the flags ask for, before any weight or data loads
    return args


def check_masking_arguments(parser, args) -> None:
    """The masking flags, checked together before any work (`parser.error`)."""
    if not (0 <= args.mlm_probability < 1 if args.span_column else 0 < args.mlm_probability < 1):
        allowed = "[0, 1) with --span_column (the spans alone)" if args.span_column else "(0, 1)"
        parser.error(f"--mlm_probability must be in {allowed}, got {args.mlm_probability}")
    if not 0 < args.span_mask_probability <= 1:
        parser.error(f"--span_mask_probability must be in (0, 1], got {args.span_mask_probability}")
    if args.random_replace_prob is None:
        args.random_replace_prob = round(min(0.1, 1 - args.mask_replace_prob), 12)
    for option in ("mask_replace_prob", "random_replace_prob"):
        if not 0 <= getattr(args, option) <= 1:
            parser.error(f"--{option} must be in [0, 1], got {getattr(args, option)}")
    if args.mask_replace_prob + args.random_replace_prob > 1:
        parser.error(
            f"--mask_replace_prob {args.mask_replace_prob} and --random_replace_prob {args.random_replace_prob} add "
            "up to more than 1"
        )
    train_file = args.train_file if not args.dataset_name else None  # evaluation sets may be plain text (random masks)
    if args.span_column and train_file is not None and not str(train_file).lower().endswith((".json", ".jsonl")):
        parser.error(f"--span_column needs a json/jsonl --train_file (spans are lists): --train_file is {train_file!r}")


def mask_seed(*numbers: int) -> int:
    """A 32-bit seed mixed from non-negative integers (seed, process, epoch, batch...) by numpy's SeedSequence."""
    return int(np.random.SeedSequence([int(n) for n in numbers]).generate_state(1)[0])


def mask_batch(args, tokenizer, input_ids, special_tokens_mask, units, seed: int):
    """One batch masked as the flags say (`training.masking`), drawn from its own generator seeded with `seed`:
    (masked input_ids, labels with -100 elsewhere). Random masking alone draws what the official collator draws."""
    return mask_tokens(
        input_ids.detach().cpu(),
        special_tokens_mask.detach().cpu(),
        units=None if units is None else units.detach().cpu(),
        mask_token_id=tokenizer.mask_token_id,
        vocab_size=len(tokenizer),
        generator=torch.Generator().manual_seed(seed),
        mlm_probability=args.mlm_probability,
        mask_replace_prob=args.mask_replace_prob,
        random_replace_prob=args.random_replace_prob,
        span_mask_probability=args.span_mask_probability,
    )


def evaluate(args, accelerator, model, eval_datasets, collate_fn, measure_memory_usage=False):
    """Masked-LM loss and perplexity on every evaluation set, and the memory usage of every memory layer on the first
    one: (metrics, {layer: usage}). Each process evaluates its own contiguous shard with the unwrapped model, so every
    example counts exactly once; the loss is the mean over all masked tokens, summed across processes."""

    def score(model, batch):  # (summed loss, summed TRIME loss with the in-batch memory, masked tokens)
        trime_loss = torch.zeros((), device=accelerator.device)
        if args.trime_eval:
            labels = batch.pop("labels")
            loss, trime_loss = model_trime_losses(
                model, batch, labels, args.trime_eval, chunk_size=args.trime_chunk_size
            )
            batch["labels"] = labels
        else:
            loss = model(**batch).loss
        masked = (batch["labels"] != -100).sum()
        return loss.double() * masked, trime_loss.double() * masked, masked

    return evaluate_language_model(
        accelerator, model, eval_datasets, collate_fn, args.per_device_eval_batch_size, score,
        trime=bool(args.trime_eval), measure_memory_usage=measure_memory_usage,
    )  # fmt: skip


@exits_with_usage_errors(build_parser)  # what only the model or data shows (a sequence too long): a usage error
def main(argv=None):
    args = parse_args(argv)
    # secrets (by flag name and by parsed destination) and paths removed
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir, parser=build_parser())
    start_time = time.perf_counter()

    # Initialize the accelerator (a resumed run sees the batches the uninterrupted one would), the logging, the seed
    # (drawn and logged without --seed) and the output folder (proven writable before any work).
    accelerator = start_run(args, logger)

    # Get the datasets: a dataset from the Hub, your own txt/csv/json files, or the embedded public-domain excerpt.
    if args.embedded_data:
        logger.info(
            f"No data arguments: training on {EMBEDDED_TRAIN_FILE.name} and evaluating on "
            f"{', '.join(p.name for p in EMBEDDED_VALIDATION_FILES.values())} (public domain, run_scripts/data/)"
        )
    with accelerator.main_process_first():
        raw_train, raw_validation = load_raw_datasets(args)

    # Load pretrained model and tokenizer. A plain BERT checkpoint with --pkm_* flags is converted on load (+Init).
    register_auto_classes()  # bert_pkm configs and checkpoints resolve to this package's classes
    pkm_kwargs = pkm_kwargs_from_args(args)
    tokenizer_source = args.tokenizer_name or args.model_name_or_path
    tokenizer = load_tokenizer(
        tokenizer_source,
        "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path",
        use_fast=not args.use_slow_tokenizer,
        trust_remote_code=args.trust_remote_code,
    )
    if args.model_name_or_path is not None:
        model = load_model(
            "masked-lm", args.model_name_or_path, pkm_kwargs, trust_remote_code=args.trust_remote_code, logger=logger
        )
    else:
        logger.info("Training new model from scratch")
        model = AutoModelForMaskedLM.from_config(
            config_from_scratch(args, pkm_kwargs, logger=logger), trust_remote_code=args.trust_remote_code
        ).float()
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    if args.freeze_memory:
        check_freeze_memory(model)
        logger.info(f"--freeze_memory: {freeze_memory(model):,} memory parameters are kept fixed")
    if args.trime or args.trime_eval:
        check_trime_model(model)  # its output layer must be a vocabulary projection TRIME can read

    # Preprocessing the datasets: tokenize, then concatenate the texts and cut them into blocks of max_seq_length
    # (or one sequence per line with --line_by_line).
    max_positions = usable_positions(model.config)  # RoBERTa: max_position_embeddings - 2
    if args.max_seq_length is None:
        max_seq_length = min(tokenizer.model_max_length, 1024, max_positions)
        logger.info(f"--max_seq_length not given: using {max_seq_length}")
    else:
        if args.max_seq_length > min(tokenizer.model_max_length, max_positions):
            raise InputError(
                f"--max_seq_length {args.max_seq_length} is longer than the model can take "
                f"({min(tokenizer.model_max_length, max_positions)})"
            )
        max_seq_length = args.max_seq_length

    # Whole-word and span masking need each token's unit (training.masking): from the offsets of a fast tokenizer.
    with_units = args.whole_word_masking or args.span_column is not None
    if with_units and not tokenizer.is_fast:
        raise InputError("--whole_word_masking and --span_column need a fast tokenizer: drop --use_slow_tokenizer")

    def add_units(encoding, examples):
        units = []
        for i, text in enumerate(examples["text"]):
            spans = examples["spans"][i] if "spans" in examples else None
            spans = check_spans(spans, text, f"the spans of {text[:40]!r}")
            word_ids = encoding.word_ids(i) if args.whole_word_masking else None
            units.append(unit_codes(encoding["offset_mapping"][i], word_ids, spans))
        encoding.pop("offset_mapping")
        encoding["mask_units"] = units
        return encoding

    def tokenize_line_by_line(examples):
        encoding = tokenizer(
            examples["text"],
            padding="max_length" if args.pad_to_max_length else False,
            truncation=True,
            max_length=max_seq_length,
            # We use this option because DataCollatorForLanguageModeling is more efficient when it receives the
            # `special_tokens_mask`.
            return_special_tokens_mask=True,
            return_offsets_mapping=with_units,
        )
        return add_units(encoding, examples) if with_units else encoding

    def tokenize(examples):
        # Whole lines, often longer than the model takes: group_texts cuts them into blocks of max_seq_length, so the
        # tokenizer's warning "sequence length is longer than the specified maximum ... indexing errors" does not
        # apply here; verbose=False silences that warning only (it is the one this call could give).
        encoding = tokenizer(
            examples["text"], return_special_tokens_mask=True, return_offsets_mapping=with_units, verbose=False
        )
        return add_units(encoding, examples) if with_units else encoding

    # Main data processing function that will concatenate all texts from our dataset and generate chunks of
    # max_seq_length (the remainder of each batch of 1000 texts is dropped, as in the official script).
    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated[list(examples.keys())[0]]) // max_seq_length) * max_seq_length
        blocks = {
            k: [t[i : i + max_seq_length] for i in range(0, total_length, max_seq_length)]
            for k, t in concatenated.items()
        }
        if "mask_units" in blocks:  # a block that begins inside a word or span begins that unit anew
            blocks["mask_units"] = cut_unit_codes(concatenated["mask_units"], max_seq_length)
        return blocks

    def preprocess(dataset, split):
        kwargs = dict(num_proc=args.preprocessing_num_workers, load_from_cache_file=not args.overwrite_cache)
        tokenized = dataset.map(
            tokenize_line_by_line if args.line_by_line else tokenize,
            batched=True,
            remove_columns=dataset.column_names,
            desc=f"Running tokenizer on {split}",
            **kwargs,
        )
        if args.line_by_line:
            return tokenized
        desc = f"Grouping {split} in blocks of {max_seq_length}"
        return tokenized.map(group_texts, batched=True, desc=desc, **kwargs)

    # The validation masks are drawn once, from each example's index: every evaluation scores the same positions.
    def mask_for_evaluation(example, index):
        input_ids, labels = mask_batch(
            args,
            tokenizer,
            torch.tensor([example["input_ids"]]),
            torch.tensor([example["special_tokens_mask"]]),
            torch.tensor([example["mask_units"]]) if "mask_units" in example else None,
            mask_seed(EVAL_MASK_SEED, index),
        )
        return {"input_ids": input_ids[0].tolist(), "labels": labels[0].tolist()}

    with accelerator.main_process_first():
        train_dataset = preprocess(raw_train, "train") if raw_train is not None else None
        eval_datasets = {}
        for name, dataset in raw_validation.items():
            dataset = preprocess(dataset, name)
            if args.max_eval_samples is not None:
                dataset = dataset.select(range(min(args.max_eval_samples, len(dataset))))
            eval_datasets[name] = dataset.map(
                mask_for_evaluation,
                with_indices=True,
                remove_columns=[c for c in ("special_tokens_mask", "mask_units") if c in dataset.column_names],
                desc=f"Masking {name}",
            )
    if train_dataset is not None and args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(args.max_train_samples, len(train_dataset))))
    for name, dataset in [("the training set", train_dataset), *eval_datasets.items()]:
        if dataset is not None and len(dataset) == 0:
            raise InputError(
                f"{name} yields no sequence of {max_seq_length} tokens: give more text, a smaller --max_seq_length, "
                "or --line_by_line"
            )
    do_train = train_dataset is not None and args.max_train_steps != 0 and args.num_train_epochs > 0

    # Log a few random samples from the training set:
    if do_train:
        for index in random.Random(args.seed).sample(range(len(train_dataset)), min(3, len(train_dataset))):
            logger.info(
                f"Sample {index} of the training set: {tokenizer.decode(train_dataset[index]['input_ids'])!r}."
            )

    # The collators: the training one only pads (the masks are drawn per batch in the loop below), the evaluation one
    # also pads the fixed labels with -100.
    pad_to_multiple_of = 8 if accelerator.mixed_precision != "no" else None
    train_collator = PaddingWithUnits(DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of))
    eval_collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    # The training dataloader; the optimizer: the main AdamW with a warm-up + decay schedule, the memory values in
    # their own optimizer at a constant learning rate without weight decay (XLM and the paper; --memory_optimizer
    # sparse_row_adam: row-wise updates). Prepare everything with our `accelerator` (the model sharded first with
    # --fsdp2 / --memory_parallel; sparse memory finetuning set up with --smf_*).
    model, optimizer, memory_optimizer, train_dataloader, methods = prepare_training(
        accelerator, args, model, train_dataset if do_train else None, train_collator,
        tokenizer=tokenizer, max_seq_length=max_seq_length, logger=logger,
    )
    optimizers = [o for o in (optimizer, memory_optimizer) if o is not None]

    # Scheduler and math around the number of training steps (from the prepared, per-process dataloader).
    steps_per_epoch = plan_training_steps(args, train_dataloader)
    lr_scheduler = create_scheduler(accelerator, args, optimizer)

    # We need to initialize the trackers we use, and also store our configuration (secrets removed).
    if args.with_tracking:
        accelerator.init_trackers("mlm_no_trainer", tracker_config(args))

    def evaluate_and_report(when, measure_memory_usage=False):
        metrics, usage = evaluate(args, accelerator, model, eval_datasets, eval_collator, measure_memory_usage)
        logger.info(
            f"{when}: "
            + ", ".join(f"{name} perplexity {metrics[f'eval_{name}_perplexity']:.2f}" for name in eval_datasets)
        )
        if usage:
            logger.info(f"Memory usage on {next(iter(eval_datasets))} ({when}):\n{format_memory_usage(usage)}")
        return metrics, usage

    # The training loop's bookkeeping (resume, evaluation cadence, checkpoints, metrics log, staleness): the loop
    # below computes the loss.
    loop = TrainingLoop(
        accelerator, args, model, optimizers, lr_scheduler, train_dataloader,
        steps_per_epoch=steps_per_epoch,
        settings=run_settings(args, accelerator, train_dataset) if do_train else None,  # what a resume must match
        evaluate=(lambda when: evaluate_and_report(when)[0]) if eval_datasets else None,
        methods=methods, logger=logger, desc="MLM steps",
    )  # fmt: skip
    results = {}

    # The model as loaded, before any update (Figure 3 starts here; a converted MiniLM has a new MLM head, so its
    # perplexity is very high before training).
    if args.evaluate_before_training and eval_datasets and not args.resume_from_checkpoint:
        metrics, usage = evaluate_and_report("before training", measure_memory_usage=True)
        results.update({f"initial_{k}": v for k, v in metrics.items()})
        results.update(flatten_memory_usage(usage, prefix="initial_eval_memory"))
        loop.log_evaluation({**metrics, **flatten_memory_usage(usage, prefix="eval_memory")})

    # Train!
    if do_train:
        loop.announce(f"{len(train_dataset)} (sequences of up to {max_seq_length} tokens)")
        loop.resume()  # Potentially load in the weights and states from a previous save
        for epoch in loop.epochs():
            for step, batch in loop.batches(epoch):
                # The masks of this batch depend on (seed, process, epoch, batch) only.
                seed = mask_seed(args.seed, accelerator.process_index, epoch, step)
                special, units = batch.pop("special_tokens_mask"), batch.pop("mask_units", None)
                input_ids, labels = mask_batch(args, tokenizer, batch["input_ids"], special, units, seed)
                batch["input_ids"], batch["labels"] = input_ids.to(accelerator.device), labels.to(accelerator.device)
                with accelerator.accumulate(model):
                    if args.trime:  # TRIME: the other masked positions of the batch are a memory
                        labels = batch.pop("labels")
                        loss = model_trime_losses(model, batch, labels, args.trime, chunk_size=args.trime_chunk_size)[1]
                    else:
                        loss = model(**batch).loss
                    loop.step(loss)  # backward; at an optimizer step: SMF rows, memory clipping, every optimizer
                loop.after_batch()  # after an optimizer step: metrics log, step checkpoint, --eval_steps evaluation
            loop.after_epoch(epoch)  # evaluation (but after the last epoch), epoch checkpoint
        results.update(loop.results(), train_samples=len(train_dataset))

    # Evaluation: the perplexity on every evaluation set and the memory usage on the first one (section 3.2).
    if eval_datasets:
        eval_start = time.perf_counter()
        metrics, usage = evaluate_and_report("after training" if do_train else "evaluation", measure_memory_usage=True)
        results["perplexity"] = metrics[f"eval_{next(iter(eval_datasets))}_perplexity"]  # the official script's key
        loop.log_evaluation(metrics, final=True)
        results.update(metrics)
        results.update(flatten_memory_usage(usage, prefix="eval_memory"))
        for name, dataset in eval_datasets.items():
            results[f"eval_{name}_samples"] = len(dataset)
        results["eval_runtime"] = round(time.perf_counter() - eval_start, 2)

    # Save the model (a BertPkm folder is a complete Hub repository: code files, auto_map, tokenizer, model card with
    # the results), all_results.json, the memory report; push to the Hub.
    def memory_report(trained_model):
        first_set = next(iter(args.validation_sets.values()), None)
        write_run_memory_report(args, trained_model, tokenizer, validation_file=first_set)

    card = dict(
        dataset=args.dataset_name or args.train_file or "run_scripts/data/pride_and_prejudice_train.txt",
        task="fill-mask",
        command=command,
        title="Masked language modeling results",
    )
    return finish_run(
        accelerator, args, model, tokenizer, results,
        loop=loop, card=card, start_time=start_time, logger=logger, memory_report=memory_report,
    )  # fmt: skip

if __name__ == "__main__":
    main()
