"""Section `quantized`: the value gather and Table 1's ResM/BERT-base with fp32, bf16, int8 and 4-bit value tables."""


import torch

from benchmarks.harness import MiB, interleaved, loadavg, median, min_ratio, paired_ratio
from benchmarks.speed.common import PAPER, build_encoder
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import ProductKeyMemory, ProductKeyValues, use_huge_pages


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
