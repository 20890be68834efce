"""Section `overhead`: the host time and dispatched aten ops of a forward + backward at a tiny size, ours in each mode
against the peers (the launch-bound cost of a GPU step, measured on CPU)."""

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import interleaved, median, paired_ratio
from benchmarks.speed.common import build_tiny_layer, layer_step_fn, with_paths



OVERHEAD_IMPLS = {
    "lucidrains": "lucidrains `PKM` 0.3.0",
    "xlm": "XLM-style plain torch (`benchmarks/speed/xlm_reference.py`)",
    "dense": "ours, dense value grad",
    "sparse": "ours, `sparse=True`",
    "memory_plus": "ours, Memory+ options (`qk_norm`, `output_gate='swilu'`, `memory_scale`)",
    "relu": "ours, `score_activation='relu'`",
    "memory_plus_options_only": "the Memory+ options' own modules alone (no search, no lookup: `MemoryPlusOptionsOnly`)",
}


_NO_KERNEL_OPS = {"empty", "new_empty", "new_empty_strided", "empty_strided", "_unsafe_view", "lift_fresh",
                  "_sparse_coo_tensor_with_dims_and_tensors"}  # fmt: skip


class DispatchedOps(TorchDispatchMode):
    """Counts the aten ops dispatched (on a GPU: each a kernel launch or a view), those inside autograd functions too;
    `computing`: those that are neither views nor mere allocations, about the kernel launches of a GPU step (an op
    such as EmbeddingBag's dense backward launches several, a fill one)."""

    def __init__(self):
        super().__init__()
        self.count = self.computing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.computing += not (func.is_view or func.overloadpacket.__name__ in _NO_KERNEL_OPS)
        return func(*args, **(kwargs or {}))


def section_overhead(args) -> list[str]:
    """Host time and dispatched ops of a training step at a size where the arithmetic is negligible: what a GPU step
    of these layers costs on the host (launch-bound), measured on CPU."""
    rounds, repeats = (5, 20) if args.quick else (15, 50)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(1)
        x, g = torch.randn(2, 4, 32, requires_grad=True), torch.randn(2, 4, 32)
        steps = {impl: with_paths(impl, layer_step_fn(build_tiny_layer(impl).train(), x, g)) for impl in OVERHEAD_IMPLS}
        ops, computing = {}, {}
        for impl, step in steps.items():
            for _ in range(3):  # buffers, caches
                step()
            with DispatchedOps() as counter:
                step()
            ops[impl], computing[impl] = counter.count, counter.computing

        def repeated(step):
            return lambda: [step() for _ in range(repeats)]

        samples = interleaved(
            {impl: repeated(step) for impl, step in steps.items()}, rounds=rounds, warmup=1, clock=time.thread_time
        )
    finally:
        torch.set_num_threads(threads)
    lines = [
        "## Host overhead of a step (tiny size)",
        "",
        "Forward + backward of one layer at 32 in/out, 8^2 slots, 4 heads, knn 4, k_dim 32 (lucidrains: `dim_head=16`, "
        "its query half), input 2 x 4 x 32, one torch thread: the arithmetic is negligible, so the time is the host "
        "side of a step (Python, dispatch, autograd), what bounds these layers on a GPU at the paper's size. Ours run "
        "the reference plan (`use_reference()`), what a GPU runs. "
        "Dispatched ops: aten ops seen by a `TorchDispatchMode` in one step (those inside our "
        "autograd functions included), each a kernel launch or a view on a GPU; of them computing: neither a view nor a "
        "mere allocation, about the kernel launches of the step on a GPU. Time: the CPU time of the "
        "timing thread (`time.thread_time`: on a shared machine, the time other processes hold the core does not "
        f"count), median over {rounds} interleaved rounds of {repeats} steps each (+1 warm-up round); ratio: paired "
        "median of "
        "time / lucidrains' time (lower is faster). The last row is "
        "not a layer: the modules the Memory+ options add, timed alone, what the Memory+ row cannot go below.",
        "",
        "| implementation | dispatched ops | of them computing | us per step | time / lucidrains | ops / lucidrains |",
        "|---|---|---|---|---|---|",
    ]
    for impl, label in OVERHEAD_IMPLS.items():
        lines.append(
            f"| {label} | {ops[impl]} | {computing[impl]} | {median(samples[impl]) / repeats * 1e6:.0f} | "
            f"{paired_ratio(samples, impl, 'lucidrains'):.2f} | {ops[impl] / ops['lucidrains']:.2f} |"
        )
    return lines
