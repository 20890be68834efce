"""A masked-LM training step of ResM-BERT-base (memories at layers 4 and 8, beside the FFN) against BERT-base on a GPU,
in bf16 autocast and fp32: forward, backward and the optimizer steps (AdamW; the values in Adam at lr 1e-3, dense, or
SparseRowAdam, sparse), random weights and tokens, batch 32 x 128. Interleaved rounds, CUDA-synchronised medians,
time ratios paired per round (ResM / BERT: the cost of the memories in training).

    python -m benchmarks.speed.gpu_train_step                  # on a CUDA machine (benchmarks/gpu_check.sh runs it)
    python -m benchmarks.speed.gpu_train_step --device cpu --size tiny --rounds 1 --batch 2   # a smoke run (the tests)
"""

import argparse
import sys

import torch

from benchmarks import harness  # the timing helpers
from benchmarks.speed import common  # the models, optimizers and batches of the speed section `train`


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=1000)


def build(kind: str, size: str):
    if size == "base":
        return common.build_mlm(kind)
    import transformers

    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM
    from modeling_pkm_bert.methods.optimizers.memory_optimizer import set_sparse_values

    torch.manual_seed(3)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**TINY))
    config = BertPkmConfig(**TINY, pkm_layers=[1], pkm_mode="resm", pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=16)
    model = BertPkmForMaskedLM(config)
    set_sparse_values(model, kind == "resm_sparse")
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=["base", "tiny"], default="base")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--precisions", nargs="*", default=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_train_step.py times CUDA steps: no CUDA device here (--device cpu --size tiny for a smoke run)")
    vocab = 1000 if args.size == "tiny" else 30000
    batch = {k: v.clamp(max=vocab - 1).to(args.device) for k, v in common.mlm_batch(args.batch).items()}
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"], -100)
    kinds = ["bert", "resm_dense", "resm_sparse"]
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}; torch {torch.__version__}")
    print("\n| precision | model | median ms | time / BERT (paired) |\n|---|---|---|---|")
    for precision in args.precisions:
        steps = {}
        for kind in kinds:
            model = build(kind, args.size).to(args.device).train()
            optimizers = common.make_optimizers(model, kind)
            step = common.train_step_fn(model, optimizers, batch)

            def run(step=step):
                with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    step()

            for _ in range(2):  # optimizer state, buffers
                run()
            steps[kind] = common.synchronized(run, args.device)
        samples = harness.interleaved(steps, rounds=args.rounds, warmup=1)
        for kind in kinds:
            ratio = harness.paired_ratio(samples, kind, "bert")
            print(f"| {precision} | {kind} | {harness.median(samples[kind]) * 1e3:.1f} | {ratio:.2f} |", flush=True)
        steps = samples = None  # the models go before the next precision's


if __name__ == "__main__":
    main()
