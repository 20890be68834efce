"""What the bad-input checks of issue 13 cost on the forward (CPU): the memory's training check (non-finite queries,
single token) and the model's input check (shapes, id ranges), on the tiny test layer and the paper-size layer.

    OMP_NUM_THREADS=2 python benchmarks/speed/input_checks_cost.py [--repeats 15]

Each check is timed alone (median of `--repeats`), next to the step it guards, measured in the same run, interleaved.
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from modeling_pkm_bert import BertPkmConfig, BertPkmModel, ProductKeyMemory


LAYERS = {  # name: (memory arguments, tokens per batch)
    "tiny (hidden 32, 8^2 slots, 2 heads, k_dim 16)": (dict(input_dim=32, n_keys=8, heads=2, knn=4, k_dim=16), 8 * 32),
    "paper (hidden 768, 512^2 slots, 4 heads, k_dim 256)": (
        dict(input_dim=768, n_keys=512, heads=4, knn=32, k_dim=256), 32 * 128
    ),
}  # fmt: skip


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def ms(stats):
    median, low, high = stats
    return f"{median * 1e3:.3f} ms [{low * 1e3:.3f}, {high * 1e3:.3f}]"


def memory_rows(repeats):
    rows = []
    for name, (kwargs, tokens) in LAYERS.items():
        torch.manual_seed(0)
        memory = ProductKeyMemory(**kwargs).train()
        hidden = torch.randn(tokens, kwargs["input_dim"], requires_grad=True)
        queries = memory.query_proj(hidden)
        batchnorm = torch.nn.BatchNorm1d(queries.shape[1]).train()

        def step():
            memory(hidden[None]).sum().backward()

        def unchecked_step():
            memory._check_batch_statistics = lambda *args: None
            step()
            del memory._check_batch_statistics

        timings = {"check": [], "batchnorm": [], "step": [], "unchecked": []}
        step()  # warm-up
        for _ in range(repeats):  # interleaved: the machine's load hits all alike
            timings["check"].append(timed(lambda: memory._check_batch_statistics(hidden, queries), 1)[0])
            timings["batchnorm"].append(timed(lambda: batchnorm(queries.detach()), 1)[0])
            timings["step"].append(timed(step, 1)[0])
            timings["unchecked"].append(timed(unchecked_step, 1)[0])
        stats = {k: (statistics.median(v), min(v), max(v)) for k, v in timings.items()}
        rows.append((name, tokens, stats))
    return rows


def input_rows(repeats):
    rows = []
    for name, config, shape in [
        ("tiny config (vocab 99)", BertPkmConfig(vocab_size=99, max_position_embeddings=64, pkm_layers=[]), (8, 32)),
        ("BERT-base config (vocab 30522)", BertPkmConfig(pkm_layers=[]), (32, 128)),
    ]:
        owner = SimpleNamespace(config=config, validate_input_values=True)
        input_ids = torch.randint(0, config.vocab_size, shape)
        token_type_ids, mask = torch.zeros_like(input_ids), torch.ones_like(input_ids)

        def check():
            BertPkmModel._check_inputs(owner, input_ids, mask, token_type_ids, None, None, 0)

        rows.append((name, shape, timed(check, repeats * 20)))
    return rows


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    threads, repeats = torch.get_num_threads(), args.repeats
    print(f"torch {torch.__version__}, {threads} threads, CPU; median [min, max] of {repeats} runs (checks: x20)\n")
    print("| memory layer | tokens | check alone | the query BatchNorm alone | training step (fwd+bwd) | without check |")
    print("|---|---|---|---|---|---|")
    for name, tokens, t in memory_rows(args.repeats):
        print(f"| {name} | {tokens} | {ms(t['check'])} | {ms(t['batchnorm'])} | {ms(t['step'])} | {ms(t['unchecked'])} |")
    print("\n| model input check | batch | check (shapes + one aminmax sync) |")
    print("|---|---|---|")
    for name, shape, check in input_rows(args.repeats):
        print(f"| {name} | {shape} | {ms(check)} |")


if __name__ == "__main__":
    main()
