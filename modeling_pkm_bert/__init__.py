"""Product key memory for BERT in the Hugging Face ecosystem (Kim & Jung 2020, on Lample et al. 2019).

Layout: the flat `.py` files beside this one are the Hub remote code, exactly `REMOTE_CODE_FILES`
(`configuration_bert_pkm.REMOTE_CODE_FILES`); everything else lives in a subpackage named for its job:
`kernels` (native CPU selection, Triton gathers), `training` (script support), `hub` (conversion, model cards,
upload), `analysis` (memory usage and reports), `integrations` (export, PEFT, Trainer), `parallel` (FSDP2 and
memory-parallel value tables), `serving` (int8 / 4-bit value tables).

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


__version__ = "0.2.0"

_MODEL_NAMES = (
    "BertPkmForCausalLM",
    "BertPkmForMaskedLM",
    "BertPkmForMultipleChoice",
    "BertPkmForQuestionAnswering",
    "BertPkmForSequenceClassification",
    "BertPkmForTokenClassification",
    "BertPkmModel",
    "BertPkmPreTrainedModel",
)
# public name -> (module, whether resolving it registers the native kernels first)
_PUBLIC = {
    "AUTO_MAP": ("configuration_bert_pkm", False),
    "BertPkmConfig": ("configuration_bert_pkm", False),
    "REMOTE_CODE_FILES": ("configuration_bert_pkm", False),
    **{name: ("modeling_bert_pkm", True) for name in _MODEL_NAMES},
    "ProductKeyMemory": ("product_key_memory", True),
    "ProductKeyValues": ("product_key_memory", True),
    "use_huge_pages": ("kernels.cpu", True),
    "shard_memory_values": ("parallel", False),
    "quantize_memory_values": ("serving", True),
}

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
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, registers = _PUBLIC[name]
    if registers:
        from . import kernels

        kernels.register()
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def register_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel*` resolve `model_type="bert_pkm"` to this package in the current process."""
    import transformers

    from . import kernels, modeling_bert_pkm
    from .configuration_bert_pkm import AUTO_MAP, BertPkmConfig

    kernels.register()
    transformers.AutoConfig.register(BertPkmConfig.model_type, BertPkmConfig, exist_ok=True)
    for auto_class, target in AUTO_MAP.items():
        if auto_class != "AutoConfig":
            model_class = getattr(modeling_bert_pkm, target.split(".")[-1])
            getattr(transformers, auto_class).register(BertPkmConfig, model_class, exist_ok=True)


__all__ = sorted(["BertPkmConfig", *_MODEL_NAMES, "ProductKeyMemory", "quantize_memory_values", "register_auto_classes", "shard_memory_values", "use_huge_pages"])
