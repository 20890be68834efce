"""Sparse memory finetuning in the training scripts (`--sparse_memory_finetuning`, `--smf_*`): the background
statistics a run trains with (from a checkpoint, a statistics file, or background text given on the command line) and
the `SparseMemoryFinetuning` a script attaches. The method itself (Lin et al. 2025): `method`; the flags: `arguments`.
"""

import os

from ...utils.input_errors import InputError
from . import method as smf
from .arguments import check_smf_arguments


def _background_texts(args) -> list[str]:
    import datasets

    if args.smf_background_dataset:
        name, _, config = args.smf_background_dataset.partition(":")
        dataset = datasets.load_dataset(name, config or None, split="train")
    else:
        extension = args.smf_background_file.rsplit(".", 1)[-1].lower()
        if extension in ("txt", "text", "raw", "tokens"):
            with open(args.smf_background_file, encoding="utf-8") as handle:
                return [line for line in handle.read().splitlines() if line.strip()]
        builder = {"csv": "csv", "json": "json", "jsonl": "json"}.get(extension)
        if builder is None:
            raise InputError(
                f"--smf_background_file {args.smf_background_file!r}: expected .txt/.csv/.json/.jsonl/.safetensors"
            )
        dataset = datasets.load_dataset(builder, data_files=args.smf_background_file, split="train")
    if "text" not in dataset.column_names:
        raise InputError(f"the background data has no 'text' column (columns: {dataset.column_names})")
    return [text for text in dataset["text"] if text and text.strip()]


def statistics_from_args(
    args, accelerator, model, tokenizer, max_seq_length: int, checkpoint: str | None = None, logger=None, causal=False
) -> "smf.BackgroundStatistics":
    """The background statistics a script trains with: from the checkpoint being resumed, a statistics file
    (`--smf_background_file x.safetensors`, or the one beside the model), or computed from background text with the
    frozen model (each process its share of the batches, then summed; blocks of a causal LM with `causal=True`, see
    `background_batches`). Checked against the model."""
    unwrapped = accelerator.unwrap_model(model).to(accelerator.device)  # prepare() would move it there anyway
    source = None
    if checkpoint and os.path.isfile(os.path.join(checkpoint, smf.STATISTICS_NAME)):
        source = os.path.join(checkpoint, smf.STATISTICS_NAME)
    elif args.smf_background_file and args.smf_background_file.endswith(".safetensors"):
        source = args.smf_background_file
    elif not args.smf_background_file and not args.smf_background_dataset:
        beside = os.path.join(args.model_name_or_path or "", smf.STATISTICS_NAME)
        if not os.path.isfile(beside):
            raise InputError(
                "--sparse_memory_finetuning needs background statistics: give --smf_background_file (text or "
                f".safetensors) or --smf_background_dataset, or put {smf.STATISTICS_NAME} beside the model"
            )
        source = beside
    if source is not None:
        statistics = smf.BackgroundStatistics.load(source)
        statistics.check_model(unwrapped, source)
        if logger:
            logger.info(f"SMF: background statistics of {statistics.num_batches} batches loaded from {source}")
        return statistics
    texts = _background_texts(args)
    # a background document is what one optimizer step ranks: its global batch (module docstring)
    document = args.per_device_train_batch_size * getattr(args, "gradient_accumulation_steps", 1)
    batches = smf.background_batches(
        tokenizer, texts, max_seq_length, document * accelerator.num_processes, args.smf_background_batches, causal
    )
    if not batches:
        raise InputError(
            f"the background text ({args.smf_background_file or args.smf_background_dataset}) yields no block of "
            f"{max_seq_length} tokens: give more background text or a smaller --max_seq_length"
        )
    # each process runs its share of every document, in per-device batches; the reads are summed per document
    statistics = smf.compute_background_statistics(
        unwrapped, batches, device=accelerator.device, micro_batch_size=args.per_device_train_batch_size,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes,
    )
    if logger:
        logger.info(
            f"SMF: background statistics computed on {statistics.num_batches} documents of "
            f"{document * accelerator.num_processes} sequences (one optimizer step's batch)"
        )
    return statistics


def setup_from_args(
    args, accelerator, model, tokenizer, max_seq_length: int, checkpoint: str | None = None, logger=None, causal=False
) -> "smf.SparseMemoryFinetuning | None":
    """For the scripts, before the optimizers are made: checks the flags, gets the background statistics (background
    text in blocks of `max_seq_length` tokens, cut as a causal LM's with `causal=True`; none for the gradient
    ranker), freezes everything but the values (unless `--smf_train_rest`), and returns the `SparseMemoryFinetuning` (call `.attach(memory_optimizer)` and
    `.register_for_checkpointing(accelerator)` after `accelerator.prepare`), or None when `--sparse_memory_finetuning`
    is off."""
    if not args.sparse_memory_finetuning:
        return None
    check_smf_arguments(args)
    smf.validate_top_t(args.smf_top_t, model)
    if not args.smf_train_rest:
        trainable = smf.freeze_all_but_values(model)
        if logger:
            logger.info(f"SMF: everything but the memory values frozen ({trainable:,} value parameters)")
    if args.smf_ranker == "gradient":  # ranks the step's own gradient: no background
        return smf.SparseMemoryFinetuning(model, None, args.smf_top_t, args.smf_ranker)
    statistics = statistics_from_args(args, accelerator, model, tokenizer, max_seq_length, checkpoint, logger, causal)
    if accelerator.is_main_process and args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        statistics.save(os.path.join(args.output_dir, smf.STATISTICS_NAME))  # beside the trained model
    return smf.SparseMemoryFinetuning(model, statistics, args.smf_top_t, args.smf_ranker)


__all__ = ["setup_from_args", "statistics_from_args"]
