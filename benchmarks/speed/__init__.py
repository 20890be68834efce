"""Speed and memory of the product key memory, as ratios measured side by side in one run; updates RESULTS.md.

    python benchmarks/run_benchmarks.py            # the default sections (~15-20 min on 2 quiet cores)
    python benchmarks/run_benchmarks.py --quick    # a smaller version of each (~3-4 min)
    python benchmarks/run_benchmarks.py --sections layer update   # some sections only
    python benchmarks/run_benchmarks.py --sections options        # Memory+ options
    python -m benchmarks.speed --sections layer table1             # the same entry, from the repository root

RESULTS.md holds the latest run of each section (with the machine, versions, commit and load it ran on) and a history
table of every run: a run replaces the sections it ran, keeps the others, and adds a history row.

Sections:
- overhead: the host time and dispatched aten ops of a forward + backward at a tiny size (the launch-bound cost of a
  GPU step, measured on CPU): ours in each mode (dense, sparse, Memory+ options, relu scores; CPU and GPU paths)
  against lucidrains' and the XLM-style layer.
- layer: one PKM layer at the paper's size (768 in/out, 512^2 slots, 4 heads, knn 32, k_dim 256, query BN), 8x128
  tokens, forward + backward, against lucidrains' product-key-memory 0.3.0 and a plain XLM-style implementation
  (benchmarks/speed/xlm_reference.py); peak memory of each in a fresh process (VmHWM); in the full run again with
  THP_MEM_ALLOC_ENABLE=1 (huge pages for torch's CPU allocations).
- update: one value-table update (262,144 x 768) against the fraction of rows the step touched: SparseRowAdam vs
  dense torch.optim.Adam (and torch.optim.SparseAdam in the full run).
- train: a masked-LM training step of ResM-BERT-base (memories at layers 4 and 8) incl. the optimizer steps (AdamW for
  the network, SparseRowAdam for the values, sparse value gradients) vs the same step of BERT-base; the values'
  training state in bytes; peak RSS growth during a step (sampled).
- table1: Kim & Jung's Table 1 on this machine: batch/s of BERT-base/large, +PKM (memories replace the FFN) and +ResM
  (memories beside it), batch 1x128 and 32x128, eval mode, torch.inference_mode, random weights.
- gpu: where CUDA is available, the value gather (EmbeddingBag), the layer vs its peers and Table 1 on the GPU; else
  a line saying so.
- options (not in the default run): the cost of each Memory+ option.
- shared (not in the default run): two memories sharing one value table against a table each, dense and sparse gradients.
- modernbert (not in the default run): Table 1's setting for a ModernBERT-base-sized encoder (22 layers, 768 wide,
  GeGLU 1152, local/global attention, sdpa): +ResM (memories at layers 7 and 14, the paper's memory size) against
  transformers' ModernBertModel, and ModernBertPkmModel without memories against it (the cost of our copies of its blocks).
- quantized (not in the default run): the value gather and Table 1's ResM/BERT-base with fp32, bf16, int8 and 4-bit value
  tables (`quantize_memory_values`), on 4 KiB and huge pages.
- trainer (not in the default run): a Trainer step with `sparse_row_adam`, PkmTrainer's sparse value gradient against the plain
  Trainer's dense one (`pkm_optimizers`).

Every timing is a median over rounds in which the compared variants run one after the other (rotating the order);
ratios are medians of the per-round ratios. The machine may be shared: the load average is recorded.
"""

from __future__ import annotations


# The sections, one module each (`benchmarks/speed/<name>.py`, its function `section_<name>(args)` returns the section's
# lines, or None where it measured nothing here), in the order RESULTS.md lists them; True: in the default run.
SECTIONS = {
    "overhead": True,
    "layer": True,
    "update": True,
    "train": True,
    "table1": True,
    "gpu": True,
    "options": False,
    "shared": False,
    "trainer": False,
    "quantized": False,
    "modernbert": False,
}


def section(name: str):
    """The function that runs section `name` (its module is imported here: a run imports only what it measures)."""
    import importlib

    return getattr(importlib.import_module(f"benchmarks.speed.{name}"), f"section_{name}")
