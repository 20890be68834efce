"""Every model class and memory path on each device: "cpu" always (CI) and "cuda" (marker `cuda`; `pytest -m cuda`
runs only those, benchmarks/gpu_check.sh) where torch sees a GPU. Results are compared with a CPU copy of the same
weights on the reference paths (EmbeddingBag's own backward, torch.topk selection, no candidate pruning): the cpu cases
check the fast CPU paths against it, the cuda cases the GPU."""

import copy
import math

import pytest
import torch
from torch.testing import assert_close

from helpers import batch, load_script, make_tiny_folder, mlm_args, remote_code_model, reset_accelerate_state, tiny_config
from modeling_pkm_bert import (
    BertPkmForCausalLM,
    BertPkmForMaskedLM,
    BertPkmForMultipleChoice,
    BertPkmForQuestionAnswering,
    BertPkmForSequenceClassification,
    BertPkmForTokenClassification,
    BertPkmModel,
)
from modeling_pkm_bert.methods.optimizers import set_sparse_values
from modeling_pkm_bert.product_key_memory_ops import use_reference
from modeling_pkm_bert.utils.memories import memory_modules


NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)])]
MODEL_CLASSES = [
    BertPkmModel,
    BertPkmForMaskedLM,
    BertPkmForCausalLM,
    BertPkmForSequenceClassification,
    BertPkmForQuestionAnswering,
    BertPkmForTokenClassification,
    BertPkmForMultipleChoice,
]
VARIANTS = {
    "resm": dict(pkm_mode="resm"),
    "replace": dict(pkm_mode="replace"),
    "memory_plus": dict(pkm_layers=[0, 2], pkm_shared_values=True, pkm_output_gate="swilu", pkm_qk_norm=True,
                        pkm_score_activation="relu", pkm_memory_scale=0.5),
}  # fmt: skip


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def reference_on_cpu(model):
    """A CPU copy of `model` with dense value gradients (run it under `use_reference()`: the reference paths)."""
    model = copy.deepcopy(model).cpu()
    for memory in memory_modules(model).values():
        memory.sparse_values = False
    return model


def model_inputs(model_class) -> dict:
    ids, mask = batch()
    labels = {
        BertPkmModel: {},
        BertPkmForMaskedLM: dict(labels=ids.masked_fill(mask == 0, -100)),
        BertPkmForCausalLM: dict(labels=ids.masked_fill(mask == 0, -100)),
        BertPkmForSequenceClassification: dict(labels=torch.tensor([0, 2, 1])),
        BertPkmForQuestionAnswering: dict(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([2, 4, 3])),
        BertPkmForTokenClassification: dict(labels=torch.randint(0, 3, ids.shape)),
        BertPkmForMultipleChoice: dict(labels=torch.tensor([0, 2])),  # 2 questions of 3 choices
    }[model_class]
    if model_class is BertPkmForMultipleChoice:
        ids, mask = ids[None].expand(2, -1, -1), mask[None].expand(2, -1, -1)
    return dict(input_ids=ids, attention_mask=mask, **labels)


def forward_backward(model, inputs: dict, device):
    """The loss, every output tensor and every gradient (dense, on CPU, fp32) of one training step of `model`."""
    model.zero_grad(set_to_none=True)
    output = model(**{k: v.to(device) for k, v in inputs.items()})
    if output.get("loss") is not None:
        loss = output.loss
    else:  # a fixed projection: a LayerNorm output's square mean is constant, its gradient would be rounding noise
        hidden = output.last_hidden_state
        projection = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(0)).to(hidden.device)
        loss = (hidden * projection).mean()
    loss.backward()
    tensors = [t.detach().float().cpu() for t in output.to_tuple() if isinstance(t, torch.Tensor)]
    grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).float().cpu()
             for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    return loss.detach().float().cpu(), tensors, grads


def assert_near(actual, expected, msg=None, scale=0.0):
    """Equal within fp32 rounding of a different summation order: 1e-4 relative, plus 1e-5 of the tensor's largest
    magnitude (a fixed atol would hide a wrong small gradient), plus 5e-6 of `scale`, the model's largest gradient:
    some gradients are zero in exact arithmetic (the bias before a BatchNorm, an attention key bias, a classifier bias
    under softmax cross-entropy) and are rounding noise of the gradients they cancel, up to 8e-7 of the largest on CPU.
    """
    atol = 1e-5 * max(expected.abs().max().item(), 1e-3) + 5e-6 * scale
    assert_close(actual, expected, rtol=1e-4, atol=atol, msg=msg)


