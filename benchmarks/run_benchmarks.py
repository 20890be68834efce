"""Speed and memory of the product key memory, as ratios measured side by side in one run; updates RESULTS.md.

    python benchmarks/run_benchmarks.py            # the default sections (~15-20 min on 2 quiet cores)
    python benchmarks/run_benchmarks.py --quick    # a smaller version of each (~3-4 min)
    python benchmarks/run_benchmarks.py --sections layer update   # some sections only
    python benchmarks/run_benchmarks.py --sections options        # Memory+ options

RESULTS.md holds the latest run of each section (with the machine, versions, commit and load it ran on) and a history
table of every run: a run replaces the sections it ran, keeps the others, and adds a history row.

Sections:
- overhead: the host time and dispatched aten ops of a forward + backward at a tiny size (the launch-bound cost of a
  GPU step, measured on CPU): ours in each mode (dense, sparse, Memory+ options, relu scores; CPU and GPU paths)
  against lucidrains' and the XLM-style layer.
- layer: one PKM layer at the paper's size (768 in/out, 512^2 slots, 4 heads, knn 32, k_dim 256, query BN), 8x128
  tokens, forward + backward, against lucidrains' product-key-memory 0.3.0 and a plain XLM-style implementation
  (benchmarks/xlm_reference.py); peak memory of each in a fresh process (VmHWM); in the full run again with
  THP_MEM_ALLOC_ENABLE=1 (huge pages for torch's CPU allocations).
- update: one value-table update (262,144 x 768) against the fraction of rows the step touched: SparseRowAdam vs
  dense torch.optim.Adam (and torch.optim.SparseAdam in the full run).
- train: a masked-LM training step of ResM-BERT-base (memories at layers 4 and 8) incl. the optimizer steps (AdamW for
  the network, SparseRowAdam for the values, sparse value gradients) vs the same step of BERT-base; the values'
  training state in bytes; peak RSS growth during a step (sampled).
- table1: Kim & Jung's Table 1 on this machine: batch/s of BERT-base/large, +PKM (memories replace the FFN) and +ResM
  (memories beside it), batch 1x128 and 32x128, eval mode, torch.inference_mode, random weights.
- gpu: where CUDA is available, the value gather (EmbeddingBag), the layer vs its peers and Table 1 on the GPU; else
  a line saying so.
- options (not in the default run): the cost of each Memory+ option.
- shared (not in the default run): two memories sharing one value table against a table each, dense and sparse gradients.
- modernbert (not in the default run): Table 1's setting for a ModernBERT-base-sized encoder (22 layers, 768 wide,
  GeGLU 1152, local/global attention, sdpa): +ResM (memories at layers 7 and 14, the paper's memory size) against
  transformers' ModernBertModel, and ModernBertPkmModel without memories against it (the cost of our copies of its blocks).
- quantized (not in the default run): the value gather and Table 1's ResM/BERT-base with fp32, bf16, int8 and 4-bit value
  tables (`quantize_memory_values`), on 4 KiB and huge pages.
- trainer (not in the default run): a Trainer step with `sparse_row_adam`, PkmTrainer's sparse value gradient against the plain
  Trainer's dense one (`pkm_optimizers`).

Every timing is a median over rounds in which the compared variants run one after the other (rotating the order);
ratios are medians of the per-round ratios. The machine may be shared: the load average is recorded.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from modeling_pkm_bert.utils.output_folders import check_command_paths  # noqa: E402
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from modeling_pkm_bert.methods.optimizers.memory_optimizer import (  # noqa: E402
    SparseRowAdam,
    cast_pkm_values,
    pkm_param_groups,
    pkm_value_parameters,
    set_sparse_values,
)
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import ProductKeyMemory, ProductKeyValues, use_huge_pages  # noqa: E402


PAPER = dict(n_keys=512, heads=4, knn=32, k_dim=256)
MiB = 2**20


# ----------------------------------------------------------------------------------------------- measuring


def interleaved(functions: dict, rounds: int, warmup: int = 1, before=None, clock=time.perf_counter) -> dict:
    """Times each function once per round, all functions in every round (order rotated); returns the samples (s).
    `clock`: wall time by default; `time.thread_time` counts the CPU time of this thread only (single-threaded host
    work on a shared machine: the time another process holds the core does not count)."""
    names = list(functions)
    for _ in range(warmup):
        for name in names:
            if before:
                before(name)
            functions[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if before:
                before(name)
            start = clock()
            functions[name]()
            samples[name].append(clock() - start)
    return samples


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def median(values):
    return statistics.median(values)


def paired_ratio(samples: dict, numerator: str, denominator: str) -> float:
    """Median over rounds of time[numerator] / time[denominator]."""
    return median([a / b for a, b in zip(samples[numerator], samples[denominator])])


def clearly_lower(peak: int, others: list[int], noise: int = 15 * MiB) -> bool:
    """Whether `peak` is below every one of `others` by more than the run-to-run noise of a fresh process's peak RSS
    (about +-15 MiB on this machine): a tie within the noise does not count as lower."""
    return all(peak < other - noise for other in others)


def min_ratio(samples: dict, numerator: str, denominator: str) -> float:
    """min time[numerator] / min time[denominator]: interference only ever slows a run down, so on a shared machine
    the fastest round is the least disturbed one (a cross-check of the paired median)."""
    return min(samples[numerator]) / min(samples[denominator])


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak RSS growth over the block, sampled every millisecond from /proc/self/statm (approximate)."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.growth = self.peak - self.start


def peak_rss() -> int:
    """VmHWM: the peak RSS of this process image (unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def mem_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_worker(args, worker: str, extra: list[str], env: dict | None = None) -> dict:
    threads = args["threads"] if isinstance(args, dict) else args.threads
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--threads", str(threads), *extra]
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=str(ROOT), timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(f"worker {worker} {extra} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


# ----------------------------------------------------------------------------------------------- layer


def build_layer(impl: str):
    torch.manual_seed(0)
    if impl == "lucidrains":
        from product_key_memory import PKM

        return PKM(dim=768, heads=4, num_keys=512, topk=32, dim_head=128)
    if impl == "xlm":
        from xlm_reference import XlmProductKeyMemory

        return XlmProductKeyMemory(768, 768, **PAPER)
    if impl == "ours_dense":
        return ProductKeyMemory(768, 768, **PAPER)
    if impl == "ours_sparse":
        return ProductKeyMemory(768, 768, **PAPER, sparse=True)
    raise ValueError(impl)


LAYER_IMPLS = {
    "lucidrains": "lucidrains `PKM` 0.3.0 (LayerNorm query, dense grads)",
    "xlm": "XLM-style plain torch (`benchmarks/xlm_reference.py`, BN query, head loop, EmbeddingBag, dense grads)",
    "ours_dense": "ours, `ProductKeyMemory(...)` (dense value grad)",
    "ours_sparse": "ours, `ProductKeyMemory(..., sparse=True)` (sparse value grad)",
}


def layer_step_fn(module, x, g):
    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        (module(x) * g).sum().backward()

    return step


def layer_timing(rounds: int, batch=(8, 128)) -> dict:
    torch.manual_seed(1)
    x = torch.randn(*batch, 768, requires_grad=True)
    g = torch.randn(*batch, 768)
    modules = {impl: build_layer(impl).train() for impl in LAYER_IMPLS}
    steps = {impl: layer_step_fn(m, x, g) for impl, m in modules.items()}
    # ours on the reference plan too, in the same rounds: a CPU fast path stays only where it wins against it
    for impl in ("ours_dense", "ours_sparse"):
        steps[f"{impl}_reference"] = with_paths(impl, layer_step_fn(modules[impl], x, g))
    samples = interleaved(steps, rounds=rounds, warmup=2)
    return {"samples": samples}


def worker_layer_memory(impl: str, steps: int) -> dict:
    module = build_layer(impl).train()
    torch.manual_seed(1)
    x = torch.randn(8, 128, 768, requires_grad=True)
    g = torch.randn(8, 128, 768)
    after_init = peak_rss()
    step = layer_step_fn(module, x, g)
    for _ in range(steps):
        step()
    peak = peak_rss()
    return {"impl": impl, "peak_rss": peak, "after_init_rss": after_init}


def section_layer(args) -> list[str]:
    rounds = 3 if args.quick else 7
    result = layer_timing(rounds)
    samples = result["samples"]
    memory = {}
    for impl in LAYER_IMPLS:
        memory[impl] = run_worker(args, "layer-memory", ["--impl", impl, "--steps", "2" if args.quick else "3"])
    peers = ["lucidrains", "xlm"]
    best_peer = min(peers, key=lambda p: median(samples[p]))
    lines = [
        "## 1. PKM layer vs peers (forward + backward)",
        "",
        "768 in/out, 512^2 slots, 4 heads, knn 32, k_dim 256 (query BatchNorm where the implementation has one), input "
        "8 x 128 x 768 fp32 with `requires_grad`, step = forward + `(out * g).sum().backward()`, grads set to None before "
        f"each step. Interleaved rounds: {rounds} (+2 warm-up). Peak memory: peak RSS (`VmHWM`) of a fresh process that builds "
        f"the layer and runs {2 if args.quick else 3} steps (includes the torch import and the 768 MiB value table); "
        "'step extra' = peak minus the peak after building the layer.",
        "",
        "| implementation | median ms | all rounds (ms) | speed-up vs faster peer (paired median; fastest rounds) | peak RSS MiB | step extra MiB |",
        "|---|---|---|---|---|---|",
    ]
    for impl, label in LAYER_IMPLS.items():
        speedup = paired_ratio(samples, best_peer, impl)
        m = memory[impl]
        lines.append(
            f"| {label} | {fmt_ms(median(samples[impl]))} | {', '.join(fmt_ms(s) for s in samples[impl])} | "
            f"{speedup:.2f}x; {min_ratio(samples, best_peer, impl):.2f}x | {m['peak_rss'] / MiB:.0f} | "
            f"{(m['peak_rss'] - m['after_init_rss']) / MiB:.0f} |"
        )
    lines += [
        "",
        "The CPU plan against the reference plan (`use_reference()`: plain torch ops, torch's autograd), same rounds: "
        + "; ".join(f"{impl.removeprefix('ours_')} {paired_ratio(samples, impl + '_reference', impl):.2f}x faster"
                    f" ({fmt_ms(median(samples[impl + '_reference']))} on the reference)" for impl in ("ours_dense", "ours_sparse")),
    ]
    sparse_speedup = paired_ratio(samples, best_peer, "ours_sparse")
    dense_speedup = paired_ratio(samples, best_peer, "ours_dense")
    peer_peaks = [memory[p]["peak_rss"] for p in peers]
    lower_memory = clearly_lower(memory["ours_sparse"]["peak_rss"], peer_peaks)
    lower_memory_dense = clearly_lower(memory["ours_dense"]["peak_rss"], peer_peaks)
    lowest_peer_peak = min(memory[p]["peak_rss"] for p in peers)

    def peak_delta(impl):
        return (memory[impl]["peak_rss"] - lowest_peer_peak) / MiB

    lines += [
        "",
        f"Faster peer in this run: **{best_peer}**. Target >= 2x faster than it, with lower peak memory (by more than "
        "15 MiB): "
        f"sparse {'**met**' if sparse_speedup >= 2 and lower_memory else '**not met**'} ({sparse_speedup:.2f}x, "
        f"peak {peak_delta('ours_sparse'):+.0f} MiB vs the lower peer); dense "
        f"{'**met**' if dense_speedup >= 2 and lower_memory_dense else '**not met**'} ({dense_speedup:.2f}x, peak "
        f"{peak_delta('ours_dense'):+.0f} MiB"
        + ("" if lower_memory_dense else ": the dense gradient itself is the 768 MiB every dense implementation holds")
        + ").",
    ]
    if not args.quick:
        try:
            thp = run_worker(args, "layer-timing", ["--rounds", "3"], env={"THP_MEM_ALLOC_ENABLE": "1"})["samples"]
            best_thp = min(peers, key=lambda p: median(thp[p]))
            lines += [
                "",
                "Same comparison in a fresh process with `THP_MEM_ALLOC_ENABLE=1` (torch backs large CPU allocations "
                "with transparent huge pages: the page faults of fresh hundreds-of-MiB buffers, e.g. a dense value "
                "gradient, mostly disappear, which helps the dense peers most). 3 rounds:",
                "",
                "| implementation | median ms | speed-up vs faster peer |",
                "|---|---|---|",
            ]
            for impl, label in LAYER_IMPLS.items():
                lines.append(f"| {label} | {fmt_ms(median(thp[impl]))} | {paired_ratio(thp, best_thp, impl):.2f}x |")
        except Exception as error:  # noqa: BLE001
            lines += ["", f"(THP variant failed: {error})"]
        if args.threads != 2:
            try:
                two = run_worker({**vars(args), "threads": 2}, "layer-timing", ["--rounds", "3"])["samples"]
                best_two = min(peers, key=lambda p: median(two[p]))
                lines += [
                    "",
                    "Same comparison in a fresh process with 2 torch threads (on this shared machine the second thread is "
                    "often descheduled, which penalises every parallel op; see the note on threads). 3 rounds:",
                    "",
                    "| implementation | median ms | speed-up vs faster peer |",
                    "|---|---|---|",
                ]
                for impl, label in LAYER_IMPLS.items():
                    lines.append(f"| {label} | {fmt_ms(median(two[impl]))} | {paired_ratio(two, best_two, impl):.2f}x |")
            except Exception as error:  # noqa: BLE001
                lines += ["", f"(2-thread variant failed: {error})"]
    return lines + compiled_layer(args)


def compiled_layer(args) -> list[str]:
    """Our layer (dense value grads) eager vs `torch.compile`d: its plan under compile (the search traced, the value read
    the custom op) and the plain reference compiled (`use_reference()`: EmbeddingBag's own backward)."""
    from modeling_pkm_bert.product_key_memory_ops import use_reference

    rounds = 3 if args.quick else 5
    torch.manual_seed(1)
    x, g = torch.randn(8, 128, 768, requires_grad=True), torch.randn(8, 128, 768)
    modules = {kind: build_layer("ours_dense").train() for kind in ("eager", "compiled", "compiled_reference")}

    def under_reference(step):
        def run():
            with use_reference():
                step()

        return run

    # inductor; compiles in the first call below
    steps = {kind: layer_step_fn(m if kind == "eager" else torch.compile(m), x, g) for kind, m in modules.items()}
    steps["compiled_reference"] = under_reference(steps["compiled_reference"])
    start = time.perf_counter()
    for step in steps.values():
        step()
    compile_seconds = time.perf_counter() - start
    samples = interleaved(steps, rounds=rounds, warmup=1)
    labels = {
        "eager": "eager (its plan: native selection, search backward through the selected sub-keys, CSR value backward)",
        "compiled": "`torch.compile` (inductor) of its plan: one graph, the value read the custom op",
        "compiled_reference": "`torch.compile` (inductor) of the reference (`use_reference()`)",
    }
    lines = [
        "",
        f"`torch.compile` of our layer (dense value grads), same step, {rounds} interleaved rounds (first calls, including "
        f"compilation: {compile_seconds:.0f} s):",
        "",
        "| ours, `ProductKeyMemory(...)` | median ms | time / eager (paired median) |",
        "|---|---|---|",
    ]
    for kind, label in labels.items():
        lines.append(f"| {label} | {fmt_ms(median(samples[kind]))} | {paired_ratio(samples, kind, 'eager'):.2f} |")
    return lines


# ----------------------------------------------------------------------------------------------- host overhead

TINY = dict(n_keys=8, heads=4, knn=4, k_dim=32)  # lucidrains' dim_head is a query half: 16
OVERHEAD_IMPLS = {
    "lucidrains": "lucidrains `PKM` 0.3.0",
    "xlm": "XLM-style plain torch (`benchmarks/xlm_reference.py`)",
    "dense": "ours, dense value grad",
    "sparse": "ours, `sparse=True`",
    "memory_plus": "ours, Memory+ options (`qk_norm`, `output_gate='swilu'`, `memory_scale`)",
    "relu": "ours, `score_activation='relu'`",
    "memory_plus_options_only": "the Memory+ options' own modules alone (no search, no lookup: `MemoryPlusOptionsOnly`)",
}


class MemoryPlusOptionsOnly(torch.nn.Module):
    """What the Memory+ options add to a step, alone: a Memory+ memory's qk-norms of the queries and sub-keys, its swilu
    gate and output projection and its learned scale, applied to fixed queries and a fixed read (parameters, so that
    every backward runs) without the search and lookup between them: a floor for the Memory+ row."""

    def __init__(self):
        super().__init__()
        self.memory = ProductKeyMemory(32, 32, **TINY, qk_norm=True, output_gate="swilu", memory_scale=0.01)
        self.queries = torch.nn.Parameter(torch.randn(8, TINY["heads"] * TINY["k_dim"]))
        self.read = torch.nn.Parameter(torch.randn(8, 32))

    def forward(self, hidden_states):
        memory, inputs = self.memory, hidden_states.reshape(-1, 32)
        halves = memory.query_norm(self.queries.view(-1, TINY["heads"] * 2, TINY["k_dim"] // 2))
        output = memory.output_proj(self.read * torch.nn.functional.silu(memory.gate_proj(inputs))) * memory.memory_scale
        return output.view_as(hidden_states) + (halves.sum() + memory.scoring_keys().sum())


def build_tiny_layer(impl: str):
    torch.manual_seed(0)
    if impl == "lucidrains":
        from product_key_memory import PKM

        return PKM(dim=32, heads=4, num_keys=8, topk=4, dim_head=16)
    if impl == "xlm":
        from xlm_reference import XlmProductKeyMemory

        return XlmProductKeyMemory(32, 32, **TINY)
    if impl == "memory_plus_options_only":
        return MemoryPlusOptionsOnly()
    options = {
        "sparse": dict(sparse=True), "relu": dict(score_activation="relu"),
        "memory_plus": dict(qk_norm=True, output_gate="swilu", memory_scale=0.01),
    }.get(impl, {})  # fmt: skip
    return ProductKeyMemory(32, 32, **TINY, **options)


# ops that neither compute nor copy: views are `is_view`; these allocate or rewrap (no kernel on a GPU)
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


def with_paths(impl: str, step):
    """The step of ours on the reference plan (`use_reference()`): what a GPU runs (no fast path has shown a win there)."""
    from modeling_pkm_bert.product_key_memory_ops import use_reference

    def run():
        with use_reference():
            step()

    return run


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


# ----------------------------------------------------------------------------------------------- value update


def section_update(args) -> list[str]:
    rows, dim = 262144, 768
    fractions = [0.05, 0.39, 1.0] if args.quick else [0.01, 0.05, 0.1, 0.25, 0.39, 0.5, 1.0]
    rounds = 3
    torch.manual_seed(2)
    parameter = torch.nn.Parameter(torch.randn(rows, dim) * dim**-0.5)
    optimizers = {
        "SparseRowAdam (bf16 m, row-wise v)": SparseRowAdam([parameter], lr=1e-3),
        "SparseRowAdam (betas[0]=0: no m)": SparseRowAdam([parameter], lr=1e-3, betas=(0.0, 0.999)),
        "torch.optim.Adam (dense)": torch.optim.Adam([parameter], lr=1e-3),
    }
    if not args.quick:
        optimizers["torch.optim.SparseAdam"] = torch.optim.SparseAdam([parameter], lr=1e-3)
    dense_grad = torch.randn(rows, dim) * 1e-3
    table = {}
    for fraction in fractions:
        used = torch.randperm(rows)[: int(rows * fraction)].sort().values
        sparse_grad = torch.sparse_coo_tensor(
            used[None], torch.randn(used.numel(), dim) * 1e-3, (rows, dim), is_coalesced=True, check_invariants=False
        )

        def set_grad(name, sparse_grad=sparse_grad):
            parameter.grad = dense_grad if "dense" in name else sparse_grad

        samples = interleaved({name: opt.step for name, opt in optimizers.items()}, rounds=rounds, warmup=1, before=set_grad)
        table[fraction] = samples
        del sparse_grad
    parameter.grad = None
    state_bytes = {name: sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)) for name, opt in optimizers.items()}
    table_bytes = rows * dim * 4
    names = list(optimizers)
    lines = [
        "## 2. Value update cost vs fraction of rows touched",
        "",
        f"One optimizer step on a {rows} x {dim} fp32 table (768 MiB), gradient prepared beforehand (sparse, coalesced, "
        "for the sparse optimizers; dense for Adam, whose cost does not depend on the fraction). 8 x 128 tokens at the "
        f"paper's size touch ~39% of the rows (131,072 lookups, ~102k distinct). Interleaved rounds: {rounds}. Median ms:",
        "",
        "| rows touched | " + " | ".join(names) + " | dense Adam / SparseRowAdam |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for fraction, samples in table.items():
        cells = " | ".join(fmt_ms(median(samples[n])) for n in names)
        ratio = paired_ratio(samples, "torch.optim.Adam (dense)", names[0])
        lines.append(f"| {fraction:.0%} | {cells} | {ratio:.1f}x |")
    lines += [
        "",
        "Optimizer state (bytes over the table): "
        + "; ".join(f"{n}: {state_bytes[n] / table_bytes:.2f}x" for n in names)
        + ". With the weights and the gradient, training state = weights (1x) + gradient + state.",
    ]
    return lines


# ----------------------------------------------------------------------------------------------- train step


def build_mlm(kind: str, size: str = "base"):
    import transformers

    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    torch.manual_seed(3)
    common = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**common))
    config = BertPkmConfig(pkm_layers=[4, 8], pkm_mode="resm", **common)
    model = BertPkmForMaskedLM(config)
    set_sparse_values(model, kind == "resm_sparse")
    return model


def make_optimizers(model, kind: str):
    lr, weight_decay = 1e-4, 0.01
    if kind == "bert":
        groups = pkm_param_groups(model, lr, weight_decay)
        return [torch.optim.AdamW(groups, lr=lr)]
    main = torch.optim.AdamW(pkm_param_groups(model, lr, weight_decay, include_values=False), lr=lr)
    if kind == "resm_sparse":
        return [main, SparseRowAdam(pkm_value_parameters(model), lr=1e-3)]
    return [main, torch.optim.Adam(pkm_value_parameters(model), lr=1e-3)]  # the paper's/XLM's dense Adam


def mlm_batch(batch: int, seq: int = 128):
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(1000, 30000, (batch, seq), generator=generator)
    labels = torch.full_like(input_ids, -100)
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    labels[masked] = input_ids[masked]
    input_ids = input_ids.masked_fill(masked, 103)
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)


