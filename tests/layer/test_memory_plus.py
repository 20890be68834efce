"""Memory+ and the modern options (issue 16): shared values, swilu, qk-norm, ReLU scores, memory scale.

Every option is checked against a reference formula written here (brute force over all n_keys² slots), in the fast
CPU paths and in the reference paths, forward and gradients, dense and sparse value gradients."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import BertConfig, BertForMaskedLM

from helpers import REPO_ROOT, BertPkmModelTester, load_script, lookup_plans, tiny_config
from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM, BertPkmModel
from modeling_pkm_bert.hub.conversion import convert_to_pkm
from modeling_pkm_bert.analysis.memory_usage import track_memory_usage
from modeling_pkm_bert.methods.optimizers import (
    SparseRowAdam,
    pkm_param_groups,
    pkm_value_parameters,
    set_sparse_values,
)
from modeling_pkm_bert.product_key_memory import ProductKeyMemory, ProductKeyValues
from modeling_pkm_bert.product_key_memory_ops import use_plan
from modeling_pkm_bert.methods.optimizers.scripts import clip_memory_gradients
from modeling_pkm_bert.training import add_pkm_arguments, pkm_kwargs_from_args


DIM, N_KEYS, HEADS, KNN, K_DIM = 12, 6, 2, 4, 8
OPTIONS = {
    "qk_norm": dict(qk_norm=True),
    "relu": dict(score_activation="relu"),
    "swilu": dict(output_gate="swilu"),
    "scale": dict(memory_scale=0.3),
    "all": dict(qk_norm=True, score_activation="relu", output_gate="swilu", memory_scale=-0.7),
}
ALL_CONFIG = dict(
    pkm_shared_values=True, pkm_output_gate="swilu", pkm_qk_norm=True, pkm_score_activation="relu", pkm_memory_scale=0.5
)


def make_memory(values=None, sparse=None, **options) -> ProductKeyMemory:
    memory = ProductKeyMemory(
        DIM, DIM, n_keys=N_KEYS, heads=HEADS, knn=KNN, k_dim=K_DIM, query_batchnorm=False, values=values,
        sparse=sparse, **options,
    )
    with torch.no_grad():  # off their initial values, so that a wrong parameter use shows
        for name, parameter in memory.named_parameters():
            if "norm" in name or "output_proj" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return memory


def reference(memory: ProductKeyMemory, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The memory written out: all n_keys² product-key scores, their top-knn per head, then the options."""
    half = K_DIM // 2
    halves = memory.query_proj(x).view(-1, HEADS, 2, half)
    keys = memory.keys  # (heads, 2, n_keys, half)
    if memory.qk_norm:
        halves = F.layer_norm(halves, (half,), memory.query_norm.weight, memory.query_norm.bias)
        keys = F.layer_norm(keys, (half,), memory.key_norm.weight, memory.key_norm.bias)
    first = torch.einsum("thd,hnd->thn", halves[:, :, 0], keys[:, 0])
    second = torch.einsum("thd,hnd->thn", halves[:, :, 1], keys[:, 1])
    products = (first[..., :, None] + second[..., None, :]).flatten(-2)  # slot i1 * n_keys + i2
    scores, slots = products.topk(KNN, dim=-1)
    weights = F.relu(scores) if memory.score_activation == "relu" else scores.softmax(-1)
    out = (weights[..., None] * table[slots]).sum((1, 2))
    if memory.output_gate == "swilu":
        out = F.linear(out * F.silu(x @ memory.gate_proj.weight.t()), memory.output_proj.weight, memory.output_proj.bias)
    if memory.memory_scale is not None:
        out = out * memory.memory_scale
    return out


@pytest.fixture
def plan(request):
    """The lookup plan a test runs (`helpers.lookup_plans()`, by name), for the test's duration."""
    with use_plan(lookup_plans()[request.param]):
        yield request.param


def gradients(module_list, x, outputs):
    torch.manual_seed(1)
    loss = sum((out * torch.randn_like(out)).sum() for out in outputs)
    params = {id(p): p for m in module_list for p in m.parameters()}
    grads = torch.autograd.grad(loss, [x, *params.values()], allow_unused=True)
    return [g.to_dense() if g is not None and g.is_sparse else g for g in grads]


