"""Triton kernels for the value gathers of a product key memory on GPU (opt-in, see `ProductKeyValues.triton_devices`).

A memory reads `heads * knn` random rows of its value table per token and sums them with the softmax weights. torch's
`EmbeddingBag` with `per_sample_weights` does this well on CPU (fbgemm) but reaches a fraction of the bandwidth of a
GPU (Meta's memory layers report < 400 GB/s on an H100, against ~3 TB/s for their own kernels). Two kernels cover all
of a memory's gathers:

- `bag_sum(table, rows, weights, offsets)`: `out[b] = sum of weights[l] * table[rows[l]]` over the lookups
  `l in [offsets[b], offsets[b + 1])`, fp32 sums. It is the forward lookup (bags of `heads * knn` lookups per token)
  and the value gradient (bags: the lookups of each used row sorted by row; table: the output gradient).
- `row_dots(table, rows, other, bag)`: `out[l] = dot(table[rows[l]], other[l // bag])`, the gradient of each
  per-sample weight.

Importing `modeling_pkm_bert` registers them as `torch.ops.pkm_bert.bag_sum` and `torch.ops.pkm_bert.row_dots` for CUDA
tensors when the `triton` package is installed. Under the Triton interpreter (`TRITON_INTERPRET=1` before the import)
they also take CPU tensors: that is how the tests check them on a machine without a GPU.
"""

import os

import torch


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the gathers stay on EmbeddingBag
    triton = None

BAG_SUM = "pkm_bert::bag_sum"
ROW_DOTS = "pkm_bert::row_dots"


def available() -> bool:
    """Whether the `triton` package is importable (the kernels still need a GPU, or the interpreter, to run)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _bag_sum_kernel(table, rows, weights, offsets, out, dim, BLOCK_LOOKUPS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        bag, block = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
        in_row = columns < dim
        begin, end = tl.load(offsets + bag), tl.load(offsets + bag + 1)
        total = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        for start in range(begin, end, BLOCK_LOOKUPS):
            lookups = start + tl.arange(0, BLOCK_LOOKUPS)
            valid = lookups < end
            row = tl.load(rows + lookups, mask=valid, other=0).to(tl.int64)
            weight = tl.load(weights + lookups, mask=valid, other=0.0).to(tl.float32)
            tile = tl.load(table + row[:, None] * dim + columns[None, :], mask=valid[:, None] & in_row[None, :], other=0.0)
            total += tl.sum(tile.to(tl.float32) * weight[:, None], axis=0)
        tl.store(out + bag.to(tl.int64) * dim + columns, total.to(out.dtype.element_ty), mask=in_row)

    @triton.jit
    def _row_dots_kernel(table, rows, other, out, n_lookups, bag, dim, BLOCK_LOOKUPS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        lookups = tl.program_id(0).to(tl.int64) * BLOCK_LOOKUPS + tl.arange(0, BLOCK_LOOKUPS)
        valid = lookups < n_lookups
        row = tl.load(rows + lookups, mask=valid, other=0).to(tl.int64)
        token = lookups // bag
        total = tl.zeros([BLOCK_LOOKUPS], dtype=tl.float32)
        for start in range(0, dim, BLOCK_DIM):
            columns = start + tl.arange(0, BLOCK_DIM)
            mask = valid[:, None] & (columns < dim)[None, :]
            a = tl.load(table + row[:, None] * dim + columns[None, :], mask=mask, other=0.0)
            b = tl.load(other + token[:, None] * dim + columns[None, :], mask=mask, other=0.0)
            total += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
        tl.store(out + lookups, total.to(out.dtype.element_ty), mask=valid)


def _check_table(name: str, table: torch.Tensor):
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-d tensor, got shape {tuple(table.shape)}")


def _check_rows(rows: torch.Tensor, n_rows: int):
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32 or int64, got {rows.dtype}")
    # an out-of-range row would read past the table; checked on the device (no host sync), raised at the next sync
    torch._assert_async(((rows >= 0) & (rows < n_rows)).all(), f"rows must be in [0, {n_rows})")


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
    n_bags, dim = offsets.numel() - 1, table.shape[1]
    out = table.new_empty(n_bags, dim)
    if n_bags and dim:
        block_dim = min(triton.next_power_of_2(dim), 256)
        grid = (n_bags, triton.cdiv(dim, block_dim))
        _bag_sum_kernel[grid](table, rows.contiguous(), weights.contiguous(), offsets.contiguous(), out, dim,
                              BLOCK_LOOKUPS=16, BLOCK_DIM=block_dim)  # fmt: skip
    return out


def _row_dots(table: torch.Tensor, rows: torch.Tensor, other: torch.Tensor, bag: int) -> torch.Tensor:
    _check_table("table", table)
    _check_table("other", other)
    if rows.dim() != 1 or bag < 1 or rows.numel() != other.shape[0] * bag or other.shape[1] != table.shape[1]:
        raise ValueError(
            f"rows must be 1-d with {bag} lookups for each of the {other.shape[0]} rows of other, and other as wide as "
            f"table ({table.shape[1]}); got rows {tuple(rows.shape)}, other {tuple(other.shape)}"
        )
    _check_rows(rows, table.shape[0])
    n_lookups, dim = rows.numel(), table.shape[1]
    out = torch.empty(n_lookups, dtype=torch.promote_types(table.dtype, other.dtype), device=table.device)
    if n_lookups:
        block_dim = min(triton.next_power_of_2(max(dim, 1)), 128)
        _row_dots_kernel[(triton.cdiv(n_lookups, 32),)](table, rows.contiguous(), other, out, n_lookups, bag, dim,
                                                         BLOCK_LOOKUPS=32, BLOCK_DIM=block_dim)  # fmt: skip
    return out


def _fake_bag_sum(table, rows, weights, offsets):
    return table.new_empty(offsets.shape[0] - 1, table.shape[1])


def _fake_row_dots(table, rows, other, bag):
    return rows.new_empty(rows.shape, dtype=torch.promote_types(table.dtype, other.dtype))


def register() -> bool:
    """Registers the two ops (once) for CUDA, and for CPU under the Triton interpreter; False without triton."""
    if triton is None:
        return False
    if not hasattr(torch.ops.pkm_bert, "bag_sum"):
        devices = ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)
        for name, function, fake in ((BAG_SUM, _bag_sum, _fake_bag_sum), (ROW_DOTS, _row_dots, _fake_row_dots)):
            torch.library.custom_op(name, mutates_args=(), device_types=devices)(function).register_fake(fake)
    return True


__all__ = ["available", "register"]
