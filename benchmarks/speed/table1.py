"""Section `table1`: Kim & Jung's Table 1 on this machine (batch/s of BERT and its +PKM, +ResM variants) and what a
memory costs inside it."""

import contextlib
import time

import torch

from benchmarks.harness import interleaved, median, min_ratio, paired_ratio, timed
from benchmarks.speed.common import build_encoder
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import ProductKeyMemory, use_huge_pages
from modeling_pkm_bert.methods.optimizers.memory_optimizer import cast_pkm_values


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