def train_step_fn(model, optimizers, batch):
    def step():
        loss = model(**batch).loss
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

    return step


def value_state_bytes(model, optimizers) -> tuple[int, int]:
    """(bytes of the value tables, bytes of their training state: weights + gradient + optimizer state)."""
    values = pkm_value_parameters(model)
    ids = {id(v) for v in values}
    weights = sum(v.numel() * v.element_size() for v in values)
    grads = 0
    for v in values:
        if v.grad is not None:
            g = v.grad
            grads += (g._values().numel() * g._values().element_size() + g._indices().numel() * 8) if g.is_sparse else g.numel() * g.element_size()
    state = 0
    for optimizer in optimizers:
        for p, s in optimizer.state.items():
            if id(p) in ids:
                state += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return weights, weights + grads + state


def train_pair(kinds: list[str], batch: int, rounds: int) -> dict:
    data = mlm_batch(batch)
    models = {k: build_mlm(k).train() for k in kinds}
    optimizers = {k: make_optimizers(m, k) for k, m in models.items()}
    steps = {k: train_step_fn(models[k], optimizers[k], data) for k in kinds}
    samples = interleaved(steps, rounds=rounds, warmup=1)
    peaks, states = {}, {}
    for k in kinds:
        with PeakRss() as peak:
            loss = models[k](**data).loss
            loss.backward()
            for optimizer in optimizers[k]:
                optimizer.step()
        if k != "bert":
            states[k] = value_state_bytes(models[k], optimizers[k])
        for optimizer in optimizers[k]:
            optimizer.zero_grad(set_to_none=True)
        peaks[k] = peak.growth
    return {"samples": samples, "peaks": peaks, "states": states}


