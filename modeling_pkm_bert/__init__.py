"""Product key memory for BERT in the Hugging Face ecosystem (Kim & Jung 2020, on Lample et al. 2019).

Layout: the flat `.py` files beside this one are the Hub remote code, exactly `REMOTE_CODE_FILES`
(`configuration_bert_pkm.REMOTE_CODE_FILES`); everything else lives in a subpackage named for its job:
`utils` (small shared helpers: finding a model's memories, the lazy imports), `kernels` (the native CPU selection;
GPUs run the reference torch ops), `serving` (int8 / 4-bit value tables), `parallel` (FSDP2 and memory-parallel value
tables), `methods` (the memory optimizers, TRIME, sparse memory finetuning), `hub` (conversion, model cards, upload),
`analysis` (memory usage and reports), `training` (the scripts' harness and task data), `integrations` (export, PEFT,
Trainer). In that order they form layers: a subpackage imports only from those before it (tests/repo/test_layout.py
checks that no import cycle forms).

The import is lazy: `import modeling_pkm_bert` imports neither torch nor transformers and registers no op. A public
name is resolved on first use (module `__getattr__`); resolving a model class, `ProductKeyMemory` or
`register_auto_classes` registers the native CPU kernels first (`kernels.register()`; `PKM_BERT_NATIVE=0`: off).
"""

from .utils.lazy_imports import lazy_exports


# the public names, each resolved on first use from the module that defines it
_PUBLIC = {
    ".configuration_bert_pkm": ("AUTO_MAP", "BertPkmConfig", "REMOTE_CODE_FILES"),
    ".modeling_bert_pkm": (
        "BertPkmForCausalLM",
        "BertPkmForMaskedLM",
        "BertPkmForMultipleChoice",
        "BertPkmForQuestionAnswering",
        "BertPkmForSequenceClassification",
        "BertPkmForTokenClassification",
        "BertPkmModel",
        "BertPkmPreTrainedModel",
    ),
    ".configuration_roberta_pkm": ("ROBERTA_AUTO_MAP", "RobertaPkmConfig"),
    ".modeling_roberta_pkm": (
        "RobertaPkmForCausalLM",
        "RobertaPkmForMaskedLM",
        "RobertaPkmForMultipleChoice",
        "RobertaPkmForQuestionAnswering",
        "RobertaPkmForSequenceClassification",
        "RobertaPkmForTokenClassification",
        "RobertaPkmModel",
        "RobertaPkmPreTrainedModel",
    ),
    ".configuration_modernbert_pkm": ("MODERNBERT_AUTO_MAP", "ModernBertPkmConfig"),
    ".modeling_modernbert_pkm": (
        "ModernBertPkmForMaskedLM",
        "ModernBertPkmForMultipleChoice",
        "ModernBertPkmForQuestionAnswering",
        "ModernBertPkmForSequenceClassification",
        "ModernBertPkmForTokenClassification",
        "ModernBertPkmModel",
        "ModernBertPkmPreTrainedModel",
    ),
    ".product_key_memory": ("ProductKeyMemory", "ProductKeyValues"),
    ".kernels.cpu": ("use_huge_pages",),
    ".parallel.memory_parallel": ("shard_memory_values",),
    ".serving.quantization": ("quantize_memory_values",),
}
# the modules that run the memory: resolving a name of theirs registers the native kernels first
_RUN_THE_MEMORY = (".modeling_bert_pkm", ".modeling_roberta_pkm", ".modeling_modernbert_pkm", ".product_key_memory", ".kernels.cpu", ".serving.quantization")
_REGISTERS_KERNELS = {name for module in _RUN_THE_MEMORY for name in _PUBLIC[module]}
_resolve, __dir__, _ = lazy_exports(__name__, _PUBLIC)

def __getattr__(name):
    if name == "__version__":  # the one version, that of the code every saved folder records
        from .configuration_bert_pkm import PKM_CODE_VERSION

        return PKM_CODE_VERSION
    if name in _REGISTERS_KERNELS:
        from . import kernels

        kernels.register()
    return _resolve(name)


def register_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel*` resolve `model_type="bert_pkm"`, `"roberta_pkm"` and `"modernbert_pkm"` to this
    package in the current process."""
    import transformers

    from . import kernels, modeling_bert_pkm, modeling_modernbert_pkm, modeling_roberta_pkm
    from .configuration_bert_pkm import AUTO_MAP, BertPkmConfig
    from .configuration_modernbert_pkm import MODERNBERT_AUTO_MAP, ModernBertPkmConfig
    from .configuration_roberta_pkm import ROBERTA_AUTO_MAP, RobertaPkmConfig

    kernels.register()
    families = [
        (BertPkmConfig, AUTO_MAP, modeling_bert_pkm),
        (RobertaPkmConfig, ROBERTA_AUTO_MAP, modeling_roberta_pkm),
        (ModernBertPkmConfig, MODERNBERT_AUTO_MAP, modeling_modernbert_pkm),
    ]
    for config_class, auto_map, module in families:
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_class, target in auto_map.items():
            if auto_class != "AutoConfig":
                model_class = getattr(module, target.split(".")[-1])
                getattr(transformers, auto_class).register(config_class, model_class, exist_ok=True)


__all__ = sorted(
    [
        "BertPkmConfig",
        *_PUBLIC[".modeling_bert_pkm"],
        "ProductKeyMemory",
        "ModernBertPkmConfig",
        *_PUBLIC[".modeling_modernbert_pkm"],
        "RobertaPkmConfig",
        *_PUBLIC[".modeling_roberta_pkm"],
        "quantize_memory_values",
        "register_auto_classes",
        "shard_memory_values",
        "use_huge_pages",
    ]
)
