"""What the speed sections and the GPU scripts share: the layers and models they build (the paper's sizes), a
training step, a fresh worker process of the speed entry, and the CUDA timing helpers."""

import json
import os
import subprocess
import sys

import torch

from benchmarks.harness import BENCHMARKS, REPO_ROOT
# through the package: resolving these registers the native CPU selection (the modules alone would not)
from modeling_pkm_bert import ProductKeyMemory
from modeling_pkm_bert.methods.optimizers.memory_optimizer import (
    SparseRowAdam,
    pkm_param_groups,
    pkm_value_parameters,
    set_sparse_values,
)

PAPER = dict(n_keys=512, heads=4, knn=32, k_dim=256)


ENTRY = BENCHMARKS / "run_benchmarks.py"  # a worker is a fresh process of the speed entry, `--worker NAME`


def run_worker(args, worker: str, extra: list[str], env: dict | None = None) -> dict:
    threads = args["threads"] if isinstance(args, dict) else args.threads
    command = [sys.executable, str(ENTRY), "--worker", worker, "--threads", str(threads), *extra]
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=str(REPO_ROOT), timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(f"worker {worker} {extra} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def build_layer(impl: str):
    torch.manual_seed(0)
    if impl == "lucidrains":
        from product_key_memory import PKM

        return PKM(dim=768, heads=4, num_keys=512, topk=32, dim_head=128)
    if impl == "xlm":
        from benchmarks.speed.xlm_reference import XlmProductKeyMemory

        return XlmProductKeyMemory(768, 768, **PAPER)
    if impl == "ours_dense":
        return ProductKeyMemory(768, 768, **PAPER)
    if impl == "ours_sparse":
        return ProductKeyMemory(768, 768, **PAPER, sparse=True)
    raise ValueError(impl)


LAYER_IMPLS = {
    "lucidrains": "lucidrains `PKM` 0.3.0 (LayerNorm query, dense grads)",
    "xlm": "XLM-style plain torch (`benchmarks/speed/xlm_reference.py`, BN query, head loop, EmbeddingBag, dense grads)",
    "ours_dense": "ours, `ProductKeyMemory(...)` (dense value grad)",
    "ours_sparse": "ours, `ProductKeyMemory(..., sparse=True)` (sparse value grad)",
}


def with_paths(impl: str, step):
    """The step of ours on the reference plan (`use_reference()`): what a GPU runs (no fast path has shown a win there)."""
    from modeling_pkm_bert.product_key_memory_ops import use_reference

    def run():
        with use_reference():
            step()

    return run


def layer_step_fn(module, x, g):
    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        (module(x) * g).sum().backward()

    return step


TINY = dict(n_keys=8, heads=4, knn=4, k_dim=32)  # lucidrains' dim_head is a query half: 16


class MemoryPlusOptionsOnly(torch.nn.Module):
    """What the Memory+ options add to a step, alone: a Memory+ memory's qk-norms of the queries and sub-keys, its swilu
    gate and output projection and its learned scale, applied to fixed queries and a fixed read (parameters, so that
    every backward runs) without the search and lookup between them: a floor for the Memory+ row."""

    def __init__(self):
        super().__init__()
        self.memory = ProductKeyMemory(32, 32, **TINY, qk_norm=True, output_gate="swilu", memory_scale=0.01)
        self.queries = torch.nn.Parameter(torch.randn(8, TINY["heads"] * TINY["k_dim"]))
        self.read = torch.nn.Parameter(torch.randn(8, 32))

    def forward(self, hidden_states):
        memory, inputs = self.memory, hidden_states.reshape(-1, 32)
        halves = memory.query_norm(self.queries.view(-1, TINY["heads"] * 2, TINY["k_dim"] // 2))
        output = memory.output_proj(self.read * torch.nn.functional.silu(memory.gate_proj(inputs))) * memory.memory_scale
        return output.view_as(hidden_states) + (halves.sum() + memory.scoring_keys().sum())


def build_tiny_layer(impl: str):
    torch.manual_seed(0)
    if impl == "lucidrains":
        from product_key_memory import PKM

        return PKM(dim=32, heads=4, num_keys=8, topk=4, dim_head=16)
    if impl == "xlm":
        from benchmarks.speed.xlm_reference import XlmProductKeyMemory

        return XlmProductKeyMemory(32, 32, **TINY)
    if impl == "memory_plus_options_only":
        return MemoryPlusOptionsOnly()
    options = {
        "sparse": dict(sparse=True), "relu": dict(score_activation="relu"),
        "memory_plus": dict(qk_norm=True, output_gate="swilu", memory_scale=0.01),
    }.get(impl, {})  # fmt: skip
    return ProductKeyMemory(32, 32, **TINY, **options)


def build_mlm(kind: str, size: str = "base"):
    import transformers

    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    torch.manual_seed(3)
    common = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**common))
    config = BertPkmConfig(pkm_layers=[4, 8], pkm_mode="resm", **common)
    model = BertPkmForMaskedLM(config)
    set_sparse_values(model, kind == "resm_sparse")
    return model


def make_optimizers(model, kind: str):
    lr, weight_decay = 1e-4, 0.01
    if kind == "bert":
        groups = pkm_param_groups(model, lr, weight_decay)
        return [torch.optim.AdamW(groups, lr=lr)]
    main = torch.optim.AdamW(pkm_param_groups(model, lr, weight_decay, include_values=False), lr=lr)
    if kind == "resm_sparse":
        return [main, SparseRowAdam(pkm_value_parameters(model), lr=1e-3)]
    return [main, torch.optim.Adam(pkm_value_parameters(model), lr=1e-3)]  # the paper's/XLM's dense Adam


def mlm_batch(batch: int, seq: int = 128):
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(1000, 30000, (batch, seq), generator=generator)
    labels = torch.full_like(input_ids, -100)
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    labels[masked] = input_ids[masked]
    input_ids = input_ids.masked_fill(masked, 103)
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)


