"""Triton kernels for the value gathers of a product key memory on GPU (opt-in, see `ProductKeyValues.triton_devices`).

A memory reads `heads * knn` random rows of its value table per token and sums them with the softmax weights. torch's
`EmbeddingBag` with `per_sample_weights` does this well on CPU (fbgemm) but reaches a fraction of the bandwidth of a
GPU (Meta's memory layers report < 400 GB/s on an H100, against ~3 TB/s for their own kernels). Three ops cover all
of a memory's gathers:

- `bag_sum(table, rows, weights, offsets)`: `out[b] = sum of weights[l] * table[rows[l]]` over the lookups
  `l in [offsets[b], offsets[b + 1])`, fp32 sums (fp64 for fp64 inputs). It is the forward lookup (bags of
  `heads * knn` lookups per token) and the sorted-segment value gradient (bags: the lookups of each used row sorted by
  row; table: the output gradient).
- `row_dots(table, rows, other, bag)`: `out[l] = dot(table[rows[l]], other[l // bag])`, the gradient of each
  per-sample weight.
- `row_sum_backward(grad_output, table, rows, weights, bag, table_grad, weights_grad, slots=None, n_slots=-1)`: the
  whole backward of `out[t] = sum_j weights[t * bag + j] * table[rows[t * bag + j]]` in one pass over the lookups:
  the weight gradient `dot(table[row], grad_output[t])` (as `row_dots`) and the table gradient, each
  `weights[l] * grad_output[t]` added with fp32 atomics into row `rows[l]` of a dense fp32 buffer (cast once to a
  bf16/fp16 table's dtype at the end). Each table row is read once per lookup and each `grad_output` row once per
  token (per 128 lookups of a token for longer bags). With `slots` (e.g. the inverse of `torch.unique(rows)`),
  lookup `l` adds into row `slots[l]` of an `(n_slots, dim)` gradient instead: the coalesced rows of a sparse
  gradient without a sort by row.

Why the bf16 gather was 0.66x EmbeddingBag on an H200 (reasoning from the code; the measurement is
`benchmarks/gpu_triton_gathers.py`): the old `bag_sum` reduced every `(16 lookups x 256 columns)` tile across its
lookups (`tl.sum(tile, axis=0)`) inside the loop. The lookups of a tile lie across warps, so each iteration ended in a
shared-memory reduction and a barrier, and the next iteration's loads could only start after it: one memory latency
per iteration, with a single tile in flight per program. A bf16 tile is half the bytes of an fp32 one (8 KiB against
16 KiB), so the same fixed latency per iteration bought half the bandwidth, exactly where bf16 fell behind. The PTX
Triton 3.9 compiles for sm_90 shows it: the old bf16 loop held 8 `bar.sync`, 16 shuffles and 8 shared-memory accesses
for 4 16-B loads per thread (fp32: 4 barriers for 8 loads). Now (`tests/test_triton_kernels.py` compiles both loops for
sm_90 without a GPU and checks): no barrier in either loop, 8 16-B loads per thread per iteration in bf16 as in fp32
(ptxas: 98 / 64 registers, no spills); the fused backward's loop adds with `red.global.gpu.relaxed.add.v4.f32`.

- the accumulator is 2-d, `(BLOCK_LOOKUPS, BLOCK_DIM)` in fp32, reduced across lookups once after the loop: the loop
  body is loads and FMAs only, no barrier, and the compiler issues a whole tile's loads before the first FMA;
- a tile holds about the same bytes for every dtype (32 KiB: 8192 fp32 or 16384 bf16 elements, `_TILE_BYTES`), so
  a bf16 program keeps as many bytes in flight as an fp32 one; 8 warps then load 128 B per thread per iteration
  (8 vectors of 16 B), with ~2 programs per SM ~64 KiB in flight per SM, above the ~30 KiB per SM that Little's law
  asks of ~4.8 TB/s at ~0.8 us DRAM latency;
- a row block spans up to 1024 columns for 2-byte dtypes (2 KiB, as fp32's 512) and is the width that pads the row
  least (768 columns: 3 blocks of 256, no masked lanes), and the lookups of a tile are as many as the mean bag holds
  (`rows.numel() / bags`, known from the shapes without a sync): 64 per tile for the forward at the paper's size, a
  handful for the short segments of the value gradient, where a 64-lookup tile would be mostly masked lanes;
- `tl.multiple_of`/`tl.max_contiguous` on the column offsets (contiguous runs of BLOCK_DIM starting at multiples of
  BLOCK_DIM, true by construction) and Triton's own specialization of `dim` divisible by 16 let the loads be 16 B
  vectors; a row block that divides `dim` drops the column mask (`EVEN_DIM`).
Accumulation stays fp32 for fp32, bf16 and fp16 (fp64 for fp64 inputs); the result is rounded once to the table's
dtype.

Importing `modeling_pkm_bert` registers them as `torch.ops.pkm_bert.bag_sum`, `row_dots` and `row_sum_backward` for
CUDA tensors when the `triton` package is installed. Under the Triton interpreter (`TRITON_INTERPRET=1` before the
import) they also take CPU tensors: that is how the tests check them on a machine without a GPU.
"""

