"""Does `torch.compile` remove the launch overhead of a PKM layer step on a GPU? Wall times of forward + backward at
the paper's size, 8 x 128 tokens (the layers of `run_benchmarks.py` section 1): lucidrains' PKM and ours (dense value
gradient, `trace_training_lookup=True` when compiled; sparse eager), eager and compiled with the default mode and
`mode="reduce-overhead"` (CUDA graphs). Interleaved rounds, medians, ratios paired per round.

    python benchmarks/gpu_layer_compile.py                 # on a CUDA machine; benchmarks/RESULTS.md section 5 (H200)
    python benchmarks/gpu_layer_compile.py --device cpu --rounds 1 --modes   # a smoke run of the code, eager only
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_benchmarks as rb  # noqa: E402  (the layers and timing helpers of section 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--modes", nargs="*", default=["default", "reduce-overhead"], help="torch.compile modes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_layer_compile.py times CUDA steps: no CUDA device here (--device cpu for a smoke run)")
    x = torch.randn(8, 128, 768, device=args.device, requires_grad=True)
    g = torch.randn(8, 128, 768, device=args.device)
    steps = {}

    def add(name, impl, mode=None):
        module = rb.build_layer(impl).to(args.device).train()
        if impl.startswith("ours"):
            module.trace_training_lookup = mode is not None  # a compiled training step traces the lookup too
        runner = torch.compile(module, mode=None if mode == "default" else mode) if mode else module

        def step():
            for p in module.parameters():
                p.grad = None
            x.grad = None
            (runner(x) * g).sum().backward()

        start = time.perf_counter()
        for _ in range(3):
            step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        print(f"{name}: warm-up (and compilation) {time.perf_counter() - start:.1f} s", flush=True)
        steps[name] = rb.synchronized(step, args.device)

    add("lucidrains eager", "lucidrains")
    add("ours dense eager", "ours_dense")
    add("ours sparse eager", "ours_sparse")
    for mode in args.modes:
        add(f"ours dense compiled {mode}", "ours_dense", mode)
        add(f"lucidrains compiled {mode}", "lucidrains", mode)
    samples = rb.interleaved(steps, rounds=args.rounds, warmup=2)
    print("\n| step | median ms | speed-up vs lucidrains eager |\n|---|---|---|")
    for name, values in samples.items():
        print(f"| {name} | {rb.median(values) * 1e3:.2f} | {rb.paired_ratio(samples, 'lucidrains eager', name):.2f}x |")


if __name__ == "__main__":
    main()
