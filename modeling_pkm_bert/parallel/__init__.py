"""Training across processes: memory-parallel value tables (sharded column-wise) composed with FSDP2."""

from .memory_parallel import (
    ShardedProductKeyValues,
    full_state_dict,
    fully_shard_with_memory_parallel,
    memory_parallel_parameters,
    save_consolidated,
    shard_memory_values,
    value_bytes_per_process,
)

__all__ = [
    "ShardedProductKeyValues",
    "full_state_dict",
    "fully_shard_with_memory_parallel",
    "memory_parallel_parameters",
    "save_consolidated",
    "shard_memory_values",
    "value_bytes_per_process",
]
