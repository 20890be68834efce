"""What every training script does before its loop, the same in each: the accelerator, the logging, the seed and the
output folder (`start_run`); the training dataloader, the optimizers and `accelerator.prepare` (`prepare_training`).

    accelerator = start_run(args, logger)
    ...  # data, model, preprocessing, collator
    model, optimizer, memory_optimizer, train_dataloader, methods = prepare_training(
        accelerator, args, model, train_dataset, collator, tokenizer=tokenizer, max_seq_length=128, logger=logger
    )

The main AdamW (weight decay on the weights, not on biases and norms) on the schedule the script creates next; the
memory values in their own optimizer (`--memory_optimizer`) at a constant `--memory_learning_rate` without weight decay
(XLM and the paper). Before the optimizers: the model sharded with `--fsdp2` / `--memory_parallel`, and the training
methods the flags turn on set up (`methods.setup_methods`: e.g. sparse memory finetuning's background statistics).
"""

from __future__ import annotations


def start_run(args, logger):
    """The run's `Accelerator` (`--gradient_accumulation_steps`, `--mixed_precision`, trackers with `--with_tracking`;
    the seedable sampler draws each epoch's order from (seed, epoch), so that a resumed run sees the batches the
    uninterrupted one would), one log on every process with its configuration, the seed set (without `--seed` one is
    drawn, the same on every process, logged and written into `args.seed`: the data order derives from it), and the
    output folder created and proven writable before any data is loaded or any step trained. Returns the accelerator."""
    import logging
    import os
    import random

    import datasets
    import transformers
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import broadcast_object_list, set_seed

    from .checks import prepare_output_dir

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

    if args.seed is None:
        args.seed = broadcast_object_list([random.SystemRandom().randrange(2**31)])[0]
        logger.info(f"No --seed given: using seed {args.seed}")
    set_seed(args.seed)

    if args.output_dir is not None:  # before any data or step: a trained model must be savable
        # A new or empty folder is the run's own at once (a failed run may rerun into it); a folder that holds anything
        # is marked only once every check has passed (checks.mark_run_output): a failed resume marks nothing it found.
        fresh = not os.path.isdir(args.output_dir) or not any(os.scandir(args.output_dir))
        tool = getattr(args, "output_tool", None) if fresh and accelerator.is_main_process else None
        prepare_output_dir(args.output_dir, tool)
    accelerator.wait_for_everyone()
    return accelerator


def prepare_training(
    accelerator, args, model, train_dataset, collate_fn, *, tokenizer, max_seq_length: int, logger,
    batch_size: int | None = None, causal: bool = False,
):  # fmt: skip
    """The training dataloader (shuffled from its own generator seeded with `--seed`; `batch_size` examples a batch,
    default `--per_device_train_batch_size`), the model sharded (`--fsdp2`, `--memory_parallel`), the training methods
    set up (`methods.setup_methods`; e.g. sparse memory finetuning's background text cut in blocks of `max_seq_length`
    tokens, as a causal LM's with `causal`), the main AdamW and the memory values' optimizer created, and everything
    prepared by `accelerator`; returns `(model, optimizer, memory_optimizer, train_dataloader, methods)` (None where
    absent; `methods`: the list for `TrainingLoop`). Without a `train_dataset` (evaluation only) the model is prepared
    alone with an empty AdamW and no method."""
    import contextlib

    import torch
    from torch.utils.data import DataLoader

    from ..parallel import prepare_memory_parallel, register_sharded_checkpointing
    from ..utils.input_errors import InputError
    from .checkpoints import resolve_checkpoint
    from ..methods import prepare_methods, setup_methods
    from ..methods.optimizers.scripts import create_memory_optimizer, optimizer_param_groups

    training = train_dataset is not None
    train_dataloader = None
    if training:
        train_dataloader = DataLoader(
            train_dataset,
            shuffle=True,
            collate_fn=collate_fn,
            batch_size=batch_size or args.per_device_train_batch_size,
            # its own generator: creating an epoch's iterator then draws no number from the global RNG (dropout),
            # which a resumed run would otherwise draw at a different point
            generator=torch.Generator().manual_seed(args.seed),
        )
    # --fsdp2 / --memory_parallel: the model sharded across the processes (FSDP2; value tables column-wise)
    model = prepare_memory_parallel(accelerator, model, args)
    # The training methods, before the optimizers: they may freeze parameters (sparse memory finetuning: all but the
    # memory values, its background statistics from the resumed checkpoint, a file, or computed now)
    methods = []
    if training:
        checkpoint = None  # the folder being resumed; none yet with `latest`: TrainingLoop.resume says so
        if args.resume_from_checkpoint:
            with contextlib.suppress(InputError):
                checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        methods = setup_methods(
            args, accelerator, model,
            tokenizer=tokenizer, max_seq_length=max_seq_length, causal=causal, checkpoint=checkpoint, logger=logger,
        )  # fmt: skip

    main_groups, memory_groups = optimizer_param_groups(model, args.weight_decay)
    optimizer = torch.optim.AdamW(main_groups or [{"params": []}], lr=args.learning_rate)  # empty: all frozen (SMF)
    # before prepare: DDP reads the sparse-gradient flags of --memory_optimizer sparse_row_adam when it wraps the model
    memory_optimizer = create_memory_optimizer(memory_groups, args, model) if training else None

    model, optimizer, *rest = accelerator.prepare(
        model, optimizer, *(x for x in (memory_optimizer, train_dataloader) if x is not None)
    )
    memory_optimizer = rest.pop(0) if memory_optimizer is not None else None
    train_dataloader = rest.pop(0) if training else None
    optimizers = [o for o in (optimizer, memory_optimizer) if o is not None]
    register_sharded_checkpointing(accelerator, model, optimizers, args)  # --fsdp2: model and optimizers via DCP
    prepare_methods(methods, accelerator, model, memory_optimizer)  # their hooks, their state in every checkpoint
    return model, optimizer, memory_optimizer, train_dataloader, methods
