"""What transformers' common model tests check for BERT (tests/test_modeling_common.py), for every BertPkm and
RobertaPkm class:
batching equivalence, save/load, initialisation of weights missing from a checkpoint, training with gradient
checkpointing (reentrant and not) equal to training without, query BatchNorm statistics included."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

import modeling_pkm_bert
from helpers import family_tester, tiny_config
from modeling_pkm_bert.utils.memories import memory_modules


CLASSES = [
    "BertPkmModel",
    "BertPkmForMaskedLM",
    "BertPkmForCausalLM",
    "BertPkmForSequenceClassification",
    "BertPkmForTokenClassification",
    "BertPkmForQuestionAnswering",
    "BertPkmForMultipleChoice",
]
CLASSES += [name.replace("BertPkm", "RobertaPkm") for name in CLASSES]  # the same layers, RoBERTa's embeddings and heads


def head(class_name: str) -> str:
    """The BertPkm class of the same head (`RobertaPkmForMaskedLM` -> `BertPkmForMaskedLM`)."""
    return class_name.replace("RobertaPkm", "BertPkm")


def make_model(class_name: str) -> torch.nn.Module:
    labels = 3 if head(class_name) in ("BertPkmForSequenceClassification", "BertPkmForTokenClassification") else 2
    return family_tester(class_name).get_model(class_name, pkm_layers=[0, 2], num_labels=labels)  # CausalLM: a decoder


def make_inputs(class_name: str, size: int = 3, length: int = 7) -> dict:
    ids = torch.randint(5, 99, (size, length))
    mask = torch.ones_like(ids)
    mask[0, length - 3 :] = 0  # one padded row
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    if head(class_name) == "BertPkmForMultipleChoice":
        inputs = {name: torch.stack([value, value.flip(0)], 1) for name, value in inputs.items()}
    if head(class_name) == "BertPkmForCausalLM":
        inputs["use_cache"] = False  # the forward pass, without a cache among the outputs
    return inputs


def first_output(outputs) -> torch.Tensor:
    return outputs[0]  # last_hidden_state, or the logits of a head


@pytest.mark.parametrize("class_name", CLASSES)
def test_batching_equivalence(class_name):
    """Each row alone gives what it gives in a batch with a padded row (transformers' test_batching_equivalence);
    the padded row also without its padding, where its outputs do not depend on the positions."""
    model = make_model(class_name).eval()
    inputs = make_inputs(class_name)
    with torch.no_grad():
        batched = model(**inputs)
        for row in range(3):
            alone = model(**{name: value[row : row + 1] if torch.is_tensor(value) else value for name, value in inputs.items()})
            assert alone.keys() == batched.keys()
            for name in batched.keys():
                torch.testing.assert_close(alone[name], batched[name][row : row + 1], atol=1e-5, rtol=1e-5, msg=name)
        if head(class_name) in ("BertPkmModel", "BertPkmForMaskedLM", "BertPkmForTokenClassification"):
            length = int(inputs["attention_mask"][0].sum())
            unpadded = model(**{name: value[:1, :length] for name, value in inputs.items()})
            torch.testing.assert_close(unpadded[0], batched[0][:1, :length], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("class_name", CLASSES)
def test_save_load_gives_the_same_outputs(class_name, tmp_path):
    model = make_model(class_name)
    model.train()
    with torch.no_grad():  # a training forward moves the query BatchNorm statistics: they must be saved
        model(**make_inputs(class_name))
    model.eval()
    inputs = make_inputs(class_name)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    for name, buffer in model.state_dict().items():  # every parameter and buffer, bitwise
        assert torch.equal(loaded.state_dict()[name], buffer), name
    with torch.no_grad():  # the same weights at other addresses: a GEMM may sum in another order (seen: 9e-10)
        torch.testing.assert_close(first_output(loaded(**inputs)), first_output(model(**inputs)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("class_name", CLASSES)
def test_weights_missing_from_a_checkpoint_are_initialised(class_name, tmp_path):
    """transformers' test_can_init_all_missing_weights: with `ignore_mismatched_memories=True` (without it the load is
    refused, tests/models/test_bad_inputs.py), a checkpoint without its memories loads with memories
    initialised as a new model's (keys uniform in XLM's bound, values N(0, v_dim^-1/2), BatchNorm reset), never
    torch.empty garbage; the weights that were in the checkpoint are loaded."""
    model = make_model(class_name)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items() if ".memory." not in name}
    assert len(kept) < len(weights)
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="do not fit"):  # a BertPkm checkpoint that lost its memories is refused
        type(model).from_pretrained(tmp_path)
    torch.manual_seed(1)
    loaded = type(model).from_pretrained(tmp_path, ignore_mismatched_memories=True)  # unless the user opts in
    for name, tensor in kept.items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, msg=name)
    memories = memory_modules(loaded)
    assert len(memories) == 2
    for memory in memories.values():
        bound = (memory.k_dim // 2) ** -0.5
        assert memory.keys.abs().max() <= bound and memory.keys.std() > bound / 3
        assert abs(memory.values.weight.std().item() - memory.v_dim**-0.5) < 0.05 * memory.v_dim**-0.5
        assert memory.values.weight.abs().max() < 10 * memory.v_dim**-0.5
        assert memory.query_proj.weight.isfinite().all() and memory.query_proj.weight.abs().max() < 1
        batchnorm = memory.query_batchnorm
        assert torch.equal(batchnorm.running_var, torch.ones_like(batchnorm.running_var))
        assert torch.equal(batchnorm.running_mean, torch.zeros_like(batchnorm.running_mean))


@pytest.mark.parametrize("class_name", CLASSES)
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense_values", "sparse_values"])
def test_training_with_gradient_checkpointing_equals_training_without(class_name, use_reentrant, sparse):
    """Same loss, gradients and query BatchNorm running statistics (updated once, not again by the recomputation); with
    sparse value gradients too (at this size the read is one autograd node, recomputed by the checkpoint)."""
    model = make_model(class_name).train()
    for memory in memory_modules(model).values():
        memory.sparse_values = sparse
    inputs = make_inputs(class_name)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert checkpointed.is_gradient_checkpointing
    results = []
    for candidate in (model, checkpointed):
        loss = first_output(candidate(**inputs)).pow(2).mean()
        loss.backward()
        results.append(candidate)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert any(".memory.values." in name for name in grads) and any(".memory.keys" in name for name in grads)
    for name, parameter in checkpointed.named_parameters():
        if name in grads:
            assert parameter.grad.is_sparse == grads[name].is_sparse == (sparse and ".memory.values." in name), name
            got, expected = (grad.to_dense() if grad.is_sparse else grad for grad in (parameter.grad, grads[name]))
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, msg=name)
        else:
            assert parameter.grad is None, name
    for name, buffer in model.named_buffers():
        assert torch.equal(dict(checkpointed.named_buffers())[name], buffer), name  # num_batches_tracked == 1
    batchnorms = [m.query_batchnorm for m in memory_modules(checkpointed).values()]
    assert [int(bn.num_batches_tracked) for bn in batchnorms] == [1, 1]


# transformers' loading contracts (tests/test_modeling_common.py: test_load_with_mismatched_shapes,
# test_can_load_ignoring_mismatched_shapes, test_model_weights_reload_no_missing_tied_weights) and its exported
# generation (test_torch_export_generate_dynamic), for both memory modes


@pytest.mark.parametrize("mode", ["resm", "replace"])
def test_a_head_of_another_shape_raises_what_transformers_raises_unless_ignored(mode, tmp_path):
    model = modeling_pkm_bert.BertPkmForSequenceClassification(tiny_config(num_labels=2, pkm_mode=mode))
    model.save_pretrained(tmp_path)
    for error in (RuntimeError, ValueError):  # transformers raises RuntimeError; ours names the tensors as well
        with pytest.raises(error, match=r"classifier.weight: \(2, 32\) in the checkpoint, \(3, 32\) here"):
            modeling_pkm_bert.BertPkmForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    loaded, info = modeling_pkm_bert.BertPkmForSequenceClassification.from_pretrained(
        tmp_path, num_labels=3, ignore_mismatched_sizes=True, output_loading_info=True
    )
    assert loaded.classifier.weight.shape == (3, 32)
    assert {key for key, _, _ in info["mismatched_keys"]} == {"classifier.weight", "classifier.bias"}
    for name, tensor in model.bert.state_dict().items():
        assert torch.equal(loaded.bert.state_dict()[name], tensor), name


@pytest.mark.parametrize("mode", ["resm", "replace"])
def test_tensors_missing_outside_the_memories_are_initialised_as_transformers_does(mode, tmp_path):
    model = modeling_pkm_bert.BertPkmForMaskedLM(tiny_config(pkm_mode=mode, pkm_layers=[0, 2]))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = {"bert.encoder.layer.1.attention.self.query.weight", "cls.predictions.transform.dense.weight"}
    save_file({k: v for k, v in weights.items() if k not in dropped}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = modeling_pkm_bert.BertPkmForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == dropped
    for name in dropped:
        tensor = loaded.state_dict()[name]
        assert tensor.isfinite().all() and 0 < tensor.std() < 0.1, name  # N(0, initializer_range), not torch.empty
    # a memory tensor missing would compute something else: still refused
    save_file({k: v for k, v in weights.items() if ".memory.keys" not in k}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="do not fit"):
        modeling_pkm_bert.BertPkmForMaskedLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("mode", ["resm", "replace"])
def test_token_types_broadcast_as_exported_generation_passes_them(mode):
    model = modeling_pkm_bert.BertPkmForCausalLM(tiny_config(is_decoder=True, pkm_mode=mode)).eval()
    input_ids = torch.randint(5, 99, (2, 2))
    token_types = torch.tensor([[1], [0]])
    with torch.no_grad():
        broadcast = model(input_ids, token_type_ids=token_types, use_cache=False).logits
        full = model(input_ids, token_type_ids=token_types.expand(2, 2), use_cache=False).logits
    torch.testing.assert_close(broadcast, full)
    with pytest.raises(ValueError, match=r"token_type_ids of shape \(2, 3\) must match input_ids: \(2, 2\)"):
        model(input_ids, token_type_ids=torch.zeros(2, 3, dtype=torch.long))
