"""The PKM layer on a GPU, eager and compiled, fp32 and bf16, against lucidrains' PKM: wall times of forward + backward
at the paper's size, 8 x 128 tokens (the layers of the speed section `layer`). Ours: dense and sparse value
gradients, each on its plan (compiled: one graph, the value read the custom op, `fullgraph=True`) and on the plain
reference (`use_reference()`), which decides whether the custom op stays. Interleaved rounds, CUDA-synchronised medians, ratios paired per round.

    python -m benchmarks.speed.gpu_layer_compile                 # on a CUDA machine (benchmarks/gpu_check.sh runs it)
    python -m benchmarks.speed.gpu_layer_compile --device cpu --size tiny --rounds 1   # a smoke run of the code (the tests)
"""

import argparse
import contextlib
import sys
import time

import torch

from benchmarks import harness  # the timing helpers
from benchmarks.speed import common  # the layers of the speed sections

from modeling_pkm_bert.product_key_memory_ops import use_reference


SIZES = {  # (layer builder, input shape)
    "paper": (common.build_layer, (8, 128, 768)),
    "tiny": (common.build_tiny_layer, (2, 4, 32)),
}


def build(impl: str, size: str, device: str, dtype: torch.dtype):
    builder = SIZES[size][0]
    impl = impl.removesuffix("_reference")
    name = {"ours_dense": "dense", "ours_sparse": "sparse"}.get(impl, impl) if size == "tiny" else impl
    return builder(name).to(device=device, dtype=dtype).train()


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=list(SIZES), default="paper")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="*", default=["eager", "default"], help="eager and/or torch.compile modes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_layer_compile.py times CUDA steps: no CUDA device here (--device cpu --size tiny for a smoke run)")
    # ours on its plan (what `plan_lookup` picks: under compile the value read is the custom op) and on the plain
    # reference (`use_reference()`): a fast path stays on a GPU only where this shows it faster
    impls = ["lucidrains", "ours_dense", "ours_dense_reference", "ours_sparse", "ours_sparse_reference"]
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}; torch {torch.__version__}")
    print("\n| dtype | step | median ms | speed-up vs lucidrains eager (paired) |\n|---|---|---|---|")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(*SIZES[args.size][1], device=args.device, dtype=dtype, requires_grad=True)
        g = torch.randn(*SIZES[args.size][1], device=args.device, dtype=dtype)
        steps = {}
        for impl in impls:
            for mode in args.modes:
                module = build(impl, args.size, args.device, dtype)
                if mode == "eager":
                    runner = module
                else:  # ours: one graph (fullgraph), sparse gradients included
                    runner = torch.compile(module, mode=None if mode == "default" else mode, fullgraph=impl != "lucidrains")

                def step(module=module, runner=runner, reference=impl.endswith("_reference")):
                    for p in module.parameters():
                        p.grad = None
                    x.grad = None
                    with use_reference() if reference else contextlib.nullcontext():
                        (runner(x) * g).sum().backward()

                start = time.perf_counter()
                for _ in range(3):
                    step()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                name = f"{impl} {mode}"
                print(f"<!-- {dtype_name} {name}: warm-up (and compilation) {time.perf_counter() - start:.1f} s -->", flush=True)
                steps[name] = common.synchronized(step, args.device)
        samples = harness.interleaved(steps, rounds=args.rounds, warmup=2)
        for name, values in samples.items():
            speedup = harness.paired_ratio(samples, "lucidrains eager", name)
            print(f"| {dtype_name} | {name} | {harness.median(values) * 1e3:.3f} | {speedup:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