@pytest.mark.parametrize("plan", ["cpu", "reference"], indirect=True)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_equals_reference_formula(option, sparse, plan):
    memory = make_memory(sparse=sparse, **OPTIONS[option])
    x = torch.randn(9, DIM, requires_grad=True)
    out = memory(x)
    expected = reference(memory, x, memory.values.weight)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(gradients([memory], x, [out]), gradients([memory], x, [expected])):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("plan", ["cpu", "reference"], indirect=True)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_shared_table_gradient_is_the_sum_over_memories(sparse, plan):
    table = ProductKeyValues(N_KEYS**2, DIM, sparse=sparse)
    first = make_memory(values=table, **OPTIONS["all"])
    second = make_memory(values=table, qk_norm=True, output_gate="swilu")
    assert first.values is second.values is table
    assert not first.owns_values
    x = torch.randn(7, DIM, requires_grad=True)
    outs = [first(x), second(x.flip(0))]
    refs = [reference(first, x, table.weight), reference(second, x.flip(0), table.weight)]
    got, want = gradients([first, second], x, outs), gradients([first, second], x, refs)
    for g, w in zip(got, want):
        # the softmax memory's key_norm.bias shifts every score of a head alike, so its gradient is zero: rounding
        # (~1e-6, the CPU's kernels decide) against rounding, measured on the scale of the other gradients (1-160)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 if w.abs().max() > 1e-5 else 1e-5)
    # the table's gradient: that of each memory alone, summed
    g_first = torch.autograd.grad(reference(first, x, table.weight).square().sum(), table.weight)[0]
    g_second = torch.autograd.grad(reference(second, x.flip(0), table.weight).square().sum(), table.weight)[0]
    g_both = torch.autograd.grad((first(x).square().sum() + second(x.flip(0)).square().sum()), table.weight)[0]
    g_both = g_both.to_dense() if g_both.is_sparse else g_both
    assert g_first.abs().sum() > 0 and g_second.abs().sum() > 0
    torch.testing.assert_close(g_both, g_first + g_second, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_shared_table_gradient_with_gradient_checkpointing_equals_without(sparse):
    """Checkpointing recomputes the lookups in the backward pass (use_reentrant=True: each layer in a nested pass of its
    own): the shared table's gradient stays that of the plain backward, bitwise."""
    import copy

    torch.manual_seed(0)
    base = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 1, 2], pkm_shared_values=True))
    ids = torch.randint(5, 99, (4, 8))

    def table_gradient(use_reentrant=None):
        model = copy.deepcopy(base).train()
        set_sparse_values(model, sparse)
        torch.manual_seed(1)  # the same dropout masks (checkpointing replays the RNG state)
        if use_reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            model.enable_input_require_grads()
        model(input_ids=ids, labels=ids).loss.backward()
        grad = model.bert.encoder.layer[0].memory.values.weight.grad
        return grad.to_dense() if sparse else grad

    expected = table_gradient()
    assert expected.abs().sum() > 0
    for use_reentrant in (False, True):
        assert torch.equal(table_gradient(use_reentrant), expected), use_reentrant


def test_qk_norm_search_is_exact_over_the_normalised_keys():
    memory = make_memory(qk_norm=True)
    queries = torch.randn(5, 3, HEADS, K_DIM)
    scores, indices = memory.search(queries)
    half = K_DIM // 2
    halves = memory.query_norm(queries.view(5, 3, HEADS, 2, half))
    keys = memory.scoring_keys()
    products = (
        torch.einsum("bthd,hnd->bthn", halves[..., 0, :], keys[:, 0])[..., :, None]
        + torch.einsum("bthd,hnd->bthn", halves[..., 1, :], keys[:, 1])[..., None, :]
    ).flatten(-2)
    best, slots = products.topk(KNN, dim=-1)
    torch.testing.assert_close(scores, best)
    assert torch.equal(indices.sort(-1).values, slots.sort(-1).values)


def test_options_off_keep_the_module_unchanged():
    memory = ProductKeyMemory(DIM, n_keys=N_KEYS, heads=HEADS, knn=KNN, k_dim=K_DIM)
    names = {name for name, _ in memory.named_parameters()}
    assert names == {"query_proj.weight", "query_proj.bias", "query_batchnorm.weight", "query_batchnorm.bias", "keys",
                     "values.weight"}
    assert memory.memory_scale is None and memory.owns_values


