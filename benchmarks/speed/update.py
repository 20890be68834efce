"""Section `update`: one value-table update against the fraction of rows the step touched (SparseRowAdam vs Adam)."""


import torch

from benchmarks.harness import fmt_ms, interleaved, median, paired_ratio
from modeling_pkm_bert.methods.optimizers.memory_optimizer import SparseRowAdam



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
