"""The CPU's native kernel and the plan that runs it: the product-key selection of `kernels/cpu.py`
(`csrc/product_key_select.c`, both builds) equals the torch selection (ties, skewed, NaN and infinite scores; threads;
the op's schema); `product_key_memory_ops.plan_lookup` takes it for fp32 CPU queries only and `use_reference()` never
does; the search with gradients and a few training steps under plan "cpu" equal the reference's; the build is cached,
a missing compiler or PKM_BERT_NATIVE=0 leaves the torch selection; `use_huge_pages` keeps the model it moves."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from helpers import lookup_plans
from modeling_pkm_bert import ProductKeyMemory, use_huge_pages
from modeling_pkm_bert.kernels import cpu as cpu_kernels
from modeling_pkm_bert.kernels.cpu import FLAGS, PORTABLE_FLAGS, _torch_selection, select_product_keys_native
from modeling_pkm_bert.methods.optimizers import SparseRowAdam
from modeling_pkm_bert.product_key_memory_ops import REFERENCE, plan_lookup, use_plan, use_reference

PLANS = lookup_plans()


SHAPES = [  # heads, tokens, n_keys, knn
    (4, 37, 512, 32),  # the paper's size
    (1, 5, 16, 16),  # knn = n_keys: every sub-key is a candidate
    (2, 9, 64, 5),
    (3, 7, 100, 7),  # n_keys not a multiple of the vector width
    (2, 4, 8, 1),
    (1, 3, 24, 20),  # fewer groups than 2 * knn
]


def compiled(flags):
    if cpu_kernels.library(flags) is None:
        pytest.skip(f"no C compiler could build the kernel with {' '.join(flags)} (the torch selection is used then)")
    return flags


@pytest.fixture(params=[FLAGS, PORTABLE_FLAGS], ids=["native", "portable"])
def flags(request):
    """Both builds: `-march=native` (AVX-512 paths on a CPU that has it) and the portable C paths."""
    return compiled(request.param)


def product_scores(subkey_scores):
    """All n_keys ** 2 product scores of each (token, head), slot i1 * n_keys + i2: `(tokens, heads, n_keys ** 2)`."""
    halves = subkey_scores.unflatten(0, (-1, 2))  # (heads, 2, tokens, n_keys)
    return (halves[:, 0, :, :, None] + halves[:, 1, :, None, :]).flatten(-2).transpose(0, 1)


def assert_valid_selection(subkey_scores, knn, scores, indices):
    """Scores equal the torch selection's exactly; the indices are distinct slots with those scores, and exactly torch's,
    ties included (issue 60: before, a tie at the boundary could pick another slot of equal score)."""
    reference_scores, reference_indices = _torch_selection(subkey_scores, knn)
    full = product_scores(subkey_scores)
    assert torch.equal(scores, reference_scores)
    assert torch.equal(full.gather(-1, indices), scores)
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all()
    boundary_tied = (full == scores[..., -1:]).sum(-1) > (scores == scores[..., -1:]).sum(-1)
    untied = ~boundary_tied & (scores.diff(dim=-1) != 0).all(-1)
    assert torch.equal(indices[untied], reference_indices[untied])
    assert torch.equal(indices, reference_indices)  # issue 60: ties too have one order on every path


@pytest.mark.parametrize("heads,tokens,n_keys,knn", SHAPES)
def test_native_selection_equals_torch(flags, heads, tokens, n_keys, knn):
    subkey_scores = torch.randn(heads * 2, tokens, n_keys)
    result = select_product_keys_native(subkey_scores, knn, flags)
    assert result is not None
    assert_valid_selection(subkey_scores, knn, *result)


@pytest.mark.parametrize("heads,tokens,n_keys,knn", SHAPES)
def test_native_selection_with_ties(flags, heads, tokens, n_keys, knn):
    # few distinct values: ties everywhere, also at the thresholds and between pairs
    subkey_scores = torch.randint(-2, 3, (heads * 2, tokens, n_keys)).float()
    assert_valid_selection(subkey_scores, knn, *select_product_keys_native(subkey_scores, knn, flags))


def test_native_selection_on_skewed_scores(flags):
    # the top scores all in one threshold group and sorted rows: many candidates, the quadratic ranking's worst case
    subkey_scores = torch.arange(8 * 3 * 512, dtype=torch.float32).view(8, 3, 512) % 512 / 7
    subkey_scores[:, 1] = subkey_scores[:, 1].flip(-1)
    subkey_scores[:, 2, ::64] += 1000
    assert_valid_selection(subkey_scores, 32, *select_product_keys_native(subkey_scores, 32, flags))


def test_nan_scores_fall_back_to_torch(flags):
    subkey_scores = torch.randn(8, 6, 512)
    subkey_scores[3, 2, 100] = float("nan")
    assert select_product_keys_native(subkey_scores, 32, flags) is None
    compiled(FLAGS)
    scores, indices = torch.ops.pkm_bert.select_product_keys(subkey_scores, 32)
    reference_scores, reference_indices = _torch_selection(subkey_scores, 32)
    torch.testing.assert_close(scores, reference_scores, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(indices, reference_indices)


def test_threads_split_the_tokens():
    compiled(FLAGS)
    subkey_scores = torch.randn(8, 700, 512)  # 2800 (token, head) rows: enough for 2 threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = select_product_keys_native(subkey_scores, 32)
        torch.set_num_threads(2)
        two = select_product_keys_native(subkey_scores, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_op_schema_and_fake_tensor():
    compiled(FLAGS)
    torch.library.opcheck(torch.ops.pkm_bert.select_product_keys.default, (torch.randn(4, 10, 64), 8))


def native_calls(run) -> int:
    with torch.profiler.profile() as profile:
        run()
    return len([event for event in profile.events() if "select_product_keys" in event.name])


def test_the_plan_takes_the_kernel_for_fp32_cpu_queries():
    compiled(FLAGS)
    cpu = torch.device("cpu")
    for needs_grad in (False, True):
        assert plan_lookup(cpu, torch.float32, needs_grad=needs_grad).selection == "native"
        assert plan_lookup(cpu, torch.float64, needs_grad=needs_grad).selection == "torch"
    memory = ProductKeyMemory(32, n_keys=64, heads=2, knn=8, k_dim=16).eval()
    hidden = torch.randn(2, 7, 32)
    with torch.inference_mode():
        output = memory(hidden)
        assert native_calls(lambda: memory(hidden)) == 1
        with use_reference():
            torch.testing.assert_close(output, memory(hidden), rtol=0, atol=1e-6)
            assert native_calls(lambda: memory(hidden)) == 0
    memory.train()  # with gradients: inside the search through the selected sub-keys; never in the reference
    assert native_calls(lambda: memory(hidden).sum().backward()) == 1
    with use_reference():
        assert native_calls(lambda: memory(hidden).sum().backward()) == 0


def defined_order(subkey_scores, knn):
    """The top-`knn` slots of each (token, head) by brute force over every slot, in the order ties have on every path:
    score descending, then the ranks of the two sub-keys in their half (each half ranked by score, then the lower
    index), a candidate's ranks below `knn` (`candidate_pairs`: the only slots the search considers)."""
    from modeling_pkm_bert.product_key_memory import candidate_pairs

    groups, tokens, n_keys = subkey_scores.shape
    indices = torch.empty(tokens, groups // 2, knn, dtype=torch.int64)
    for t in range(tokens):
        for h in range(groups // 2):
            first, second = subkey_scores[2 * h, t].tolist(), subkey_scores[2 * h + 1, t].tolist()
            order1 = sorted(range(n_keys), key=lambda i: (-first[i], i))
            order2 = sorted(range(n_keys), key=lambda i: (-second[i], i))
            pairs = [(order1[a], order2[b], a, b) for a, b in zip(*candidate_pairs(knn))]
            best = sorted(pairs, key=lambda p: (-(subkey_scores[2 * h, t, p[0]] + subkey_scores[2 * h + 1, t, p[1]]).item(), p[2], p[3]))
            indices[t, h] = torch.tensor([i1 * n_keys + i2 for i1, i2, _, _ in best[:knn]])
    return indices


def test_every_path_ranks_ties_alike(flags):
    """Issue 60: with duplicated sub-keys (equal scores) the native selection picked slot 23 where torch.topk picked 47,
    and the memory outputs of the native and the reference path differed by up to 1.25. Ties have one order now: each
    path's indices equal the brute-force order exactly, and the outputs agree."""
    torch.manual_seed(0)
    subkey_scores = torch.randint(-3, 4, (2 * 3, 11, 24)).float()  # ties everywhere, at every boundary
    subkey_scores[:, :, 12:] = subkey_scores[:, :, :12]  # every sub-key twice
    expected = defined_order(subkey_scores, 6)
    reference_scores, reference_indices = _torch_selection(subkey_scores, 6)
    assert torch.equal(reference_indices, expected)
    assert torch.equal(select_product_keys_native(subkey_scores, 6, flags)[1], expected)
    memory = ProductKeyMemory(32, n_keys=64, heads=4, knn=16, k_dim=16).eval()
    with torch.no_grad():
        memory.keys[:, :, 32:] = memory.keys[:, :, :32]
    hidden = torch.randn(2, 25, 32)
    with torch.no_grad():
        flat = hidden.flatten(0, 1)
        queries = memory.normalized_queries(flat, memory.query_proj(flat)).view(-1, 4, 16)
    outputs, indices = {}, {}
    plans = {**PLANS, "native without gradients": plan_lookup(torch.device("cpu"), torch.float32, needs_grad=False)}
    for name, plan in plans.items():
        with use_plan(plan), torch.no_grad():
            outputs[name], indices[name] = memory(hidden), memory.search(queries)[1]
    for name, output in outputs.items():
        assert torch.equal(indices[name], indices["reference"]), name
        torch.testing.assert_close(output, outputs["reference"], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("with_ties", [False, True])
def test_native_search_with_gradients_equals_the_torch_search(with_ties):
    """Scores, indices, and the query and key gradients of the native search (plan "cpu") vs the reference; with ties,
    where either may pick another slot of equal score, the gradients vs autograd through brute-force scores of the
    slots the native search picked."""
    compiled(FLAGS)
    torch.manual_seed(3)
    memory = ProductKeyMemory(32, n_keys=64, heads=3, knn=16, k_dim=12)
    queries = torch.randn(40, 3, 12)
    if with_ties:  # rounded keys and queries: many equal sub-key and product scores, and repeated sub-keys
        with torch.no_grad():
            memory.keys.copy_(memory.keys.mul(4).round().div(4))
        queries = queries.round()
    weights = torch.randn(40, 3, 16)
    results = []
    for plan in (PLANS["cpu"], REFERENCE):
        memory.keys.grad = None
        q = queries.clone().requires_grad_()

        def search():
            with use_plan(plan):
                scores, indices = memory.search(q)
            (scores * weights).sum().backward()
            results.append((scores.detach(), indices, q.grad, memory.keys.grad.clone()))

        assert native_calls(search) == (plan is PLANS["cpu"])
    (scores, indices, query_grad, keys_grad), (ref_scores, ref_indices, ref_query_grad, ref_keys_grad) = results
    assert torch.equal(scores, ref_scores)
    assert keys_grad.abs().sum() > 0
    if with_ties:
        assert (scores.diff(dim=-1) == 0).any()  # the case this test is for: equal scores
        assert torch.equal(indices, ref_indices)  # issue 60: ranked alike (they differed before)
        memory.keys.grad = None
        q = queries.clone().requires_grad_()
        first, second = memory.keys[:, 0], memory.keys[:, 1]  # (heads, n_keys, half)
        half = memory.k_dim // 2
        i1, i2 = indices.div(memory.n_keys, rounding_mode="floor"), indices.remainder(memory.n_keys)
        heads = torch.arange(3).view(1, 3, 1)
        slot_scores = (q[..., None, :half] * first[heads, i1]).sum(-1) + (q[..., None, half:] * second[heads, i2]).sum(-1)
        torch.testing.assert_close(slot_scores.detach(), scores, rtol=0, atol=1e-6)
        (slot_scores * weights).sum().backward()
        ref_query_grad, ref_keys_grad = q.grad, memory.keys.grad
    else:
        assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(query_grad, ref_query_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys_grad, ref_keys_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
def test_training_with_the_native_search_equals_the_torch_search_after_several_steps(sparse):
    compiled(FLAGS)
    torch.manual_seed(4)
    # no query bias: before a BatchNorm its gradient is rounding noise, which Adam would blow up to lr-sized steps
    memory = ProductKeyMemory(24, 16, n_keys=32, heads=2, knn=8, k_dim=16, query_bias=False, sparse=sparse).train()
    native, reference = copy.deepcopy(memory), copy.deepcopy(memory)
    optimizers = [
        (
            torch.optim.AdamW([p for n, p in m.named_parameters() if n != "values.weight"], lr=1e-2, foreach=False),
            SparseRowAdam([m.values.weight], lr=1e-2, exp_avg_dtype=torch.float32),
        )
        for m in (native, reference)
    ]
    for step in range(4):
        x = torch.randn(3, 10, 24)
        mask = torch.ones(3, 10)
        mask[step % 3, 6:] = 0
        for module, module_optimizers, plan in zip((native, reference), optimizers, (PLANS["cpu"], PLANS["cpu_torch_selection"])):
            with use_plan(plan):
                loss = module(x, mask).square().mean()
            loss.backward()
            for optimizer in module_optimizers:
                optimizer.step()
                optimizer.zero_grad()
    for (name, p), q in zip(native.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
        assert not torch.equal(p, memory.get_parameter(name)), name  # it trained


def test_build_is_cached_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("PKM_BERT_CACHE", str(tmp_path))
    if cpu_kernels.build_library(PORTABLE_FLAGS) is None:
        pytest.skip("no C compiler")
    built = list(tmp_path.glob("product_key_select-*.so"))
    assert len(built) == 1 and not [p for p in tmp_path.iterdir() if p.is_dir()]  # no scratch left behind
    mtime = built[0].stat().st_mtime_ns
    assert cpu_kernels.build_library(PORTABLE_FLAGS) is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_without_a_compiler_the_torch_selection_is_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PKM_BERT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    flags = ("-O2", "-fPIC", "-shared")  # a build nobody made before in this process
    with caplog.at_level("INFO", logger="modeling_pkm_bert.kernels.cpu"):
        assert select_product_keys_native(torch.randn(2, 3, 16), 4, flags) is None
    assert "could not build" in caplog.text


def test_disabled_by_environment():
    code = "import torch; from modeling_pkm_bert import BertPkmModel; print(hasattr(torch.ops.pkm_bert, 'select_product_keys'))"
    env = {**os.environ, "PKM_BERT_NATIVE": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_infinite_scores(flags):
    subkey_scores = torch.randn(4, 5, 64)
    subkey_scores[0, 1, :40] = float("inf")  # inf + (-inf) sums are NaN: the torch selection decides
    subkey_scores[1, 1, :] = float("-inf")
    subkey_scores[2, 3, :] = float("-inf")
    result = select_product_keys_native(subkey_scores, 8, flags)
    assert result is None
    clean = subkey_scores[:, [0, 2, 4]]
    clean[0, 0, :10] = float("inf")
    assert_valid_selection(clean, 8, *select_product_keys_native(clean, 8, flags))


# ---------------------------------------------------------------- huge pages


def test_use_huge_pages_moves_large_tensors_and_keeps_the_model(tmp_path):
    memory = ProductKeyMemory(64, n_keys=128, heads=2, knn=8, k_dim=16).eval()  # values: 16384 x 64 fp32, 4 MiB
    memory.register_buffer("large_buffer", torch.randn(1 << 20))  # 4 MiB
    memory.register_buffer("shared_view", memory.large_buffer[:10])  # shares its storage: both stay
    values, keys = memory.values.weight, memory.keys
    before = {name: (tensor.clone(), tensor.data_ptr()) for name, tensor in memory.state_dict().items()}
    hidden = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected = memory(hidden)
    optimizer = torch.optim.SGD(memory.parameters(), lr=0.1)

    on_huge_pages = use_huge_pages(memory, min_bytes=2 << 20)
    state = memory.state_dict()
    assert memory.values.weight is values and memory.keys is keys  # parameters keep their identity
    for name, (tensor, pointer) in before.items():
        assert torch.equal(state[name], tensor), name
        assert (state[name].data_ptr() != pointer) == (name == "values.weight"), name
    with torch.no_grad():
        assert torch.equal(memory(hidden), expected)
    memory.train()
    memory(hidden).sum().backward()
    optimizer.step()  # the optimizer still holds the moved parameter
    assert not torch.equal(memory.values.weight, before["values.weight"][0])

    if cpu_kernels._madvise() is None:
        assert on_huge_pages == 0
        pytest.skip("no transparent huge pages on this system (not Linux, or disabled): nothing else to check")
    begin, end = cpu_kernels._huge_page_range(memory.values.weight)
    assert end - begin >= 2 << 20
    assert on_huge_pages >= (end - begin) // 2  # most of the aligned range (a fragmented host may deny a few pages)
    assert cpu_kernels.huge_page_bytes([memory.values.weight]) == on_huge_pages


def test_use_huge_pages_rejects_a_bad_size():
    with pytest.raises(ValueError, match="min_bytes"):
        use_huge_pages(torch.nn.Linear(2, 2), min_bytes=-1)


def test_use_huge_pages_on_a_loaded_checkpoint(tmp_path):
    """transformers maps safetensors files into memory: the tables are copied out of the file mapping."""
    from modeling_pkm_bert import BertPkmConfig, BertPkmModel

    config = BertPkmConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        pkm_layers=[1], pkm_n_keys=256, pkm_heads=2, pkm_knn=8, pkm_k_dim=16,
    )  # fmt: skip
    BertPkmModel(config).save_pretrained(tmp_path)
    model = BertPkmModel.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(input_ids).last_hidden_state
    use_huge_pages(model, min_bytes=1 << 20)  # the 65536 x 32 value table only
    values = model.encoder.layer[1].memory.values.weight
    address = values.data_ptr()
    with open("/proc/self/maps") as maps:
        mapping = next(line for line in maps if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16))
    assert "safetensors" not in mapping
    with torch.no_grad():
        assert torch.equal(model(input_ids).last_hidden_state, expected)
