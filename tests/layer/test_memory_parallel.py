"""Memory parallel (value tables sharded column-wise across processes) composed with FSDP2, on 2 CPU processes (gloo).

One spawn of 2 processes runs every distributed check (start-up dominates on 2 cores) and writes its measurements to a
JSON file; the tests read them."""

import json
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from helpers import REPO_ROOT, load_script, make_tiny_folder, remote_code_model, tiny_config, torchrun
from modeling_pkm_bert import BertPkmForMaskedLM, shard_memory_values
from modeling_pkm_bert.parallel import ShardedProductKeyValues


WORLD = 2
# sequence lengths of the 4 sequences (rank 0 gets the first 2): the ranks have different numbers of real tokens (the
# memory pads the exchanged token lists), and the same number of labels (the first 5 of each), so the mean of the two
# processes' losses is the one-process loss of the 4 sequences
LENGTHS = [8, 6, 8, 8]
LABELED = 5


def batch(vocab_size: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(LENGTHS):
        attention_mask[row, :length] = 1
    labels = torch.full_like(input_ids, -100)
    labels[:, :LABELED] = input_ids[:, :LABELED]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def config(shared: bool):
    # hidden 32 = v_dim, 2 memories (layers 0 and 2) with their own tables, or one shared table
    return tiny_config(pkm_layers=[0, 2], pkm_shared_values=shared, pkm_query_batchnorm=True)


def optimizers_for(model, memory_optimizer="adam"):
    """AdamW for the model, the values' own group at 1e-3 (Adam or SparseRowAdam), as the scripts."""
    from modeling_pkm_bert.methods.optimizers import SparseRowAdam
    from modeling_pkm_bert.methods.optimizers.scripts import optimizer_param_groups

    main, memory = optimizer_param_groups(model, weight_decay=0.01)
    memory_class = SparseRowAdam if memory_optimizer == "sparse_row_adam" else torch.optim.Adam
    return [torch.optim.AdamW(main, lr=1e-2), memory_class(memory, lr=1e-3)]


def train_steps(model, inputs, optimizers, steps=2):
    for _ in range(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        model(**inputs).loss.backward()
        for optimizer in optimizers:
            optimizer.step()


def reference(shared: bool, memory_optimizer="adam"):
    """One process, the whole batch: logits, loss, gradients, and the parameters after 2 steps."""

    torch.manual_seed(0)
    model = BertPkmForMaskedLM(config(shared)).eval()  # eval: the query BatchNorm uses its running statistics
    inputs = batch(model.config.vocab_size)
    output = model(**inputs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    logits, loss = output.logits.detach(), output.loss.detach()
    train_steps(model, inputs, optimizers_for(model, memory_optimizer))
    return model, logits, loss, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def smf_run(rank, mesh, ranker="tfidf"):
    from torch.distributed.tensor import DTensor

    from modeling_pkm_bert.parallel import fully_shard_with_memory_parallel
    from modeling_pkm_bert.methods.sparse_finetuning import (
        SparseMemoryFinetuning,
        compute_background_statistics,
        freeze_all_but_values,
    )

    runs = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = BertPkmForMaskedLM(config(False))
        inputs = batch(model.config.vocab_size)
        statistics = compute_background_statistics(model, [inputs]) if ranker != "gradient" else None
        freeze_all_but_values(model)
        if sharded:
            fully_shard_with_memory_parallel(model, mesh)
            inputs = {k: v[2 * rank : 2 * rank + 2] for k, v in inputs.items()}
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        smf = SparseMemoryFinetuning(model, statistics, top_t=5, ranker=ranker).attach(optimizer)
        chosen = []
        for _ in range(2):
            optimizer.zero_grad()
            model(**inputs).loss.backward()
            optimizer.step()
            chosen.append({name: rows.tolist() for name, rows in smf.chosen.items()})
        values = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        runs[sharded] = chosen, values
    (chosen_one, values_one), (chosen_two, values_two) = runs[False], runs[True]
    return {
        "chosen": chosen_two,
        "chosen_equal": chosen_one == chosen_two,
        "values_diff": max(float((values_two[name] - values_one[name]).abs().max()) for name in values_one),
    }


def _worker(rank, port, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from modeling_pkm_bert.parallel import (
        save_consolidated,
        fully_shard_with_memory_parallel,
        memory_parallel_parameters,
        value_bytes_per_process,
    )
    from modeling_pkm_bert.methods.optimizers.scripts import optimizer_param_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def max_diff(a, b):
        return float((full(a).detach() - b).abs().max())

    for shared in (False, True):
        ref_model, ref_logits, ref_loss, ref_grads, ref_after = reference(shared)
        torch.manual_seed(0)
        model = BertPkmForMaskedLM(config(shared)).eval()
        whole_bytes = sum(
            m.values.weight.numel() * 4 for m in {id(m.values): m for m in model.modules() if hasattr(m, "keys") and hasattr(m, "values") and hasattr(m.values, "weight")}.values()
        )
        fully_shard_with_memory_parallel(model, mesh)
        tables = {id(m) for m in model.modules() if isinstance(m, ShardedProductKeyValues)}
        inputs = {k: v[2 * rank : 2 * rank + 2] for k, v in batch(model.config.vocab_size).items()}
        output = model(**inputs)
        output.loss.backward()
        losses = [torch.zeros(()) for _ in range(WORLD)]
        dist.all_gather(losses, output.loss.detach())
        logits = [torch.zeros_like(output.logits) for _ in range(WORLD)]
        dist.all_gather(logits, output.logits.detach().contiguous())
        grads = {name: max_diff(p.grad, ref_grads[name]) for name, p in model.named_parameters()}
        local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if "values" in name}
        # 2 optimizer steps from the same start
        for p in model.parameters():
            p.grad = None
        optimizers = optimizers_for(model)
        train_steps(model, inputs, optimizers)
        after = {name: max_diff(p, ref_after[name]) for name, p in model.named_parameters()}
        # checkpoint (DCP, sharded: each process writes its shards), then a fresh sharded model resumes from it
        checkpoint = os.path.join(out_dir, f"dcp_{int(shared)}")
        state = {"model": get_model_state_dict(model), "memory_optim": get_optimizer_state_dict(model, optimizers[1])}
        dcp.save(state, checkpoint_id=checkpoint)
        torch.manual_seed(1)  # other weights: the load must replace them all
        resumed = BertPkmForMaskedLM(config(shared)).eval()
        fully_shard_with_memory_parallel(resumed, mesh)
        resumed_memory = torch.optim.Adam(optimizer_param_groups(resumed, weight_decay=0.01)[1], lr=1e-3)
        loaded = {"model": get_model_state_dict(resumed), "memory_optim": get_optimizer_state_dict(resumed, resumed_memory)}
        dcp.load(loaded, checkpoint_id=checkpoint)
        set_state_dict(resumed, resumed_memory, model_state_dict=loaded["model"], optim_state_dict=loaded["memory_optim"])
        resume_diff = max(
            float((full(a) - full(b)).abs().max())
            for a, b in zip(model.state_dict().values(), resumed.state_dict().values())
        )
        moments = [resumed_memory.state[p]["exp_avg"] for p in memory_parallel_parameters(resumed)]
        # consolidated Hub folder: the full state dict, saved by rank 0 as a normal model
        save_consolidated(model, os.path.join(out_dir, f"hub_{int(shared)}"), rank == 0)
        final_logits = model(**inputs).logits.detach()
        all_final = [torch.zeros_like(final_logits) for _ in range(WORLD)]
        dist.all_gather(all_final, final_logits.contiguous())
        if rank == 0:
            torch.save(torch.cat(all_final), os.path.join(out_dir, f"hub_{int(shared)}_logits.pt"))
        results[f"shared={shared}"] = {
            "loss_diff": float((torch.stack(losses).mean() - ref_loss).abs()),
            "logits_diff": float((torch.cat(logits) - ref_logits).abs().max()),
            "grad_diff": grads,
            "after_diff": after,
            "tables": len(tables),
            "local_value_shapes": local,
            "value_bytes": value_bytes_per_process(model),
            "whole_value_bytes": whole_bytes,
            "resume_diff": resume_diff,
            "resumed_moments_nonzero": all(float(m.to_local().abs().sum()) > 0 for m in moments),
        }
        dist.barrier()
    # SparseRowAdam on the sharded tables: the same rows on every process, whole-row second moments
    after_sparse_row = reference(False, "sparse_row_adam")[4]
    torch.manual_seed(0)
    model = BertPkmForMaskedLM(config(False)).eval()
    fully_shard_with_memory_parallel(model, mesh)
    inputs = {k: v[2 * rank : 2 * rank + 2] for k, v in batch(model.config.vocab_size).items()}
    train_steps(model, inputs, optimizers_for(model, "sparse_row_adam"))
    results["sparse_row_adam"] = {name: max_diff(p, after_sparse_row[name]) for name, p in model.named_parameters()}
    # sparse memory finetuning: the same rows chosen on every process (reads counted on each process's tokens,
    # summed), and the values after 2 steps equal the one-process run
    results["smf"] = smf_run(rank, mesh)
    # the gradient ranker: each row's norm summed over the column shards, so the same rows everywhere
    results["smf_gradient"] = smf_run(rank, mesh, "gradient")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("memory_parallel")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return out_dir, [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.multiprocess
def test_two_processes_equal_one(two_processes, shared):
    """FSDP2 + memory parallel on 2 processes: logits, loss, every gradient and the parameters after 2 steps (AdamW for
    the model, Adam at 1e-3 for the values' own group) equal the one-process run on the whole batch (fp32, 1e-5)."""
    for results in two_processes[1]:
        result = results[f"shared={shared}"]
        assert result["loss_diff"] < 1e-5 and result["logits_diff"] < 1e-5
        assert max(result["grad_diff"].values()) < 1e-5, result["grad_diff"]
        assert max(result["after_diff"].values()) < 1e-5, result["after_diff"]


@pytest.mark.multiprocess
def test_sparse_row_adam_on_sharded_tables(two_processes):
    """SparseRowAdam (the values' row-wise lazy Adam) on column shards: each process updates its columns of the rows
    touched on any process, with the whole row's second moment: 2 steps equal the one-process run."""
    for results in two_processes[1]:
        assert max(results["sparse_row_adam"].values()) < 1e-5, results["sparse_row_adam"]


@pytest.mark.multiprocess
def test_sparse_memory_finetuning_chooses_the_same_rows_everywhere(two_processes):
    """SMF under memory parallel: every process chooses the same rows (the reads of all processes' tokens, summed), the
    one-process choice, and the values after 2 restricted steps equal the one-process run."""
    ranks = two_processes[1]
    for key in ("smf", "smf_gradient"):  # the TF-IDF ranker, and the gradient ranker (row norms over the shards)
        assert ranks[0][key]["chosen"] == ranks[1][key]["chosen"]
        assert all(len(rows) == 5 for step in ranks[0][key]["chosen"] for rows in step.values())
        for results in ranks:
            assert results[key]["chosen_equal"], key
            assert results[key]["values_diff"] < 1e-5, key


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.multiprocess
def test_each_process_holds_its_columns(two_processes, shared):
    """Per-process value bytes are 1/world of the tables (measured); a shared table is sharded once."""
    for results in two_processes[1]:
        result = results[f"shared={shared}"]
        assert result["tables"] == (1 if shared else 2)
        assert result["value_bytes"] * WORLD == result["whole_value_bytes"]
        assert {tuple(shape) for shape in result["local_value_shapes"].values()} == {(64, 32 // WORLD)}


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.multiprocess
def test_checkpoint_resume_and_consolidated_folder(two_processes, shared):
    """DCP save/load of the sharded model and the values' optimizer state resumes exactly; the consolidated folder
    loads in one process, without the package (trust_remote_code), with the sharded model's outputs; and the DCP
    checkpoint of 2 processes loads into 1 (resharded by torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    out_dir, ranks = two_processes
    for results in ranks:
        assert results[f"shared={shared}"]["resume_diff"] == 0.0
        assert results[f"shared={shared}"]["resumed_moments_nonzero"]
    folder = out_dir / f"hub_{int(shared)}"
    assert (folder / "model.safetensors").is_file() and (folder / "modeling_bert_pkm.py").is_file()
    loaded = remote_code_model(folder).eval()  # the folder's code, not the package
    inputs = batch(loaded.config.vocab_size)
    with torch.no_grad():
        logits = loaded(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert (logits - torch.load(out_dir / f"hub_{int(shared)}_logits.pt")).abs().max() < 1e-5
    # world size 2 -> 1: the plain model's state dict filled from the sharded checkpoint
    plain = BertPkmForMaskedLM(config(shared))
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(out_dir / f"dcp_{int(shared)}"), no_dist=True)
    reference_state = loaded.state_dict()
    assert any("values" in name for name in state["model"])
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, reference_state[name]), name


# --- refused settings: a clear error naming the setting, nothing changed -------------------------------------------


class _FakeMesh:
    ndim = 1
    device_type = "cpu"

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def get_group(self):
        return None


def test_v_dim_not_divisible_is_refused():
    model = BertPkmForMaskedLM(tiny_config())
    memories = [m for m in model.modules() if type(m).__name__ == "ProductKeyMemory"]
    table = memories[0].values
    with pytest.raises(ValueError, match=r"v_dim=32 .*not divisible by the 3 processes"):
        shard_memory_values(model, _FakeMesh(3))
    assert memories[0].values is table  # nothing replaced


@pytest.mark.parametrize(
    "script, source", [("run_mlm", "--config_name"), ("run_mlm", "--model_name_or_path"), ("run_glue", "--model_name_or_path")]
)
def test_v_dim_the_processes_do_not_divide_is_refused_at_argument_checking(tmp_path, capsys, monkeypatch, script, source):
    """--memory_parallel on 3 processes (WORLD_SIZE, as torchrun sets it) with v_dim = hidden_size 32: one usage line
    naming both numbers, before any model is loaded (its config alone is read). --fsdp2 pads its row shards: accepted,
    and so is a number of processes that divides v_dim."""
    tiny_config().save_pretrained(tmp_path / "tiny")
    module = load_script(script)
    argv = [source, str(tmp_path / "tiny"), "--output_dir", str(tmp_path / "out")]
    argv += ["--task_name", "sst2"] if script == "run_glue" else ["--tokenizer_name", str(tmp_path / "tiny")]
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as raised:
        module.parse_args([*argv, "--memory_parallel"])
    assert raised.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--memory_parallel on 3 processes: the memories' v_dim=32 (hidden_size of" in error
    assert "is not divisible by 3" in error
    assert not (tmp_path / "out").exists()
    module.parse_args([*argv, "--fsdp2"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    module.parse_args([*argv, "--memory_parallel"])


@pytest.mark.parametrize("flag", ["--fsdp2", "--memory_parallel"])
def test_an_older_torch_is_named_at_argument_checking(tmp_path, capsys, monkeypatch, flag):
    """FSDP2 (fully_shard) is public from torch 2.6: under an older torch the flags are refused at argument checking
    with the version, not with an ImportError from deep inside; the library entry point says the same."""
    from modeling_pkm_bert.parallel import fully_shard_with_memory_parallel

    tiny_config().save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(SystemExit) as raised:
        load_script("run_mlm").parse_args(["--config_name", str(tmp_path / "tiny"), flag])
    assert raised.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag}: FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6; this is torch 2.5.1+cpu" in error
    with pytest.raises(ImportError, match=r"needs torch >= 2.6; this is torch 2.5.1"):
        fully_shard_with_memory_parallel(BertPkmForMaskedLM(tiny_config()), _FakeMesh(2))


def test_the_declared_torch_range_is_the_tested_one():
    """setup.py's torch minimum is the torch both test environments install (constraints.txt, constraints-min.txt):
    the range declares only what CI runs; and FSDP2 exists in it."""
    import ast
    import re

    from modeling_pkm_bert.parallel.arguments import FSDP2_MIN_TORCH

    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    (requirement,) = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and str(n.value).startswith("torch>=")]
    minimum = re.match(r"torch>=([\d.]+),", requirement).group(1)
    for constraints in ("constraints.txt", "constraints-min.txt"):
        pinned = re.search(r"^torch==([\d.]+)$", (REPO_ROOT / constraints).read_text(), re.MULTILINE).group(1)
        assert pinned.split(".")[:2] == minimum.split(".")[:2], (constraints, pinned, requirement)
    assert tuple(map(int, minimum.split(".")[:2])) >= FSDP2_MIN_TORCH


def test_two_dimensional_mesh_is_refused():
    model = BertPkmForMaskedLM(tiny_config())
    mesh = _FakeMesh(2)
    mesh.ndim, mesh.mesh_dim_names = 2, ("replicate", "shard")
    with pytest.raises(ValueError, match=r"2-D device mesh .*not supported yet"):
        shard_memory_values(model, mesh, mesh_dim="shard")
    assert all(type(m.values).__name__ == "ProductKeyValues" for m in model.modules() if hasattr(m, "keys") and hasattr(m, "values"))


def test_sparse_gradients_are_refused():
    model = BertPkmForMaskedLM(tiny_config())
    memories = [m for m in model.modules() if type(m).__name__ == "ProductKeyMemory"]
    memories[0].sparse_values = True
    table = memories[0].values
    with pytest.raises(ValueError, match=r"sparse=True .*memory parallel and FSDP need dense gradients"):
        shard_memory_values(model, _FakeMesh(2))
    assert memories[0].values is table


def test_sparse_gradients_under_fsdp2_are_refused():
    """FSDP2 without memory parallel: sparse value gradients are refused before anything is wrapped."""
    from modeling_pkm_bert.parallel import fully_shard_with_memory_parallel

    model = BertPkmForMaskedLM(tiny_config())
    memories = [m for m in model.modules() if type(m).__name__ == "ProductKeyMemory"]
    memories[0].sparse_values = True
    with pytest.raises(ValueError, match=r"sparse=True .*FSDP2 refuses sparse gradients"):
        fully_shard_with_memory_parallel(model, _FakeMesh(2), memory_parallel=False)
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


def test_shared_table_with_mismatched_shape_is_refused():
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], pkm_shared_values=True))
    memories = [m for m in model.modules() if type(m).__name__ == "ProductKeyMemory"]
    memories[1].v_dim = 16  # a memory that disagrees with the shared table it reads
    with pytest.raises(ValueError, match=r"shared table's shards would not match"):
        shard_memory_values(model, _FakeMesh(2))


# --- the scripts: run_mlm.py and run_clm.py under torchrun, 2 CPU processes (gloo) --------------------------------


def _script_tiny(folder):
    """The word-level tokenizer and tiny config of tests/scripts/test_run_mlm.py (memory at layer 1)."""
    return make_tiny_folder(folder)


def _launch(script, tiny, output_dir, options, processes=2):
    common = f"--config_name {tiny} --tokenizer_name {tiny} --output_dir {output_dir} --seed 3 --max_train_steps 2"
    # 9 evaluation examples at 4 a batch: shards of 5 and 4, so 2 evaluation forwards on one process and 1 on the other
    common += " --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --max_eval_samples 9"
    common += " --max_seq_length 32" if script == "run_mlm.py" else " --block_size 32"
    done = torchrun(REPO_ROOT / "run_scripts" / script, [*common.split(), *options.split()], processes)
    assert processes == 1 or ("MULTI_CPU" in done.stderr and "[RANK 1]" in done.stderr)
    return done


@pytest.fixture(scope="module")
def script_tiny(tmp_path_factory):
    return _script_tiny(tmp_path_factory.mktemp("script_tiny"))


@pytest.mark.multiprocess
def test_run_mlm_memory_parallel_trains_checkpoints_and_resumes_exactly(script_tiny, tmp_path):
    """run_mlm.py --memory_parallel on 2 processes: trains, writes sharded checkpoints (DCP) and a normal Hub folder;
    resuming from the step-1 checkpoint ends with the uninterrupted run's weights, bitwise."""
    from safetensors.torch import load_file

    options = "--max_train_samples 16 --checkpointing_steps 1 --memory_parallel"
    _launch("run_mlm.py", script_tiny, tmp_path / "straight", options)
    straight = tmp_path / "straight"
    assert json.loads((straight / "all_results.json").read_text())["step"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(straight / "step_1" / "sharded_state"))
    remote_code_model(straight)  # the folder's code, not the package
    _launch("run_mlm.py", script_tiny, tmp_path / "resumed", f"{options} --resume_from_checkpoint {straight / 'step_1'}")
    one, two = load_file(straight / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[key], two[key]) for key in one)
    # another world size: refused by the run-settings check (naming num_processes) unless --allow_inexact_resume,
    # then torch.distributed.checkpoint reshards the 2-process checkpoint into 1 process
    done = _launch(
        "run_mlm.py", script_tiny, tmp_path / "one", f"{options} --resume_from_checkpoint {straight / 'step_1'}"
        " --allow_inexact_resume", processes=1,
    )
    assert "num_processes: checkpoint 2, now 1" in done.stderr
    assert json.loads((tmp_path / "one" / "all_results.json").read_text())["step"] == 2


@pytest.mark.parametrize("flag", ["--fsdp2", "--memory_parallel"])
@pytest.mark.multiprocess
def test_run_clm_trains_with_fsdp2_and_memory_parallel(script_tiny, tmp_path, flag):
    from transformers import AutoModelForCausalLM

    _launch("run_clm.py", script_tiny, tmp_path / "out", f"{flag} --max_train_samples 16")
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert results["step"] == 2 and math.isfinite(results["perplexity"])
    AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)


def test_run_mlm_fsdp2_flag_is_in_help():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "run_scripts" / "run_mlm.py"), "--help"], capture_output=True, text=True
    )
    assert "--memory_parallel" in done.stdout and "--fsdp2" in done.stdout


def test_fsdp2_with_sparse_row_adam_is_refused_before_sharding():
    import argparse

    from modeling_pkm_bert.parallel import prepare_memory_parallel

    model = BertPkmForMaskedLM(tiny_config())
    args = argparse.Namespace(fsdp2=True, memory_parallel=False, memory_optimizer="sparse_row_adam")
    with pytest.raises(ValueError, match=r"--fsdp2 with --memory_optimizer sparse_row_adam"):
        prepare_memory_parallel(None, model, args)
    assert not type(model).__name__.startswith("FSDP")
