"""Training across processes: memory-parallel value tables (sharded column-wise) composed with FSDP2.

Lazy: `modeling_pkm_bert.parallel.arguments` (the flags) imports the standard library only; the names below import
torch.distributed when first used.
"""

from ..utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".arguments": ("add_parallel_arguments",),
        ".memory_parallel": (
            "ShardedProductKeyValues",
            "full_state_dict",
            "fully_shard_with_memory_parallel",
            "memory_parallel_parameters",
            "save_consolidated",
            "shard_memory_values",
            "value_bytes_per_process",
        ),
        ".scripts": ("prepare_memory_parallel", "register_sharded_checkpointing", "save_sharded_model"),
    },
)
