"""Native kernels: the product-key selection for CPU inference (`cpu`, C source in `csrc/`, compiled on first
use) and the opt-in Triton value gathers for GPUs (`triton_gathers`).

Nothing registers at import: `register()` does, once per process. The package root calls it when a model class or
`ProductKeyMemory` is first resolved (`from modeling_pkm_bert import BertPkmForMaskedLM`), and the training
loaders call it; `PKM_BERT_NATIVE=0` keeps the native CPU selection off.
"""

import os


_registered = False


def register() -> None:
    """Register `torch.ops.pkm_bert.*`: the native CPU selection, and the Triton ops where CUDA (or the Triton
    interpreter) is there. Idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    import torch

    from . import cpu

    cpu.register()  # the native product-key selection for CPU inference (PKM_BERT_NATIVE=0: off)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":  # triton's import costs ~0.2 s
        from . import triton_gathers

        triton_gathers.register()  # torch.ops.pkm_bert.bag_sum, row_dots, row_sum_backward (ProductKeyValues.triton_devices)