def test_bad_options_are_named():
    table = ProductKeyValues(N_KEYS**2, DIM)
    with pytest.raises(ValueError, match=r"values: a shared table of shape \(36, 12\).*n_keys=4"):
        ProductKeyMemory(DIM, DIM, n_keys=4, heads=HEADS, knn=KNN, k_dim=K_DIM, values=table)
    for bad in (0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="memory_scale"):
            make_memory(memory_scale=bad)
        with pytest.raises(ValueError, match="pkm_memory_scale"):
            tiny_config(pkm_memory_scale=bad)
    with pytest.raises(ValueError, match="score_activation"):
        make_memory(score_activation="gelu")
    with pytest.raises(ValueError, match="output_gate"):
        make_memory(output_gate="glu")
    with pytest.raises(ValueError, match="pkm_output_gate"):
        tiny_config(pkm_output_gate="glu")
    with pytest.raises(ValueError, match="pkm_score_activation"):
        tiny_config(pkm_score_activation="sigmoid")
    # swilu in place of the FFN cannot start function-preserving: a zero start is refused there (the documented rule)
    with pytest.raises(ValueError, match="pkm_output_gate='swilu'.*replace.*function-preserving"):
        tiny_config(pkm_output_gate="swilu", pkm_mode="replace", pkm_value_init="zeros")
    tiny_config(pkm_output_gate="swilu", pkm_mode="replace")  # with normal values it is a valid model


def test_bert_shares_one_table_saved_once_and_reloads(tmp_path):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], **ALL_CONFIG)).eval()
    memories = [model.bert.encoder.layer[i].memory for i in (0, 2)]
    assert memories[0].values is memories[1].values
    assert memories[0].keys is not memories[1].keys
    # the options' own initialisation survives BERT's _init_weights
    torch.testing.assert_close(memories[0].query_norm.weight, torch.full((8,), 8**-0.25))
    assert memories[0].memory_scale.item() == 0.5 and memories[0].output_proj.bias.abs().max() == 0
    input_ids = torch.tensor([[2, 7, 8, 9, 3, 0], [2, 10, 11, 12, 13, 3]])
    with torch.no_grad():
        expected = model(input_ids, attention_mask=(input_ids != 0).long()).logits
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        value_keys = [k for k in f.keys() if k.endswith("values.weight")]
    assert value_keys == ["bert.encoder.layer.0.memory.values.weight"]
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path).eval()
    layers = loaded.bert.encoder.layer
    assert layers[0].memory.values is layers[2].memory.values
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids, attention_mask=(input_ids != 0).long()).logits, expected)
    moved = loaded.to(torch.float64)
    assert moved.bert.encoder.layer[0].memory.values is moved.bert.encoder.layer[2].memory.values
    assert moved.bert.encoder.layer[2].memory.values.weight.dtype == torch.float64
    # a shared-values checkpoint into a config without it, and the reverse: errors naming the field
    with pytest.raises(ValueError, match="pkm_shared_values=True"):
        BertPkmForMaskedLM.from_pretrained(tmp_path, pkm_shared_values=False)
    separate = tmp_path / "separate"
    BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).save_pretrained(separate)
    with pytest.raises(ValueError, match="separate value table per memory.*pkm_shared_values=False"):
        BertPkmForMaskedLM.from_pretrained(separate, pkm_shared_values=True)


REMOTE_SCRIPT = r"""
import json, sys
sys.modules["modeling_pkm_bert"] = None
import torch
from transformers import AutoModelForMaskedLM
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
layers = model.bert.encoder.layer
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(ids, attention_mask=(ids != 0).long()).logits
print("RESULT" + json.dumps({"module": type(model).__module__, "shared": layers[0].memory.values is layers[2].memory.values,
                             "logits": logits.tolist()}))
"""


def test_remote_code_load_keeps_the_options(tmp_path):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], **ALL_CONFIG)).eval()
    model.save_pretrained(tmp_path)
    input_ids = [[2, 7, 8, 9, 3, 0], [2, 10, 11, 12, 13, 3]]
    with torch.no_grad():
        ids = torch.tensor(input_ids)
        expected = model(ids, attention_mask=(ids != 0).long()).logits
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path), json.dumps(input_ids)],
        capture_output=True, text=True, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                                           "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.split("RESULT", 1)[1])
    assert out["module"].startswith("transformers_modules") and out["shared"]
    torch.testing.assert_close(torch.tensor(out["logits"]), expected)


