"""Training across processes: memory-parallel value tables (sharded column-wise) composed with FSDP2.

Lazy: `modeling_pkm_bert.parallel.arguments` (the flags) imports the standard library only; the names below import
torch.distributed when first used.
"""

import importlib


_NAMES = {
    "ShardedProductKeyValues": "memory_parallel",
    "full_state_dict": "memory_parallel",
    "fully_shard_with_memory_parallel": "memory_parallel",
    "memory_parallel_parameters": "memory_parallel",
    "save_consolidated": "memory_parallel",
    "shard_memory_values": "memory_parallel",
    "value_bytes_per_process": "memory_parallel",
    "add_parallel_arguments": "arguments",
    "prepare_memory_parallel": "scripts",
    "register_sharded_checkpointing": "scripts",
    "save_sharded_model": "scripts",
}


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_NAMES))


__all__ = sorted(_NAMES)
