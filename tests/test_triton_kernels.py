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


def test_kernels_under_the_triton_interpreter():
    if not triton_kernels.available():
        pytest.skip("the triton package is not installed (pip install -e '.[dev]' installs it): kernels not checked")
    if torch.cuda.is_available():  # the interpreter of triton 3.6 (torch 2.11's CUDA wheels) cannot run them either
        pytest.skip("CUDA is here: tests/test_devices.py checks the compiled kernels (the interpreter stands in for them)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_interpreted.py")],
        capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=600,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and not re.search(r"skipped|failed|error|deselected", summary), summary


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
