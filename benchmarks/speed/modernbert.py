"""Section `modernbert`: Table 1's setting for a ModernBERT-base-sized encoder, +ResM against transformers' own."""



from benchmarks.harness import loadavg, median, min_ratio, paired_ratio
from benchmarks.speed.common import build_modernbert
from benchmarks.speed.table1 import table1_rounds, time_models, verdict
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import use_huge_pages


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
