"""The Triton value gathers (`kernels/triton_gathers.py`): checked on CPU tensors under the Triton interpreter, in a
subprocess (the interpreter is chosen when the kernels are defined), and compiled on CUDA where a GPU is; their launch
configurations and the loops Triton compiles for an H200 (no GPU needed); the CPU fallback when they are not there."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.backends
except ImportError:
    triton = None

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


def compiled_loop(kernel, signature: dict, constexprs: dict, num_warps: int) -> str:
    """The PTX of the (only) loop of `kernel` compiled for an H100/H200 (sm_90), without a GPU: Triton's own compiler,
    pointers 16-B aligned and integers divisible by 16 (as Triton specializes them at the paper's size)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "enable_fp_fusion": True}  # (triton 3.9's default, stated: no warning)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    lines = ptx.splitlines()
    header = next(i for i, line in enumerate(lines) if "Loop Header" in line)
    label = re.search(r"(\$L__BB\d+_\d+):", lines[header] + lines[header - 1]).group(1)
    back_edge = next(i for i in range(header, len(lines)) if re.search(rf"bra\s+{re.escape(label)};", lines[i]))
    return "\n".join(lines[header:back_edge])


def test_compiled_loops_stream_rows_without_barriers():
    """The bf16 fix, checked in the code an H200 runs (compiled here for sm_90, no GPU needed): at the paper's size the
    loop of `bag_sum` has no barrier (the old per-tile `tl.sum` put 8 `bar.sync` in each bf16 iteration, with 4 vector
    loads) and issues as many 16-B table loads per thread in bf16 as in fp32 (8); the fused backward's loop has no
    barrier and adds with vector reductions that return nothing (`red`, relaxed), not `atom`."""
    if not triton_kernels.available() or "nvidia" not in triton.backends.backends:
        pytest.skip("needs the triton package with its NVIDIA backend (the compiler runs without a GPU)")
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        config = triton_kernels.bag_sum_config(768, size, 128)
        signature = {"table": f"*{dtype}", "rows": "*i64", "weights": f"*{dtype}", "offsets": "*i64",
                     "out": f"*{dtype}", "dim": "i32", "BLOCK_LOOKUPS": "constexpr", "BLOCK_DIM": "constexpr",
                     "EVEN_DIM": "constexpr", "ACC": "constexpr"}  # fmt: skip
        constexprs = {"BLOCK_LOOKUPS": config["BLOCK_LOOKUPS"], "BLOCK_DIM": config["BLOCK_DIM"], "EVEN_DIM": True,
                      "ACC": triton.language.float32}
        loop = compiled_loop(triton_kernels._bag_sum_kernel, signature, constexprs, config["num_warps"])
        assert "bar.sync" not in loop, dtype
        assert loop.count("ld.global.v4.b32") == 8, dtype  # 32 KiB a tile / (256 threads x 16 B)
    config = triton_kernels.row_sum_backward_config(128, 768)
    signature = {"grad_output": "*bf16", "table": "*bf16", "rows": "*i64", "weights": "*fp32", "slots": "*i64",
                 "grad_table": "*fp32", "grad_weights": "*fp32", "bag": "i32", "dim": "i32"}  # fmt: skip
    constexprs = {"TABLE_GRAD": True, "WEIGHTS_GRAD": True, "HAS_SLOTS": False, "ACC": triton.language.float32,
                  "BLOCK_LOOKUPS": config["BLOCK_LOOKUPS"], "BLOCK_DIM": config["BLOCK_DIM"]}  # fmt: skip
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    loop = compiled_loop(triton_kernels._row_sum_backward_kernel, signature, constexprs, config["num_warps"])
    assert "bar.sync" not in loop and "atom." not in loop
    assert "red.global.gpu.relaxed.add.v4.f32" in loop


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