import math
import os
from typing import Optional

import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the gathers stay on EmbeddingBag
    triton = None

BAG_SUM = "pkm_bert::bag_sum"
ROW_DOTS = "pkm_bert::row_dots"
ROW_SUM_BACKWARD = "pkm_bert::row_sum_backward"

_TILE_BYTES = 32 * 1024  # bytes a program loads per loop iteration (see the module docstring)


def available() -> bool:
    """Whether the `triton` package is importable (the kernels still need a GPU, or the interpreter, to run)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _bag_sum_kernel(
        table, rows, weights, offsets, out, dim,
        BLOCK_LOOKUPS: tl.constexpr, BLOCK_DIM: tl.constexpr, EVEN_DIM: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        bag, block = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
        columns = tl.max_contiguous(tl.multiple_of(columns, BLOCK_DIM), BLOCK_DIM)
        in_row = columns < dim
        begin, end = tl.load(offsets + bag), tl.load(offsets + bag + 1)
        total = tl.zeros([BLOCK_LOOKUPS, BLOCK_DIM], dtype=ACC)
        for start in range(begin, end, BLOCK_LOOKUPS):
            lookups = start + tl.arange(0, BLOCK_LOOKUPS)
            valid = lookups < end
            row = tl.load(rows + lookups, mask=valid, other=0).to(tl.int64)
            weight = tl.load(weights + lookups, mask=valid, other=0.0).to(ACC)
            if EVEN_DIM:
                mask = valid[:, None]
            else:
                mask = valid[:, None] & in_row[None, :]
            tile = tl.load(table + row[:, None] * dim + columns[None, :], mask=mask, other=0.0)
            total += tile.to(ACC) * weight[:, None]  # reduced across lookups once, after the loop
        out_row = out + bag.to(tl.int64) * dim
        tl.store(out_row + columns, tl.sum(total, axis=0).to(out.dtype.element_ty), mask=in_row)

    @triton.jit
    def _row_dots_kernel(
        table, rows, other, out, n_lookups, bag, dim,
        BLOCK_LOOKUPS: tl.constexpr, BLOCK_DIM: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        lookups = tl.program_id(0).to(tl.int64) * BLOCK_LOOKUPS + tl.arange(0, BLOCK_LOOKUPS)
        valid = lookups < n_lookups
        row = tl.load(rows + lookups, mask=valid, other=0).to(tl.int64)
        token = lookups // bag
        total = tl.zeros([BLOCK_LOOKUPS, BLOCK_DIM], dtype=ACC)
        for start in range(0, dim, BLOCK_DIM):
            columns = start + tl.arange(0, BLOCK_DIM)
            mask = valid[:, None] & (columns < dim)[None, :]
            a = tl.load(table + row[:, None] * dim + columns[None, :], mask=mask, other=0.0)
            b = tl.load(other + token[:, None] * dim + columns[None, :], mask=mask, other=0.0)
            total += a.to(ACC) * b.to(ACC)
        tl.store(out + lookups, tl.sum(total, axis=1).to(out.dtype.element_ty), mask=valid)

    @triton.jit
    def _row_sum_backward_kernel(
        grad_output, table, rows, weights, slots, grad_table, grad_weights, bag, dim,
        TABLE_GRAD: tl.constexpr, WEIGHTS_GRAD: tl.constexpr, HAS_SLOTS: tl.constexpr,
        BLOCK_LOOKUPS: tl.constexpr, BLOCK_DIM: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        token, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        within = chunk * BLOCK_LOOKUPS + tl.arange(0, BLOCK_LOOKUPS)
        valid = within < bag
        lookups = token * bag + within
        row = tl.load(rows + lookups, mask=valid, other=0).to(tl.int64)
        if HAS_SLOTS:
            target = tl.load(slots + lookups, mask=valid, other=0).to(tl.int64)
        else:
            target = row
        weight = tl.load(weights + lookups, mask=valid, other=0.0).to(ACC)
        dots = tl.zeros([BLOCK_LOOKUPS, BLOCK_DIM], dtype=ACC)
        for start in range(0, dim, BLOCK_DIM):
            columns = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK_DIM), BLOCK_DIM), BLOCK_DIM)
            in_row = columns < dim
            g = tl.load(grad_output + token * dim + columns, mask=in_row, other=0.0).to(ACC)
            mask = valid[:, None] & in_row[None, :]
            if WEIGHTS_GRAD:
                tile = tl.load(table + row[:, None] * dim + columns[None, :], mask=mask, other=0.0)
                dots += tile.to(ACC) * g[None, :]
            if TABLE_GRAD:  # result unused (Triton emits reductions, no round trip); relaxed: no fences
                target_at = grad_table + target[:, None] * dim + columns[None, :]
                tl.atomic_add(target_at, weight[:, None] * g[None, :], mask=mask, sem="relaxed")
        if WEIGHTS_GRAD:
            tl.store(grad_weights + lookups, tl.sum(dots, axis=1).to(grad_weights.dtype.element_ty), mask=valid)


def _check_table(name: str, table: torch.Tensor):
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-d tensor, got shape {tuple(table.shape)}")


def _check_rows(rows: torch.Tensor, n_rows: int, name: str = "rows"):
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {rows.dtype}")
    # an out-of-range row would read past the table; checked on the device (no host sync), raised at the next sync
    torch._assert_async(((rows >= 0) & (rows < n_rows)).all(), f"{name} must be in [0, {n_rows})")


def _accumulator(*tensors: torch.Tensor):
    """The sums' dtype: fp64 where an input is fp64 (fp32 sums would silently lose its precision), else fp32."""
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


