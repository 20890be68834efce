import pytest
import torch

from modeling_pkm_bert import ProductKeyMemory


def brute_force_topk(memory: ProductKeyMemory, queries: torch.Tensor):
    """Scores every one of the n_keys**2 product keys of each head, slot = i1 * n_keys + i2."""
    keys = memory.keys  # (heads, 2, n_keys, half)
    n = memory.n_keys
    full_keys = torch.cat(
        [keys[:, 0].repeat_interleave(n, dim=1), keys[:, 1].repeat(1, n, 1)], dim=-1
    )  # (heads, n*n, k_dim): row i1*n+i2 = concat(keys[h,0,i1], keys[h,1,i2])
    scores = torch.einsum("...hd,hsd->...hs", queries, full_keys)
    return scores.topk(memory.knn, dim=-1)


@pytest.mark.parametrize(
    "n_keys,heads,knn,k_dim,batch_shape",
    [(8, 2, 4, 16, (5,)), (16, 4, 16, 8, (2, 3)), (6, 1, 6, 4, (7,)), (10, 3, 1, 6, (1, 4))],
)
def test_search_equals_brute_force(n_keys, heads, knn, k_dim, batch_shape):
    memory = ProductKeyMemory(12, n_keys=n_keys, heads=heads, knn=knn, k_dim=k_dim).double()
    queries = torch.randn(*batch_shape, heads, k_dim, dtype=torch.float64)
    scores, indices = memory.search(queries)
    expected_scores, expected_indices = brute_force_topk(memory, queries)
    assert scores.shape == indices.shape == (*batch_shape, heads, knn)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-12)
    # with random float64 queries there are no ties: the same slots in the same (descending) order
    assert torch.equal(indices, expected_indices)
    assert indices.min() >= 0 and indices.max() < n_keys**2


def test_search_rejects_wrong_query_shape():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=16)
    with pytest.raises(ValueError, match="heads, k_dim"):
        memory.search(torch.randn(3, 2, 15))


def test_forward_is_softmax_weighted_sum_of_value_rows_over_heads():
    memory = ProductKeyMemory(12, 10, n_keys=8, heads=3, knn=4, k_dim=8, query_batchnorm=False).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    output = memory(x)
    queries = memory.query_proj(x).unflatten(-1, (3, 8))
    scores, indices = brute_force_topk(memory, queries)
    weights = scores.softmax(-1)
    expected = (weights[..., None] * memory.values.weight[indices]).sum(dim=(-3, -2))
    assert output.shape == (2, 5, 10)
    torch.testing.assert_close(output, expected)


def test_padding_is_skipped_in_batchnorm_and_lookup():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=16).train()
    real = torch.randn(3, 4, 12)
    padded = torch.cat([real, 100 * torch.randn(3, 2, 12)], dim=1)  # huge pad activations would shift BN stats
    mask = torch.cat([torch.ones(3, 4), torch.zeros(3, 2)], dim=1)
    out_real = memory(real)
    stats_real = memory.query_batchnorm.running_mean.clone()
    memory.query_batchnorm.reset_running_stats()
    out_padded = memory(padded, mask)
    torch.testing.assert_close(out_padded[:, :4], out_real)
    assert torch.equal(out_padded[:, 4:], torch.zeros(3, 2, 12))
    torch.testing.assert_close(memory.query_batchnorm.running_mean, stats_real)


def test_all_padding_gives_zeros_and_no_nan():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=16).train()
    out = memory(torch.randn(2, 3, 12), torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3, 12))


def test_mask_shape_mismatch_is_an_error():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=16)
    with pytest.raises(ValueError, match="attention_mask"):
        memory(torch.randn(2, 3, 12), torch.ones(2, 4))
    with pytest.raises(ValueError, match="input_dim"):
        memory(torch.randn(2, 3, 11))