TRAIN_LABELS = {
    "bert": "BERT-base (transformers `BertForMaskedLM`), AdamW",
    "resm_sparse": "ResM-BERT-base {4,8}: sparse value grads + `SparseRowAdam` (ours)",
    "resm_dense": "ResM-BERT-base {4,8}: dense value grads + dense `torch.optim.Adam` (paper/XLM style)",
}


def section_train(args) -> list[str]:
    batch = 2 if args.quick else 8
    rounds = 2 if args.quick else 3
    results = [train_pair(["bert", "resm_sparse"], batch, rounds)]
    dense_note = ""
    if not args.quick:
        if mem_available() > 12 * 2**30:
            try:
                results.append(run_worker(args, "train-pair", ["--kinds", "bert", "resm_dense", "--batch", str(batch), "--rounds", str(rounds)]))
            except Exception as error:  # noqa: BLE001
                dense_note = f"(dense-Adam pair failed: {error})"
        else:
            dense_note = f"(dense-Adam pair skipped: only {mem_available() / 2**30:.1f} GiB available, it needs ~12)"
    lines = [
        "## 3. Training step: ResM-BERT-base vs BERT-base",
        "",
        f"Masked-LM step at batch {batch} x 128 (15% masked, dropout on), fp32: forward, backward, optimizer steps "
        "(AdamW lr 1e-4 wd 0.01 for the network, values in their own optimizer at lr 1e-3), zero_grad. Each pair is "
        f"timed interleaved in one process, {rounds} rounds after a warm-up. 'peak RSS growth' is sampled during one "
        "extra step (approximate). Value training state = value tables + their gradient + their optimizer state, "
        "right after the optimizer step.",
        "",
        "| configuration | median s | ratio to BERT-base (paired median; fastest rounds) | peak RSS growth MiB | value training state / value tables |",
        "|---|---|---|---|---|",
    ]
    ratios = {}
    for result in results:
        samples = result["samples"]
        for kind in samples:
            ratio = paired_ratio(samples, kind, "bert")
            if kind != "bert":
                ratios[kind] = ratio
            state = result["states"].get(kind)
            state_text = f"{state[1] / state[0]:.2f}x ({state[1] / MiB:.0f} MiB)" if state else "-"
            lines.append(
                f"| {TRAIN_LABELS[kind]} | {median(samples[kind]):.2f} | {ratio:.3f}; {min_ratio(samples, kind, 'bert'):.3f} | "
                f"{result['peaks'][kind] / MiB:.0f} | {state_text} |"
            )
    sparse_state = results[0]["states"]["resm_sparse"]
    lines += [
        "",
        f"Targets: step <= 1.2x BERT-base: **{'met' if ratios['resm_sparse'] <= 1.2 else 'not met'}** "
        f"({ratios['resm_sparse']:.3f}x); value training state <= 2x the tables (dense Adam: 4x): "
        f"**{'met' if sparse_state[1] <= 2 * sparse_state[0] else 'not met'}** ({sparse_state[1] / sparse_state[0]:.2f}x).",
    ]
    if dense_note:
        lines += ["", dense_note]
    return lines


# ----------------------------------------------------------------------------------------------- table 1


