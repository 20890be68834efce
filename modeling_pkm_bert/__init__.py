"""Product key memory for BERT in the Hugging Face ecosystem (Kim & Jung 2020, on Lample et al. 2019)."""

from .configuration_bert_pkm import AUTO_MAP, BertPkmConfig
from .modeling_bert_pkm import (
    BertPkmForCausalLM,
    BertPkmForMaskedLM,
    BertPkmForMultipleChoice,
    BertPkmForQuestionAnswering,
    BertPkmForSequenceClassification,
    BertPkmForTokenClassification,
    BertPkmModel,
    BertPkmPreTrainedModel,
)
import os

import torch

from .product_key_memory import ProductKeyMemory
from . import cpu_kernels
from .cpu_kernels import use_huge_pages
from .serving import quantize_memory_values


cpu_kernels.register()  # the native product-key selection for CPU inference (PKM_BERT_NATIVE=0: off)
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":  # triton's import costs ~0.2 s: only then
    from . import triton_kernels

    triton_kernels.register()  # torch.ops.pkm_bert.bag_sum / row_dots, used where ProductKeyValues.triton_devices says


__version__ = "0.2.0"


def register_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel*` resolve `model_type="bert_pkm"` to this package in the current process."""
    import transformers

    from . import modeling_bert_pkm

    transformers.AutoConfig.register(BertPkmConfig.model_type, BertPkmConfig, exist_ok=True)
    for auto_class, target in AUTO_MAP.items():
        if auto_class != "AutoConfig":
            model_class = getattr(modeling_bert_pkm, target.split(".")[-1])
            getattr(transformers, auto_class).register(BertPkmConfig, model_class, exist_ok=True)


__all__ = [
    "BertPkmConfig",
    "BertPkmForCausalLM",
    "BertPkmForMaskedLM",
    "BertPkmForMultipleChoice",
    "BertPkmForQuestionAnswering",
    "BertPkmForSequenceClassification",
    "BertPkmForTokenClassification",
    "BertPkmModel",
    "BertPkmPreTrainedModel",
    "ProductKeyMemory",
    "quantize_memory_values",
    "register_auto_classes",
    "use_huge_pages",
]