@pytest.mark.slow  # torch.compile of each option (up to 2.4 s a case on 2 loaded cores)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_torch_compile_each_option(option):
    memory = make_memory(**OPTIONS[option]).train()
    compiled = torch.compile(memory, backend="aot_eager")
    x = torch.randn(2, 5, DIM, requires_grad=True)
    eager_out = memory(x)
    eager = gradients([memory], x, [eager_out])
    compiled_out = compiled(x)
    torch.testing.assert_close(compiled_out, eager_out)
    for got, want in zip(gradients([memory], x, [compiled_out]), eager):
        torch.testing.assert_close(got, want)


def test_torch_compile_memories_sharing_a_table():
    table = ProductKeyValues(N_KEYS**2, DIM)
    memories = torch.nn.ModuleList([make_memory(values=table, **OPTIONS["all"]), make_memory(values=table)]).train()

    def run(x):
        return memories[1](memories[0](x) + x)

    x = torch.randn(2, 5, DIM)
    (eager,) = torch.autograd.grad(run(x).square().sum(), table.weight)
    (got,) = torch.autograd.grad(torch.compile(run, backend="aot_eager")(x).square().sum(), table.weight)
    torch.testing.assert_close(got, eager)


def tiny_bert():
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
                        max_position_embeddings=64)
    return BertForMaskedLM(config).eval()


@pytest.mark.parametrize("options", [ALL_CONFIG, dict(pkm_output_gate="swilu"), dict(pkm_memory_scale=0.01)],
                         ids=["all", "swilu", "scale"])
def test_conversion_with_zero_values_is_function_preserving(options):
    source = tiny_bert()
    model, report = convert_to_pkm(source, pkm_layers=[0, 2], pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=16,
                                   pkm_value_init="zeros", **options)
    input_ids = torch.randint(5, 99, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, source(input_ids).logits, rtol=0, atol=0)
    if options.get("pkm_shared_values"):
        assert report.memory_value_parameters == 64 * 32  # one table, counted once
    # not a dead start: the values get a gradient
    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    assert model.bert.encoder.layer[0].memory.values.weight.grad.abs().sum() > 0


def test_conversion_of_real_minilm_with_all_options(minilm_path):
    from transformers import AutoModel, AutoTokenizer

    source = AutoModel.from_pretrained(minilm_path).eval()
    model, _ = convert_to_pkm(source, pkm_layers=[2, 4], pkm_n_keys=16, pkm_knn=8, pkm_value_init="zeros", **ALL_CONFIG)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    batch = tokenizer(["Call me Ishmael.", "It is a truth universally acknowledged."], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).last_hidden_state, source(**batch).last_hidden_state, rtol=0, atol=0)
    assert model.encoder.layer[2].memory.values is model.encoder.layer[4].memory.values


def test_optimizer_groups_sparse_update_and_clipping_hold_the_table_once():
    from accelerate import Accelerator

    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], **ALL_CONFIG))
    table = model.bert.encoder.layer[0].memory.values.weight
    assert pkm_value_parameters(model) == [table]
    groups = {g["name"]: g["params"] for g in pkm_param_groups(model, lr=1e-3, weight_decay=0.01)}
    assert [id(p) for p in groups["pkm_values"]] == [id(table)]
    scales = {id(m.memory_scale) for m in (model.bert.encoder.layer[i].memory for i in (0, 2))}
    assert scales <= {id(p) for p in groups["no_decay"]}  # a scale is not decayed toward 0
    accelerator = Accelerator(cpu=True)
    input_ids = torch.randint(5, 99, (4, 8))
    for sparse in (False, True):
        set_sparse_values(model, sparse)
        model.zero_grad(set_to_none=True)
        model(input_ids, labels=input_ids).loss.backward()
        grad = table.grad.to_dense() if table.grad.is_sparse else table.grad.clone()
        assert table.grad.is_sparse == sparse
        norm = clip_memory_gradients(accelerator, model, None, 1e-4)
        torch.testing.assert_close(norm, grad.norm())
        clipped = table.grad.to_dense() if table.grad.is_sparse else table.grad
        torch.testing.assert_close(clipped.norm(), torch.tensor(1e-4), rtol=1e-3, atol=0)
        before = table.detach().clone()
        SparseRowAdam([table], lr=1e-2).step()
        changed = (table.detach() != before).any(1)
        assert torch.equal(changed, grad.ne(0).any(1))  # exactly the rows either memory read
    assert clip_memory_gradients(accelerator, model, None, None) is None


