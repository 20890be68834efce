"""`quantize_memory_values`: each memory table (product-key values, n-gram tables) as int8 or 4-bit rows (FBGEMM's
row-wise layout), for serving.

The value tables are most of a BertPkm model's bytes, and a CPU lookup is bound by reading random rows; packed rows
are 3.96x (int8) or 7.7x (4-bit) smaller than fp32 and read by torch's quantized EmbeddingBag kernels
(`torch.ops.quantized.embedding_bag_{byte,4bit}_rowwise_offsets`) with the softmax weights as per-sample weights. The
search, the softmax and the rest of the model are unchanged. The module that reads them,
`QuantizedProductKeyValues`, lives in the remote-code file `product_key_memory.py`, and the config field
`pkm_values_quantization` records the format, so a saved folder loads with `trust_remote_code=True` anywhere.
"""

import torch
from torch import nn

from ..product_key_memory import (
    VALUE_QUANTIZATIONS,
    ProductKeyMemory,
    QuantizedProductKeyValues,
    packed_row_bytes,
)
from ..utils.memories import ngram_memory_modules


BITS = {bits: name for name, bits in VALUE_QUANTIZATIONS.items()}  # 8 -> "int8", 4 -> "4bit"
_PREPACK_OPS = {8: "embedding_bag_byte_prepack", 4: "embedding_bag_4bit_prepack"}
_CHUNK_ROWS = 1 << 15  # rows packed at a time: the fp32 copy of a chunk is all the extra memory quantizing needs


def _memories(model: nn.Module) -> list[ProductKeyMemory]:
    return [module for module in model.modules() if isinstance(module, ProductKeyMemory)]


def _tables(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every memory table of `model` as (owner, attribute): the product-key memories' `values`, the n-gram memories'
    `tables`."""
    return [(memory, "values") for memory in _memories(model)] + [
        (memory, "tables") for memory in ngram_memory_modules(model).values()
    ]


def quantized_tables(model: nn.Module) -> list[QuantizedProductKeyValues]:
    """The distinct quantized memory tables of `model` (product-key values and n-gram tables; a shared table once)."""
    tables = {}
    for owner, attribute in _tables(model):
        table = getattr(owner, attribute)
        if isinstance(table, QuantizedProductKeyValues):
            tables.setdefault(id(table), table)
    return list(tables.values())


def check_not_quantized(model: nn.Module, what: str = "a training checkpoint") -> None:
    """Raises ValueError when `model` holds quantized value tables: they are inference only (no gradient, no
    optimizer state), so saving them as `what` would resume a training that cannot run."""
    tables = quantized_tables(model)
    if tables:
        raise ValueError(
            f"this model's {len(tables)} value table(s) are {tables[0].quantization}-quantized (inference only): it cannot"
            f" be saved as {what} (accelerate save_state / the scripts' checkpoints) nor trained; save it for serving with"
            " model.save_pretrained(folder), and train the fp32 model instead"
        )


def prepack_rows(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """A `(rows, dim)` float table -> uint8 packed rows `(rows, packed_row_bytes(dim, bits))`, FBGEMM's layout, by
    `torch.ops.quantized.embedding_bag_{byte,4bit}_prepack` (chunks of rows), or a torch version of it where a torch
    build lacks the op."""
    rows, dim = weight.shape
    out = torch.empty(rows, packed_row_bytes(dim, bits), dtype=torch.uint8)
    op = getattr(torch.ops.quantized, _PREPACK_OPS[bits], None) if hasattr(torch.ops, "quantized") else None
    for start in range(0, rows, _CHUNK_ROWS):
        chunk = weight[start : start + _CHUNK_ROWS].detach().to("cpu", torch.float32).contiguous()
        out[start : start + chunk.shape[0]] = op(chunk) if op is not None else _prepack_torch(chunk, bits)
    return out


def _prepack_torch(chunk: torch.Tensor, bits: int) -> torch.Tensor:
    """FBGEMM's row-wise quantization in torch ops: `code = round((x - min) / scale)`, scale = range / (2^bits - 1)."""
    low, high = chunk.min(1, keepdim=True).values, chunk.max(1, keepdim=True).values
    if bits == 8:
        scale, inverse = (high - low) / 255.0, 255.0 / (high - low + 1e-8)
        codes = torch.round((chunk - low) * inverse).clamp(0, 255).to(torch.uint8)
        qparams = torch.cat((scale, low), 1).contiguous().view(torch.uint8)
        return torch.cat((codes, qparams), 1)
    low = low.half().float()  # the bias is stored in fp16: quantize against the stored one
    scale = ((high - low) / 15.0).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((chunk - low) / scale).clamp(0, 15).to(torch.uint8)
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    qparams = torch.cat((scale, low), 1).half().contiguous().view(torch.uint8)
    return torch.cat((packed, qparams), 1)


@torch.no_grad()
def quantize_memory_values(model: nn.Module, bits: int = 8) -> int:
    """Replaces each memory table of `model` by a packed one, int8 (`bits=8`: an fp32 scale and bias per row, 3.96x
    smaller than fp32 at 768 values a row) or 4-bit (`bits=4`: fp16 scale and bias, 7.7x smaller), read through torch's
    quantized EmbeddingBag kernels on the same lookup path; returns the number of tables packed. The tables are the
    product-key memories' values and the hashed n-gram memories' tables (their rows are short: an n-gram row of 32
    values packs 3.2x (int8) and 6.4x (4-bit) smaller, the scale and bias being a larger share). A table shared by
    several memories (`pkm_shared_values`) becomes one packed table, still shared. The search, the hashing, the softmax
    and the rest of the model are unchanged, and `model.config.pkm_values_quantization` records the format ("int8" |
    "4bit") of every memory table, so `save_pretrained` writes a folder that loads as it is (with
    `trust_remote_code=True` where this package is not installed). Inference only: a quantized model refuses
    training-mode forwards with gradients and training checkpoints. The packed rows stay on the table's device;
    FBGEMM's kernels run on the CPU, elsewhere a dequantising torch path reads the rows.

    Raises ValueError for bits other than 8 or 4, a model without memories, a model already quantized, and 4 bits for
    rows of an odd number of values.
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits={bits!r}: quantize_memory_values packs 8 (int8) or 4 (4-bit) bits per value")
    tables = _tables(model)
    if not tables:
        raise ValueError(
            f"{type(model).__name__} has no product key memory nor n-gram memory: there is no table to quantize"
        )
    done = quantized_tables(model)
    if done:
        raise ValueError(
            f"the memory tables are already {done[0].quantization}-quantized: quantizing twice would compound the"
            " rounding; quantize the fp32 model (e.g. load its folder again) instead"
        )
    for owner, attribute in tables:  # check every table before changing any
        dim = getattr(owner, attribute).weight.shape[1]
        if bits == 4 and dim % 2:
            raise ValueError(
                f"4-bit rows need an even row size; the table of {getattr(owner, 'layer_name', type(owner).__name__)} "
                f"has {dim} values a row: use bits=8"
            )
    packed = {}  # id(fp32 table) -> packed table
    for owner, attribute in tables:
        table = getattr(owner, attribute)
        if id(table) not in packed:
            rows, dim = table.weight.shape
            quantized = QuantizedProductKeyValues(rows, dim, bits, packed=prepack_rows(table.weight, bits).to(table.weight.device))
            packed[id(table)] = quantized.train(table.training)
        setattr(owner, attribute, packed[id(table)])
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "pkm_values_quantization"):
        config.pkm_values_quantization = BITS[bits]
    return len(packed)


__all__ = ["check_not_quantized", "prepack_rows", "quantize_memory_values", "quantized_tables"]
