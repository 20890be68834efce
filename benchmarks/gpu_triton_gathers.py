"""The Triton value gathers (`modeling_pkm_bert/kernels/triton_gathers.py`) against EmbeddingBag on a GPU, in achieved
GB/s and as a share of the device's copy bandwidth (a `tensor.copy_` moving the same bytes), fp32 and bf16:

- forward: `bag_sum` against `F.embedding_bag(..., per_sample_weights=...)`;
- backward (dense value gradient and per-sample weight gradient): the fused `row_sum_backward` against EmbeddingBag's
  autograd backward and against the memory's own backward op with `triton=True` (today: a sort by row, `bag_sum` over
  the row segments and `row_dots`);
- `--sweep`: every launch configuration of a small grid for both kernels, the fastest first (to tune the defaults of
  `bag_sum_config` / `row_sum_backward_config`).

The paper's size by default: 8 x 128 tokens, heads 4 x knn 32 = 128 lookups a token, 512² value rows of 768; the rows
drawn uniformly (no reuse in the caches: the bandwidth's worst case). Bytes counted: forward, the value rows read, the
output written, the indices and weights read; backward, the floor: the value rows read once (weight gradient), the
output gradient read, the dense value gradient written once. Issue 34's goal: the gather at >= 60% of the copy
bandwidth in fp32 and bf16.

    python benchmarks/gpu_triton_gathers.py [--sweep] [--output gathers.md]

Needs CUDA; `TRITON_INTERPRET=1 python benchmarks/gpu_triton_gathers.py --smoke` runs it on CPU at a tiny size under
the Triton interpreter (a check that it runs: its figures mean nothing).
"""

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from modeling_pkm_bert import kernels  # noqa: E402
from modeling_pkm_bert.kernels import triton_gathers  # noqa: E402


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--bag", type=int, default=128, help="lookups a token (heads x knn)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--rows", type=int, default=512**2, help="value rows (n_keys²)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each op (the median is reported)")
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch configurations of both kernels")
    parser.add_argument("--output", help="also write the tables to this markdown file")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny size, one run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.bag, args.dim, args.rows, args.repeats = 4, 8, 40, 64, 1
    return args


def timer(device: torch.device, repeats: int):
    """A function timing `fn` (median of `repeats` runs after warm-up, in ms): CUDA events on a GPU."""

    def measure(fn) -> float:
        for _ in range(2 if device.type == "cuda" else 0):  # compiles the kernels, warms the allocator
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)

    return measure


