"""The arithmetic behind benchmarks/RESULTS.md: interleaved rounds, paired ratios, verdicts, the memories' share."""

import argparse
import sys
import time

import pytest
import torch

from modeling_pkm_bert import BertPkmConfig, BertPkmModel


@pytest.fixture(scope="module")
def bench():
    """The names of the speed package that these tests read (the harness, the sections, RESULTS.md's format) in one
    namespace; a test that replaces a name patches the module that uses it."""
    import types

    from benchmarks import harness, speed
    from benchmarks.speed import overhead, results, table1, trainer

    names = {}
    for module in (harness, speed, table1, overhead, trainer, results):
        names |= {name: value for name, value in vars(module).items() if not name.startswith("__")}
    return types.SimpleNamespace(**names)


def test_interleaved_runs_every_function_each_round_in_rotated_order(bench):
    calls = []
    functions = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    prepared = []
    samples = bench.interleaved(functions, rounds=4, warmup=2, before=prepared.append)
    assert calls[:6] == list("abcabc")  # the warm-up, untimed
    assert calls[6:] == list("abc" "bca" "cab" "abc")  # each round starts one later: no variant always runs first
    assert prepared == calls  # `before` precedes every call
    assert {name: len(times) for name, times in samples.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for times in samples.values() for t in times)


def test_interleaved_times_each_call_separately(bench):
    samples = bench.interleaved({"slow": lambda: time.sleep(0.02), "fast": lambda: None}, rounds=3, warmup=0)
    assert min(samples["slow"]) >= 0.02
    assert max(samples["fast"]) < 0.02


def test_ratios_pair_the_rounds(bench):
    samples = {"bert": [1.0, 2.0, 4.0], "resm": [1.25, 2.0, 5.0]}
    # per-round ratios 0.8, 1.0, 0.8: the paired median is 0.8, whatever the medians of the columns (2.0 / 2.0 = 1.0)
    assert bench.paired_ratio(samples, "bert", "resm") == pytest.approx(0.8)
    assert bench.paired_ratio(samples, "resm", "bert") == pytest.approx(1.25)
    assert bench.min_ratio(samples, "bert", "resm") == pytest.approx(1.0 / 1.25)


@pytest.mark.parametrize(
    "paired, implied, expected",
    [(0.96, 0.951, "met"), (0.95, 0.95, "met"), (0.946, 0.951, "unclear"), (0.951, 0.949, "unclear"), (0.94, 0.949, "not met")],
)
def test_verdict_needs_both_estimates(bench, paired, implied, expected):
    assert bench.verdict(paired, implied) == expected


def test_verdict_takes_the_gpu_target(bench):
    assert bench.verdict(0.91, 0.92, target=0.9) == "met"
    assert bench.verdict(0.91, 0.92) == "not met"


def test_a_lower_peak_must_clear_the_noise(bench):
    MiB = 2**20
    assert bench.clearly_lower(1591 * MiB, [2091 * MiB, 2061 * MiB])  # sparse mode in RESULTS.md
    assert not bench.clearly_lower(2062 * MiB, [2091 * MiB, 2061 * MiB])  # dense: above one peer
    assert not bench.clearly_lower(2050 * MiB, [2091 * MiB, 2061 * MiB])  # 11 MiB lower: within the noise
    assert bench.clearly_lower(2050 * MiB, [2091 * MiB, 2061 * MiB], noise=10 * MiB)


# not BertPkmModelTester's model: sizes of its own (vocabulary 64, 2 layers, 8-dim keys, BERT's positions and dropout)
def tiny_model(layers):
    config = BertPkmConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        pkm_layers=layers, pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=8,
    )  # fmt: skip
    return BertPkmModel(config).eval()


def test_memory_timer_measures_a_share_of_each_call(bench):
    model = tiny_model([0, 1])
    ids = torch.randint(0, 64, (2, 16))
    timer = bench.MemoryTimer(model)
    entered = []

    def slow_down(module, args):  # registered after the timer's hook: inside the timed span
        entered.append(module)
        time.sleep(0.02)

    for memory in (m for m in model.modules() if isinstance(m, bench.ProductKeyMemory)):
        memory.register_forward_pre_hook(slow_down)

    def run():
        with torch.inference_mode():
            model(input_ids=ids)

    samples = bench.interleaved({"resm": timer.wrap(run)}, rounds=3, warmup=1)
    assert len(entered) == 2 * 4  # both memories, in the warm-up and the 3 rounds
    assert len(timer.per_call) == 4  # one entry per call, the warm-up's first
    assert all(inside >= 0.04 for inside in timer.per_call)  # the time in both memories, summed
    shares = [inside / total for inside, total in zip(timer.per_call[1:], samples["resm"])]
    assert all(0 < share < 1 for share in shares)


def test_memory_timer_of_a_model_without_memories_reads_zero(bench):
    model = tiny_model([])
    timer = bench.MemoryTimer(model)
    with torch.inference_mode():
        timer.wrap(lambda: model(input_ids=torch.randint(0, 64, (1, 8))))()
    assert timer.per_call == [0.0]