def value_grads(grads: dict) -> dict:
    found = {n: g for n, g in grads.items() if "memory.values" in n}
    assert found, list(grads)
    return found


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_class", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_training_step_equals_the_cpu_reference(device, model_class, variant):
    qa = model_class is BertPkmForQuestionAnswering
    config = tiny_config(num_labels=2 if qa else 3, is_decoder=model_class is BertPkmForCausalLM, **VARIANTS[variant])
    model = model_class(config).train()
    reference, inputs = reference_on_cpu(model), model_inputs(model_class)
    loss, outputs, grads = forward_backward(model.to(device), inputs, device)
    assert torch.isfinite(loss)
    for name, grad in value_grads(grads).items():
        assert grad.isfinite().all() and grad.abs().sum() > 0, name
    with use_reference():
        expected_loss, expected_outputs, expected_grads = forward_backward(reference, inputs, "cpu")
    assert_near(loss, expected_loss)
    assert len(outputs) == len(expected_outputs)
    for out, expected in zip(outputs, expected_outputs):
        assert_near(out, expected)
    assert grads.keys() == expected_grads.keys()
    scale = max(g.abs().max().item() for g in expected_grads.values())
    for name in grads:
        assert_near(grads[name], expected_grads[name], msg=name, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_autocast_gives_finite_outputs_and_gradients(device, dtype):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).train().to(device)
    inputs = {k: v.to(device) for k, v in model_inputs(BertPkmForMaskedLM).items()}
    fp32_loss = model(**inputs).loss.item()
    try:
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    except RuntimeError as error:  # a torch without this autocast dtype on this device
        pytest.skip(f"torch.autocast({device.type!r}, dtype={dtype}) refused: {error}")
    model.zero_grad(set_to_none=True)
    with autocast:
        output = model(**inputs)
    assert output.logits.dtype == dtype  # autocast took effect
    assert math.isfinite(output.loss.item()) and abs(output.loss.item() - fp32_loss) <= 0.05 * fp32_loss
    output.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads.values())
    assert all(g.abs().sum() > 0 for g in value_grads(grads).values())


@pytest.mark.parametrize("variant", ["resm", "memory_plus"])
def test_sparse_value_gradients_equal_dense(device, variant):
    config = tiny_config(**VARIANTS[variant])
    dense = BertPkmForMaskedLM(config).train().to(device)
    sparse = copy.deepcopy(dense)
    assert set_sparse_values(sparse, True) == len(config.pkm_layers)
    inputs = model_inputs(BertPkmForMaskedLM)
    _, _, dense_grads = forward_backward(dense, inputs, device)
    assert not any(p.grad.is_sparse for p in dense.parameters() if p.grad is not None)
    _, _, sparse_grads = forward_backward(sparse, inputs, device)
    assert all(memory.values.weight.grad.is_sparse for memory in memory_modules(sparse).values())
    assert sparse_grads.keys() == dense_grads.keys()
    for name in value_grads(dense_grads):
        assert_close(sparse_grads[name], dense_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_greedy_generation_equals_the_cpu_reference(device):
    model = BertPkmForCausalLM(tiny_config(is_decoder=True, pkm_layers=[0, 2])).eval()
    reference = reference_on_cpu(model)
    prompt = torch.randint(1, 99, (2, 4))
    settings = dict(max_new_tokens=6, do_sample=False)
    with use_reference():
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    prompt = prompt.to(device)
    tokens = model.to(device).generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    assert tokens.device.type == device.type and tokens.shape == (2, 10)
    assert torch.equal(tokens.cpu(), expected)


def test_saved_folder_loads_onto_the_device(device, tmp_path):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).eval()
    model.save_pretrained(tmp_path)
    ids, mask = batch()
    with torch.no_grad(), use_reference():
        expected = reference_on_cpu(model)(ids, attention_mask=mask).logits
        for loaded in (
            remote_code_model(tmp_path).to(device).eval(),  # the folder's own code, as trust_remote_code loads it
            BertPkmForMaskedLM.from_pretrained(tmp_path, device_map=device.type).eval(),  # built on the device
        ):
            assert {p.device.type for p in loaded.parameters()} == {device.type}
            assert_near(loaded(ids.to(device), attention_mask=mask.to(device)).logits.cpu(), expected)


def cuda_allocations() -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0) if torch.cuda.is_available() else 0


def test_run_mlm_trains_on_the_device(device, tmp_path, monkeypatch):
    """run_mlm's main() for 3 steps: accelerate puts it on the GPU where there is one (ACCELERATE_USE_CPU: on CPU)."""
    pytest.importorskip("datasets", reason="run_scripts/run_mlm.py needs the datasets package")
    if device.type == "cpu":
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    folder = make_tiny_folder(tmp_path / "tiny")
    options = "--max_train_samples 8 --max_train_steps 3 --max_eval_samples 8"
    before = cuda_allocations()
    try:
        results = load_script("run_mlm").main(mlm_args(folder, tmp_path / "out", options))
    finally:
        reset_accelerate_state()
    assert results["step"] == 3 and math.isfinite(results["train_loss"]) and math.isfinite(results["perplexity"])
    assert (cuda_allocations() > before) == (device.type == "cuda")
    assert (tmp_path / "out" / "model.safetensors").exists()
