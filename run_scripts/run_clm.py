#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Causal language modeling of BertPkm models (Lample et al. 2019: product key memory in a left-to-right LM) and of plain
causal models (`AutoModelForCausalLM`: BertLMHeadModel, GPT-2, ...) with 🤗 Accelerate, optionally with TRIME's
in-batch memory objective (Zhong et al. 2022).

Follows the transformers `run_clm_no_trainer.py` example and shares with `run_mlm.py` (the same flags, the same
training loop: `modeling_pkm_bert.training.loop`):
* product key memory: `--pkm_*` flags (a BERT config or checkpoint becomes a BertPkm model with memories), the values
  in their own optimizer at a constant `--memory_learning_rate`, `--memory_optimizer`, `--freeze_memory`;
* several evaluation sets (`--validation_files wt2=wiki.test.raw pg19=book.txt`), each with its loss and perplexity,
  the memory usage of every memory layer on the first one, `--track_staleness`;
* `--sparse_memory_finetuning` (Lin et al. 2025): only the memory value rows that each step reads much more than
  background text does are trained (the background text cut into blocks as the training text is);
* exact resume (`--checkpointing_steps`, `--resume_from_checkpoint`; a resume with other settings or data stops
  unless `--allow_inexact_resume`), two or more processes, `metrics.jsonl` (every step's loss, every evaluation),
  `all_results.json` and the model folder written atomically, a model card (`--base_model`, `--license`; its command
  without secrets or local paths), `--memory_report`, `--push_to_hub`; `--memory_max_grad_norm`;
* with no data arguments, the public-domain excerpt shipped with the project (`run_scripts/data/`).

TRIME (`--trime local|long`, `modeling_pkm_bert/methods/trime/objective.py`): the training loss scores each next token against the
vocabulary and against the other positions of the batch (local: the earlier positions of the same block; long: also
the previous blocks of the batch, which are then consecutive blocks of the text). Every evaluation reports the
ordinary perplexity and, with `--trime` or `--trime_eval`, the perplexity with the same memory at test time
(`eval_<set>_trime_perplexity`).

A small BertPkm causal LM from scratch, with a memory at layer 2 (0-based) and TRIME_long:

    python run_clm.py --config_name bert-base-uncased --tokenizer_name bert-base-uncased \\
        --config_overrides "num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024" \\
        --pkm_layers 2 --pkm_n_keys 128 --pkm_k_dim 128 --block_size 128 --trime long \\
        --train_file wikitext-2-raw/wiki.train.raw --validation_files wt2=wikitext-2-raw/wiki.valid.raw \\
        --per_device_train_batch_size 16 --learning_rate 5e-4 --max_train_steps 20000 --output_dir clm-pkm

A BERT config or checkpoint is made a decoder (`is_decoder=True`: causal self-attention). Launch with `python`,
`accelerate launch`, or `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 run_clm.py ...` on CPU processes.
"""

from __future__ import annotations  # annotations name torch types that `--help` does not import

import argparse
import os
import random
import sys
import time
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
    import torch
    from accelerate.logging import get_logger
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    from modeling_pkm_bert import BertPkmConfig, RobertaPkmConfig, register_auto_classes
    from modeling_pkm_bert.analysis.memory_usage import flatten_memory_usage, format_memory_usage
    from modeling_pkm_bert.analysis.report import write_run_memory_report
    from modeling_pkm_bert.methods.optimizers.memory_optimizer import freeze_memory
    from modeling_pkm_bert.methods.trime.objective import causal_targets, check_trime_model, model_trime_losses
    from modeling_pkm_bert.training.checkpoints import run_settings
    from modeling_pkm_bert.training.checks import check_freeze_memory, check_model_config, validate_training_arguments
    from modeling_pkm_bert.training.lm_data import (
        check_language_modeling_arguments,
        evaluate_language_model,
        load_raw_datasets,
    )
    from modeling_pkm_bert.training.loading import (
        config_from_scratch,
        load_model,
        load_tokenizer,
        pkm_kwargs_from_args,
        read_config,
    )
    from modeling_pkm_bert.utils.positions import ROBERTA_FAMILY_MODEL_TYPES, usable_positions
    from modeling_pkm_bert.training.loop import TrainingLoop, create_scheduler, finish_run, plan_training_steps
    from modeling_pkm_bert.training.preparation import prepare_training, start_run
    from modeling_pkm_bert.training.results import tracker_config

    logger = get_logger(__name__)

    MODEL_TYPES = (
        *(config.model_type for config in MODEL_FOR_CAUSAL_LM_MAPPING.keys()),
        BertPkmConfig.model_type,
        RobertaPkmConfig.model_type,
    )
    # BERT-family configs are bidirectional unless made decoders
    DECODER_MODEL_TYPES = ("bert", BertPkmConfig.model_type, *ROBERTA_FAMILY_MODEL_TYPES)

# The embedded default data: public-domain excerpts (see run_scripts/data/README.md).
EMBEDDED_DATA = Path(__file__).resolve().parent / "data"
EMBEDDED_TRAIN_FILE = EMBEDDED_DATA / "pride_and_prejudice_train.txt"
EMBEDDED_VALIDATION_FILES = {
    "pride_and_prejudice": EMBEDDED_DATA / "pride_and_prejudice_validation.txt",  # held-out chapters of the book
    "moby_dick": EMBEDDED_DATA / "moby_dick_validation.txt",  # another author
}


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__), description="Causal language modeling of BertPkm and other causal models"
    )
    add_language_modeling_arguments(parser)  # data, model, tokenizer
    add_training_arguments(parser)  # batch sizes, optimisation, checkpoints, evaluation cadence, staleness, Hub
    parser.add_argument(
        "--config_overrides",
        type=str,
        default=None,
        help="Override config fields of a model trained from scratch: "
        '"num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024".',
    )
    parser.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="Training and evaluation blocks of this many tokens (default: the model's positions, at most 1024).",
    )
    add_pkm_arguments(parser)
    add_parallel_arguments(parser)  # --fsdp2, --memory_parallel
    add_reliability_arguments(parser)
    add_model_card_arguments(parser)
    add_method_arguments(parser, task="causal-lm")  # TRIME, sparse memory finetuning
    add_memory_report_arguments(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    # Sanity checks, before any work
    validate_training_arguments(parser, args)
    check_language_modeling_arguments(parser, args, EMBEDDED_TRAIN_FILE, EMBEDDED_VALIDATION_FILES, MODEL_TYPES)
    if args.config_overrides is not None and args.model_name_or_path is not None:
        parser.error("--config_overrides applies to a model trained from scratch, not with --model_name_or_path")
    if args.block_size is not None and args.block_size < 2:
        parser.error(f"--block_size must be at least 2 (a token and its successor), got {args.block_size}")
    check_method_arguments(args, "causal-lm")  # TRIME's memories resolved, sparse memory finetuning
    check_model_config(parser, args, "causal-lm")  # the config the flags ask for, before any weight or data loads
    return args


def lm_targets(batch: dict) -> torch.Tensor:
    """The next-token target of every position of the batch (-100 at the last one)."""
    return causal_targets(batch["labels"])


def evaluate(args, accelerator, model, eval_datasets, collate_fn, measure_memory_usage=False):
    """Loss and perplexity of every evaluation set, with the TRIME memory at test time too (`--trime_eval`), and the
    memory usage of every memory layer on the first set: (metrics, {layer: usage}). Each process scores its own
    contiguous shard in order: every token counts once, and the blocks of a batch are consecutive in the text
    (TRIME_long's memory). Losses are summed over tokens and processes."""

    def score(model, batch):  # (summed loss, summed TRIME loss, scored tokens)
        targets = lm_targets(batch)
        if args.trime_eval:
            loss, trime_loss = model_trime_losses(
                model, {"input_ids": batch["input_ids"]}, targets, args.trime_eval,
                reduction="sum", chunk_size=args.trime_chunk_size,
            )  # fmt: skip
        else:
            logits = model(input_ids=batch["input_ids"]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            trime_loss = torch.zeros_like(loss)
        return loss, trime_loss, (targets != -100).sum()

    return evaluate_language_model(
        accelerator, model, eval_datasets, collate_fn, args.per_device_eval_batch_size, score,
        trime=bool(args.trime_eval), measure_memory_usage=measure_memory_usage,
    )  # fmt: skip


@exits_with_usage_errors(build_parser)  # what only the model or data shows (a block too long): a usage error
def main(argv=None):
    args = parse_args(argv)
    # secrets (by flag name and by parsed destination) and paths removed
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir, parser=build_parser())
    start_time = time.perf_counter()

    # The accelerator, logging, seed (drawn and logged without --seed) and a writable output folder.
    accelerator = start_run(args, logger)

    # Get the datasets: a dataset from the Hub, your own txt/csv/json files, or the embedded public-domain excerpt.
    if args.embedded_data:
        logger.info(
            f"No data arguments: training on {EMBEDDED_TRAIN_FILE.name} and evaluating on "
            f"{', '.join(p.name for p in EMBEDDED_VALIDATION_FILES.values())} (public domain, run_scripts/data/)"
        )
    with accelerator.main_process_first():
        raw_train, raw_validation = load_raw_datasets(args)

    # Load the model and tokenizer. BERT-family configs become decoders (causal self-attention).
    register_auto_classes()
    pkm_kwargs = pkm_kwargs_from_args(args)
    tokenizer = load_tokenizer(
        args.tokenizer_name or args.model_name_or_path,
        "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path",
        use_fast=not args.use_slow_tokenizer,
        trust_remote_code=args.trust_remote_code,
    )
    if args.model_name_or_path is not None:
        source_type = read_config(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        decoder = {"is_decoder": True} if source_type.model_type in DECODER_MODEL_TYPES else {}
        model = load_model(
            "causal-lm",
            args.model_name_or_path,
            pkm_kwargs,
            config_overrides=decoder,
            trust_remote_code=args.trust_remote_code,
            logger=logger,
        )
    else:
        logger.info("Training new model from scratch")
        config = config_from_scratch(args, pkm_kwargs, logger=logger)
        if config.model_type in DECODER_MODEL_TYPES:
            config.is_decoder = True
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code).float()
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    if args.freeze_memory:
        check_freeze_memory(model)
        logger.info(f"--freeze_memory: {freeze_memory(model):,} memory parameters are kept fixed")
    if args.trime or args.trime_eval:
        check_trime_model(model)  # its output layer must be a vocabulary projection TRIME can read

    # Blocks: no longer than the model's positions.
    config = model.config
    max_positions = usable_positions(config)  # RoBERTa: max_position_embeddings - 2
    block_size = args.block_size or min(1024, max_positions or 1024, tokenizer.model_max_length)
    if max_positions is not None and block_size > max_positions:
        raise InputError(
            f"--block_size {block_size} is longer than the model's {max_positions} positions "
            "(max_position_embeddings): give a --block_size of at most that"
        )
    if args.block_size is None:
        logger.info(f"--block_size not given: using {block_size}")

    # Tokenize every line, each followed by a separator (the line break of the text), concatenate, cut into blocks.
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    long_memory = "long" in (args.trime, args.trime_eval)

    def tokenize(examples):
        ids = tokenizer(examples["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [line + [separator] if separator is not None else line for line in ids]}

    def group_texts(examples):
        concatenated = [token for line in examples["input_ids"] for token in line]
        total_length = len(concatenated) // block_size * block_size
        return {"input_ids": [concatenated[i : i + block_size] for i in range(0, total_length, block_size)]}

    def preprocess(dataset, split):
        kwargs = dict(num_proc=args.preprocessing_num_workers, load_from_cache_file=not args.overwrite_cache)
        dataset = dataset.map(
            tokenize, batched=True, remove_columns=dataset.column_names, desc=f"Running tokenizer on {split}", **kwargs
        )
        # in groups of 1000 lines (each group's remainder dropped, as the official script), or the whole text at once
        # when a TRIME_long memory needs consecutive blocks
        return dataset.map(
            group_texts,
            batched=True,
            batch_size=None if long_memory else 1000,
            desc=f"Grouping {split} in blocks of {block_size}",
            **kwargs,
        )

    with accelerator.main_process_first():
        train_dataset = preprocess(raw_train, "train") if raw_train is not None else None
        eval_datasets = {}
        for name, dataset in raw_validation.items():
            dataset = preprocess(dataset, name)
            if args.max_eval_samples is not None:
                dataset = dataset.select(range(min(args.max_eval_samples, len(dataset))))
            eval_datasets[name] = dataset
    if train_dataset is not None and args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(args.max_train_samples, len(train_dataset))))
    for name, dataset in [("the training set", train_dataset), *eval_datasets.items()]:
        if dataset is not None and len(dataset) == 0:
            raise InputError(
                f"{name} yields no block of {block_size} tokens: give more text or a smaller --block_size"
            )
    do_train = train_dataset is not None and args.max_train_steps != 0 and args.num_train_epochs > 0
    train_blocks = len(train_dataset) if train_dataset is not None else 0
    sampled_blocks = train_blocks

    # TRIME_long trains on batches of consecutive blocks: each training example becomes a group of
    # per_device_train_batch_size consecutive blocks, the groups are shuffled, and a batch is one group.
    consecutive = do_train and args.trime == "long"
    if consecutive:
        if len(train_dataset) < args.per_device_train_batch_size:
            raise InputError(
                f"--trime long: the training set has {len(train_dataset)} blocks of {block_size} tokens, fewer than "
                f"one batch of {args.per_device_train_batch_size} consecutive blocks: give more text or smaller sizes"
            )
        train_dataset = train_dataset.map(
            lambda examples: {"input_ids": [examples["input_ids"]]},
            batched=True,
            batch_size=args.per_device_train_batch_size,
            drop_last_batch=True,
            desc="Grouping consecutive blocks (TRIME_long)",
        )
        sampled_blocks = len(train_dataset) * args.per_device_train_batch_size  # the last partial group is dropped

    if do_train:
        for index in random.Random(args.seed).sample(range(sampled_blocks), min(3, sampled_blocks)):
            block = train_dataset[index // args.per_device_train_batch_size]["input_ids"] if consecutive else None
            ids = block[index % args.per_device_train_batch_size] if consecutive else train_dataset[index]["input_ids"]
            logger.info(f"Sample {index} of the training set: {tokenizer.decode(ids)!r}.")

    def collate_blocks(examples):
        input_ids = torch.tensor([example["input_ids"] for example in examples])
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def collate_group(examples):  # a batch of one example: a group of consecutive blocks
        return collate_blocks([{"input_ids": block} for block in examples[0]["input_ids"]])

    eval_collator = collate_blocks
    # The training dataloader (a batch is a group of consecutive blocks with TRIME_long), the model sharded with
    # --fsdp2 / --memory_parallel, sparse memory finetuning (background blocks cut as the training blocks are), the
    # optimizers: AdamW with warm-up and decay, the memory values in their own optimizer at a constant rate.
    model, optimizer, memory_optimizer, train_dataloader, methods = prepare_training(
        accelerator, args, model, train_dataset if do_train else None, collate_group if consecutive else collate_blocks,
        tokenizer=tokenizer, max_seq_length=block_size, logger=logger,
        batch_size=1 if consecutive else None, causal=True,
    )  # fmt: skip
    optimizers = [o for o in (optimizer, memory_optimizer) if o is not None]

    # Scheduler and math around the number of training steps (from the prepared, per-process dataloader).
    steps_per_epoch = plan_training_steps(args, train_dataloader)
    lr_scheduler = create_scheduler(accelerator, args, optimizer)

    # We need to initialize the trackers we use, and also store our configuration (secrets removed).
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", tracker_config(args))

    def evaluate_and_report(when, measure_memory_usage=False):
        metrics, usage = evaluate(args, accelerator, model, eval_datasets, eval_collator, measure_memory_usage)
        parts = []
        for name in eval_datasets:
            part = f"{name} perplexity {metrics[f'eval_{name}_perplexity']:.2f}"
            if args.trime_eval:
                part += f" ({metrics[f'eval_{name}_trime_perplexity']:.2f} with the {args.trime_eval} memory)"
            parts.append(part)
        logger.info(f"{when}: " + ", ".join(parts))
        if usage:
            logger.info(f"Memory usage on {next(iter(eval_datasets))} ({when}):\n{format_memory_usage(usage)}")
        return metrics, usage

    # The training loop's bookkeeping (resume, evaluation cadence, checkpoints, metrics log, staleness): the loop
    # below computes the loss. What an exact resume must match includes the blocks as sampled (TRIME_long's groups).
    loop = TrainingLoop(
        accelerator, args, model, optimizers, lr_scheduler, train_dataloader,
        steps_per_epoch=steps_per_epoch,
        settings=run_settings(args, accelerator, train_dataset) if do_train else None,
        evaluate=(lambda when: evaluate_and_report(when)[0]) if eval_datasets else None,
        methods=methods, logger=logger, desc="CLM steps",
    )  # fmt: skip
    results = {}

    # The model as loaded, before any update.
    if args.evaluate_before_training and eval_datasets and not args.resume_from_checkpoint:
        metrics, usage = evaluate_and_report("before training", measure_memory_usage=True)
        results.update({f"initial_{k}": v for k, v in metrics.items()})
        results.update(flatten_memory_usage(usage, prefix="initial_eval_memory"))
        loop.log_evaluation({**metrics, **flatten_memory_usage(usage, prefix="eval_memory")})

    # Train!
    if do_train:
        loop.announce(
            f"{train_blocks} blocks of {block_size} tokens",
            f"Loss = {f'TRIME with the {args.trime} memory' if args.trime else 'cross-entropy'}",
        )
        loop.resume()  # Potentially load in the weights and states from a previous save
        for epoch in loop.epochs():
            for step, batch in loop.batches(epoch):
                with accelerator.accumulate(model):
                    if args.trime:  # TRIME: the other positions of the batch (local, or also earlier blocks: long)
                        inputs, targets = {"input_ids": batch["input_ids"]}, lm_targets(batch)
                        chunk_size = args.trime_chunk_size
                        loss = model_trime_losses(model, inputs, targets, args.trime, chunk_size=chunk_size)[1]
                    else:
                        loss = model(**batch).loss
                    loop.step(loss)  # backward; at an optimizer step: SMF rows, memory clipping, every optimizer
                loop.after_batch()  # after an optimizer step: metrics log, step checkpoint, --eval_steps evaluation
            loop.after_epoch(epoch)  # evaluation (but after the last epoch), epoch checkpoint
        results.update(
            loop.results(), train_samples=train_blocks, train_tokens_per_step=loop.total_batch_size * block_size
        )

    # Evaluation: the perplexity of every set (with and without the TRIME memory) and the memory usage on the first.
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
        write_run_memory_report(args, trained_model, tokenizer, validation_file=first_set, max_seq_length=block_size)

    card = dict(
        dataset=args.dataset_name or args.train_file or "run_scripts/data/pride_and_prejudice_train.txt",
        task="text-generation",
        command=command,
        title="Causal language modeling results",
    )
    return finish_run(
        accelerator, args, model, tokenizer, results,
        loop=loop, card=card, start_time=start_time, logger=logger, memory_report=memory_report,
    )  # fmt: skip


if __name__ == "__main__":
    main()
