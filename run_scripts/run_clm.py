#!/usr/bin/env python
# Copyright 2021 The HuggingFace Inc. team and the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
Causal language modeling of BertPkm models (Lample et al. 2019: product key memory in a left-to-right LM) and of plain
causal models (`AutoModelForCausalLM`: BertLMHeadModel, GPT-2, ...) with 🤗 Accelerate, optionally with TRIME's
in-batch memory objective (Zhong et al. 2022).

Follows the transformers `run_clm_no_trainer.py` example and shares with `run_mlm.py`:
* product key memory: `--pkm_*` flags (a BERT config or checkpoint becomes a BertPkm model with memories), the values
  in their own optimizer at a constant `--memory_learning_rate`, `--memory_optimizer`, `--freeze_memory`;
* several evaluation sets (`--validation_files wt2=wiki.test.raw pg19=book.txt`), each with its loss and perplexity,
  the memory usage of every memory layer on the first one, `--track_staleness`;
* exact resume (`--checkpointing_steps`, `--resume_from_checkpoint`; a resume with other settings or data stops
  unless `--allow_inexact_resume`), two or more processes, `all_results.json` and the model folder written
  atomically, a model card (`--base_model`, `--license`; its command without secrets or local paths),
  `--push_to_hub`; `--memory_max_grad_norm`;
* with no data arguments, the public-domain excerpt shipped with the project (`run_scripts/data/`).

TRIME (`--trime local|long`, `modeling_pkm_bert/trime.py`): the training loss scores each next token against the
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
import collections
import contextlib
import importlib.util
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path


# `--help` prints every flag in a fraction of a second: it imports the flag module only (standard library; the
# package's import is lazy), not torch, transformers, datasets, accelerate (as run_mlm.py does)
HELP = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if importlib.util.find_spec("modeling_pkm_bert") is None:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from modeling_pkm_bert.training.arguments import (  # noqa: E402
    add_model_card_arguments,
    add_pkm_arguments,
    add_reliability_arguments,
    add_trime_arguments,
    card_command,
)
from modeling_pkm_bert.parallel.arguments import add_parallel_arguments  # noqa: E402


if HELP:
    SchedulerType = str  # parse_args() only prints the help
