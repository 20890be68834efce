"""Section `train`: a masked-LM training step of ResM-BERT-base vs BERT-base, the values' training state, peak RSS."""


import torch

from benchmarks.harness import MiB, PeakRss, interleaved, median, mem_available, min_ratio, paired_ratio
from benchmarks.speed.common import build_mlm, make_optimizers, mlm_batch, run_worker, train_step_fn
from modeling_pkm_bert.methods.optimizers.memory_optimizer import pkm_value_parameters



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