def copy_gbps(measure, n_bytes: int, device: torch.device) -> float:
    """The device's copy bandwidth moving `n_bytes` (half read, half written), in GB/s."""
    source = torch.empty(max(n_bytes // 2, 1), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / measure(lambda: target.copy_(source)) / 1e6


def memory_backward_op():
    """The memory's own value backward op (with `triton=True`: its Triton path), or None where it has another name."""
    from modeling_pkm_bert import product_key_memory_ops

    return getattr(product_key_memory_ops, "row_sum_backward_op", None)


def bench_dtype(args, name: str, device: torch.device, measure) -> list[dict]:
    dtype = DTYPES[name]
    tokens, bag, dim, n_rows, size = args.tokens, args.bag, args.dim, args.rows, DTYPES[name].itemsize
    generator = torch.Generator(device=device).manual_seed(0)
    table = torch.randn(n_rows, dim, device=device, generator=generator).to(dtype)
    indices = torch.randint(0, n_rows, (tokens, bag), device=device, generator=generator)
    weights = torch.rand(tokens, bag, device=device, generator=generator).to(dtype)  # EmbeddingBag: the table's dtype
    grad_output = torch.randn(tokens, dim, device=device, generator=generator).to(dtype)
    rows, flat_weights = indices.reshape(-1), weights.reshape(-1)
    bounds = torch.arange(0, tokens * bag + 1, bag, device=device)
    lookups = tokens * bag
    forward_bytes = lookups * dim * size + tokens * dim * size + lookups * (8 + size)
    backward_bytes = lookups * dim * size + tokens * dim * size + n_rows * dim * size
    copy_forward, copy_backward = copy_gbps(measure, forward_bytes, device), copy_gbps(measure, backward_bytes, device)

    leaf_table, leaf_weights = table.clone().requires_grad_(), weights.clone().requires_grad_()
    out = F.embedding_bag(indices, leaf_table, mode="sum", per_sample_weights=leaf_weights)
    timings = {
        "forward": {
            "EmbeddingBag": measure(lambda: F.embedding_bag(indices, table, mode="sum", per_sample_weights=weights)),
            "bag_sum": measure(lambda: torch.ops.pkm_bert.bag_sum(table, rows, flat_weights, bounds)),
        },
        "backward": {
            "EmbeddingBag": measure(
                lambda: torch.autograd.grad(out, (leaf_table, leaf_weights), grad_output, retain_graph=True)
            ),
            "row_sum_backward (fused)": measure(
                lambda: torch.ops.pkm_bert.row_sum_backward(grad_output, table, rows, flat_weights, bag, True, True)
            ),
        },
    }
    layer_op = memory_backward_op()
    if layer_op is not None:
        timings["backward"]["memory's op, triton=True"] = measure(
            lambda: layer_op(grad_output, table, indices, weights, False, True, True, True)
        )
    results = []
    for phase, n_bytes, copy in (("forward", forward_bytes, copy_forward), ("backward", backward_bytes, copy_backward)):
        reference = timings[phase]["EmbeddingBag"]
        for op, ms in timings[phase].items():
            gbps = n_bytes / ms / 1e6
            results.append({"dtype": name, "phase": phase, "op": op, "ms": ms, "GB/s": gbps,
                            "of copy": gbps / copy, "x EmbeddingBag": reference / ms})  # fmt: skip
        copy_ms = n_bytes / copy / 1e6
        results.append({"dtype": name, "phase": phase, "op": "copy_ (same bytes)", "ms": copy_ms, "GB/s": copy,
                        "of copy": 1.0, "x EmbeddingBag": reference / copy_ms})  # fmt: skip
    if args.sweep:
        tensors = (table, rows, flat_weights, bounds, grad_output)
        results += sweep(args, name, measure, *tensors, forward_bytes, backward_bytes)
    return results


def sweep(args, name, measure, table, rows, weights, bounds, grad_output, forward_bytes, backward_bytes) -> list[dict]:
    """Every configuration of a small grid (tiles up to 64 KiB), both kernels; the defaults marked."""
    size, dim, results = table.element_size(), table.shape[1], []
    out = table.new_empty(bounds.numel() - 1, dim)
    grid = list(itertools.product((16, 32, 64, 128), (128, 256, 512, 1024), (4, 8)))
    default = triton_gathers.bag_sum_config(dim, size, rows.numel() / (bounds.numel() - 1))
    for lookups, width, warps in grid[:2] if args.smoke else grid:
        if lookups * width * size > 64 * 1024:
            continue
        config = {"BLOCK_LOOKUPS": lookups, "BLOCK_DIM": width, "num_warps": warps}
        ms = measure(lambda: triton_gathers.launch_bag_sum(table, rows, weights, bounds, out, config))  # noqa: B023
        results.append({"dtype": name, "phase": "forward sweep", "op": _config_name(config, default), "ms": ms,
                        "GB/s": forward_bytes / ms / 1e6})  # fmt: skip
    grad_table = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    grad_weights = torch.empty_like(weights)
    bag = rows.numel() // grad_output.shape[0]
    grid = list(itertools.product((32, 64, 128), (32, 64, 128, 256), (4, 8)))
    default = triton_gathers.row_sum_backward_config(bag, dim)
    for lookups, width, warps in grid[:2] if args.smoke else grid:
        if lookups * width > 16384:
            continue
        config = {"BLOCK_LOOKUPS": lookups, "BLOCK_DIM": width, "num_warps": warps}

        def step(config=config):  # the zero fill and the cast are part of the op
            grad_table.zero_()
            triton_gathers.launch_row_sum_backward(
                grad_output, table, rows, weights, bag, grad_table, grad_weights, config=config
            )
            return grad_table.to(table.dtype)

        ms = measure(step)
        results.append({"dtype": name, "phase": "backward sweep", "op": _config_name(config, default), "ms": ms,
                        "GB/s": backward_bytes / ms / 1e6})  # fmt: skip
    return results


def _config_name(config: dict, default: dict) -> str:
    name = f"lookups {config['BLOCK_LOOKUPS']}, columns {config['BLOCK_DIM']}, warps {config['num_warps']}"
    return name + (" (default)" if config == default else "")


def markdown(results: list[dict]) -> str:
    lines = ["| dtype | phase | op | ms | GB/s | of copy | x EmbeddingBag |", "|---|---|---|---:|---:|---:|---:|"]
    main = [r for r in results if "sweep" not in r["phase"]]
    swept = sorted((r for r in results if "sweep" in r["phase"]), key=lambda r: (r["dtype"], r["phase"], r["ms"]))
    for r in main + swept:
        share = f"{r['of copy']:.0%}" if "of copy" in r else ""
        ratio = f"{r['x EmbeddingBag']:.2f}" if "x EmbeddingBag" in r else ""
        cells = (r["dtype"], r["phase"], r["op"], f"{r['ms']:.3f}", f"{r['GB/s']:.0f}", share, ratio)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernels on CPU under the Triton interpreter: set TRITON_INTERPRET=1")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("gpu_triton_gathers.py measures CUDA kernels: no CUDA device here (--smoke: a CPU check that it runs)")
    else:
        device = torch.device("cuda")
    if not triton_gathers.available():
        sys.exit("the triton package is not installed")
    kernels.register()
    measure = timer(device, args.repeats)
    results = [r for name in args.dtypes for r in bench_dtype(args, name, device, measure)]
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: figures meaningless)"
    import triton

    header = (f"{card}; torch {torch.__version__}, triton {triton.__version__}; {args.tokens} tokens x {args.bag} "
              f"lookups, {args.rows} rows of {args.dim}; median of {args.repeats}")  # fmt: skip
    report = header + "\n\n" + markdown(results)
    print(report)
    if args.output:
        with open(args.output, "w") as file:
            file.write(report + "\n")
    return results


if __name__ == "__main__":
    main()
