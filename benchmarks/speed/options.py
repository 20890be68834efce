"""Section `options`: the cost of each Memory+ option."""


import torch

from benchmarks.harness import fmt_ms, interleaved, loadavg, median, min_ratio, paired_ratio
from benchmarks.speed.common import PAPER, layer_step_fn
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import ProductKeyMemory, ProductKeyValues

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
