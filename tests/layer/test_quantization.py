"""Compact value tables (issue 26): int8 / 4-bit packed rows for serving, saved, loaded, refused where they cannot go."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import load_script, tiny_config
from modeling_pkm_bert import BertPkmForMaskedLM, BertPkmModel, quantize_memory_values
from modeling_pkm_bert import product_key_memory
from modeling_pkm_bert.product_key_memory import QuantizedProductKeyValues, dequantize_rows
from modeling_pkm_bert.serving.quantization import _prepack_torch, check_not_quantized, prepack_rows


INPUTS = torch.tensor([[2, 7, 8, 9, 3, 0], [2, 10, 11, 12, 13, 3]])
MASK = (INPUTS != 0).long()


def logits(model):
    with torch.no_grad():
        return model(INPUTS, attention_mask=MASK).logits


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def memory_output_error(model, quantized_model):
    """Relative error of the first memory's output (the part of the model that quantization changes)."""
    hidden = torch.randn(64, model.config.hidden_size)
    memory = next(m for m in model.modules() if isinstance(m, product_key_memory.ProductKeyMemory))
    quantized = next(m for m in quantized_model.modules() if isinstance(m, product_key_memory.ProductKeyMemory))
    with torch.no_grad():
        return relative_error(quantized(hidden), memory(hidden))


@pytest.mark.parametrize("bits, name, tolerance", [(8, "int8", 0.02), (4, "4bit", 0.25)])
def test_quantized_model_computes_the_same_up_to_rounding(bits, name, tolerance):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).eval()
    reference = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).eval()
    reference.load_state_dict(model.state_dict())
    assert quantize_memory_values(model, bits=bits) == 2
    assert model.config.pkm_values_quantization == name
    values = model.bert.encoder.layer[0].memory.values
    assert isinstance(values, QuantizedProductKeyValues) and values.weight.dtype == torch.uint8
    assert not values.weight.requires_grad
    assert memory_output_error(reference, model) < tolerance
    assert relative_error(logits(model), logits(reference)) < tolerance
    # the rest of the model is untouched
    assert torch.equal(model.bert.encoder.layer[0].memory.keys, reference.bert.encoder.layer[0].memory.keys)


@pytest.mark.parametrize("bits", [8, 4])
def test_fallback_path_equals_the_fbgemm_kernels_and_warns_once(bits, monkeypatch):
    if not product_key_memory.quantized_ops_available(bits):
        pytest.skip("this torch build has no FBGEMM quantized EmbeddingBag")
    table = QuantizedProductKeyValues(64, 32, bits, packed=prepack_rows(torch.randn(64, 32), bits)).eval()
    indices, weights = torch.randint(0, 64, (10, 8)), torch.rand(10, 8)
    kernel = table(indices, per_sample_weights=weights)
    monkeypatch.setattr(product_key_memory, "quantized_ops_available", lambda bits: False)
    monkeypatch.setattr(product_key_memory, "_fallback_warned", set())
    with pytest.warns(UserWarning, match="dequantising torch path"):
        fallback = table(indices, per_sample_weights=weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        table(indices, per_sample_weights=weights)
    torch.testing.assert_close(fallback, kernel, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_torch_prepack_matches_fbgemm_prepack(bits):
    weight = torch.randn(100, 32)
    ours = dequantize_rows(_prepack_torch(weight, bits), 32, bits)
    theirs = dequantize_rows(prepack_rows(weight, bits), 32, bits)
    step = (weight.max(1).values - weight.min(1).values) / (255 if bits == 8 else 15)
    # at most one code apart (rounding of ties, fp16 qparams)
    assert ((ours - theirs).abs() <= step[:, None] * 1.01 + 1e-3).all()


def test_shared_table_stays_one_table_saved_once(tmp_path):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2], pkm_shared_values=True)).eval()
    expected_fp32 = logits(model)
    assert quantize_memory_values(model, bits=8) == 1
    layers = model.bert.encoder.layer
    assert layers[0].memory.values is layers[2].memory.values
    expected = logits(model)
    assert relative_error(expected, expected_fp32) < 0.02
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tables = [k for k in f.keys() if k.endswith("memory.values.weight")]
    assert tables == ["bert.encoder.layer.0.memory.values.weight"]
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.bert.encoder.layer[0].memory.values is loaded.bert.encoder.layer[2].memory.values
    assert torch.equal(logits(loaded), expected)


