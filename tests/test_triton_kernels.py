"""The Triton value gathers (`triton_kernels.py`): checked on CPU tensors under the Triton interpreter, in a
subprocess (the interpreter is chosen when the kernels are defined); and the CPU fallback when they are not there."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modeling_pkm_bert import ProductKeyMemory
from modeling_pkm_bert.kernels import triton_gathers as triton_kernels
from modeling_pkm_bert.product_key_memory import ProductKeyValues


HERE = Path(__file__).resolve().parent


def run_kernel_tests(env: dict, allowed_skips: int = 0) -> str:
    """tests/triton_interpreted.py in a subprocess with `env`: all passed (and at most `allowed_skips` skipped)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(HERE / "triton_interpreted.py")],
        capture_output=True, text=True, env={**os.environ, **env}, cwd=HERE.parent, timeout=600,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and not re.search(r"failed|error|deselected", summary), summary
    skipped = re.search(r"\b(\d+) skipped\b", summary)
    assert int(skipped.group(1) if skipped else 0) <= allowed_skips, summary
    return output


def test_kernels_under_the_triton_interpreter():
    if not triton_kernels.available():
        pytest.skip("the triton package is not installed (pip install -e '.[dev]' installs it): kernels not checked")
    if torch.cuda.is_available():  # the interpreter of triton 3.6 (torch 2.11's CUDA wheels) cannot run them either
        pytest.skip("CUDA is here: test_kernels_compiled_on_cuda checks the compiled kernels instead")
    run_kernel_tests({"TRITON_INTERPRET": "1"})


@pytest.mark.cuda
def test_kernels_compiled_on_cuda():
    """The same tests on a GPU, compiled (real bf16 rounding, real atomics); the bad-input checks stay on CPU (a failed
    device-side assertion ends the CUDA context)."""
    if not (torch.cuda.is_available() and triton_kernels.available()):
        pytest.skip("needs CUDA and the triton package")
    env = {"PKM_TRITON_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
    run_kernel_tests(env, allowed_skips=3)  # two bad-input tests, the benchmark's CPU smoke run


def test_launch_configurations_keep_as_many_bytes_in_flight_for_bf16_as_for_fp32():
    """The bf16 fix (docstring of kernels/triton_gathers.py): at the paper's size (768 columns, 128 lookups a token) a
    bf16 tile of bag_sum holds the bytes of an fp32 one, in row blocks without masked lanes; short bags (the segments
    of the value gradient) get short tiles; the fused backward holds a token's 128 lookups in one program."""
    if not triton_kernels.available():
        pytest.skip("the triton package is not installed")
    fp32, bf16 = (triton_kernels.bag_sum_config(768, size, 128) for size in (4, 2))
    assert fp32["BLOCK_LOOKUPS"] * fp32["BLOCK_DIM"] * 4 == bf16["BLOCK_LOOKUPS"] * bf16["BLOCK_DIM"] * 2 == 32 * 1024
    assert 768 % fp32["BLOCK_DIM"] == 768 % bf16["BLOCK_DIM"] == 0 and bf16["num_warps"] == fp32["num_warps"] == 8
    assert triton_kernels.bag_sum_config(1024, 2, 128)["BLOCK_DIM"] == 1024  # 2 KiB of a bf16 row, one block
    assert triton_kernels.bag_sum_config(1024, 4, 128)["BLOCK_DIM"] == 512
    assert triton_kernels.bag_sum_config(768, 4, 1.6)["BLOCK_LOOKUPS"] == 2
    assert triton_kernels.bag_sum_config(300, 4, 4)["BLOCK_DIM"] == 64  # 320 columns read for 300, not 512
    assert triton_kernels.row_sum_backward_config(128, 768)["BLOCK_LOOKUPS"] == 128


def test_off_by_default_and_cpu_fallback_without_registered_kernels():
    """`triton_devices` is empty by default; asked for on CPU without the ops registered (no interpreter), the lookup
    and its gradients are EmbeddingBag's."""
    assert ProductKeyValues.triton_devices == ()
    registered = hasattr(torch.ops.pkm_bert, "bag_sum")
    assert not registered or torch.cuda.is_available()  # registered only where CUDA is (no interpreter in this process)
    if registered:
        pytest.skip("the Triton ops are registered here (CUDA tensors only): no fallback to check; tests/test_devices.py "
                    "checks them on CUDA against EmbeddingBag")
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 12, n_keys=8, heads=2, knn=4, k_dim=8).train()
    memory.values.triton_devices = ("cpu",)
    weights, indices, grad = torch.rand(5, 8, requires_grad=True), torch.randint(0, 64, (5, 8)), torch.randn(5, 12)
    table = memory.values.weight.detach().clone().requires_grad_()
    reference_weights = weights.detach().clone().requires_grad_()
    out = memory.values(indices, per_sample_weights=weights)
    expected = F.embedding_bag(indices, table, mode="sum", per_sample_weights=reference_weights)
    torch.testing.assert_close(out, expected)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(memory.values.weight.grad, table.grad)
    torch.testing.assert_close(weights.grad, reference_weights.grad)