def build_encoder(size: str, kind: str):
    import transformers

    from modeling_pkm_bert import BertPkmConfig, BertPkmModel

    dims = {"base": {}, "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)}[size]
    torch.manual_seed(5)
    if kind == "bert":
        return transformers.BertModel(transformers.BertConfig(**dims)).eval()
    layers = [4, 8] if size == "base" else [8, 16]
    return BertPkmModel(BertPkmConfig(**dims, pkm_layers=layers, pkm_mode={"pkm": "replace", "resm": "resm"}[kind])).eval()


class MemoryTimer:
    """Wall time spent inside the model's memories (forward hooks), per call of the model."""

    def __init__(self, model):
        self.per_call, self._inside, self._start = [], 0.0, 0.0
        for module in model.modules():
            if isinstance(module, ProductKeyMemory):
                module.register_forward_pre_hook(self._pre)
                module.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self._inside += time.perf_counter() - self._start

    def wrap(self, run):
        def timed():
            self._inside = 0.0
            run()
            self.per_call.append(self._inside)

        return timed


def table1_rounds(args, size: str, batch: int) -> int:
    if args.quick:
        return 9 if batch == 1 else 1
    return 15 if batch == 1 else (5 if size == "base" else 2)


def time_models(models: dict, batch: int, rounds: int) -> tuple[dict, list[float]]:
    """Interleaved forward times of `models` and, for "resm", the share of each call spent in its memories."""
    ids = torch.randint(1000, 30000, (batch, 128), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)

    def forward_fn(model):
        def run():
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask)

        return run

    functions = {k: forward_fn(m) for k, m in models.items()}
    timer = MemoryTimer(models["resm"])
    functions["resm"] = timer.wrap(functions["resm"])
    warmup = 1 if batch == 1 else 0
    samples = interleaved(functions, rounds=rounds, warmup=warmup)
    shares = [inside / total for inside, total in zip(timer.per_call[warmup:], samples["resm"])]
    return samples, shares


def verdict(paired: float, implied: float, target: float = 0.95) -> str:
    return "met" if min(paired, implied) >= target else "not met" if max(paired, implied) < target else "unclear"


def memory_breakdown(args) -> list[str]:
    """Where one memory's inference time goes at 1 x 128 tokens, each part against what this core can do at most."""
    calls = 10 if args.quick else 40
    torch.manual_seed(8)
    hidden = torch.randn(128, 768)
    with torch.inference_mode():
        big = torch.randn(2048, 2048)
        matmul = min(timed(lambda: big @ big) for _ in range(5))
        stream = torch.randn(128 << 20)  # 512 MiB
        read = min(timed(stream.sum) for _ in range(5))
    big = stream = None  # 528 MiB freed before the memory is timed (`del` would leave the lambda's name unbound)
    peak_flops, peak_read = 2 * 2048**3 / matmul, (128 << 20) * 4 / read
    parts = {  # op -> (part, work: flops or bytes, unit)
        "aten::addmm": ("query projection (GEMM)", 2 * 128 * 768 * 1024, "GFLOP/s"),
        "aten::bmm": ("sub-key scores (batched GEMM)", 2 * 128 * 8 * 512 * 128, "GFLOP/s"),
        "pkm_bert::select_product_keys": ("selection (native kernel)", None, ""),
        "aten::_embedding_bag": ("value gather (16384 random rows of 3 KiB)", 128 * 128 * 768 * 4, "GB/s"),
    }
    lines = [
        f"One memory (768, 512^2 slots, 4 heads, knn 32, fp32) at 1 x 128 tokens, profiled over {calls} calls, on 4 KiB "
        f"pages and after `use_huge_pages`; for scale, this core's fp32 matmul (2048^3) runs at {peak_flops / 1e9:.0f} "
        f"GFLOP/s and a sequential read (`sum` of 512 MiB) at {peak_read / 1e9:.1f} GB/s:",
        "",
        "| part | ms, 4 KiB pages | ms, huge pages | rate (huge pages) | share of the core's best |",
        "|---|---|---|---|---|",
    ]
    memory = ProductKeyMemory(768).eval()
    per_op = {}
    for pages in ("4 KiB", "huge"):
        if pages == "huge":
            use_huge_pages(memory)
        with torch.inference_mode():
            for _ in range(3):
                memory(hidden)
            start = time.perf_counter()
            with torch.profiler.profile() as profile:
                for _ in range(calls):
                    memory(hidden)
            total = (time.perf_counter() - start) / calls
        times = {event.key: event.self_cpu_time_total / calls / 1e6 for event in profile.key_averages()}
        per_op[pages] = {op: times.get(op, float("nan")) for op in parts}
        per_op[pages]["total"] = total
    for op, (part, work, unit) in parts.items():
        small, huge = per_op["4 KiB"][op], per_op["huge"][op]
        rate = share = "-"
        if work is not None:
            rate = f"{work / huge / 1e9:.1f} {unit}"
            share = f"{work / huge / (peak_flops if unit == 'GFLOP/s' else peak_read):.0%}"
        lines.append(f"| {part} | {small * 1e3:.2f} | {huge * 1e3:.2f} | {rate} | {share} |")
    lines.append(
        f"| whole call (wall, under the profiler) | {per_op['4 KiB']['total'] * 1e3:.2f} | "
        f"{per_op['huge']['total'] * 1e3:.2f} | - | - |"
    )
    return lines


def section_table1(args) -> list[str]:
    from modeling_pkm_bert.product_key_memory_ops import use_reference

    sizes = ["base"] if args.quick else ["base", "large"]
    lines = [
        "## 4. Table 1 on this machine: inference throughput",
        "",
        "Random weights, eval mode, `torch.inference_mode()`, input ids + an all-ones attention mask, sequence length "
        "128. +PKM: memories replace the FFN at layers {4,8} (large: {8,16}); +ResM: beside the FFN. Interleaved rounds "
        "(batch 1: after a warm-up; batch 32: the batch-1 warm-up only). Ratios are throughput ratios (BERT time / "
        "model time): the median of the per-round ratios and the ratio of the fastest rounds. Because the big batches "
        "allow only 2-5 rounds on this machine, the last column gives a noise-robust estimate from inside each ResM "
        "call: ResM = BERT + its memories, so ResM / BERT = 1 - (time in the memories / time of the call), median "
        "over the rounds.",
        "",
        "| model | batch | rounds | BERT batch/s | +PKM batch/s | +ResM batch/s | +PKM / BERT | +ResM / BERT | "
        "+ResM / BERT, fastest rounds | +ResM / BERT from the memories' share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts, bf16_error, on_huge_pages = [], float("nan"), {}
    for size in sizes:
        models = {kind: build_encoder(size, kind) for kind in ("bert", "pkm", "resm")}
        for kind, model in models.items():  # every model alike: its tensors of >= 32 MiB on 2 MiB pages
            on_huge_pages[f"{kind}-{size}"] = use_huge_pages(model)
        for batch in (1, 32):
            rounds = table1_rounds(args, size, batch)
            samples, shares = time_models(models, batch, rounds)
            pkm = paired_ratio(samples, "bert", "pkm")
            resm = paired_ratio(samples, "bert", "resm")
            implied = 1 - median(shares)
            lines.append(
                f"| BERT-{size} | {batch} x 128 | {rounds} | {1 / median(samples['bert']):.2f} | {1 / median(samples['pkm']):.2f} | "
                f"{1 / median(samples['resm']):.2f} | {pkm:.3f} | {resm:.3f} | {min_ratio(samples, 'bert', 'resm'):.3f} | "
                f"{implied:.3f} |"
            )
            verdicts.append(f"BERT-{size} {batch}x128: {resm:.3f} paired, {implied:.3f} from the share ({verdict(resm, implied)})")
        if size == "base":
            # the same ResM model on 4 KiB pages, on torch.topk (no native selection), then with bf16 value tables
            ids = torch.randint(1000, 30000, (1, 128), generator=torch.Generator().manual_seed(7))
            with torch.inference_mode():
                fp32_out = models["resm"](input_ids=ids).last_hidden_state
            del models["pkm"]
            for label in (
                "+ResM on 4 KiB pages (no `use_huge_pages`)",
                "+ResM on `torch.topk` (no native selection)",
                "+ResM with bf16 values",
            ):
                pair = {"bert": models["bert"], "resm": models["resm"]}
                if "4 KiB" in label:
                    pair["resm"] = build_encoder(size, "resm")  # the same weights (same seed), freshly allocated
                if "bf16" in label:
                    cast_pkm_values(models["resm"], torch.bfloat16)
                    on_huge_pages["resm-base, bf16 values"] = use_huge_pages(models["resm"])  # the cast made new tables
                    with torch.inference_mode():
                        out = models["resm"](input_ids=ids).last_hidden_state
                    bf16_error = ((out - fp32_out).abs().max() / fp32_out.abs().max()).item()
                for batch in (1,) if args.quick else (1, 32):
                    rounds = table1_rounds(args, size, batch)
                    with use_reference() if "topk" in label else contextlib.nullcontext():
                        samples, shares = time_models(pair, batch, rounds)
                    resm, implied = paired_ratio(samples, "bert", "resm"), 1 - median(shares)
                    lines.append(
                        f"| BERT-{size}, {label} | {batch} x 128 | {rounds} | {1 / median(samples['bert']):.2f} | - | "
                        f"{1 / median(samples['resm']):.2f} | - | {resm:.3f} | "
                        f"{min_ratio(samples, 'bert', 'resm'):.3f} | {implied:.3f} |"
                    )
                    verdicts.append(f"BERT-{size} {label} {batch}x128: {resm:.3f} paired, {implied:.3f} from the share ({verdict(resm, implied)})")
                del pair
        del models
    lines += [
        "",
        "Huge pages: every model of the table went through `use_huge_pages(model)` (its parameters of >= 32 MiB copied "
        "into memory on 2 MiB transparent huge pages: the value tables, and the word embeddings of every model); bytes "
        "on huge pages: " + ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in on_huge_pages.items()) + ". "
        "The row 'on 4 KiB pages' is the ResM model without it.",
        "",
        "bf16 values: `cast_pkm_values(model, torch.bfloat16)` (inference option; the search, softmax and everything else "
        f"stay fp32); max |difference| of the last hidden state vs fp32 values, relative to its max: {bf16_error:.1e}.",
        "",
        "Target ResM / BERT >= 0.95 on CPU: " + "; ".join(verdicts) + ". GPU (>= 0.9): section 5.",
        "Paper (V100, batch 1, BERT-base): 79.8 / 61.4 / 59.3 batch/s, ResM / BERT = 0.743.",
        "",
    ]
    return lines + memory_breakdown(args)