def bag_sum_config(dim: int, element_size: int, mean_bag: float) -> dict:
    """The launch parameters of `bag_sum` for rows of `dim` elements of `element_size` bytes in bags of `mean_bag`
    lookups on average (see the module docstring): a row block of 2 KiB of a row at most, the widest that leaves at most
    a quarter of its lanes masked (else the one that pads `dim` least); as many lookups as the mean bag holds, up to a
    tile of `_TILE_BYTES`; 8 warps for a full tile."""
    widest = max(2048 // element_size, 16)
    candidates = [width for width in (1024, 512, 256, 128, 64, 32, 16) if width <= widest]
    candidates = [width for width in candidates if width <= max(triton.next_power_of_2(dim), 16)]
    padding = {width: triton.cdiv(dim, width) * width - dim for width in candidates}
    fitting = [width for width in candidates if padding[width] * 4 <= dim]  # at most a quarter of the lanes masked
    block_dim = max(fitting) if fitting else min(candidates, key=padding.get)
    most_lookups = max(_TILE_BYTES // (element_size * block_dim), 1)
    block_lookups = min(triton.next_power_of_2(max(math.ceil(mean_bag), 1)), most_lookups)
    tile_bytes = block_lookups * block_dim * element_size
    num_warps = 8 if tile_bytes >= 16384 else 4 if tile_bytes >= 4096 else 2 if tile_bytes >= 1024 else 1
    return {"BLOCK_LOOKUPS": block_lookups, "BLOCK_DIM": block_dim, "num_warps": num_warps}


def launch_bag_sum(table, rows, weights, offsets, out, config: Optional[dict] = None):
    """Runs `_bag_sum_kernel` into `out` with `config` (default: `bag_sum_config`); `benchmarks/gpu_triton_gathers.py`
    sweeps configurations through it. Inputs unchecked: `bag_sum` checks them."""
    n_bags, dim = offsets.numel() - 1, table.shape[1]
    if not (n_bags and dim):
        return out
    config = dict(config or bag_sum_config(dim, table.element_size(), rows.numel() / n_bags))
    grid = (n_bags, triton.cdiv(dim, config["BLOCK_DIM"]))
    even_dim, acc = dim % config["BLOCK_DIM"] == 0, _accumulator(table, weights)
    _bag_sum_kernel[grid](table, rows, weights, offsets, out, dim, EVEN_DIM=even_dim, ACC=acc, **config)
    return out


def _bag_sum(table: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_table("table", table)
    if rows.dim() != 1 or weights.shape != rows.shape or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(
            f"rows and weights must be 1-d of one length and offsets 1-d (bags + 1), got {tuple(rows.shape)}, "
            f"{tuple(weights.shape)}, {tuple(offsets.shape)}"
        )
    _check_rows(rows, table.shape[0])
    # bounds outside [0, len(rows)] or decreasing would read past `rows`: checked on the device like the rows
    bounds_ok = (offsets[0] >= 0) & (offsets[-1] <= rows.numel()) & (offsets.diff() >= 0).all()
    torch._assert_async(bounds_ok, f"offsets must be non-decreasing in [0, {rows.numel()}]")
    out = table.new_empty(offsets.numel() - 1, table.shape[1])
    return launch_bag_sum(table, rows.contiguous(), weights.contiguous(), offsets.contiguous(), out)


def _check_lookups(rows: torch.Tensor, other: torch.Tensor, table: torch.Tensor, bag: int, other_name: str):
    if rows.dim() != 1 or bag < 1 or rows.numel() != other.shape[0] * bag or other.shape[1] != table.shape[1]:
        raise ValueError(
            f"rows must be 1-d with {bag} lookups for each of the {other.shape[0]} rows of {other_name}, and "
            f"{other_name} as wide as table ({table.shape[1]}); got rows {tuple(rows.shape)}, "
            f"{other_name} {tuple(other.shape)}"
        )


def _row_dots(table: torch.Tensor, rows: torch.Tensor, other: torch.Tensor, bag: int) -> torch.Tensor:
    _check_table("table", table)
    _check_table("other", other)
    _check_lookups(rows, other, table, bag, "other")
    _check_rows(rows, table.shape[0])
    n_lookups, dim = rows.numel(), table.shape[1]
    out = torch.empty(n_lookups, dtype=torch.promote_types(table.dtype, other.dtype), device=table.device)
    if n_lookups:
        block_dim = min(triton.next_power_of_2(max(dim, 1)), 128)
        _row_dots_kernel[(triton.cdiv(n_lookups, 32),)](table, rows.contiguous(), other, out, n_lookups, bag, dim,
                                                         BLOCK_LOOKUPS=32, BLOCK_DIM=block_dim,
                                                         ACC=_accumulator(table, other))  # fmt: skip
    return out


def row_sum_backward_config(bag: int, dim: int) -> dict:
    """The launch parameters of `row_sum_backward`: all the lookups of a token in one program up to 128 (its
    `grad_output` row is then read once), columns in blocks that keep the `(lookups, columns)` tile at 8192 elements."""
    block_lookups = min(triton.next_power_of_2(bag), 128)
    block_dim = min(max(8192 // block_lookups, 16), max(triton.next_power_of_2(dim), 16))
    num_warps = 8 if block_lookups * block_dim >= 4096 else 4
    return {"BLOCK_LOOKUPS": block_lookups, "BLOCK_DIM": block_dim, "num_warps": num_warps}


def launch_row_sum_backward(
    grad_output, table, rows, weights, bag, grad_table, grad_weights, slots=None, config: Optional[dict] = None
):
    """Runs `_row_sum_backward_kernel`, adding into `grad_table` (fp32, fp64 for fp64 inputs; None: no table gradient)
    and storing `grad_weights` (None: none); `config` defaults to `row_sum_backward_config`. Inputs unchecked."""
    tokens, dim = grad_output.shape
    if not (tokens and dim and bag) or (grad_table is None and grad_weights is None):
        return
    config = dict(config or row_sum_backward_config(bag, dim))
    grid = (tokens, triton.cdiv(bag, config["BLOCK_LOOKUPS"]))
    _row_sum_backward_kernel[grid](
        grad_output, table, rows, weights, slots if slots is not None else rows, grad_table, grad_weights, bag, dim,
        TABLE_GRAD=grad_table is not None, WEIGHTS_GRAD=grad_weights is not None, HAS_SLOTS=slots is not None,
        ACC=_accumulator(grad_output, table, weights), **config,
    )  # fmt: skip


def _row_sum_backward(
    grad_output: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, bag: int,
    table_grad: bool, weights_grad: bool, slots: Optional[torch.Tensor] = None, n_slots: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    _check_table("table", table)
    _check_table("grad_output", grad_output)
    _check_lookups(rows, grad_output, table, bag, "grad_output")
    if weights.shape != rows.shape:
        raise ValueError(f"weights must have the shape of rows {tuple(rows.shape)}, got {tuple(weights.shape)}")
    _check_rows(rows, table.shape[0])
    if slots is not None:
        if slots.shape != rows.shape or n_slots < 0:
            raise ValueError(
                f"slots must have the shape of rows {tuple(rows.shape)} and come with n_slots >= 0; got slots "
                f"{tuple(slots.shape)}, n_slots {n_slots}"
            )
        _check_rows(slots, n_slots, "slots")
    rows, weights = rows.contiguous(), weights.contiguous()
    slots = slots.contiguous() if slots is not None else None
    grad_table = grad_weights = None
    if table_grad:  # fp32 sums for every narrower dtype (atomics into an fp32 buffer, then one rounding)
        shape = (n_slots if slots is not None else table.shape[0], table.shape[1])
        wide = torch.float64 if _accumulator(grad_output, table, weights) == tl.float64 else torch.float32
        grad_table = torch.zeros(shape, dtype=wide, device=table.device)
    if weights_grad:
        grad_weights = torch.empty_like(weights)
    launch_row_sum_backward(grad_output, table, rows, weights, bag, grad_table, grad_weights, slots)
    grad_table = grad_table.to(table.dtype) if table_grad else table.new_empty(0)
    return grad_table, grad_weights if weights_grad else weights.new_empty(0)


def _fake_bag_sum(table, rows, weights, offsets):
    return table.new_empty(offsets.shape[0] - 1, table.shape[1])


def _fake_row_dots(table, rows, other, bag):
    return rows.new_empty(rows.shape, dtype=torch.promote_types(table.dtype, other.dtype))


def _fake_row_sum_backward(grad_output, table, rows, weights, bag, table_grad, weights_grad, slots=None, n_slots=-1):
    shape = (n_slots if slots is not None else table.shape[0], table.shape[1])
    return table.new_empty(shape if table_grad else (0,)), weights.new_empty(weights.shape if weights_grad else (0,))


def register() -> bool:
    """Registers the three ops (once) for CUDA, and for CPU under the Triton interpreter; False without triton."""
    if triton is None:
        return False
    devices = ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)
    for name, function, fake in (
        (BAG_SUM, _bag_sum, _fake_bag_sum),
        (ROW_DOTS, _row_dots, _fake_row_dots),
        (ROW_SUM_BACKWARD, _row_sum_backward, _fake_row_sum_backward),
    ):
        if not hasattr(torch.ops.pkm_bert, name.split("::")[1]):
            torch.library.custom_op(name, mutates_args=(), device_types=devices)(function).register_fake(fake)
    return True


__all__ = ["available", "register"]
