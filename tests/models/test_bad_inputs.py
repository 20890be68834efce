"""Bad configs, forward inputs and checkpoints get a clear error naming the problem; valid ones are unaffected (issue 13).

Each entry of CASES is one distinct bad input: `make(tmp_path)` must raise `error` with a message matching `names`.
"""

import json
import subprocess
import sys

import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM

from helpers import tiny_config
from modeling_pkm_bert import (
    BertPkmConfig,
    BertPkmForCausalLM,
    BertPkmForMaskedLM,
    BertPkmForMultipleChoice,
    BertPkmForQuestionAnswering,
    BertPkmForSequenceClassification,
    BertPkmForTokenClassification,
    BertPkmModel,
    ProductKeyMemory,
)


def ids(batch=2, length=6, low=1, high=99):
    return torch.randint(low, high, (batch, length))


def model(cls=BertPkmModel, train=False, **overrides):
    built = cls(tiny_config(**overrides))
    return built.train() if train else built.eval()


def call(cls=BertPkmModel, train=False, overrides=None, **inputs):
    with torch.set_grad_enabled(train):
        return model(cls, train, **(overrides or {}))(**inputs)


def saved(tmp_path, cls=BertPkmForMaskedLM, **overrides):
    cls(tiny_config(**overrides)).save_pretrained(tmp_path)
    return tmp_path


def edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


def causal_with_past(past, new):
    lm = model(BertPkmForCausalLM, is_decoder=True)
    with torch.no_grad():
        cache = lm(input_ids=ids(1, past), use_cache=True).past_key_values
        return lm(input_ids=ids(1, new), past_key_values=cache, use_cache=True)


def strip_memories(folder):
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".memory." not in k}, folder / "model.safetensors", {"format": "pt"})
    return folder