def test_memory_usage_per_layer_and_for_the_shared_table():
    model = BertPkmModel(tiny_config(pkm_layers=[0, 2], **ALL_CONFIG)).eval()
    with track_memory_usage(model) as tracker, torch.no_grad():
        model(torch.randint(5, 99, (3, 7)))
    results = tracker.results()
    assert list(results) == ["layer_0", "layer_2", "shared_values"]
    assert results["layer_0"]["tokens"] == results["layer_2"]["tokens"] == 21
    assert results["shared_values"]["tokens"] == 42
    assert results["shared_values"]["mu"] >= max(results["layer_0"]["mu"], results["layer_2"]["mu"])


def test_flags_for_every_option():
    parser = add_pkm_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        "--pkm_shared_values true --pkm_output_gate swilu --pkm_qk_norm true --pkm_score_activation relu "
        "--pkm_memory_scale 0.01 --memory_max_grad_norm 1.0".split()
    )
    assert pkm_kwargs_from_args(args) == dict(
        pkm_shared_values=True, pkm_output_gate="swilu", pkm_qk_norm=True, pkm_score_activation="relu",
        pkm_memory_scale=0.01,
    )
    assert args.memory_max_grad_norm == 1.0
    BertPkmConfig(**pkm_kwargs_from_args(args))
    for bad in ("--pkm_output_gate glu", "--pkm_score_activation gelu", "--memory_max_grad_norm -1",
                "--memory_max_grad_norm nan", "--pkm_qk_norm maybe"):
        with pytest.raises(SystemExit):
            parser.parse_args(bad.split())
    # the scripts' one clipping call: the memory optimizer's hook, which the training loop's step runs
    hook = REPO_ROOT / "modeling_pkm_bert" / "methods" / "optimizers" / "training_method.py"
    assert hook.read_text().count("clip_memory_gradients(") == 1


def test_staleness_of_a_shared_table_is_per_memory():
    from modeling_pkm_bert.analysis.staleness import NEVER, StalenessTracker, top1_slots

    model = BertPkmModel(tiny_config(pkm_layers=[0, 2], **ALL_CONFIG)).train()
    tracker = StalenessTracker(model).attach()
    tracker.step = 1
    memories = {f"layer_{i}": model.encoder.layer[i].memory for i in (0, 2)}
    active, reads = {}, {name: [] for name in memories}
    for name, memory in memories.items():
        memory.register_forward_pre_hook(lambda module, args, name=name: active.update(name=name))
    memories["layer_0"].values.register_forward_hook(
        lambda module, args, kwargs, out: reads[active["name"]].append((args[0], kwargs["per_sample_weights"])),
        with_kwargs=True,
    )
    model(torch.randint(5, 99, (2, 6)))
    for name, last in tracker.last_top1_step.items():
        expected = torch.cat([top1_slots(indices, weights) for indices, weights in reads[name]]).unique()
        assert torch.equal((last != NEVER).nonzero().squeeze(1), expected.sort().values)