def train_step_fn(model, optimizers, batch):
    def step():
        loss = model(**batch).loss
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

    return step


def build_encoder(size: str, kind: str):
    import transformers

    from modeling_pkm_bert import BertPkmConfig, BertPkmModel

    dims = {"base": {}, "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)}[size]
    torch.manual_seed(5)
    if kind == "bert":
        return transformers.BertModel(transformers.BertConfig(**dims)).eval()
    layers = [4, 8] if size == "base" else [8, 16]
    return BertPkmModel(BertPkmConfig(**dims, pkm_layers=layers, pkm_mode={"pkm": "replace", "resm": "resm"}[kind])).eval()


def synchronized(function, device: str):
    def run():
        function()
        if device == "cuda":
            torch.cuda.synchronize()

    return run


def peak_allocated(function, device: str) -> float:
    """Peak bytes allocated by torch on the device during `function`, above what was allocated before (CUDA only)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    function()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def build_modernbert(kind: str):
    """ModernBERT-base's size with random weights: transformers' ModernBertModel ("plain"), ours without memories
    ("ours"), ours with ResM memories at layers 7 and 14 ([n // 3, 2n // 3] of 22; the paper's 512^2 slots, 4 heads,
    knn 32, k_dim 256) ("resm"); sdpa attention for all."""
    import transformers

    from modeling_pkm_bert import ModernBertPkmConfig, ModernBertPkmModel

    torch.manual_seed(5)
    if kind == "plain":
        return transformers.ModernBertModel(transformers.ModernBertConfig(attn_implementation="sdpa")).eval()
    layers = [] if kind == "ours" else [7, 14]
    return ModernBertPkmModel(ModernBertPkmConfig(pkm_layers=layers, pkm_mode="resm", attn_implementation="sdpa")).eval()