def flip_byte(folder, tensor_name):
    """Flips one byte inside a tensor's data in the safetensors file (the header and layout stay valid)."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_size])[tensor_name]["data_offsets"]
    data[8 + header_size + (start + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return folder


def unclear_4d_mask():
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    allowed[0, 0, 3, 3] = False  # token 3 may not attend to itself, yet the others attend to it
    return allowed


def nan_embeds(value=float("nan")):
    embeds = torch.randn(2, 6, 32)
    embeds[1, 2, 5] = value
    return embeds


def memory_step(**inputs):
    memory = ProductKeyMemory(32, n_keys=8, heads=2, knn=4, k_dim=16).train()
    return memory(**inputs)


CONFIG_CASES = [
    ("config: value table of terabytes", lambda t: tiny_config(pkm_n_keys=10**6), ValueError, r"pkm_n_keys.*116\.4 TiB"),
    ("config: paper hidden, n_keys 2**17", lambda t: BertPkmConfig(pkm_n_keys=2**17), ValueError, r"pkm_n_keys.*bytes"),
    ("config: query features of terabytes", lambda t: tiny_config(pkm_heads=2**30), ValueError, r"pkm_heads.*bytes"),
    ("config: bool n_keys", lambda t: tiny_config(pkm_n_keys=True), StrictDataclassFieldValidationError, "pkm_n_keys"),
    ("config: float n_keys", lambda t: tiny_config(pkm_n_keys=8.0), StrictDataclassFieldValidationError, "pkm_n_keys"),
    ("config: float layer index", lambda t: tiny_config(pkm_layers=[1.5]), StrictDataclassFieldValidationError, "pkm_layers"),
    ("config: layers as a string", lambda t: tiny_config(pkm_layers="12"), StrictDataclassFieldValidationError, "pkm_layers"),
    ("config: NaN dropout", lambda t: tiny_config(pkm_value_dropout=float("nan")), ValueError, "pkm_value_dropout"),
    ("config: 'yes' as batchnorm", lambda t: tiny_config(pkm_query_batchnorm="yes"), StrictDataclassFieldValidationError, "pkm_query_batchnorm"),
    ("config: malformed checksum", lambda t: tiny_config(pkm_weights_checksum={"sha": 1}), ValueError, "pkm_weights_checksum"),
]  # fmt: skip

FORWARD_CASES = [
    ("forward: 1-D input_ids", lambda t: call(input_ids=ids()[0]), ValueError, r"input_ids of shape \(6,\).*2-D.*\[None\]"),
    ("forward: 3-D input_ids", lambda t: call(input_ids=ids()[None]), ValueError, r"input_ids of shape \(1, 2, 6\).*2-D"),
    ("forward: float input_ids", lambda t: call(input_ids=ids().float()), ValueError, r"input_ids.*float32.*integers"),
    ("forward: negative id", lambda t: call(input_ids=ids().index_fill(1, torch.tensor([2]), -1)), ValueError, r"input_ids.*holds -1.*\[0, 98\]"),
    ("forward: id = vocab_size", lambda t: call(input_ids=ids().index_fill(1, torch.tensor([2]), 99)), ValueError, r"input_ids.*holds 99.*\[0, 98\]"),
    ("forward: token type 2", lambda t: call(input_ids=ids(), token_type_ids=torch.full((2, 6), 2)), ValueError, r"token_type_ids.*holds 2.*\[0, 1\]"),
    ("forward: token type -1", lambda t: call(input_ids=ids(), token_type_ids=torch.full((2, 6), -1)), ValueError, r"token_type_ids.*holds -1"),
    ("forward: token types of another shape", lambda t: call(input_ids=ids(), token_type_ids=torch.zeros(2, 5, dtype=torch.long)), ValueError, r"token_type_ids of shape \(2, 5\).*\(2, 6\)"),
    ("forward: empty sequences", lambda t: call(input_ids=ids(2, 0)), ValueError, r"input_ids of shape \(2, 0\).*no token"),
    ("forward: empty batch", lambda t: call(input_ids=ids(0, 6)), ValueError, r"input_ids of shape \(0, 6\).*no token"),
    ("forward: mask shorter than ids", lambda t: call(input_ids=ids(), attention_mask=torch.ones(2, 5)), ValueError, r"attention_mask of shape \(2, 5\).*\(2, 6\)"),
    ("forward: mask of another batch", lambda t: call(input_ids=ids(), attention_mask=torch.ones(3, 6)), ValueError, r"attention_mask of shape \(3, 6\)"),
    ("forward: 3-D mask", lambda t: call(input_ids=ids(), attention_mask=torch.ones(2, 6, 6)), ValueError, r"attention_mask of shape \(2, 6, 6\).*2-D"),
    ("forward: 4-D mask of another length", lambda t: call(input_ids=ids(), attention_mask=torch.ones(2, 1, 6, 5, dtype=torch.bool)), ValueError, r"attention_mask of shape \(2, 1, 6, 5\).*4-D"),
    ("forward: 4-D mask, padding unclear", lambda t: call(input_ids=ids(), attention_mask=unclear_4d_mask(), train=True), ValueError, r"attention_mask.*token 3 of sequence 0.*padding"),
    ("forward: longer than max_position_embeddings", lambda t: call(input_ids=ids(1, 65)), ValueError, r"input_ids.*65 tokens.*max_position_embeddings=64"),
    ("forward: too long with past_key_values", lambda t: causal_with_past(60, 10), ValueError, r"past_key_values of 60 tokens.*max_position_embeddings=64"),
    ("forward: position id 64", lambda t: call(input_ids=ids(), position_ids=torch.arange(59, 65)[None]), ValueError, r"position_ids.*holds 64.*\[0, 63\]"),
    ("forward: inputs_embeds of another hidden size", lambda t: call(inputs_embeds=torch.randn(2, 6, 31)), ValueError, r"inputs_embeds of shape \(2, 6, 31\).*hidden_size=32"),
    ("forward: 2-D inputs_embeds", lambda t: call(inputs_embeds=torch.randn(6, 32)), ValueError, r"inputs_embeds of shape \(6, 32\)"),
    ("forward: multiple choice with 2-D ids", lambda t: call(BertPkmForMultipleChoice, input_ids=ids()), ValueError, r"input_ids of shape \(2, 6\).*num_choices"),
    ("heads: masked LM, id = vocab_size", lambda t: call(BertPkmForMaskedLM, input_ids=ids(high=100).index_fill(1, torch.tensor([0]), 99)), ValueError, r"input_ids.*holds 99"),
    ("heads: sequence classification, negative id", lambda t: call(BertPkmForSequenceClassification, input_ids=ids().index_fill(0, torch.tensor([1]), -1)), ValueError, r"input_ids.*holds -1"),
    ("heads: question answering, too long", lambda t: call(BertPkmForQuestionAnswering, input_ids=ids(2, 70)), ValueError, r"70 tokens.*max_position_embeddings"),
    ("heads: token classification, bad mask", lambda t: call(BertPkmForTokenClassification, input_ids=ids(), attention_mask=torch.ones(2, 7)), ValueError, r"attention_mask of shape \(2, 7\)"),
    ("heads: causal LM, empty", lambda t: call(BertPkmForCausalLM, input_ids=ids(1, 0), overrides=dict(is_decoder=True)), ValueError, r"no token"),
    ("train: a single token", lambda t: call(input_ids=ids(1, 1), train=True), ValueError, r"encoder\.layer\.1\.memory.*1 real token.*BatchNorm needs at least 2"),
    ("train: a single real token in a padded batch", lambda t: call(input_ids=ids(2, 3), attention_mask=torch.tensor([[1, 0, 0], [0, 0, 0]]), train=True), ValueError, r"1 real token"),
    ("train: NaN in inputs_embeds", lambda t: call(inputs_embeds=nan_embeds(), train=True), ValueError, r"encoder\.layer\.1\.memory: \d+ non-finite value.*training"),
    ("train: inf in inputs_embeds", lambda t: call(inputs_embeds=nan_embeds(float("inf")), train=True), ValueError, r"non-finite value"),
    ("memory module: NaN input in training", lambda t: memory_step(hidden_states=nan_embeds()), ValueError, r"ProductKeyMemory: 1 non-finite"),
    ("memory module: one token in training", lambda t: memory_step(hidden_states=torch.randn(1, 1, 32)), ValueError, r"ProductKeyMemory: .*1 real token"),
]  # fmt: skip

CHECKPOINT_CASES = [
    ("checkpoint: pkm_layers edited", lambda t: BertPkmForMaskedLM.from_pretrained(edit_config(saved(t), pkm_layers=[2])), ValueError, r"(?s)memories at layers \[1\].*missing.*layer\.2\.memory\.keys.*not in the model.*layer\.1\.memory\.keys"),
    ("checkpoint: pkm_mode resm -> replace", lambda t: BertPkmForMaskedLM.from_pretrained(edit_config(saved(t), pkm_mode="replace")), ValueError, r"(?s)pkm_mode='replace'.*not in the model.*layer\.1\.intermediate\.dense"),
    ("checkpoint: pkm_mode replace -> resm", lambda t: BertPkmForMaskedLM.from_pretrained(edit_config(saved(t, pkm_mode="replace"), pkm_mode="resm")), ValueError, r"(?s)missing from the checkpoint.*layer\.1\.intermediate\.dense"),
    ("checkpoint: pkm_n_keys edited", lambda t: BertPkmForMaskedLM.from_pretrained(edit_config(saved(t), pkm_n_keys=16)), ValueError, r"(?s)another shape.*memory\.keys: \(2, 2, 8, 8\) in the checkpoint, \(2, 2, 16, 8\) here"),
    ("checkpoint: memory tensors stripped", lambda t: BertPkmForMaskedLM.from_pretrained(strip_memories(saved(t))), ValueError, r"(?s)bert_pkm.*missing from the checkpoint.*memory\.values\.weight"),
    ("checkpoint: pkm_layers overridden on load", lambda t: BertPkmForMaskedLM.from_pretrained(saved(t), pkm_layers=[0, 1]), ValueError, r"layer\.0\.memory"),
    ("checkpoint: flipped byte, checksum", lambda t: BertPkmForMaskedLM.from_pretrained(flip_byte(saved_with_checksum(t), "bert.encoder.layer.1.memory.values.weight")), ValueError, r"pkm_weights_checksum.*corrupted"),
]  # fmt: skip

CASES = CONFIG_CASES + FORWARD_CASES + CHECKPOINT_CASES


def load_plain_bert(folder, **bert_overrides):
    config = tiny_config()
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("pkm_") and k not in ("auto_map", "model_type")}
    BertForMaskedLM(BertConfig(**{**fields, **bert_overrides})).save_pretrained(folder)
    return BertPkmForMaskedLM.from_pretrained(folder, config=config)


def test_a_bert_checkpoint_with_fewer_layers_loads_as_transformers_loads_it(tmp_path):
    """transformers initialises the layers a checkpoint lacks and lists them in its load report; BertPkm does the same
    outside the memories (their tensors, and the FFN of a memory layer, missing: refused, the cases above)."""
    config = tiny_config()
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("pkm_") and k not in ("auto_map", "model_type")}
    BertForMaskedLM(BertConfig(**{**fields, "num_hidden_layers": 2})).save_pretrained(tmp_path)
    assert max(config.pkm_layers) < 2  # the memory layers are in the checkpoint: +Init
    model, info = BertPkmForMaskedLM.from_pretrained(tmp_path, config=config, output_loading_info=True)
    missing = set(info["missing_keys"])
    assert {k for k in missing if "layer.2." in k} == {k for k in model.state_dict() if "layer.2." in k} != set()
    assert not [k for k in missing if "layer.2." not in k and ".memory." not in k]
    assert torch.isfinite(model.bert.encoder.layer[2].attention.self.query.weight).all()


def saved_with_checksum(folder):
    BertPkmForMaskedLM(tiny_config()).save_pretrained(folder, checksum=True)
    return folder


def test_there_are_enough_distinct_cases():
    assert len({name for name, *_ in CASES}) == len(CASES) >= 34


@pytest.mark.parametrize("name,make,error,names", CASES, ids=[case[0] for case in CASES])
def test_bad_input_gets_a_clear_error(tmp_path, name, make, error, names):
    with pytest.raises(error, match=names):
        make(tmp_path)


# ---- the non-finite policy leaves no trace


def test_a_refused_non_finite_batch_leaves_the_batchnorm_statistics_and_later_outputs_clean():
    lm = model(BertPkmForMaskedLM, train=True)
    batchnorm = lm.bert.encoder.layer[1].memory.query_batchnorm
    lm(input_ids=ids())  # one clean step: statistics that are not the initial ones
    before = {k: v.clone() for k, v in batchnorm.state_dict().items()}
    with pytest.raises(ValueError, match="non-finite"):
        lm(inputs_embeds=nan_embeds())
    for key, value in batchnorm.state_dict().items():
        assert torch.equal(value, before[key]), key
    lm(input_ids=ids())  # training goes on
    with torch.no_grad():
        assert torch.isfinite(lm.eval()(input_ids=ids()).logits).all()


def test_non_finite_inputs_in_eval_touch_no_state_and_stay_in_their_sequence():
    lm = model(BertPkmForMaskedLM)
    embeds = nan_embeds()
    with torch.no_grad():
        logits = lm(inputs_embeds=embeds).logits
    assert torch.isfinite(logits[0]).all() and not torch.isfinite(logits[1]).all()


# ---- 4-D masks: the memories see the real tokens


def test_a_padding_mask_broadcast_to_4d_trains_as_the_2d_mask():
    input_ids, mask = ids(3, 7), torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])
    four_d = mask.bool()[:, None, None, :].expand(3, 1, 7, 7)
    additive = (1.0 - four_d.float()) * torch.finfo(torch.float32).min
    results = []
    for attention_mask in (mask, four_d, additive):
        torch.manual_seed(0)
        lm = model(BertPkmForMaskedLM, train=True)
        logits = lm(input_ids=input_ids, attention_mask=attention_mask).logits
        results.append((logits, lm.bert.encoder.layer[1].memory.query_batchnorm.running_mean))
    for logits, running_mean in results[1:]:
        torch.testing.assert_close(running_mean, results[0][1])
        torch.testing.assert_close(logits[mask.bool()], results[0][0][mask.bool()])


def test_a_causal_4d_mask_with_padding_trains_as_the_2d_mask():
    input_ids, mask = ids(2, 6), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    results = []
    for attention_mask in (mask, causal):
        torch.manual_seed(0)
        lm = model(BertPkmForCausalLM, train=True, is_decoder=True)
        logits = lm(input_ids=input_ids, attention_mask=attention_mask).logits
        results.append((logits, lm.bert.encoder.layer[1].memory.query_batchnorm.running_var))
    torch.testing.assert_close(results[1][1], results[0][1])
    torch.testing.assert_close(results[1][0][mask.bool()], results[0][0][mask.bool()])


# ---- valid inputs are unaffected


def test_padded_batches_train_and_evaluate_as_before():
    lm = model(BertPkmForSequenceClassification, train=True)
    input_ids, mask = ids(3, 9), torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7])
    loss = lm(input_ids=input_ids, attention_mask=mask, labels=torch.tensor([0, 1, 0])).loss
    loss.backward()
    assert torch.isfinite(loss)
    with torch.no_grad():
        lm.eval()
        alone = lm(input_ids=input_ids[2:, :2]).logits
        padded = lm(input_ids=input_ids, attention_mask=mask).logits[2:]
    torch.testing.assert_close(alone, padded)


def test_generation_with_past_key_values_and_a_padded_prompt():
    lm = model(BertPkmForCausalLM, is_decoder=True)
    prompt = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = lm.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)
    # the cache reaches max_position_embeddings exactly: allowed
    with torch.no_grad():
        cache = lm(input_ids=ids(1, 60), use_cache=True).past_key_values
        assert lm(input_ids=ids(1, 4), past_key_values=cache, use_cache=True).logits.shape == (1, 4, 99)


def test_single_token_inference_and_training_without_batchnorm():
    with torch.no_grad():
        assert call(input_ids=ids(1, 1)).last_hidden_state.shape == (1, 1, 32)
    out = call(input_ids=ids(1, 1), train=True, overrides=dict(pkm_query_batchnorm=False))
    assert torch.isfinite(out.last_hidden_state).all()


def test_value_checks_can_be_switched_off():
    base = model()
    base.validate_input_values = False
    with pytest.raises(IndexError):  # the embedding's own error: the check was skipped
        base(input_ids=ids().index_fill(1, torch.tensor([0]), 99))


# ---- checkpoints


def test_the_opt_outs_load_what_fits(tmp_path):
    folder = edit_config(saved(tmp_path), pkm_layers=[2])
    loaded = BertPkmForMaskedLM.from_pretrained(folder, ignore_mismatched_memories=True)
    assert loaded.bert.encoder.layer[2].memory is not None and loaded.bert.encoder.layer[1].memory is None
    edit_config(folder, pkm_layers=[1], pkm_n_keys=16)
    loaded = BertPkmForMaskedLM.from_pretrained(folder, ignore_mismatched_sizes=True)
    assert loaded.bert.encoder.layer[1].memory.keys.shape == (2, 2, 16, 8)


def test_plain_bert_still_converts_on_load(tmp_path):
    lm = load_plain_bert(tmp_path)  # +Init: new memories, no error
    assert lm.bert.encoder.layer[1].memory is not None
    replace = BertPkmForMaskedLM.from_pretrained(tmp_path, config=tiny_config(pkm_mode="replace"))
    assert replace.bert.encoder.layer[1].intermediate is None


def test_a_head_missing_from_the_checkpoint_is_still_initialised(tmp_path):
    saved(tmp_path)
    classifier = BertPkmForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert classifier.classifier.out_features == 3


def test_checksum_round_trip_is_sticky_and_optional(tmp_path):
    lm = BertPkmForMaskedLM(tiny_config())
    lm.save_pretrained(tmp_path / "plain")
    assert BertPkmForMaskedLM.from_pretrained(tmp_path / "plain").config.pkm_weights_checksum is None
    lm.save_pretrained(tmp_path / "sum", checksum=True)
    loaded = BertPkmForMaskedLM.from_pretrained(tmp_path / "sum")
    assert loaded.config.pkm_weights_checksum["algorithm"] == "sha256"
    # another head class verifies the embeddings and encoder
    BertPkmForSequenceClassification.from_pretrained(tmp_path / "sum")
    with torch.no_grad():
        loaded.bert.encoder.layer[1].memory.values.weight[0, 0] += 1
    loaded.save_pretrained(tmp_path / "again")  # a loaded model with a checksum saves a fresh one
    assert BertPkmForMaskedLM.from_pretrained(tmp_path / "again").config.pkm_weights_checksum is not None
    flip_byte(tmp_path / "again", "bert.encoder.layer.1.memory.values.weight")
    with pytest.raises(ValueError, match="pkm_weights_checksum"):
        BertPkmForSequenceClassification.from_pretrained(tmp_path / "again")
    BertPkmForMaskedLM.from_pretrained(tmp_path / "again", verify_checksum=False)


REMOTE_CHECKSUM = r"""
import sys
sys.modules["modeling_pkm_bert"] = None
from transformers import AutoModelForMaskedLM
AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True)  # intact: loads
try:
    AutoModelForMaskedLM.from_pretrained(sys.argv[2], trust_remote_code=True)
except ValueError as error:
    print("REFUSED", error)
"""


def test_checksum_is_verified_through_remote_code(tmp_path):
    good, bad = saved_with_checksum(tmp_path / "good"), saved_with_checksum(tmp_path / "bad")
    flip_byte(bad, "bert.encoder.layer.1.memory.values.weight")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CHECKSUM, str(good), str(bad)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout and "pkm_weights_checksum" in result.stdout



@pytest.mark.slow  # torch.compile (5 s on 2 cores)
def test_compiled_graphs_hold_no_data_dependent_check():
    """`fullgraph=True` fails on any graph break: the id-range and non-finite checks (host syncs) are not traced."""
    lm = model(BertPkmForMaskedLM, train=True)
    input_ids = ids(2, 8)
    compiled = torch.compile(lm, backend="eager", fullgraph=True)
    torch.manual_seed(0)
    expected = lm(input_ids=input_ids).logits
    torch.manual_seed(0)
    torch.testing.assert_close(compiled(input_ids=input_ids).logits, expected)
    with torch.no_grad():
        lm.eval()
        torch.testing.assert_close(compiled(input_ids=input_ids).logits, lm(input_ids=input_ids).logits)