else:
    import datasets
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.logging import get_logger
    from accelerate.utils import broadcast_object_list, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    import transformers
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        SchedulerType,
        get_scheduler,
    )

    from modeling_pkm_bert import BertPkmConfig, register_auto_classes
    from modeling_pkm_bert.hub.model_card import card_base_model, card_license
    from modeling_pkm_bert.training.lm_data import check_data_file, load_raw_datasets, parse_validation_sets
    from modeling_pkm_bert.analysis.memory_usage import flatten_memory_usage, format_memory_usage, gather, track_memory_usage
    from modeling_pkm_bert.analysis.staleness import STALENESS_FILE, StalenessTracker
    from modeling_pkm_bert.parallel import (
        prepare_memory_parallel,
        register_sharded_checkpointing,
        save_sharded_model,
    )
    from modeling_pkm_bert.training import (
        atomic_write_json,
        check_checkpoint,
        check_data_files,
        check_freeze_memory,
        clip_memory_gradients,
        config_from_scratch,
        create_memory_optimizer,
        freeze_memory,
        load_model,
        memory_modules,
        memory_optimizer_summary,
        optimizer_param_groups,
        peak_memory_mb,
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
    from modeling_pkm_bert.training.trime import (
        causal_targets,
        check_trime_model,
        model_trime_losses,
        perplexity,
        resolve_trime_arguments,
    )

    logger = get_logger(__name__)

    MODEL_TYPES = (*(conf.model_type for conf in MODEL_FOR_CAUSAL_LM_MAPPING.keys()), BertPkmConfig.model_type)
    # BERT-family configs are bidirectional unless made decoders
    DECODER_MODEL_TYPES = ("bert", BertPkmConfig.model_type)

# The embedded default data: public-domain excerpts (see run_scripts/data/README.md).
EMBEDDED_DATA = Path(__file__).resolve().parent / "data"
EMBEDDED_TRAIN_FILE = EMBEDDED_DATA / "pride_and_prejudice_train.txt"
EMBEDDED_VALIDATION_FILES = {
    "pride_and_prejudice": EMBEDDED_DATA / "pride_and_prejudice_validation.txt",  # held-out chapters of the book
    "moby_dick": EMBEDDED_DATA / "moby_dick_validation.txt",  # another author
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Causal language modeling of BertPkm and other causal models")
    parser.add_argument("--dataset_name", type=str, default=None, help="A dataset of the datasets library (Hub).")
    parser.add_argument("--dataset_config_name", type=str, default=None, help="The configuration of the dataset.")
    parser.add_argument("--train_file", type=str, default=None, help="Training data: a txt, csv or json file.")
    parser.add_argument(
        "--validation_file", type=str, default=None, help="An evaluation file; see --validation_files."
    )
    parser.add_argument(
        "--validation_files",
        type=str,
        nargs="+",
        default=None,
        metavar="[NAME=]FILE",
        help="Several evaluation sets, each with its own loss and perplexity, e.g. `wt2=wiki.test.raw pg19=book.txt`; "
        "the name defaults to the file's name. The memory usage is measured on the first one.",
    )
    parser.add_argument(
        "--text_column_name", type=str, default=None, help="The text column of csv/json files (default: `text`)."
    )
    parser.add_argument(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="The percentage of the train set used as validation set when there is no validation split or file.",
    )
    parser.add_argument(
        "--max_train_samples", type=int, default=None, help="Keep the first n training blocks (after grouping)."
    )
    parser.add_argument("--max_eval_samples", type=int, default=None, help="Keep the first n blocks of each set.")
    parser.add_argument(
        "--model_name_or_path",
        type=str,
        default=None,
        help="A checkpoint: BertPkm, BERT (made a decoder; converted to BertPkm on load when --pkm_* flags are given) "
        "or any causal LM; without it a model is trained from scratch from --config_name/--model_type.",
    )
    parser.add_argument("--config_name", type=str, default=None, help="A config name or path (training from scratch).")
    parser.add_argument(
        "--config_overrides",
        type=str,
        default=None,
        help="Override config fields of a model trained from scratch: "
        '"num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024".',
    )
    parser.add_argument("--model_type", type=str, default=None, help="A model type, to train from scratch.")
    parser.add_argument("--tokenizer_name", type=str, default=None, help="A tokenizer name or path.")
    parser.add_argument("--use_slow_tokenizer", action="store_true", help="Use a slow (Python) tokenizer.")
    parser.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="Training and evaluation blocks of this many tokens (default: the model's positions, at most 1024).",
    )
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="Training blocks per device.")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8, help="Evaluation blocks per device.")
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="Initial learning rate (after warm-up).")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="Weight decay to use.")
    parser.add_argument("--num_train_epochs", type=int, default=3, help="Total number of training epochs to perform.")
    parser.add_argument(
        "--max_train_steps", type=int, default=None, help="Total number of training steps; overrides num_train_epochs."
    )
    parser.add_argument(
        "--gradient_accumulation_steps", type=int, default=1, help="Batches accumulated before each optimizer step."
    )
    parser.add_argument(
        "--lr_scheduler_type",
        type=SchedulerType,
        default="linear",
        help="The scheduler of the main optimizer (the memory values keep a constant rate).",
        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"],
    )
    parser.add_argument("--num_warmup_steps", type=int, default=0, help="Number of steps for the warm-up.")
    parser.add_argument(
        "--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"], help="Mixed precision."
    )
    parser.add_argument("--output_dir", type=str, default=None, help="Where to store the final model.")
    parser.add_argument(
        "--seed", type=int, default=None, help="A seed (drawn and logged if not given). Resume with the same seed."
    )
    parser.add_argument(
        "--preprocessing_num_workers", type=int, default=None, help="The number of processes to use for preprocessing."
    )
    parser.add_argument("--overwrite_cache", action="store_true", help="Overwrite the cached datasets.")
    parser.add_argument(
        "--checkpointing_steps",
        type=str,
        default=None,
        help="Save the complete training state every n optimizer steps (an integer), or 'epoch' at each epoch's end.",
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="A step_<N> or epoch_<E> folder to continue from, or 'latest' for the newest one in output_dir.",
    )
    parser.add_argument(
        "--eval_steps", type=int, default=None, help="Evaluate every n optimizer steps instead of every epoch."
    )
    parser.add_argument(
        "--evaluate_before_training", action="store_true", help="Also evaluate the model as loaded (`initial_*`)."
    )
    parser.add_argument(
        "--track_staleness",
        action="store_true",
        help="Record for every memory slot the last training step at which it was a top-1 pick.",
    )
    parser.add_argument("--staleness_bins", type=int, default=5, help="Step ranges of the staleness histogram.")
    parser.add_argument(
        "--trust_remote_code", action="store_true", help="Allow custom code from the Hub (trusted repos only)."
    )
    parser.add_argument("--push_to_hub", action="store_true", help="Whether or not to push the model to the Hub.")
    parser.add_argument("--hub_model_id", type=str, help="The Hub repository of the output_dir.")
    parser.add_argument("--hub_token", type=str, help="The token to use to push to the Model Hub.")
    parser.add_argument("--hub_private_repo", action="store_true", help="Create the Hub repository as private.")
    parser.add_argument("--with_tracking", action="store_true", help="Enable experiment trackers for logging.")
    parser.add_argument(
        "--report_to", type=str, default="all", help="The trackers of --with_tracking (tensorboard, wandb, ... all)."
    )
    add_pkm_arguments(parser)
    add_parallel_arguments(parser)  # --fsdp2, --memory_parallel
    add_reliability_arguments(parser)
    add_model_card_arguments(parser)
    add_trime_arguments(parser, causal=True)
    args = parser.parse_args(argv)
    resolve_trime_arguments(args)

    # Sanity checks
    validate_training_arguments(parser, args)
    args.embedded_data = args.dataset_name is None and not any(
        (args.train_file, args.validation_file, args.validation_files)
    )
    if args.validation_file is not None and args.validation_files is not None:
        parser.error("give the evaluation sets either with --validation_file or with --validation_files, not both")
    if args.dataset_name is not None and args.train_file is not None:
        parser.error("give the training data either with --dataset_name or with --train_file, not both")
    args.validation_sets = parse_validation_sets(parser, args)
    if args.embedded_data:
        args.train_file = str(EMBEDDED_TRAIN_FILE)
        args.validation_sets = {name: str(path) for name, path in EMBEDDED_VALIDATION_FILES.items()}
    files = [("--train_file", args.train_file)] + [
        (f"--validation_files {n}", p) for n, p in args.validation_sets.items()
    ]
    for option, path in files:
        if path is not None:
            check_data_file(parser, option, path)
    check_data_files(parser, files)  # UTF-8, well-formed json / csv, before any work
    if args.model_type is not None and args.model_type not in MODEL_TYPES:
        parser.error(f"unknown --model_type {args.model_type!r} (a causal LM type, e.g. bert or gpt2)")
    if args.model_name_or_path is None and args.config_name is None and args.model_type is None:
        parser.error("give --model_name_or_path, or --config_name / --model_type to train a model from scratch")
    if args.model_name_or_path is None and args.tokenizer_name is None:
        parser.error("training from scratch needs --tokenizer_name (this script does not train tokenizers)")
    if args.config_overrides is not None and args.model_name_or_path is not None:
        parser.error("--config_overrides applies to a model trained from scratch, not with --model_name_or_path")
    if args.block_size is not None and args.block_size < 2:
        parser.error(f"--block_size must be at least 2 (a token and its successor), got {args.block_size}")
    if args.checkpointing_steps is not None and not (
        args.checkpointing_steps == "epoch" or args.checkpointing_steps.isdigit()
    ):
        parser.error(f"--checkpointing_steps must be an integer or 'epoch', got {args.checkpointing_steps!r}")
    if (args.checkpointing_steps or args.resume_from_checkpoint == "latest") and args.output_dir is None:
        parser.error("--checkpointing_steps and --resume_from_checkpoint latest need an --output_dir")
    if args.push_to_hub and args.output_dir is None:
        parser.error("Need an `output_dir` to create a repo when `--push_to_hub` is passed.")
    if args.eval_steps is not None and args.eval_steps < 1:
        parser.error("--eval_steps must be >= 1")
    return args


