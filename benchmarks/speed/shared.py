"""Section `shared`: two memories sharing one value table against a table each, dense and sparse gradients."""


import torch

from benchmarks.harness import fmt_ms, interleaved, loadavg, median, min_ratio, paired_ratio
from benchmarks.speed.common import PAPER
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import ProductKeyMemory, ProductKeyValues


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