def test_run_mlm_trains_memory_plus_from_flags_and_clips_the_values(tmp_path, monkeypatch):
    run_mlm = load_script("run_mlm")
    BertPkmModelTester().get_tokenizer("train", 200).save_pretrained(tmp_path / "bert")
    BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=64).save_pretrained(tmp_path / "bert")
    norms = []

    def recording_clip(accelerator, model, memory_optimizer, max_norm, *args, **kwargs):
        norm = clip_memory_gradients(accelerator, model, memory_optimizer, max_norm, *args, **kwargs)
        norms.append((max_norm, norm))
        return norm

    # the memory optimizer's hook clips in the loop
    monkeypatch.setattr("modeling_pkm_bert.methods.optimizers.scripts.clip_memory_gradients", recording_clip)
    flags = (
        "--pkm_layers 0 2 --pkm_n_keys 8 --pkm_knn 4 --pkm_heads 2 --pkm_k_dim 16 --pkm_shared_values true "
        "--pkm_output_gate swilu --pkm_qk_norm true --pkm_score_activation relu --pkm_memory_scale 0.1 "
        "--memory_max_grad_norm 1e-3 --memory_optimizer sparse_row_adam --max_train_steps 2 --max_train_samples 8 "
        "--max_eval_samples 4 --max_seq_length 32 --per_device_train_batch_size 4 --seed 3"
    )
    args = ["--config_name", str(tmp_path / "bert"), "--tokenizer_name", str(tmp_path / "bert"),
            "--output_dir", str(tmp_path / "out"), *flags.split()]
    results = run_mlm.main(args)
    assert len(norms) == 2 and all(max_norm == 1e-3 and norm > 0 for max_norm, norm in norms)
    assert results["eval_memory/shared_values/tokens"] == 2 * results["eval_memory/layer_0/tokens"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["pkm_shared_values"] and config["pkm_output_gate"] == "swilu" and config["pkm_memory_scale"] == 0.1
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path / "out")
    assert loaded.bert.encoder.layer[0].memory.values is loaded.bert.encoder.layer[2].memory.values


def test_options_benchmark_section_measures_every_variant_against_the_default(monkeypatch):
    from benchmarks.speed import options as bench
    monkeypatch.setattr(bench, "PAPER", dict(n_keys=16, heads=2, knn=4, k_dim=16))
    lines = bench.section_options(argparse.Namespace(quick=True, threads=1, options_batch=(2, 8)))
    rows = [line for line in lines if line.startswith("| ") and "ms" not in line and "---" not in line]
    assert len(rows) == len(bench.OPTION_VARIANTS)
    assert rows[0].endswith("| 1.00; 1.00 |")  # the default against itself


def test_shared_table_benchmark_section_compares_dense_and_sparse_gradients(monkeypatch):
    from benchmarks.speed import shared as bench
    monkeypatch.setattr(bench, "PAPER", dict(n_keys=16, heads=2, knn=4, k_dim=16))
    lines = bench.section_shared(argparse.Namespace(quick=True, threads=1, options_batch=(2, 8)))
    rows = [line for line in lines if line.startswith("| ") and "ms" not in line and "---" not in line]
    assert [row.split(" | ")[:2] for row in rows] == [
        [f"| {kind}", label]
        for kind in ("dense", "sparse (`sparse=True`)")
        for label in ("a table each (2 x 1 MiB)", "one shared table (1 MiB)")
    ]
    assert rows[0].endswith("| 1.00; 1.00 |") and rows[2].endswith("| 1.00; 1.00 |")  # own tables against themselves


def test_memory_plus_report_lists_every_finished_run(tmp_path):
    mp = load_script("runner", folder="benchmarks/studies/memory_plus")
    args = argparse.Namespace(
        output_dir=str(tmp_path), seeds=[0, 1], max_train_steps=5, max_seq_length=16, per_device_train_batch_size=2,
        learning_rate=1e-4, num_warmup_steps=1, memory_optimizer="adam",
    )
    for arm, perplexity in zip(mp.ARMS, (10.0, 20.0)):
        run = mp.run_dir(args, arm, 0)
        run.mkdir(parents=True)
        results = {f"eval_{name}_perplexity": perplexity for name in mp.SETS}
        results |= {f"initial_eval_{name}_perplexity": 100.0 for name in mp.SETS}
        results |= {f"eval_memory/layer_2/{k}": v for k, v in dict(tokens=8, mu=0.5, top1_mu=0.1, kl_u=1, kl_w=2).items()}
        (run / "all_results.json").write_text(json.dumps(results))
    report = mp.write_report(args, "/somewhere/minilm", {})
    assert report.count("--seed 1") == 2 and "/somewhere" not in report and str(tmp_path) not in report
    assert "| ResM | 0 | 100.0 | 10.0 | 100.0 | 10.0 |" in report
    assert "| ResM + shared values + swilu + qk-norm | 1 | 20.0 | 20.0 |" in report  # one seed finished per arm