# ----------------------------------------------------------------------------------------------- GPU


def synchronized(function, device: str):
    def run():
        function()
        if device == "cuda":
            torch.cuda.synchronize()

    return run


def peak_allocated(function, device: str) -> float:
    """Peak bytes allocated by torch on the device during `function`, above what was allocated before (CUDA only)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    function()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def gpu_gathers(device: str, quick: bool) -> list[str]:
    """The forward gather of a memory at the paper's size (EmbeddingBag), fp32 and bf16."""
    import torch.nn.functional as F

    lines = ["| tokens | values | EmbeddingBag ms | GB/s |", "|---|---|---|---|"]
    generator = torch.Generator(device=device).manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.randn(512**2, 768, device=device, dtype=dtype)
        for tokens in (1024, 4096) if not quick else (1024,):
            rows = torch.randint(0, 512**2, (tokens, 128), device=device, generator=generator)
            weights = torch.rand(tokens, 128, device=device, dtype=dtype, generator=generator)
            functions = {"embedding_bag": lambda: F.embedding_bag(rows, table, mode="sum", per_sample_weights=weights)}
            samples = interleaved({k: synchronized(f, device) for k, f in functions.items()}, rounds=5 if quick else 20, warmup=3)
            read = tokens * 128 * 768 * table.element_size()
            bag = median(samples["embedding_bag"])
            cells = [f"{tokens}", str(dtype).replace("torch.", ""), f"{bag * 1e3:.3f}", f"{read / bag / 1e9:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
        table = None  # freed before the next dtype's (not `del`: the lambdas above still name it)
    return lines


def gpu_layer(device: str, quick: bool) -> list[str]:
    """The layer comparison of section 1 on the device."""
    torch.manual_seed(1)
    x = torch.randn(8, 128, 768, device=device, requires_grad=True)
    g = torch.randn(8, 128, 768, device=device)
    impls = dict(LAYER_IMPLS)
    modules = {impl: build_layer(impl).to(device).train() for impl in impls}
    steps = {impl: synchronized(layer_step_fn(m, x, g), device) for impl, m in modules.items()}
    samples = interleaved(steps, rounds=3 if quick else 10, warmup=2)
    peers = ["lucidrains", "xlm"]
    best_peer = min(peers, key=lambda p: median(samples[p]))
    lines = ["| implementation | median ms | speed-up vs faster peer | peak allocated during a step, MiB |", "|---|---|---|---|"]
    for impl, label in impls.items():
        for p in modules[impl].parameters():  # the step's own gradients count: start without them
            p.grad = None
        peak = peak_allocated(steps[impl], device) / MiB
        lines.append(f"| {label} | {median(samples[impl]) * 1e3:.2f} | {paired_ratio(samples, best_peer, impl):.2f}x | {peak:.0f} |")
    return lines


def gpu_table1(device: str, quick: bool) -> tuple[list[str], list[str]]:
    lines = [
        "| model | batch | BERT batch/s | +PKM batch/s | +ResM batch/s | +PKM / BERT | +ResM / BERT |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for size in ["base"] if quick else ["base", "large"]:
        models = {kind: build_encoder(size, kind).to(device) for kind in ("bert", "pkm", "resm")}
        for batch in (1, 32):
            ids = torch.randint(1000, 30000, (batch, 128), device=device, generator=torch.Generator(device=device).manual_seed(6))
            mask = torch.ones_like(ids)

            def forward_fn(model):
                def run():
                    with torch.inference_mode():
                        model(input_ids=ids, attention_mask=mask)

                return synchronized(run, device)

            rounds = 3 if quick else (30 if batch == 1 else 10)
            samples = interleaved({k: forward_fn(m) for k, m in models.items()}, rounds=rounds, warmup=3)
            rate = {k: f"{1 / median(v):.1f}" for k, v in samples.items()}
            ratio = {k: f"{paired_ratio(samples, 'bert', k):.3f}" for k in samples if k != "bert"}
            lines.append(
                f"| BERT-{size} | {batch} x 128 | {rate['bert']} | {rate['pkm']} | {rate['resm']} | {ratio['pkm']} | "
                f"{ratio['resm']} |"
            )
            best = float(ratio["resm"])
            verdicts.append(f"BERT-{size} {batch}x128: {best:.3f} ({'met' if best >= 0.9 else 'not met'})")
        del models
    return lines, verdicts


def section_gpu(args) -> list[str] | None:
    device = args.device
    title = ["## 5. GPU: gathers, layer vs peers, Table 1", ""]
    if device == "cuda" and not torch.cuda.is_available():
        print("section gpu: no CUDA device, nothing measured (RESULTS.md keeps the last GPU run)")
        return None
    name = torch.cuda.get_device_name() if device == "cuda" else f"{device} (smoke run of the GPU section)"
    lines = title + [
        f"Device: {name}; the layer on its reference plan. fp32, CUDA-synchronised "
        "wall times, interleaved rounds, medians; ratios are medians of per-round ratios.",
        "",
        "### Value gather, 128 lookups (4 heads x knn 32) of 768-wide rows per token, 262,144-row table",
        "",
        *gpu_gathers(device, args.quick),
        "",
        "### PKM layer at the paper's size, 8 x 128 tokens, forward + backward",
        "",
        *gpu_layer(device, args.quick),
        "",
        "### Table 1 on the device (random weights, eval, `torch.inference_mode()`, sequence length 128)",
        "",
    ]
    table, verdicts = gpu_table1(device, args.quick)
    if device != "cuda":
        return lines + table + ["", f"(A smoke run on {device}: no GPU figures, no verdict on the GPU target.)"]
    return lines + table + ["", "Target ResM / BERT >= 0.9 on a GPU: " + "; ".join(verdicts) + "."]



# ----------------------------------------------------------------------------------------------- Memory+ options


OPTION_VARIANTS = {
    "default": ("default layer (softmax, no norm, no gate, no scale)", {}),
    "qk_norm": ("`qk_norm=True` (LayerNorm on query halves and sub-keys)", dict(qk_norm=True)),
    "relu": ('`score_activation="relu"`', dict(score_activation="relu")),
    "swilu": ('`output_gate="swilu"` (+ 2 Linear 768 x 768)', dict(output_gate="swilu")),
    "scale": ("`memory_scale=0.01`", dict(memory_scale=0.01)),
    "all": ("all four together", dict(qk_norm=True, score_activation="relu", output_gate="swilu", memory_scale=0.01)),
}


def section_options(args) -> list[str]:
    """The layer cost of each Memory+ option at the paper's size, against the default layer in the same rounds (a
    shared table: section `shared`)."""
    rounds = 3 if args.quick else 5
    batch = getattr(args, "options_batch", None) or ((4, 128) if args.quick else (8, 128))
    torch.manual_seed(1)
    x = torch.randn(*batch, 768, requires_grad=True)
    g = torch.randn(*batch, 768)
    table = ProductKeyValues(PAPER["n_keys"] ** 2, 768)  # one table read by every single-memory variant (same work)
    torch.nn.init.normal_(table.weight, std=768**-0.5)
    modules = {
        name: ProductKeyMemory(768, 768, **PAPER, values=table, **options).train()
        for name, (_, options) in OPTION_VARIANTS.items()
    }
    samples = interleaved({name: layer_step_fn(m, x, g) for name, m in modules.items()}, rounds=rounds, warmup=1)
    lines = [
        "## Memory+ options: layer cost (forward + backward)",
        "",
        f"`python benchmarks/run_benchmarks.py --sections options{' --quick' if args.quick else ''}`. "
        f"768 in/out, 512^2 slots, 4 heads, knn 32, k_dim 256, query BatchNorm, dense value gradient; input "
        f"{batch[0]} x {batch[1]} x 768 fp32 with `requires_grad`; step = forward + `(out * g).sum().backward()`, grads "
        f"set to None before each step; {rounds} interleaved rounds (+1 warm-up), torch threads {args.threads}. Every "
        "variant reads the same value table (a memory's cost does not depend on who owns its table). Ratio = median "
        "over rounds of (variant time / default time in the same round); < 1.00 is noise.",
        "",
        "| variant | median ms | all rounds (ms) | time / default (paired median; fastest rounds) |",
        "|---|---|---|---|",
    ]
    for name, (label, _) in OPTION_VARIANTS.items():
        lines.append(
            f"| {label} | {fmt_ms(median(samples[name]))} | {', '.join(fmt_ms(t) for t in samples[name])} | "
            f"{paired_ratio(samples, name, 'default'):.2f}; {min_ratio(samples, name, 'default'):.2f} |"
        )
    del modules, samples
    return lines + ["", f"Load average at the end of this section: {loadavg()} (ratios are paired per round)."]


def section_shared(args) -> list[str]:
    """Two memories sharing one value table (Memory+) against two with a table each, fwd + bwd of both, with dense and
    with sparse value gradients (autograd sums the shared table's two gradients)."""
    rounds = 3 if args.quick else getattr(args, "rounds", 5)
    batch = getattr(args, "options_batch", None) or ((4, 128) if args.quick else (8, 128))
    torch.manual_seed(2)
    x = torch.randn(*batch, 768, requires_grad=True)
    g = torch.randn(*batch, 768)

    def pair_step(pair):
        def step():
            for memory in pair:
                for p in memory.parameters():
                    p.grad = None
            x.grad = None
            ((pair[0](x) + pair[1](x)) * g).sum().backward()

        return step

    table_mib = PAPER["n_keys"] ** 2 * 768 * 4 / 2**20
    lines = [
        "## Two memories sharing one value table against a table each (forward + backward)",
        "",
        f"`python benchmarks/run_benchmarks.py --sections shared{' --quick' if args.quick else ''}`. Two "
        f"memories at the paper's size (768 in/out, {PAPER['n_keys']}^2 slots, 4 heads, knn 32, k_dim 256, query "
        f"BatchNorm) on the same input {batch[0]} x {batch[1]} x 768 fp32; step = both forwards + "
        "`((a(x) + b(x)) * g).sum().backward()`, grads set to None before each step; a table each vs one shared table "
        f"(`values=`); {rounds} interleaved rounds (+1 warm-up), torch threads {args.threads}.",
        "",
        "| value gradient | two memories | median ms | all rounds (ms) | time / own tables (paired median; fastest rounds) |",
        "|---|---|---|---|---|",
    ]
    for sparse in (False, True):
        own = [ProductKeyMemory(768, 768, **PAPER, sparse=sparse).train() for _ in range(2)]
        table = ProductKeyValues(PAPER["n_keys"] ** 2, 768, sparse=sparse)
        torch.nn.init.normal_(table.weight, std=768**-0.5)
        shared = [ProductKeyMemory(768, 768, **PAPER, values=table).train() for _ in range(2)]

        def no_gradients(_name):  # only the running pair holds gradients
            for memory in (*own, *shared):
                for p in memory.parameters():
                    p.grad = None

        samples = interleaved({"own": pair_step(own), "shared": pair_step(shared)}, rounds=rounds, warmup=1, before=no_gradients)
        kind = "sparse (`sparse=True`)" if sparse else "dense"
        for name, label in (("own", f"a table each (2 x {table_mib:.0f} MiB)"), ("shared", f"one shared table ({table_mib:.0f} MiB)")):
            lines.append(
                f"| {kind} | {label} | {fmt_ms(median(samples[name]))} | {', '.join(fmt_ms(t) for t in samples[name])} | "
                f"{paired_ratio(samples, name, 'own'):.2f}; {min_ratio(samples, name, 'own'):.2f} |"
            )
        own = shared = table = samples = None  # freed before the next pair (no_gradients still names them)
    return lines + [
        "",
        "Autograd adds the shared table's two gradients out of place; the second lookup's backward takes a fresh buffer "
        "(the first one's gradient is still in flight), the first reuses the table's kept one. "
        f"Load average at the end of this section: {loadavg()} (ratios are paired per round).",
    ]


# ----------------------------------------------------------------------------------------------- main


def header(args) -> list[str]:
    import transformers

    try:
        from importlib.metadata import version

        pkm_version = version("product-key-memory")
    except Exception:  # noqa: BLE001
        pkm_version = "n/a"
    cpu = platform.processor() or "n/a"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "n/a"
    return [
        f"Command: `python benchmarks/run_benchmarks.py {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; commit {git_commit()}  ",
        f"Machine: {cpu}, {os.cpu_count()} logical CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"Linux {platform.release()}; transparent huge pages: {thp}  ",
        f"Versions: Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"product-key-memory {pkm_version}  ",
        f"Threads: torch.set_num_threads({args.threads}); THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}  ",
        f"Load average at start: {loadavg()} (the machine is shared: absolute times are noisy, ratios are paired)",
    ]


def git_commit() -> str:
    """The commit of the code measured (`+changes` when the tree differs from it), or n/a outside a checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "modeling_pkm_bert"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "n/a"
    return commit + ("+changes" if dirty else "")


# ---------------------------------------------------------------------------------------------- RESULTS.md
# The latest run of each section between markers, in SECTIONS' order, and a history row per run; a run rewrites the
# sections it ran and keeps the others.

TITLE = [
    "# Benchmarks: product key memory speed and memory",
    "",
    "Each section is the latest run of it, with the command, commit, machine and load it ran under; the history table "
    "lists every run. `python benchmarks/run_benchmarks.py --sections NAME` reruns a section (`--help`: what each "
    "measures). Times are medians of interleaved rounds; ratios are paired per round, so they hold on a shared "
    "machine where absolute times do not.",
    "",
]
HISTORY_TITLE = ["## History", "", "| date | commit | sections | machine | load at start | torch | took |", "|---|---|---|---|---|---|---|"]


def section_marks(name: str) -> tuple[str, str]:
    return f"<!-- section {name} -->", f"<!-- /section {name} -->"


def read_results(path) -> tuple[dict[str, list[str]], list[str]]:
    """The sections (`{name: lines}`) and history rows of a RESULTS.md written by `update_results`."""
    sections, history = {}, []
    lines = Path(path).read_text(encoding="utf-8").splitlines() if Path(path).exists() else []
    name = None
    for line in lines:
        if line.startswith("<!-- section ") and line.endswith(" -->"):
            name = line[len("<!-- section "):-len(" -->")]
            sections[name] = []
        elif name is not None and line == section_marks(name)[1]:
            name = None
        elif name is not None:
            sections[name].append(line)
        elif line.startswith("| 20"):  # a history row starts with its date
            history.append(line)
    return sections, history


def update_results(path, ran: dict[str, list[str]], history: str | None = None) -> None:
    """Replace the sections in `ran`, keep the others, add the `history` row; written atomically."""
    sections, rows = read_results(path)
    sections.update(ran)
    order = [name for name in SECTIONS if name in sections] + [name for name in sections if name not in SECTIONS]
    lines = TITLE + HISTORY_TITLE + rows + ([history] if history else []) + [""]
    for name in order:
        lines += [section_marks(name)[0], *sections[name], section_marks(name)[1], ""]
    lines += NOTES
    temporary = Path(f"{path}.tmp")
    temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def history_row(args, sections: list[str], machine: list[str], seconds: float) -> str:
    fields = {line.split(":", 1)[0]: line.split(":", 1)[1].strip().rstrip() for line in machine if ":" in line}
    date, _, commit = fields["Date"].partition("; commit ")
    cpu = ", ".join(fields["Machine"].split(", ")[:2]).replace(" logical CPUs", " CPUs")
    torch_version = fields["Versions"].split("torch ")[1].split(",")[0]
    load = fields["Load average at start"].split(" (")[0]
    sections = " ".join(sections) + (" (quick)" if args.quick else "")
    return f"| {date} | {commit} | {sections} | {cpu} | {load} | {torch_version} | {seconds / 60:.0f} min |"


NOTES = [
    "## Notes",
    "",
    "- Sections dated before 2026-12-03 measured the layer before its restructuring: the paths they name "
    "(`HostBoundLookup`, the Triton gathers, `ONE_NODE_WHEN_HOST_BOUND`, size thresholds) are gone; a GPU now runs the "
    "reference plan, a CPU the plan of the next note. Their figures stay until the section is rerun.",
    "- What makes the layer fast on CPU: the CPU plan of `modeling_pkm_bert/product_key_memory_ops.py` "
    "(`memory.explain_paths()` prints it; `use_reference()` runs the reference, as section 1's `ours_*_reference` rows "
    "do; each path is tested against the reference in `tests/`): (1) the native selection of the note on Table 1, in "
    "training too; (2) the search backward through the selected sub-keys only (`ProductKeySearch`: no dense "
    "n_keys-wide gradient matmuls); (3) the value backward as one sparse-matrix product (CSR, rows sorted once) written "
    "into a gradient buffer reused from step to step once the optimizer dropped the gradient (a fresh 768 MiB "
    "allocation costs its page faults every step, about as long as the whole layer on this VM). Every plan scores only "
    "the 119 of the 32 x 32 candidate pairs that can reach the top 32 ((a+1)(b+1) <= knn), and `SparseRowAdam` updates "
    "the touched rows in cache-sized chunks with a bf16 first moment and a row-wise second moment.",
    "- Threads: the benchmark runs torch with 1 thread by default. This 2-core VM is shared with other jobs; with 2 "
    "threads every parallel op waits for a descheduled peer thread (single ops then take 10+ ms), which measures the "
    "scheduler, not the code. `--threads 2` is available.",
    "- THP: `THP_MEM_ALLOC_ENABLE=1` (a torch environment variable) backs large CPU allocations with huge pages. It "
    "removes most of the page-fault cost of the peers' fresh dense gradients, so against peers run that way the layer "
    "speed-up is smaller (see section 1); our path avoids those allocations either way.",
    "- Table 1 on CPU: the selection runs in a native kernel (`modeling_pkm_bert/kernels/csrc/product_key_select.c`, built at "
    "first use with the system C compiler, registered as `torch.ops.pkm_bert.select_product_keys` by "
    "`modeling_pkm_bert.kernels.cpu`): a threshold from the maxima of 64 groups of sub-keys leaves ~40 of the 512 "
    "scores per head-half, ranked by counting with AVX-512, then the pruned pairs likewise (the rows 'on "
    "`torch.topk`' measure the model without it). `use_huge_pages` puts the value tables on 2 MiB pages: a lookup "
    "reads random 3 KiB rows of a 768 MiB table, and on 4 KiB pages nearly every row costs a TLB miss and a page "
    "walk. The breakdown under the table shows what a memory costs then: two GEMMs and a gather that each run close "
    "to what this core does at best (its fp32 matmul, its sequential read), plus the selection. At ~7-8 ms per "
    "memory against ~270 ms for BERT-base at 1 x 128, the fp32 ResM / BERT-base ratio cannot rise much above ~0.95 "
    "on this CPU; bf16 values halve the gather. BERT-large hides the same memory cost behind 2x the layers and 1.8x "
    "the width.",
    "- GPU: section 5 runs where CUDA is available; the layer runs its reference plan there (no fast path has shown a "
    "win on a GPU).",
    "- The values' training state (weights + sparse gradient + `SparseRowAdam` state) is 1.5x the table plus the "
    "fraction of rows a step touches (0.39 at 8 x 128 tokens): it reaches 2x at ~11 x 128 tokens per memory per step "
    "and 2.5x once every row is touched; `SparseRowAdam(betas=(0.0, 0.999))` keeps no first moment (<= 2x always).",
]


# ----------------------------------------------------------------------------------------------- Trainer


def section_trainer(args) -> list[str]:
    """A Trainer step with `memory_optimizer="sparse_row_adam"`: PkmTrainer (sparse value gradient: the rows read) against
    the plain Trainer with `pkm_optimizers` (the same optimizer on the dense gradient of the whole table)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM
    from modeling_pkm_bert.integrations.trainer import PkmTrainer, pkm_optimizers

    rounds, batch, length = (3, 8, 128) if args.quick else (5, 8, 128)
    sizes = [(256, 256)] if args.quick else [(256, 256), (512, 256), (512, 768)]  # (n_keys, hidden = value size)
    sizes, batch = getattr(args, "trainer_sizes", None) or sizes, getattr(args, "trainer_batch", None) or batch  # tests
    generator = torch.Generator().manual_seed(0)
    scratch = tempfile.TemporaryDirectory(prefix="pkm-trainer-section-")  # the Trainer's output_dir: nothing kept
    ids = torch.randint(5, 1000, (batch, length), generator=generator)
    inputs = {"input_ids": ids, "labels": torch.where(torch.rand(batch, length, generator=generator) < 0.15, ids, -100)}
    lines = [
        "## Trainer: sparse value gradient (PkmTrainer) vs dense (plain Trainer), `sparse_row_adam`",
        "",
        f"`python benchmarks/run_benchmarks.py --sections trainer{' --quick' if args.quick else ''}`. "
        f"BertPkmForMaskedLM, 2 layers, vocab 1000, intermediate 4 x hidden, one memory (layer 1; 4 heads, knn 32, "
        f"k_dim 128, values of the hidden size); batch {batch} x {length} tokens, 15% labelled. A step is what `Trainer.train` runs per step: "
        "`training_step` (forward + backward), `_clip_grad_norm` (max_grad_norm 1.0), `optimizer.step()`, gradients "
        f"set to None. {rounds} interleaved rounds (+1 warm-up), torch threads {args.threads}. Both use the same "
        "optimizer (torch AdamW + SparseRowAdam for the values at 1e-3).",
        "",
        "| slots x hidden | value table | rows a step reads | value gradient, dense / sparse | dense step (ms) | sparse step "
        "(ms) | dense / sparse time (paired median; fastest) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n_keys, hidden in sizes:
        config = BertPkmConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=4 * hidden, max_position_embeddings=length, pkm_layers=[1], pkm_n_keys=n_keys,
                               pkm_heads=4, pkm_knn=32, pkm_k_dim=128)
        torch.manual_seed(0)
        initial = BertPkmForMaskedLM(config)
        training = TrainingArguments(scratch.name, max_steps=100, learning_rate=1e-4, report_to=[], use_cpu=True,
                                     max_grad_norm=1.0, disable_tqdm=True, save_strategy="no")
        data = Dataset.from_dict({"input_ids": ids.tolist()})
        trainers = {}
        for name in ("dense", "sparse"):
            model = BertPkmForMaskedLM(config)
            model.load_state_dict(initial.state_dict())
            if name == "sparse":
                trainer = PkmTrainer(model=model, args=training, train_dataset=data, memory_optimizer="sparse_row_adam")
                trainer.create_optimizer()
            else:
                optimizers = pkm_optimizers(model, training, memory_optimizer="sparse_row_adam")
                trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=optimizers)
            trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
            trainers[name] = trainer

        def step_fn(trainer):
            def step():
                trainer.model.train()
                trainer.training_step(trainer.model, dict(inputs))
                trainer._clip_grad_norm(trainer.model)
                trainer.optimizer.step()
                trainer.model.zero_grad(set_to_none=True)

            return step

        samples = interleaved({name: step_fn(t) for name, t in trainers.items()}, rounds=rounds, warmup=1)
        sparse = trainers["sparse"].model
        sparse.train()
        trainers["sparse"].training_step(sparse, dict(inputs))
        gradient = sparse.bert.encoder.layer[1].memory.values.weight.grad.coalesce()
        rows_read = gradient._nnz() / n_keys**2
        sparse_mib = (gradient._values().nbytes + gradient._indices().nbytes) / 2**20
        sparse.zero_grad(set_to_none=True)
        table_mb = n_keys**2 * hidden * 4 / 2**20
        lines.append(
            f"| {n_keys}^2 x {hidden} | {table_mb:.3g} MiB fp32 | {rows_read:.0%} | {table_mb:.3g} / {sparse_mib:.3g} MiB | "
            f"{fmt_ms(median(samples['dense']))} | "
            f"{fmt_ms(median(samples['sparse']))} | {paired_ratio(samples, 'dense', 'sparse'):.2f}; "
            f"{min_ratio(samples, 'dense', 'sparse'):.2f} |"
        )
        del trainers, samples, initial
    return lines


# ----------------------------------------------------------------------------------------------- quantized


def quantized_tables(values) -> dict:
    """fp32, bf16, int8 and 4-bit copies of one value table (`ProductKeyValues` / `QuantizedProductKeyValues`)."""
    import copy

    from modeling_pkm_bert.product_key_memory import QuantizedProductKeyValues
    from modeling_pkm_bert.serving.quantization import prepack_rows

    rows, dim = values.weight.shape
    bf16 = copy.deepcopy(values).to(torch.bfloat16)
    return {
        "fp32": values.eval(),
        "bf16": bf16.eval(),
        "int8": QuantizedProductKeyValues(rows, dim, 8, packed=prepack_rows(values.weight, 8)).eval(),
        "4bit": QuantizedProductKeyValues(rows, dim, 4, packed=prepack_rows(values.weight, 4)).eval(),
    }


def section_quantized(args) -> list[str]:
    """The value gather of one memory and Table 1's ResM/BERT-base with fp32, bf16, int8 and 4-bit value tables
    (`quantize_memory_values`), on 4 KiB pages and after `use_huge_pages`, all variants interleaved."""
    from modeling_pkm_bert.product_key_memory import lookup_dtype

    kinds = ("fp32", "bf16", "int8", "4bit")
    torch.manual_seed(3)
    slots, tokens = PAPER["n_keys"] ** 2, 128
    table = ProductKeyValues(slots, 768)
    torch.nn.init.normal_(table.weight, std=768**-0.5)
    tables = quantized_tables(table)
    sizes = {k: sum(t.nbytes for t in v.parameters()) / MiB for k, v in tables.items()}
    indices = torch.randint(0, slots, (tokens, PAPER["heads"] * PAPER["knn"]))
    weights = torch.softmax(torch.randn(tokens, PAPER["heads"], PAPER["knn"]), -1).flatten(1)
    with torch.inference_mode():
        outputs = {k: t(indices, per_sample_weights=weights.to(lookup_dtype(t.weight))).float() for k, t in tables.items()}
    errors = {k: ((o - outputs["fp32"]).norm() / outputs["fp32"].norm()).item() for k, o in outputs.items()}
    rounds = 10 if args.quick else 30
    lines = [
        "## Compact value tables: int8 and 4-bit rows (`quantize_memory_values`)",
        "",
        f"`python benchmarks/run_benchmarks.py --sections quantized{' --quick' if args.quick else ''}`. "
        f"Torch threads {args.threads}. (a) The value gather alone: {tokens} tokens x {PAPER['heads']} heads x "
        f"knn {PAPER['knn']} random rows of a {PAPER['n_keys']}^2 x 768 table with softmax weights "
        "(`values(indices, per_sample_weights=w)`), `torch.inference_mode()`; fp32 and bf16: `ProductKeyValues` "
        "(EmbeddingBag), int8 and 4-bit: FBGEMM's `torch.ops.quantized.embedding_bag_{byte,4bit}_rowwise_offsets`. "
        f"All eight variants (4 tables x 4 KiB / huge pages) interleaved, {rounds} rounds (+1 warm-up). Error: "
        "relative (Frobenius) error of the weighted sums against fp32. Target: int8 >= 2x the fp32 gather.",
        "",
        "| values | table MiB | error vs fp32 | ms, 4 KiB pages | ms, huge pages | speed-up vs fp32 (4 KiB; huge; paired medians) |",
        "|---|---|---|---|---|---|",
    ]
    huge_tables = {}
    for kind, t in tables.items():  # huge-page copies of the same rows (use_huge_pages copies the tensors)
        import copy

        huge_tables[kind] = copy.deepcopy(t)
        use_huge_pages(huge_tables[kind])

    def gather(t):
        w = weights.to(lookup_dtype(t.weight))

        def run():
            with torch.inference_mode():
                t(indices, per_sample_weights=w)

        return run

    functions = {f"{k} 4k": gather(tables[k]) for k in kinds} | {f"{k} huge": gather(huge_tables[k]) for k in kinds}
    samples = interleaved(functions, rounds=rounds, warmup=1)
    verdicts = []
    for kind in kinds:
        small, big = paired_ratio(samples, "fp32 4k", f"{kind} 4k"), paired_ratio(samples, "fp32 huge", f"{kind} huge")
        lines.append(
            f"| {kind} | {sizes[kind]:.0f} | {errors[kind]:.4f} | {median(samples[f'{kind} 4k']) * 1e3:.2f} | "
            f"{median(samples[f'{kind} huge']) * 1e3:.2f} | {small:.2f}x; {big:.2f}x |"
        )
        if kind == "int8":
            verdicts.append(f"int8 gather vs fp32: {small:.2f}x (4 KiB), {big:.2f}x (huge pages): {'met' if min(small, big) >= 2 else 'not met'}")
    del huge_tables, tables, functions, samples, table

    # (b) Table 1: BERT-base against ResM-BERT-base whose two memories read each kind of table (the tables are swapped
    # into the one model between calls, so every variant shares the rest of the weights)
    bert, resm = build_encoder("base", "bert"), build_encoder("base", "resm")
    memories = [m for m in resm.modules() if isinstance(m, ProductKeyMemory)]
    per_memory = [quantized_tables(m.values) for m in memories]
    lines += [
        "",
        "(b) Table 1 at BERT-base size with each kind of value table: random weights, eval mode, `torch.inference_mode()`,"
        " input ids + an all-ones attention mask, sequence length 128; ResM: memories beside the FFN at layers {4, 8}; "
        "the ResM model's two tables are swapped between calls, so all variants share every other weight. Ratios: "
        "throughput ResM / BERT (BERT time / ResM time), median of the per-round ratios; the fastest rounds' ratio "
        "after the semicolon. Target: ResM / BERT-base >= 0.96 with int8.",
        "",
        "| pages | batch | rounds | BERT batch/s | " + " | ".join(f"ResM {k} batch/s" for k in kinds) + " | "
        + " | ".join(f"ResM {k} / BERT" for k in kinds) + " |",
        "|---|---|---|---|" + "---|" * (2 * len(kinds)),
    ]
    for pages in ("4 KiB", "huge"):
        if pages == "huge":
            use_huge_pages(bert)
            use_huge_pages(resm)
            for variant in per_memory:
                for t in variant.values():
                    use_huge_pages(t)
        for batch in (1,) if pages == "4 KiB" else (1, 32):
            rounds = (9 if args.quick else 15) if batch == 1 else (1 if args.quick else 3)
            ids = torch.randint(1000, 30000, (batch, 128), generator=torch.Generator().manual_seed(6))
            mask = torch.ones_like(ids)

            def forward(model, kind=None):
                def run():
                    if kind is not None:
                        for memory, variant in zip(memories, per_memory):
                            memory.values = variant[kind]
                    with torch.inference_mode():
                        model(input_ids=ids, attention_mask=mask)

                return run

            functions = {"bert": forward(bert)} | {k: forward(resm, k) for k in kinds}
            samples = interleaved(functions, rounds=rounds, warmup=1 if batch == 1 else 0)
            ratios = {k: paired_ratio(samples, "bert", k) for k in kinds}
            fastest = {k: min_ratio(samples, "bert", k) for k in kinds}
            lines.append(
                f"| {pages} | {batch} x 128 | {rounds} | {1 / median(samples['bert']):.2f} | "
                + " | ".join(f"{1 / median(samples[k]):.2f}" for k in kinds) + " | "
                + " | ".join(f"{ratios[k]:.3f}; {fastest[k]:.3f}" for k in kinds) + " |"
            )
            verdicts.append(
                f"ResM/BERT-base {pages} pages {batch}x128 with int8: {ratios['int8']:.3f} (fp32 {ratios['fp32']:.3f}):"
                f" {'met' if ratios['int8'] >= 0.96 else 'not met'}"
            )
    return lines + ["", "Verdicts: " + "; ".join(verdicts) + f". Load average at the end: {loadavg()}."]


def build_modernbert(kind: str):
    """ModernBERT-base's size with random weights: transformers' ModernBertModel ("plain"), ours without memories
    ("ours"), ours with ResM memories at layers 7 and 14 ([n // 3, 2n // 3] of 22; the paper's 512^2 slots, 4 heads,
    knn 32, k_dim 256) ("resm"); sdpa attention for all."""
    import transformers

    from modeling_pkm_bert import ModernBertPkmConfig, ModernBertPkmModel

    torch.manual_seed(5)
    if kind == "plain":
        return transformers.ModernBertModel(transformers.ModernBertConfig(attn_implementation="sdpa")).eval()
    layers = [] if kind == "ours" else [7, 14]
    return ModernBertPkmModel(ModernBertPkmConfig(pkm_layers=layers, pkm_mode="resm", attn_implementation="sdpa")).eval()


def section_modernbert(args) -> list[str]:
    lines = [
        "## Table 1's setting on ModernBERT-base: inference throughput",
        "",
        "Random weights of ModernBERT-base's size (22 layers, hidden 768, GeGLU 1152, global attention every third "
        "layer, a 128-token window elsewhere, sdpa), eval mode, `torch.inference_mode()`, input ids + an all-ones "
        "attention mask, sequence length 128, all three models in one run (interleaved rounds, as section 4). plain: "
        "transformers' `ModernBertModel`; ours: `ModernBertPkmModel` without memories (our copies of its blocks); "
        "+ResM: memories (512^2 slots, 4 heads, knn 32, k_dim 256) beside the MLP at layers 7 and 14. Ratios are "
        "throughput ratios (plain time / model time): the median of the per-round ratios, the ratio of the fastest "
        "rounds, and for +ResM the estimate from the memories' share of each call (1 - time in the memories / time of "
        "the call).",
        "",
        "| batch | rounds | plain batch/s | ours batch/s | +ResM batch/s | ours / plain | +ResM / plain | "
        "+ResM / plain, fastest rounds | +ResM / ours from the memories' share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    models = {"bert": build_modernbert("plain"), "ours": build_modernbert("ours"), "resm": build_modernbert("resm")}
    for model in models.values():
        use_huge_pages(model)
    verdicts = []
    for batch in (1, 32):
        rounds = table1_rounds(args, "base", batch)
        samples, shares = time_models(models, batch, rounds)
        ours, resm, implied = paired_ratio(samples, "bert", "ours"), paired_ratio(samples, "bert", "resm"), 1 - median(shares)
        lines.append(
            f"| {batch} x 128 | {rounds} | {1 / median(samples['bert']):.2f} | {1 / median(samples['ours']):.2f} | "
            f"{1 / median(samples['resm']):.2f} | {ours:.3f} | {resm:.3f} | {min_ratio(samples, 'bert', 'resm'):.3f} | "
            f"{implied:.3f} |"
        )
        verdicts.append(f"{batch}x128: +ResM/plain {resm:.3f} paired, {implied:.3f} from the share ({verdict(resm, implied)})")
    return lines + ["", "Verdicts (target 0.95, as Table 1's): " + "; ".join(verdicts) + f". Load average at the end: {loadavg()}."]


SECTIONS = {
    "overhead": section_overhead,
    "layer": section_layer,
    "update": section_update,
    "train": section_train,
    "table1": section_table1,
    "gpu": section_gpu,
    "options": section_options,
    "shared": section_shared,
    "trainer": section_trainer,
    "quantized": section_quantized,
    "modernbert": section_modernbert,
}


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (~3-4 min)")
    extra_sections = ("options", "shared", "trainer", "quantized", "modernbert")  # not in the default run
    parser.add_argument("--sections", nargs="*", default=[s for s in SECTIONS if s not in extra_sections],
                        choices=list(SECTIONS), help=f"default: all but {', '.join(extra_sections)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core machine, "
                        "2 threads make every parallel op wait on a descheduled peer thread)")
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--device", default="cuda", help="device of the gpu section (cpu: a smoke run of its code)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--kinds", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_command_paths(parser, args, "run_benchmarks")
    torch.set_num_threads(args.threads)

    if args.worker == "layer-memory":
        print(json.dumps(worker_layer_memory(args.impl, args.steps)))
        return
    if args.worker == "layer-timing":
        print(json.dumps(layer_timing(args.rounds)))
        return
    if args.worker == "train-pair":
        print(json.dumps(train_pair(args.kinds, args.batch, args.rounds)))
        return

    started = time.perf_counter()
    machine, measured = header(args), []
    for name in args.sections:
        section_start = time.perf_counter()
        print(f"[{time.perf_counter() - started:6.0f}s] section {name} ...", flush=True)
        text = SECTIONS[name](args)
        if text is None:  # measured nothing here (the gpu section without a GPU)
            continue
        text = [*text[:2], *machine, "", *text[2:], "", f"_(section took {time.perf_counter() - section_start:.0f} s)_"]
        print("\n".join(text), flush=True)
        update_results(args.output, {name: text})  # each finished section is kept, should a later one fail
        measured.append(name)
    if measured:
        update_results(args.output, {}, history=history_row(args, measured, machine, time.perf_counter() - started))
        print(f"updated {args.output}")

if __name__ == "__main__":
    main()