@pytest.mark.parametrize("bits, name, ratio", [(8, "int8", 0.26), (4, "4bit", 0.14)])
def test_saved_folder_is_small_and_loads_identically(tmp_path, bits, name, ratio):
    config = tiny_config(hidden_size=256, num_attention_heads=4, pkm_n_keys=32, pkm_layers=[0, 2])  # rows of 256+8 bytes
    model = BertPkmForMaskedLM(config).eval()
    model.save_pretrained(tmp_path / "fp32")
    quantize_memory_values(model, bits=bits)
    expected = logits(model)
    model.save_pretrained(tmp_path / name)
    assert json.loads((tmp_path / name / "config.json").read_text())["pkm_values_quantization"] == name
    from safetensors import safe_open

    def table_bytes(folder):
        with safe_open(folder / "model.safetensors", "pt") as f:
            return sum(f.get_tensor(k).nbytes for k in f.keys() if "memory.values" in k)

    assert table_bytes(tmp_path / name) <= ratio * table_bytes(tmp_path / "fp32")
    loaded, info = BertPkmForMaskedLM.from_pretrained(tmp_path / name, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(logits(loaded.eval()), expected)
    # another head from the same folder (the base model), bf16 for the rest: the packed rows stay uint8
    base = BertPkmModel.from_pretrained(tmp_path / name, dtype=torch.bfloat16)
    assert base.encoder.layer[0].memory.values.weight.dtype == torch.uint8


REMOTE = r"""
import json, os, sys, threading, time
sys.modules["modeling_pkm_bert"] = None
import torch
from transformers import AutoModelForMaskedLM

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

# warm-up on the meta device (imports, remote code, no tensors): then only the tensors count. Without Hub kernels:
# they are chosen per device and the meta device has none (transformers >= 5.25 kernelizes every load by default and
# refuses device_map="meta", a plain BertForMaskedLM too); the measured load below keeps the defaults
AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True, device_map="meta", use_kernels=False)
before, peak, done = rss(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
thread = threading.Thread(target=sample)
thread.start()
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
for t in model.state_dict().values():  # every page of every tensor resident (a mapped file counts once touched)
    t.reshape(-1)[::512].float().sum()
done.append(1)
thread.join()
growth = max(peak[0], rss()) - before
values = model.bert.encoder.layer[1].memory.values
with torch.no_grad():
    out = model(torch.tensor(json.loads(sys.argv[2])), attention_mask=torch.tensor(json.loads(sys.argv[3]))).logits
nbytes = sum(t.nbytes for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
print("RESULT" + json.dumps({"logits": out.tolist(), "module": type(values).__module__, "class": type(values).__name__,
      "growth": growth, "model_bytes": nbytes}))
"""


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_folder_runs_as_remote_code_without_the_package(tmp_path, bits):
    # a table big enough for the RSS growth of loading to stand out of the interpreter's noise (int8: 36 MiB)
    config = tiny_config(hidden_size=576, num_attention_heads=4, intermediate_size=64, pkm_n_keys=256, pkm_layers=[1])
    model = BertPkmForMaskedLM(config).eval()
    quantize_memory_values(model, bits=bits)
    expected = logits(model)
    model.save_pretrained(tmp_path / "folder")
    del model
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    completed = subprocess.run(
        [sys.executable, "-c", REMOTE, str(tmp_path / "folder"), json.dumps(INPUTS.tolist()), json.dumps(MASK.tolist())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.split("RESULT", 1)[1])
    assert out["class"] == "QuantizedProductKeyValues" and out["module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, atol=1e-5, rtol=1e-5)
    # loading holds the packed table once: peak RSS growth of from_pretrained (every tensor then touched) <= 1.3x the model's bytes
    assert out["growth"] <= 1.3 * out["model_bytes"], out


def test_bad_bits_no_memories_and_twice_are_refused():
    model = BertPkmForMaskedLM(tiny_config()).eval()
    for bits in (3, 16, 2, True, "8", 8.5, None):
        with pytest.raises(ValueError, match="8 \\(int8\\) or 4"):
            quantize_memory_values(model, bits=bits)
    with pytest.raises(ValueError, match="no product key memory"):
        quantize_memory_values(BertPkmForMaskedLM(tiny_config(pkm_layers=[])), bits=8)
    quantize_memory_values(model, bits=8)
    with pytest.raises(ValueError, match="already int8-quantized"):
        quantize_memory_values(model, bits=4)
    assert model.config.pkm_values_quantization == "int8"  # nothing changed by the refused call
    with pytest.raises(ValueError, match="pkm_values_quantization"):
        tiny_config(pkm_values_quantization="int4")


def test_training_is_refused_with_a_clear_error():
    model = BertPkmForMaskedLM(tiny_config())
    quantize_memory_values(model, bits=8)
    model.train()
    with pytest.raises(RuntimeError, match="inference only"):
        model(INPUTS, attention_mask=MASK, labels=INPUTS)
    model.eval()
    logits(model)  # eval is fine, also with gradients enabled for the rest of the model
    with torch.no_grad():
        model.train()(INPUTS, attention_mask=MASK)  # training mode without gradients: a forward only


def test_training_checkpoint_of_a_quantized_model_is_refused(tmp_path):
    from accelerate import Accelerator

    from modeling_pkm_bert.training import save_checkpoint

    model = BertPkmForMaskedLM(tiny_config())
    quantize_memory_values(model, bits=4)
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(model)
    with pytest.raises(ValueError, match="4bit-quantized \\(inference only\\)"):
        save_checkpoint(accelerator, str(tmp_path), "step_1")
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(ValueError, match="cannot be saved"):
        check_not_quantized(prepared)
    # the serving folder is the way to save it
    model.save_pretrained(tmp_path / "serving")
    assert (tmp_path / "serving" / "model.safetensors").is_file()


def test_quantize_folder_leaves_the_source_and_copies_the_rest(tmp_path):
    from modeling_pkm_bert.hub.upload import quantize_folder

    model = BertPkmForMaskedLM(tiny_config()).eval()
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "README.md").write_text("card")
    before = (tmp_path / "src" / "model.safetensors").read_bytes()
    out = quantize_folder(tmp_path / "src", tmp_path / "dst", bits=8)
    assert (tmp_path / "src" / "model.safetensors").read_bytes() == before
    assert (tmp_path / "dst" / "README.md").read_text() == "card"
    loaded = BertPkmForMaskedLM.from_pretrained(out)
    assert loaded.config.pkm_values_quantization == "int8"
    with pytest.raises(ValueError, match="not empty"):
        quantize_folder(tmp_path / "src", tmp_path / "dst", bits=8)


def test_torch_export_of_a_quantized_model():
    model = BertPkmModel(tiny_config()).eval()
    quantize_memory_values(model, bits=8)
    with torch.no_grad():
        expected = model(INPUTS, attention_mask=MASK).last_hidden_state
    program = torch.export.export(model, (), {"input_ids": INPUTS, "attention_mask": MASK})
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("quantized" in op for op in ops)  # standard ops only: the dequantising path
    with torch.no_grad():
        out = program.module()(input_ids=INPUTS, attention_mask=MASK).last_hidden_state
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_torch_export_and_onnx_of_quantized_n_gram_tables(tmp_path):
    """Both memory kinds packed (int8): the exported program reads the n-gram tables' packed rows through the same
    dequantising standard ops, and onnxruntime gives the eager model's outputs."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from modeling_pkm_bert.integrations.export import export_onnx

    model = BertPkmModel(tiny_config(ngram_layers=[1], ngram_table_size=101, ngram_dim=4)).eval()
    with torch.no_grad():
        model.encoder.layer[1].ngram.value.weight.normal_()  # zero at the start: make the memory contribute
    assert quantize_memory_values(model, bits=8) == len(model.config.pkm_layers) + 1  # the n-gram tables too
    with torch.no_grad():
        expected = model(INPUTS, attention_mask=MASK).last_hidden_state
    program = torch.export.export(model, (), {"input_ids": INPUTS, "attention_mask": MASK})
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("quantized" in op for op in ops)
    with torch.no_grad():
        out = program.module()(input_ids=INPUTS, attention_mask=MASK).last_hidden_state
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert export_onnx(model, tmp_path / "model.onnx", {"input_ids": INPUTS, "attention_mask": MASK}).is_file()


@pytest.mark.parametrize("bits", [8, 4])
def test_export_decoding_of_scales_equals_the_dtype_view(bits, monkeypatch):
    weight = torch.randn(50, 16) * 10
    weight[0] = 0  # a constant row: scale 0 (int8) / 1 (4-bit)
    weight[1, :3] = 1e-6
    packed = prepack_rows(weight, bits)
    eager = dequantize_rows(packed, 16, bits)
    monkeypatch.setattr(product_key_memory, "is_exporting", lambda: True)  # the arithmetic (ONNX-exportable) decoding
    assert torch.equal(dequantize_rows(packed, 16, bits), eager)


@pytest.mark.parametrize("bits", [8, 4])
def test_onnx_export_of_a_quantized_model(tmp_path, bits):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from modeling_pkm_bert.integrations.export import export_onnx

    model = BertPkmModel(tiny_config()).eval()
    quantize_memory_values(model, bits=bits)
    # verify=True: onnxruntime's outputs must match the eager (FBGEMM) model's
    path = export_onnx(model, tmp_path / "model.onnx", {"input_ids": INPUTS, "attention_mask": MASK})
    assert path.is_file()


def test_convert_and_push_scripts_quantize_values(tmp_path, capsys):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=37, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    convert = load_script("convert_to_pkm")
    pkm = ["--pkm_layers", "1", "--pkm_n_keys", "8", "--pkm_heads", "2", "--pkm_knn", "4", "--pkm_k_dim", "16"]
    with pytest.raises(SystemExit):
        convert.parse_args(["--model_name_or_path", str(tmp_path / "bert"), "--output_dir", "x", "--quantize_values", "6"])
    convert.main(["--model_name_or_path", str(tmp_path / "bert"), "--output_dir", str(tmp_path / "q4"), "--quantize_values", "4", *pkm])
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path / "q4")
    assert loaded.config.pkm_values_quantization == "4bit"
    assert isinstance(loaded.bert.encoder.layer[1].memory.values, QuantizedProductKeyValues)
    # push_to_hub: the fp32 folder quantized into a sibling folder (the source untouched), listed by --dry_run
    convert.main(["--model_name_or_path", str(tmp_path / "bert"), "--output_dir", str(tmp_path / "fp32"), *pkm])
    push = load_script("push_to_hub")
    push.main(["--model_dir", str(tmp_path / "fp32"), "--hub_model_id", "me/x", "--quantize_values", "8", "--dry_run"])
    assert "Would upload" in capsys.readouterr().out
    assert json.loads((tmp_path / "fp32-int8" / "config.json").read_text())["pkm_values_quantization"] == "int8"
    assert json.loads((tmp_path / "fp32" / "config.json").read_text()).get("pkm_values_quantization") is None


def test_serving_docs_python_blocks_run_as_written(tmp_path):
    import re

    from helpers import REPO_ROOT

    text = (REPO_ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert blocks
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]


def test_a_quantized_folder_loads_and_runs_on_a_torch_without_the_kernels(tmp_path, monkeypatch):
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).eval()
    quantize_memory_values(model, bits=8)
    expected = logits(model)  # FBGEMM's kernels (where this torch has them)
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(product_key_memory, "quantized_ops_available", lambda bits: False)
    monkeypatch.setattr(product_key_memory, "_fallback_warned", set())
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="no torch.ops.quantized.embedding_bag_byte_rowwise_offsets") as record:
        fallback = logits(loaded)  # two memories, one warning
    assert len([w for w in record if "dequantising" in str(w.message)]) == 1
    torch.testing.assert_close(fallback, expected, atol=1e-5, rtol=1e-5)