def test_trainer_section_times_both_trainers_and_measures_the_sparse_gradient(bench):
    import argparse
    import re

    args = argparse.Namespace(quick=True, threads=torch.get_num_threads(), trainer_sizes=[(32, 64)], trainer_batch=2)
    rows = [line for line in bench.section_trainer(args) if line.startswith("| 32^2 x 64 |")]
    assert len(rows) == 1
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    read = float(cells[2].rstrip("%"))
    dense_mib, sparse_mib = map(float, re.findall(r"[\d.]+", cells[3]))
    assert 0 < read <= 100 and dense_mib == 0.25 and 0 < sparse_mib  # 32^2 x 64 fp32; the sparse one measured
    assert float(cells[4]) > 0 and float(cells[5]) > 0


def test_overhead_section_counts_the_dispatched_ops_of_every_mode(bench):
    """`--sections overhead`: a row per implementation with its op count and time; ours on the reference plan (what a
    GPU runs: dense, sparse, relu scores) dispatch fewer aten ops a step than the XLM-style layer's loop over heads (the
    counts do not depend on the machine)."""
    import argparse

    lines = bench.section_overhead(argparse.Namespace(quick=True))
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith("| ") and "---" not in line}
    ops = {impl: int(rows[label][1]) for impl, label in bench.OVERHEAD_IMPLS.items()}
    assert all(count > 20 for count in ops.values()), ops
    for impl in ("dense", "sparse", "relu"):
        assert ops[impl] < ops["xlm"], (impl, ops)
    computing = {impl: int(rows[label][2]) for impl, label in bench.OVERHEAD_IMPLS.items()}
    assert all(computing[impl] < ops[impl] for impl in ops), computing  # views and allocations are not counted
    assert ops["xlm"] > ops["lucidrains"]  # its loop over heads
    assert ops["dense"] < ops["memory_plus"] and ops["memory_plus_options_only"] < ops["memory_plus"]  # the options' floor


@pytest.mark.multiprocess
def test_gpu_benchmarks_smoke_on_cpu(tmp_path):
    """The GPU scripts run their code end to end on CPU at a tiny size (on a GPU: benchmarks/gpu_check.sh)."""
    import subprocess

    from helpers import REPO_ROOT

    for command, rows in (
        (["-m", "benchmarks.speed.gpu_layer_compile", "--device", "cpu", "--size", "tiny", "--rounds", "1", "--dtypes", "float32",
          "--modes", "eager"], 5),  # lucidrains; ours dense and sparse, each on its plan and on the reference
        (["-m", "benchmarks.speed.gpu_train_step", "--device", "cpu", "--size", "tiny", "--rounds", "1", "--batch", "2",
          "--precisions", "fp32"], 3),
    ):  # fmt: skip
        result = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        table = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
        assert len(table) == 1 + rows, result.stdout  # the header and a row per step
    # gpu_check.sh runs the parts named in PARTS, each with a line in the summary, and without CUDA each says so
    env = {**__import__("os").environ, "OUT": str(tmp_path), "PARTS": "layer_compile train_step", "PYTHON": sys.executable}
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["layer_compile", "train_step"], result.stdout[-2000:]
    if not torch.cuda.is_available():
        assert "no CUDA device here" in (tmp_path / "layer_compile.log").read_text()


def test_results_keep_the_latest_run_of_each_section_and_a_history(bench, tmp_path):
    path = tmp_path / "RESULTS.md"
    bench.update_results(path, {"table1": ["## 4. Table 1", "", "first table1"]}, history="| 2026-01-01 | a | table1 |")
    bench.update_results(path, {"layer": ["## 1. layer", "", "first layer"]}, history="| 2026-01-02 | b | layer |")
    bench.update_results(path, {"table1": ["## 4. Table 1", "", "second table1"]}, history="| 2026-01-03 | c | table1 |")
    sections, history = bench.read_results(path)
    assert list(sections) == ["layer", "table1"]  # SECTIONS' order, not the order of the runs
    assert sections["table1"] == ["## 4. Table 1", "", "second table1"] and sections["layer"][-1] == "first layer"
    assert history == ["| 2026-01-01 | a | table1 |", "| 2026-01-02 | b | layer |", "| 2026-01-03 | c | table1 |"]
    text = path.read_text()
    assert text.count("## Notes") == 1 and "first table1" not in text and not (tmp_path / "RESULTS.md.tmp").exists()


def test_the_committed_results_are_in_the_writers_format(bench, tmp_path):
    """benchmarks/RESULTS.md reads back into sections and history and is rewritten unchanged (no hand edit outside a
    section would survive the next run)."""
    committed = bench.BENCHMARKS / "RESULTS.md"
    sections, history = bench.read_results(committed)
    assert set(sections) <= set(bench.SECTIONS) and {"layer", "table1"} <= set(sections) and history
    copy = tmp_path / "RESULTS.md"
    copy.write_text(committed.read_text())
    bench.update_results(copy, {})
    assert copy.read_text() == committed.read_text()


def test_a_history_row_names_the_run(bench):
    args = argparse.Namespace(sections=["layer", "table1"], quick=True, threads=1)
    machine = bench.header(args)
    row = bench.history_row(args, args.sections, machine, 125.0)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "layer table1 (quick)" and cells[5] == torch.__version__ and cells[6] == "2 min"
    assert cells[0].startswith("20") and cells[1]