def lm_targets(batch: dict) -> torch.Tensor:
    """The next-token target of every position of the batch (-100 at the last one)."""
    return causal_targets(batch["labels"])


def evaluate(args, accelerator, model, eval_datasets, collate_fn, measure_memory_usage=False):
    """Loss and perplexity of every evaluation set, with the TRIME memory at test time too (`--trime_eval`), and the
    memory usage of every memory layer on the first set: (metrics, {layer: usage}).

    Each process scores its own contiguous shard in order with the unwrapped model: every token counts once, and the
    blocks of a batch are consecutive in the text (TRIME_long's memory). Losses are summed over tokens and processes.
    """
    model = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    metrics, usage = {}, {}
    with torch.random.fork_rng(devices=[]):  # evaluation never draws from the training random streams
        for index, (name, dataset) in enumerate(eval_datasets.items()):
            shard = dataset.shard(
                num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True
            )
            dataloader = DataLoader(shard, collate_fn=collate_fn, batch_size=args.per_device_eval_batch_size)
            track = measure_memory_usage and index == 0 and memory_modules(model)
            totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # (loss, TRIME loss, tokens)
            with track_memory_usage(model) if track else contextlib.nullcontext() as tracker:
                for batch in dataloader:
                    batch = {key: value.to(accelerator.device) for key, value in batch.items()}
                    targets = lm_targets(batch)
                    with torch.no_grad(), accelerator.autocast():
                        if args.trime_eval:
                            loss, trime = model_trime_losses(
                                model, {"input_ids": batch["input_ids"]}, targets, args.trime_eval,
                                reduction="sum", chunk_size=args.trime_chunk_size,
                            )
                        else:
                            logits = model(input_ids=batch["input_ids"]).logits
                            loss = torch.nn.functional.cross_entropy(
                                logits.float().flatten(0, 1), targets.flatten(), reduction="sum"
                            )
                            trime = torch.zeros_like(loss)
                    totals += torch.stack([loss.double(), trime.double(), (targets != -100).sum().double()])
            totals = accelerator.reduce(totals, reduction="sum")
            metrics[f"eval_{name}_loss"] = (totals[0] / totals[2]).item()
            metrics[f"eval_{name}_perplexity"] = perplexity(metrics[f"eval_{name}_loss"])
            if args.trime_eval:
                metrics[f"eval_{name}_trime_loss"] = (totals[1] / totals[2]).item()
                metrics[f"eval_{name}_trime_perplexity"] = perplexity(metrics[f"eval_{name}_trime_loss"])
            if track:
                gather(tracker, accelerator)
                usage = tracker.results()
    if was_training:
        model.train()
    return metrics, usage


