"""Native kernels: the product-key selection for CPU (`cpu`, C source in `csrc/`, compiled on first use).

Nothing registers at import: `register()` does, once per process. The package root calls it when a model class or
`ProductKeyMemory` is first resolved (`from modeling_pkm_bert import BertPkmForMaskedLM`), and the training
loaders call it; `PKM_BERT_NATIVE=0` keeps the native CPU selection off.
"""

_registered = False


def register() -> None:
    """Register `torch.ops.pkm_bert.select_product_keys`, the native CPU selection. Idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    from . import cpu

    cpu.register()  # PKM_BERT_NATIVE=0: off
