"""Section `gpu`: where CUDA is available, the value gather, the layer vs its peers and Table 1 on the GPU."""


import torch

from benchmarks.harness import MiB, interleaved, median, paired_ratio
from benchmarks.speed.common import LAYER_IMPLS, build_encoder, build_layer, layer_step_fn, peak_allocated, synchronized



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