def main(argv=None):
    args = parse_args(argv)
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir)  # secrets, paths removed
    start_time = time.perf_counter()

    # The seedable sampler draws each epoch's order from (seed, epoch): a resumed run sees the batches of the
    # uninterrupted one.
    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = args.report_to
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **accelerator_log_kwargs,
    )
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

    if args.seed is None:
        args.seed = broadcast_object_list([random.SystemRandom().randrange(2**31)])[0]
        logger.info(f"No --seed given: using seed {args.seed}")
    set_seed(args.seed)

    if args.output_dir is not None:
        prepare_output_dir(args.output_dir)  # before any data or step: a trained model must be savable
    accelerator.wait_for_everyone()

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
    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path,
        use_fast=not args.use_slow_tokenizer,
        trust_remote_code=args.trust_remote_code,
    )
    if args.model_name_or_path is not None:
        source_type = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
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
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    block_size = args.block_size or min(1024, max_positions or 1024, tokenizer.model_max_length)
    if max_positions is not None and block_size > max_positions:
        raise ValueError(
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
            raise ValueError(
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
            raise ValueError(
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
    train_dataloader = None
    if do_train:
        train_dataloader = DataLoader(
            train_dataset,
            shuffle=True,
            collate_fn=collate_group if consecutive else collate_blocks,
            batch_size=1 if consecutive else args.per_device_train_batch_size,
            # its own generator: creating an epoch's iterator draws no number from the global RNG (dropout)
            generator=torch.Generator().manual_seed(args.seed),
        )

    # --fsdp2 / --memory_parallel: the model sharded across the processes (FSDP2; value tables column-wise)
    model = prepare_memory_parallel(accelerator, model, args)
    # Optimizer: AdamW with warm-up and decay; the memory values in their own optimizer at a constant rate.
    main_groups, memory_groups = optimizer_param_groups(model, args.weight_decay)
    optimizer = torch.optim.AdamW(main_groups, lr=args.learning_rate)
    memory_optimizer = create_memory_optimizer(memory_groups, args, model) if do_train else None

    # Staleness: the last step each memory slot was a top-1 pick, kept in checkpoints (as safetensors).
    staleness = None
    if args.track_staleness and memory_modules(model) and do_train:
        staleness = StalenessTracker(model).attach()

    model, optimizer, *rest = accelerator.prepare(
        model, optimizer, *(x for x in (memory_optimizer, train_dataloader) if x is not None)
    )
    memory_optimizer = rest.pop(0) if memory_optimizer is not None else None
    train_dataloader = rest.pop(0) if do_train else None
    optimizers = [o for o in (optimizer, memory_optimizer) if o is not None]
    register_sharded_checkpointing(accelerator, model, optimizers, args)  # --fsdp2: model and optimizers via DCP

    # The prepared scheduler advances once per process at each optimizer step, hence the factor num_processes.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps) if do_train else 1
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch if do_train else 0
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = accelerator.prepare(
        get_scheduler(
            name=args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
            num_training_steps=max(args.max_train_steps, 1) * accelerator.num_processes,
        )
    )
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    # what an exact resume depends on (the blocks as sampled: TRIME_long's groups), saved in every checkpoint and
    # compared on resume
    settings = run_settings(args, accelerator, train_dataset) if do_train else None

    # We need to initialize the trackers we use, and also store our configuration (secrets removed).
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", tracker_config(args))

    def report_evaluation(metrics, usage, when):
        parts = []
        for name in eval_datasets:
            part = f"{name} perplexity {metrics[f'eval_{name}_perplexity']:.2f}"
            if args.trime_eval:
                part += f" ({metrics[f'eval_{name}_trime_perplexity']:.2f} with the {args.trime_eval} memory)"
            parts.append(part)
        logger.info(f"{when}: " + ", ".join(parts))
        if usage:
            logger.info(f"Memory usage on {next(iter(eval_datasets))} ({when}):\n{format_memory_usage(usage)}")

    results = {}
    if args.evaluate_before_training and eval_datasets and not args.resume_from_checkpoint:
        metrics, usage = evaluate(args, accelerator, model, eval_datasets, eval_collator, measure_memory_usage=True)
        report_evaluation(metrics, usage, "before training")
        results.update({f"initial_{k}": v for k, v in metrics.items()})
        results.update(flatten_memory_usage(usage, prefix="initial_eval_memory"))
        if args.with_tracking:
            accelerator.log({**metrics, **flatten_memory_usage(usage, prefix="eval_memory")}, step=0)

    # Train!
    completed_steps, starting_epoch, resume_batches = 0, 0, 0
    train_time, steps_timed, train_loss = 0.0, 0, None
    if do_train:
        total_batch_size = (
            args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
        )
        logger.info("***** Running training *****")
        logger.info(f"  Num examples = {train_blocks} blocks of {block_size} tokens")
        logger.info(f"  Num Epochs = {args.num_train_epochs}")
        logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
        logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
        logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        logger.info(f"  Total optimization steps = {args.max_train_steps} (warm-up {args.num_warmup_steps})")
        logger.info(f"  Loss = {f'TRIME with the {args.trime} memory' if args.trime else 'cross-entropy'}")
        if memory_optimizer is not None:
            logger.info("  " + memory_optimizer_summary(memory_optimizer, model, args.memory_learning_rate))

        if args.resume_from_checkpoint:
            checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
            if staleness is not None and not os.path.isfile(os.path.join(checkpoint, STALENESS_FILE)):
                raise ValueError(f"{checkpoint} holds no staleness state: resume it without --track_staleness")
            check_checkpoint(checkpoint, settings, args.allow_inexact_resume, accelerator.process_index, logger)
            accelerator.print(f"Resumed from checkpoint: {checkpoint}")
            accelerator.load_state(checkpoint)
            if staleness is not None:
                staleness.load(os.path.join(checkpoint, STALENESS_FILE))
            starting_epoch, completed_steps, resume_batches = resume_position(
                checkpoint, num_update_steps_per_epoch, args.gradient_accumulation_steps
            )

        progress_bar = tqdm(
            range(args.max_train_steps), disable=not accelerator.is_local_main_process, desc="CLM steps"
        )
        progress_bar.update(completed_steps)
        running_loss, running_batches = 0.0, 0  # since the last evaluation: the reported train_loss
        recent_losses = collections.deque(maxlen=20)  # the progress bar's loss
        for epoch in range(starting_epoch, args.num_train_epochs):
            model.train()
            train_dataloader.set_epoch(epoch)
            if epoch == starting_epoch and resume_batches:
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_batches)
                active_dataloader.set_epoch(epoch)
            else:
                active_dataloader = train_dataloader
            step_start = time.perf_counter()
            for batch in active_dataloader:
                if staleness is not None:
                    staleness.step = completed_steps + 1
                with accelerator.accumulate(model):
                    if args.trime:
                        targets = lm_targets(batch)
                        inputs = {"input_ids": batch["input_ids"]}
                        loss = model_trime_losses(
                            model, inputs, targets, args.trime, chunk_size=args.trime_chunk_size
                        )[1]
                    else:
                        loss = model(**batch).loss
                    recent_losses.append(loss.detach().float().item())
                    running_loss += recent_losses[-1]
                    running_batches += 1
                    accelerator.backward(loss)
                    clip_memory_gradients(accelerator, model, memory_optimizer, args.memory_max_grad_norm)
                    for o in optimizers:
                        o.step()
                    lr_scheduler.step()
                    for o in optimizers:
                        o.zero_grad()

                if accelerator.sync_gradients:
                    train_time += time.perf_counter() - step_start
                    steps_timed += 1
                    progress_bar.update(1)
                    completed_steps += 1
                    train_loss = running_loss / running_batches
                    progress_bar.set_postfix(loss=f"{sum(recent_losses) / len(recent_losses):.3f}", refresh=False)
                    if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                        if staleness is not None:
                            staleness.synchronize()
                        save_checkpoint(accelerator, args.output_dir, f"step_{completed_steps}", settings, staleness)
                    if (
                        args.eval_steps
                        and completed_steps % args.eval_steps == 0
                        and completed_steps < args.max_train_steps
                    ):
                        metrics, _ = evaluate(args, accelerator, model, eval_datasets, eval_collator)
                        report_evaluation(metrics, None, f"step {completed_steps}")
                        if args.with_tracking:
                            accelerator.log(
                                {**metrics, "train_loss": train_loss, "epoch": epoch}, step=completed_steps
                            )
                        running_loss, running_batches = 0.0, 0
                    step_start = time.perf_counter()

                if completed_steps >= args.max_train_steps:
                    break

            last_epoch = epoch == args.num_train_epochs - 1 or completed_steps >= args.max_train_steps
            if not args.eval_steps and not last_epoch and eval_datasets:  # the last one is evaluated below
                metrics, _ = evaluate(args, accelerator, model, eval_datasets, eval_collator)
                report_evaluation(metrics, None, f"epoch {epoch}")
                if args.with_tracking:
                    accelerator.log({**metrics, "train_loss": train_loss, "epoch": epoch}, step=completed_steps)
                running_loss, running_batches = 0.0, 0
            if args.checkpointing_steps == "epoch":
                if staleness is not None:
                    staleness.synchronize()
                save_checkpoint(accelerator, args.output_dir, f"epoch_{epoch}", settings, staleness)
            if last_epoch:
                break
        progress_bar.close()
        results.update(
            {
                "train_loss": train_loss,
                "train_samples": train_blocks,
                "epoch": args.num_train_epochs,
                "step": completed_steps,
                "train_time": round(train_time, 2),
                "train_steps_per_second": round(steps_timed / train_time, 4) if train_time else None,
                "train_samples_per_second": round(steps_timed * total_batch_size / train_time, 3)
                if train_time
                else None,
                "train_tokens_per_step": total_batch_size * block_size,
            }
        )

    # Evaluation: the perplexity of every set (with and without the TRIME memory) and the memory usage on the first.
    if eval_datasets:
        eval_start = time.perf_counter()
        metrics, usage = evaluate(args, accelerator, model, eval_datasets, eval_collator, measure_memory_usage=True)
        report_evaluation(metrics, usage, "after training" if do_train else "evaluation")
        first = next(iter(eval_datasets))
        results["perplexity"] = metrics[f"eval_{first}_perplexity"]  # the official script's key
        results.update(metrics)
        results.update(flatten_memory_usage(usage, prefix="eval_memory"))
        for name, dataset in eval_datasets.items():
            results[f"eval_{name}_samples"] = len(dataset)
        results["eval_runtime"] = round(time.perf_counter() - eval_start, 2)
    if staleness is not None:
        staleness.synchronize()
        histogram = staleness.results(completed_steps, args.staleness_bins)
        logger.info(
            "Staleness (fraction of slots by the step range of their last top-1 pick):\n"
            + json.dumps(histogram, indent=2)
        )
        results.update(flatten_memory_usage(histogram, prefix="staleness"))
    peak = peak_memory_mb(accelerator.device)
    results["peak_memory_mb"] = round(peak, 1) if peak is not None else None

    if args.with_tracking:
        accelerator.log({k: v for k, v in results.items() if isinstance(v, (int, float))}, step=completed_steps)
        accelerator.end_training()

    # Save the model (a BertPkm folder is a complete Hub repository: code files, auto_map, tokenizer, model card),
    # staged in output_dir/.final.tmp and renamed into place file by file: a crash never leaves a torn file.
    if args.output_dir is not None:
        unwrapped_model = accelerator.unwrap_model(model)

        def write_final(folder):
            if not save_sharded_model(accelerator, unwrapped_model, folder, args):  # --fsdp2: consolidated
                unwrapped_model.save_pretrained(
                    folder, is_main_process=accelerator.is_main_process, save_function=accelerator.save
                )
            if accelerator.is_main_process:
                tokenizer.save_pretrained(folder)
                if staleness is not None:
                    staleness.save(os.path.join(folder, STALENESS_FILE), step=completed_steps)
                write_results_model_card(
                    folder,
                    results,
                    repo_id=args.hub_model_id,
                    base_model=card_base_model(args.model_name_or_path, args.base_model),
                    license=card_license(args.model_name_or_path, args.license),
                    dataset=args.dataset_name or args.train_file or "run_scripts/data/pride_and_prejudice_train.txt",
                    task="text-generation",
                    command=command,
                    title="Causal language modeling results",
                )

        if do_train:
            save_final_outputs(accelerator, args.output_dir, write_final)
        if accelerator.is_main_process:
            results["total_runtime"] = round(time.perf_counter() - start_time, 2)
            atomic_write_json(os.path.join(args.output_dir, "all_results.json"), results)
            if args.push_to_hub and do_train:
                from modeling_pkm_bert.hub.upload import push_folder_to_hub

                repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
                push_folder_to_hub(
                    args.output_dir,
                    repo_id,
                    private=args.hub_private_repo,
                    token=args.hub_token,
                    commit_message="End of training",
                )
    logger.info(json.dumps(results, indent=4))
    return results


if __name__ == "__main__":
    main()
