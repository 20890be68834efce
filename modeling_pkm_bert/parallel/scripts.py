"""Script support for FSDP2 and memory parallel: the flags, the model preparation, checkpoints and the final save, so
that each accelerate script adds only a few calls:

    add_parallel_arguments(parser)                                    # in parse_args
    model = prepare_memory_parallel(accelerator, model, args)         # before the optimizers are made
    register_sharded_checkpointing(accelerator, model, optimizers, args)   # after accelerator.prepare
    if not save_sharded_model(accelerator, unwrapped_model, folder, args): unwrapped_model.save_pretrained(...)

Processes: `torchrun --nproc_per_node N` (on CPU with `ACCELERATE_USE_CPU=1`: gloo) or `accelerate launch` on GPUs.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..utils.input_errors import InputError
from .memory_parallel import (
    check_batch_statistics_everywhere,
    fully_shard_with_memory_parallel,
    save_consolidated,
    sync_buffers,
)

DCP_FOLDER = "sharded_state"  # inside an accelerate checkpoint folder: model and optimizers (torch.distributed.checkpoint)


def enabled(args) -> bool:
    return bool(getattr(args, "fsdp2", False) or getattr(args, "memory_parallel", False))


def prepare_memory_parallel(accelerator, model: nn.Module, args) -> nn.Module:
    """With `--fsdp2` / `--memory_parallel`: the model moved to the accelerator's device, sharded (FSDP2, value
    tables column-wise with `--memory_parallel`) over all processes, and marked as prepared so that
    `accelerator.prepare` does not wrap it in DDP. Call it before the optimizers are created. Otherwise: `model`,
    which on several processes (DDP) refuses, on every process at once, a training batch with too few real tokens on
    one of them ([`check_batch_statistics_everywhere`]; FSDP2 and memory parallel do the same)."""
    memory_parallel = getattr(args, "memory_parallel", False)
    if enabled(args) and not memory_parallel and getattr(args, "memory_optimizer", "adam") == "sparse_row_adam":
        raise InputError(
            "--fsdp2 with --memory_optimizer sparse_row_adam: FSDP2 shards the value tables by rows, which SparseRowAdam "
            "does not update; use --memory_parallel (column shards, which it does) or --memory_optimizer adam"
        )
    if not enabled(args):
        if accelerator.num_processes > 1:
            check_batch_statistics_everywhere(model)
        return model
    from torch.distributed.device_mesh import init_device_mesh

    if accelerator.num_processes > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise InputError("--fsdp2/--memory_parallel need torch.distributed (launch with torchrun or accelerate launch)")
    if not torch.distributed.is_initialized():  # one process: a group of one, the same code path
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    model = model.to(accelerator.device)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    fully_shard_with_memory_parallel(model, mesh, memory_parallel=memory_parallel)
    model._is_accelerate_prepared = True  # FSDP2 replaces DDP: accelerate.prepare keeps the model as it is
    return model


def register_sharded_checkpointing(accelerator, model: nn.Module, optimizers, args) -> None:
    """With `--fsdp2` / `--memory_parallel`: `accelerator.save_state` / `load_state` keep the model and the
    optimizers in a torch.distributed.checkpoint folder (each process writes its shards; a checkpoint of N processes
    loads into M, DCP reshards), accelerate the rest (schedulers, samplers, RNG). Call it after `accelerator.prepare`
    with the prepared optimizers."""
    if not enabled(args):
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    inner = [getattr(o, "optimizer", o) for o in optimizers]
    # accelerate would torch.save each process's shards from the main process only: the optimizers are ours
    accelerator._optimizers[:] = [o for o in accelerator._optimizers if getattr(o, "optimizer", o) not in inner]

    def state():
        model_state, optim_states = {}, {}
        for i, optimizer in enumerate(inner):
            model_state, optim_states[f"optimizer_{i}"] = get_state_dict(model, optimizer)
        return {"model": model_state, **optim_states}

    def save(models, weights, output_dir):
        if model in models:
            del weights[models.index(model)]
        sync_buffers(model, mesh)  # rank 0's BatchNorm statistics, as the next forward would use
        dcp.save(state(), checkpoint_id=os.path.join(output_dir, DCP_FOLDER))

    def load(models, input_dir):
        if model in models:
            models.remove(model)
        folder = os.path.join(input_dir, DCP_FOLDER)
        if not os.path.isdir(folder):
            raise InputError(
                f"{input_dir} holds no {DCP_FOLDER}/ (a sharded checkpoint of --fsdp2/--memory_parallel): it was saved "
                "without --fsdp2/--memory_parallel; resume it with the flags it was saved with"
            )
        loaded = state()
        dcp.load(loaded, checkpoint_id=folder)
        for i, optimizer in enumerate(inner):
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded[f"optimizer_{i}"])

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def save_sharded_model(accelerator, model: nn.Module, folder, args, **kwargs) -> bool:
    """With `--fsdp2` / `--memory_parallel`: writes the consolidated model (whole tables, safetensors and the remote
    code: a normal Hub folder) and returns True; else False (the script saves as usual). Call it on every process."""
    if not enabled(args):
        return False
    save_consolidated(model, folder, accelerator.is_main_process, **kwargs)  # rank 0's buffers
    return True
