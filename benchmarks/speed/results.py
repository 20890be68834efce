"""benchmarks/RESULTS.md: the latest run of each section between markers, in SECTIONS' order, and a history row per run;
a run rewrites the sections it ran and keeps the others (`harness.write_sections`). The header of a section names the
command, commit, machine, versions and load it ran under."""

import os
import platform
import sys

from benchmarks import harness
from benchmarks.speed import SECTIONS


RESULTS_MD = harness.BENCHMARKS / "RESULTS.md"


def header(args) -> list[str]:
    import torch
    import transformers

    try:
        from importlib.metadata import version

        pkm_version = version("product-key-memory")
    except Exception:  # noqa: BLE001
        pkm_version = "n/a"
    cpu = harness.cpu_name()
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "n/a"
    return [
        f"Command: `python benchmarks/run_benchmarks.py {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Date: {harness.now()}; commit {harness.git_commit()}  ",
        f"Machine: {cpu}, {os.cpu_count()} logical CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"Linux {platform.release()}; transparent huge pages: {thp}  ",
        f"Versions: Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"product-key-memory {pkm_version}  ",
        f"Threads: torch.set_num_threads({args.threads}); THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}  ",
        f"Load average at start: {harness.loadavg()} (the machine is shared: absolute times are noisy, ratios are paired)",
    ]


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


def read_results(path) -> tuple[dict[str, list[str]], list[str]]:
    """The sections (`{name: lines}`) and history rows of a RESULTS.md written by `update_results`."""
    return harness.read_sections(path)


def update_results(path, ran: dict[str, list[str]], history: str | None = None) -> None:
    """Replace the sections in `ran`, keep the others, add the `history` row; written atomically."""
    harness.write_sections(path, ran, SECTIONS, TITLE, HISTORY_TITLE, history, NOTES)


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
