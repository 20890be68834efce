"""Product key memory for BERT in the Hugging Face ecosystem (Kim & Jung 2020, on Lample et al. 2019).

Layout: the flat `.py` files beside this one are the Hub remote code, exactly `REMOTE_CODE_FILES`
(`configuration_bert_pkm.REMOTE_CODE_FILES`); everything else lives in a subpackage named for its job:
`utils` (small shared helpers: finding a model's memories, the lazy imports), `kernels` (native CPU selection, Triton
gathers), `serving` (int8 / 4-bit value tables), `parallel` (FSDP2 and memory-parallel value tables), `methods` (the
memory optimizers, TRIME, sparse memory finetuning), `hub` (conversion, model cards, upload), `analysis` (memory usage
and reports), `training` (the scripts' harness and task data), `integrations` (export, PEFT, Trainer). In that order
they form layers: a subpackage imports only from those before it (tests/test_layout.py checks that no import cycle
forms).

The import is lazy: `import modeling_pkm_bert` imports neither torch nor transformers and registers no op. A public
name is resolved on first use (module `__getattr__`); resolving a model class, `ProductKeyMemory` or
`register_auto_classes` registers the native CPU kernels first (`kernels.register()`; `PKM_BERT_NATIVE=0`: off).
The module paths of release 0.1.0 (`modeling_pkm_bert.optimization`, `.conversion`, ...) still import, with a
DeprecationWarning, through `LEGACY_MODULES`.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .utils.lazy_imports import lazy_exports


__version__ = "0.4.0"

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
    ".product_key_memory": ("ProductKeyMemory", "ProductKeyValues"),
    ".kernels.cpu": ("use_huge_pages",),
    ".parallel.memory_parallel": ("shard_memory_values",),
    ".serving.quantization": ("quantize_memory_values",),
}
# the modules that run the memory: resolving a name of theirs registers the native kernels first
_RUN_THE_MEMORY = (".modeling_bert_pkm", ".modeling_roberta_pkm", ".product_key_memory", ".kernels.cpu", ".serving.quantization")
_REGISTERS_KERNELS = {name for module in _RUN_THE_MEMORY for name in _PUBLIC[module]}
_resolve, __dir__, _ = lazy_exports(__name__, _PUBLIC)

# the module paths of release 0.1.0 -> their places now (kept for one release)
LEGACY_MODULES = {
    "modeling_pkm_bert.arguments": "modeling_pkm_bert.training.arguments",
    "modeling_pkm_bert.code_refresh": "modeling_pkm_bert.hub.refresh",
    "modeling_pkm_bert.conversion": "modeling_pkm_bert.hub.conversion",
    "modeling_pkm_bert.cpu_kernels": "modeling_pkm_bert.kernels.cpu",
    "modeling_pkm_bert.glue_data": "modeling_pkm_bert.training.glue_data",
    "modeling_pkm_bert.glue_metrics": "modeling_pkm_bert.training.glue_metrics",
    "modeling_pkm_bert.lm_data": "modeling_pkm_bert.training.lm_data",
    "modeling_pkm_bert.memory_usage": "modeling_pkm_bert.analysis.memory_usage",
    "modeling_pkm_bert.optimization": "modeling_pkm_bert.training.optimization",
    "modeling_pkm_bert.sparse_finetuning": "modeling_pkm_bert.training.sparse_finetuning",
    "modeling_pkm_bert.squad_metrics": "modeling_pkm_bert.training.squad_metrics",
    "modeling_pkm_bert.staleness": "modeling_pkm_bert.analysis.staleness",
    "modeling_pkm_bert.trime": "modeling_pkm_bert.training.trime",
    "modeling_pkm_bert.triton_kernels": "modeling_pkm_bert.kernels.triton_gathers",
}


class LegacyModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module at its new place (the same module object), with a DeprecationWarning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in LEGACY_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder, replaced in sys.modules by the module at its new place

    def exec_module(self, module):
        new = LEGACY_MODULES[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}; the old path goes away in the next release", DeprecationWarning, 2)
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(finder, LegacyModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(LegacyModuleFinder())


def __getattr__(name):
    if name in _REGISTERS_KERNELS:
        from . import kernels

        kernels.register()
    return _resolve(name)


def register_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel*` resolve `model_type="bert_pkm"` and `"roberta_pkm"` to this package in the
    current process."""
    import transformers

    from . import kernels, modeling_bert_pkm, modeling_roberta_pkm
    from .configuration_bert_pkm import AUTO_MAP, BertPkmConfig
    from .configuration_roberta_pkm import ROBERTA_AUTO_MAP, RobertaPkmConfig

    kernels.register()
    families = [(BertPkmConfig, AUTO_MAP, modeling_bert_pkm), (RobertaPkmConfig, ROBERTA_AUTO_MAP, modeling_roberta_pkm)]
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
        "RobertaPkmConfig",
        *_PUBLIC[".modeling_roberta_pkm"],
        "quantize_memory_values",
        "register_auto_classes",
        "shard_memory_values",
        "use_huge_pages",
    ]
)