def test_gradients_reach_every_parameter():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=16)
    x = torch.randn(4, 6, 12, requires_grad=True)
    memory(x).square().sum().backward()
    for name, parameter in memory.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_nan_under_autocast(dtype):
    memory = ProductKeyMemory(32, n_keys=16, heads=4, knn=8, k_dim=32).train()
    x = 10 * torch.randn(4, 16, 32, requires_grad=True)
    mask = torch.ones(4, 16)
    mask[1, 9:] = 0
    with torch.autocast("cpu", dtype=dtype):
        out = memory(x, mask)
    out.float().sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in memory.parameters())



def test_search_under_bfloat16_autocast_is_exact_for_the_rounded_scores():
    """Under bf16 autocast the search ranks bf16-rounded scores (docs/scripts.md): the scores it selects are the
    top-knn of every product key's bf16 sum of sub-key scores, and each is its slot's own rounded score."""
    from modeling_pkm_bert.product_key_memory import subkey_scores

    torch.manual_seed(0)
    memory = ProductKeyMemory(12, n_keys=16, heads=2, knn=8, k_dim=16).eval()
    queries = torch.randn(40, 2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scores, indices = memory.search(queries)
        halves = subkey_scores(queries.view(40, 4, -1), memory.keys).view(2, 2, 40, 16)  # (heads, half, tokens, n_keys)
    every = (halves[:, 0, :, :, None] + halves[:, 1, :, None, :]).flatten(-2).transpose(0, 1)  # (tokens, heads, n**2)
    assert scores.dtype == torch.bfloat16
    assert torch.equal(scores, every.topk(8, dim=-1).values)
    assert torch.equal(every.gather(-1, indices), scores)


def test_initialisation_and_validation():
    memory = ProductKeyMemory(64, n_keys=32, heads=2, knn=4, k_dim=128)
    bound = 64**-0.5
    assert memory.keys.shape == (2, 2, 32, 64)
    assert memory.keys.abs().max() <= bound and memory.keys.std() > 0.5 * bound / 3**0.5
    assert memory.values.weight.shape == (32 * 32, 64)
    assert abs(memory.values.weight.std().item() - 64**-0.5) < 0.01
    assert memory.mem_size == 1024
    zeros = ProductKeyMemory(64, n_keys=8, heads=2, knn=4, k_dim=16, value_init="zeros")
    assert zeros.values.weight.abs().sum() == 0
    for kwargs, match in [
        (dict(k_dim=15), "k_dim"),
        (dict(knn=9), "knn"),
        (dict(knn=0), "knn"),
        (dict(heads=0), "heads"),
        (dict(value_init="uniform"), "value_init"),
    ]:
        with pytest.raises(ValueError, match=match):
            ProductKeyMemory(64, **{**dict(n_keys=8, heads=2, knn=4, k_dim=16), **kwargs})


def test_dropouts_act_only_in_training():
    memory = ProductKeyMemory(12, n_keys=8, heads=2, knn=4, k_dim=16, value_dropout=0.5).eval()
    x = torch.randn(2, 3, 12)
    torch.testing.assert_close(memory(x), memory(x))
    memory.train()
    assert (memory(x) == 0).float().mean() > 0.2


@pytest.mark.parametrize("n_keys, heads, knn, tokens", [(1, 4, 1, 320), (1, 2, 1, 320), (2, 4, 2, 2000), (8, 4, 8, 600)])
@pytest.mark.parametrize("sparse", [False, True])
def test_gradients_when_a_slot_is_read_more_often_than_there_are_tokens(n_keys, heads, knn, tokens, sparse):
    # a tiny memory (or a collapsed one whose heads all pick one slot) has rows read more often than there are tokens:
    # the large-batch value backward must give the gradients of the same tokens read in small batches
    torch.manual_seed(0)
    memory = ProductKeyMemory(128, n_keys=n_keys, heads=heads, knn=knn, k_dim=128, sparse=sparse).eval()
    x = torch.randn(tokens, 128)

    def gradients(chunks):
        memory.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_(True)
        for part in inputs.split(tokens // chunks):
            memory(part[None]).pow(2).sum().backward()
        values = memory.values.weight.grad
        return inputs.grad, values.to_dense() if values.is_sparse else values, memory.keys.grad

    whole, parts = gradients(1), gradients(tokens // 10)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
