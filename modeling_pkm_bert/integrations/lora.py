"""PEFT LoRA on BertPkm models: a `LoraConfig` under which an adapter reloads exactly.

A memory's query BatchNorm updates its running statistics in every training forward, frozen or not, and eval mode
normalises with them: an adapter that does not save them reloads onto the base model's statistics and gives other
logits. `pkm_lora_config` lists every query BatchNorm in `modules_to_save`, so they travel with the adapter.
"""

from collections.abc import Iterable

from torch import nn

from ..utils.memories import memory_modules, ngram_memory_modules


BERT_LORA_TARGETS = ("query", "value")  # transformers' BERT attention projections, PEFT's default for BERT


def pkm_lora_config(
    model: nn.Module,
    target_modules: Iterable[str] | str | None = None,
    query_proj: bool = False,
    modules_to_save: Iterable[str] | None = None,
    ngram_memories: bool = False,
    **lora_kwargs,
):
    """A `peft.LoraConfig` for `model` whose `modules_to_save` holds the memories' query BatchNorms (running
    statistics), so that `PeftModel.from_pretrained(base, adapter)` gives the trained model's logits.

    PEFT trains every parameter of a module in `modules_to_save` (it sets `requires_grad` on its copy, again on each
    `set_adapter`), so the BatchNorms' gain and bias train with the adapter too: 2 * heads * k_dim parameters per
    memory (2,048 at the defaults, 4,096 for the paper's two memories: 1.4% on top of LoRA r=8 on BERT-base's query
    and value, 294,912). PEFT offers no way to save a module's buffers without training its parameters.

    Args:
        model: the BertPkm model (or any module holding product key memories) the adapter is for.
        target_modules: modules LoRA adapts (default: BERT's attention `query` and `value`).
        query_proj: also adapt the memories' query projection (`query_proj`).
        modules_to_save: further modules trained and saved in full (e.g. a new classification head; PEFT adds
            `classifier` itself for `task_type="SEQ_CLS"`).
        ngram_memories: train and save the hashed n-gram memories (`ngram`: tables, convolution, projections) in full
            with the adapter; by default they stay frozen, as the base model's (they hold no running statistics, so
            an adapter without them reloads exactly).
        **lora_kwargs: any other `LoraConfig` field (`r`, `lora_alpha`, `lora_dropout`, `task_type`, ...).
    """
    from peft import LoraConfig

    memories, ngram = memory_modules(model), ngram_memory_modules(model)
    if not memories and not ngram:
        raise ValueError(f"{type(model).__name__} has no product key memory and no n-gram memory; use peft.LoraConfig directly")
    if ngram_memories and not ngram:
        raise ValueError(f"ngram_memories=True: {type(model).__name__} has no n-gram memory (ngram_layers)")
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    targets = list(BERT_LORA_TARGETS if target_modules is None else target_modules)
    if not targets and not query_proj:
        raise ValueError("target_modules is empty and query_proj=False: LoRA would adapt nothing")
    module_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(targets) - module_names)
    if missing:
        raise ValueError(f"target_modules {missing} name no module of {type(model).__name__}")
    if query_proj and "query_proj" not in targets:
        targets.append("query_proj")
    to_save = list(modules_to_save or [])
    for memory in memories.values():
        if isinstance(memory.query_batchnorm, nn.modules.batchnorm._BatchNorm) and "query_batchnorm" not in to_save:
            to_save.append("query_batchnorm")
    if ngram_memories and "ngram" not in to_save:
        to_save.append("ngram")
    return LoraConfig(target_modules=targets, modules_to_save=to_save or None, **lora_kwargs)


__all__ = ["BERT_LORA_TARGETS", "pkm_lora_config"]
