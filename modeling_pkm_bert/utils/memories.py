"""Finding the memories of a model (product key memories, hashed n-gram memories): what every subpackage that works on
them (the methods, the analysis, the harness, the integrations) shares."""

import re

import torch
from torch import nn

from ..ngram_memory import NgramMemory
from ..product_key_memory import ProductKeyMemory


def is_product_key_memory(module: nn.Module) -> bool:
    """Whether `module` is a product key memory: this package's class, or a copy of it, as in a model loaded with
    `trust_remote_code=True` (its classes come from the Hub cache module, `transformers_modules.<repo>...`), matched by
    class name or by its attributes (a `keys` parameter, `values` with a `weight`, a `search` method)."""
    if isinstance(module, ProductKeyMemory) or type(module).__name__ == "ProductKeyMemory":
        return True
    return (
        isinstance(getattr(module, "keys", None), nn.Parameter)
        and isinstance(getattr(getattr(module, "values", None), "weight", None), torch.Tensor)
        and callable(getattr(module, "search", None))
    )


def memory_modules(model: nn.Module) -> dict[str, ProductKeyMemory]:
    """`{module path: memory}` of every product key memory in `model` (also wrapped: PEFT, sentence-transformers, DDP),
    found by [`is_product_key_memory`]. Empty for a model without memories; raises ValueError where a config in the
    model asks for memories (`pkm_layers`) but none is found, rather than letting a helper silently do nothing."""
    found, wanted = {}, None
    for name, module in model.named_modules():
        if is_product_key_memory(module):
            found[name] = module
        elif wanted is None and getattr(getattr(module, "config", None), "pkm_layers", None):
            wanted = module.config.pkm_layers
    if wanted and not found:
        raise ValueError(
            f"{type(model).__name__}: its config has memories at pkm_layers={list(wanted)}, but no product key memory "
            "module was found in it (looked for class name 'ProductKeyMemory' or a module with a `keys` parameter, "
            "`values.weight` and `search`)"
        )
    return found


def is_ngram_memory(module: nn.Module) -> bool:
    """Whether `module` is a hashed n-gram memory: this package's `NgramMemory` or a remote-code copy of it (class
    name), or a module with its parts (`tables` with a `weight`, a `bucket_indices` method)."""
    if isinstance(module, NgramMemory) or type(module).__name__ == "NgramMemory":
        return True
    return isinstance(getattr(getattr(module, "tables", None), "weight", None), torch.Tensor) and callable(
        getattr(module, "bucket_indices", None)
    )


def ngram_memory_modules(model: nn.Module) -> dict[str, NgramMemory]:
    """`{module path: n-gram memory}` of every hashed n-gram memory in `model` (also wrapped); empty without them,
    ValueError where a config asks for them (`ngram_layers`) but none is found."""
    found, wanted = {}, None
    for name, module in model.named_modules():
        if is_ngram_memory(module):
            found[name] = module
        elif wanted is None and getattr(getattr(module, "config", None), "ngram_layers", None):
            wanted = module.config.ngram_layers
    if wanted and not found:
        raise ValueError(
            f"{type(model).__name__}: its config has n-gram memories at ngram_layers={list(wanted)}, but no n-gram "
            "memory module was found in it"
        )
    return found


def memory_table(memory: nn.Module) -> nn.Module:
    """The table a memory reads its rows from, one name for both kinds: a product key memory's `values`, an n-gram
    memory's hash `tables` (all its tables' rows in one module); each an embedding-like module with a `weight` of
    one row per slot. (The shipped modules keep their own attribute names: the saved folders' state-dict keys.)"""
    return memory.values if is_product_key_memory(memory) else memory.tables


def memory_tables(model: nn.Module) -> dict[str, nn.Module]:
    """`{module path: table}` of every memory of `model` (`memory_table`): the product key memories', then the n-gram
    memories'. A table shared by several memories (`pkm_shared_values`) is listed under each."""
    memories = {**memory_modules(model), **ngram_memory_modules(model)}
    return {path: memory_table(memory) for path, memory in memories.items()}


def readable_name(path: str) -> str:
    """`bert.encoder.layer.4.memory` (ModernBertPkm: `model.layers.4.memory`) -> `layer_4`; a path without a layer
    number stays as it is."""
    layer_numbers = re.findall(r"(?:^|\.)layers?\.(\d+)(?=\.|$)", path)
    return f"layer_{layer_numbers[-1]}" if layer_numbers else path or "memory"


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel / torch.compile wrapper."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        else:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


__all__ = [
    "is_ngram_memory",
    "is_product_key_memory",
    "memory_modules",
    "memory_table",
    "memory_tables",
    "ngram_memory_modules",
    "readable_name",
    "unwrap_model",
]
