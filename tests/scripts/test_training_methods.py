"""The training methods behind one interface (`methods.base.TrainingMethod`, `methods.registry.METHODS`): every method
folder is registered, the training loop names none, and a method registered from outside takes part in a run through
the registry alone: its flags, its check, its hooks in order around the optimizer step, its state in the checkpoints
and its settings in the resume check."""

import argparse
import ast
import json
import logging
import os
import re

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from helpers import REPO_ROOT, reset_accelerate_state
from torch.utils.data import DataLoader, TensorDataset

from modeling_pkm_bert.methods import registry
from modeling_pkm_bert.methods.base import TrainingMethod
from modeling_pkm_bert.training.checkpoints import run_settings
from modeling_pkm_bert.training.loop import TrainingLoop, create_scheduler, plan_training_steps
from modeling_pkm_bert.utils.input_errors import InputError


METHODS_DIR = REPO_ROOT / "modeling_pkm_bert" / "methods"


def test_every_method_folder_is_registered_once():
    folders = sorted(path.name for path in METHODS_DIR.iterdir() if (path / "__init__.py").is_file())
    registered = sorted(method.__module__.split(".")[2] for method in registry.METHODS.values())
    assert registered == folders
    for name, method in registry.METHODS.items():
        assert issubclass(method, TrainingMethod) and method.name == name


def test_the_training_loop_names_no_method():
    source = (REPO_ROOT / "modeling_pkm_bert" / "training" / "loop.py").read_text(encoding="utf-8")
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported, "the scan found the loop's imports"
    assert not [module for module in imported if module.startswith("..methods.")], "the loop imports a method's folder"
    folders = [path.name for path in METHODS_DIR.iterdir() if (path / "__init__.py").is_file()]
    names = [*registry.METHODS, *(method.__name__ for method in registry.METHODS.values()), "smf"]
    named = [name for name in names if re.search(rf"\b{name}\b", source)]
    named += [folder for folder in folders if re.search(rf"methods\.{folder}\b", source)]
    assert named == []


def test_flags_and_checks_come_from_the_registry():
    def parser_for(task):
        return registry.add_method_arguments(argparse.ArgumentParser(prog="script"), task=task)

    assert "--trime" in parser_for("causal-lm").format_help()
    assert "--trime" not in parser_for("sequence-classification").format_help()
    assert "--sparse_memory_finetuning" in parser_for("question-answering").format_help()
    parser = parser_for("masked-lm")
    args = parser.parse_args(["--trime"])
    registry.check_method_arguments(args, "masked-lm")
    assert (args.trime, args.trime_eval) == ("batch", "context")  # resolved by TRIME's check
    args = parser.parse_args(["--sparse_memory_finetuning", "--smf_top_t", "0"])
    with pytest.raises(InputError, match="--smf_top_t 0 must be >= 1"):  # the script's main: a usage error
        registry.check_method_arguments(args, "masked-lm")


class ToyMethod(TrainingMethod):
    """Records its hooks; counts its optimizer steps and keeps the count in checkpoints."""

    name = "toy"
    resume_settings = ("toy_rate",)
    events: list = []

    def __init__(self, accelerator):
        self.accelerator, self.steps = accelerator, 0

    @classmethod
    def add_arguments(cls, parser, task):
        parser.add_argument("--toy_rate", type=float, default=None)

    @classmethod
    def check_arguments(cls, args, task):
        if args.toy_rate is not None and args.toy_rate <= 0:
            raise ValueError("--toy_rate must be > 0")

    @classmethod
    def setup(cls, args, accelerator, model, **context):
        return cls(accelerator) if args.toy_rate else None

    def prepared(self, accelerator, model, memory_optimizer):
        self.events.append("prepared")

    def summary(self):
        return ["Toy method on"]

    def after_backward(self):
        self.events.append("after_backward")

    def before_optimizer_step(self):
        self.events.append("before_optimizer_step")

    def after_optimizer_step(self):
        self.steps += 1
        self.events.append("after_optimizer_step")

    def save_state(self, folder):
        if self.accelerator.is_main_process:
            with open(os.path.join(folder, "toy.json"), "w", encoding="utf-8") as handle:
                json.dump({"steps": self.steps}, handle)

    def load_state(self, folder):
        with open(os.path.join(folder, "toy.json"), encoding="utf-8") as handle:
            self.steps = json.load(handle)["steps"]
        self.events.append(f"load_state {os.path.basename(folder)}")


def toy_run(output_dir, toy_rate=0.5, **overrides):
    """4 optimizer steps of a linear model (2 batches each) with every registered method that the flags turn on."""
    reset_accelerate_state()
    parser = registry.add_method_arguments(argparse.ArgumentParser(), task="sequence-classification")
    args = parser.parse_args([] if toy_rate is None else ["--toy_rate", str(toy_rate)])
    registry.check_method_arguments(args, "sequence-classification")
    options = dict(
        output_dir=str(output_dir), gradient_accumulation_steps=2, per_device_train_batch_size=2, num_train_epochs=1,
        max_train_steps=None, learning_rate=0.1, lr_scheduler_type="linear", checkpointing_steps="2",
        resume_from_checkpoint=None, eval_steps=None, track_staleness=False, staleness_bins=5, with_tracking=False,
        memory_learning_rate=1e-3, memory_optimizer="adam", memory_max_grad_norm=None, allow_inexact_resume=False,
        seed=0,
    )  # fmt: skip
    vars(args).update(options, **overrides)
    seedable = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(gradient_accumulation_steps=2, dataloader_config=seedable)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    methods = registry.setup_methods(args, accelerator, model, tokenizer=None, max_seq_length=8)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    dataloader = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    optimizer.register_step_post_hook(lambda *_: ToyMethod.events.append("optimizer.step"))
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    registry.prepare_methods(methods, accelerator, model, None)
    steps_per_epoch = plan_training_steps(args, dataloader)
    loop = TrainingLoop(
        accelerator, args, model, [optimizer], create_scheduler(accelerator, args, optimizer, num_warmup_steps=0),
        dataloader, steps_per_epoch=steps_per_epoch, settings=run_settings(args, accelerator),
        logger=logging.getLogger(__name__), methods=methods,
    )  # fmt: skip
    loop.resume()
    for epoch in loop.epochs():
        for _, (inputs, targets) in loop.batches(epoch):
            with accelerator.accumulate(model):
                loop.step(torch.nn.functional.mse_loss(model(inputs), targets))
            loop.after_batch()
        loop.after_epoch(epoch)
    return loop, methods


def test_a_registered_method_runs_its_hooks_in_order_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.METHODS, "toy", ToyMethod)
    monkeypatch.setattr(ToyMethod, "events", [])
    loop, methods = toy_run(tmp_path)
    (toy,) = [method for method in methods if isinstance(method, ToyMethod)]
    assert loop.completed_steps == toy.steps == 4  # 8 batches, 2 a step
    step = ["after_backward", "before_optimizer_step", "optimizer.step", "after_optimizer_step"]
    assert ToyMethod.events == ["prepared", *step * 4]  # the hooks once a step, not at every batch
    assert json.loads((tmp_path / "step_2" / "toy.json").read_text()) == {"steps": 2}
    assert json.loads((tmp_path / "step_2" / "run_settings.json").read_text())["toy_rate"] == 0.5

    ToyMethod.events.clear()
    loop, methods = toy_run(tmp_path, resume_from_checkpoint=str(tmp_path / "step_2"))
    (toy,) = [method for method in methods if isinstance(method, ToyMethod)]
    assert ToyMethod.events == ["prepared", "load_state step_2", *step * 2] and toy.steps == 4
    with pytest.raises(ValueError, match="toy_rate"):  # its setting is part of the resume check
        toy_run(tmp_path, toy_rate=0.25, resume_from_checkpoint=str(tmp_path / "step_2"))


def test_a_method_the_flags_leave_off_takes_no_part(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.METHODS, "toy", ToyMethod)
    monkeypatch.setattr(ToyMethod, "events", [])
    loop, methods = toy_run(tmp_path, toy_rate=None)
    assert [type(method).__name__ for method in methods] == ["MemoryOptimizerMethod"]
    assert loop.completed_steps == 4 and ToyMethod.events == ["optimizer.step"] * 4


def test_both_memory_kinds_expose_their_table_under_one_name():
    from helpers import tiny_config

    from modeling_pkm_bert import BertPkmForMaskedLM
    from modeling_pkm_bert.methods.optimizers import memory_optimizer_summary, pkm_value_parameters, set_sparse_values
    from modeling_pkm_bert.utils.memories import memory_table, memory_tables

    model = BertPkmForMaskedLM(tiny_config(ngram_layers=[0], ngram_table_size=211, ngram_dim=4))
    tables = memory_tables(model)
    layers = model.bert.encoder.layer
    memory, ngram = layers[1].memory, layers[0].ngram
    assert tables == {"bert.encoder.layer.1.memory": memory.values, "bert.encoder.layer.0.ngram": ngram.tables}
    assert memory_table(ngram) is ngram.tables and memory_table(memory) is memory.values
    assert [p.shape[0] for p in pkm_value_parameters(model)] == [8**2, ngram.tables.weight.shape[0]]
    assert set_sparse_values(model, True) == 2 and all(table.sparse for table in tables.values())
    assert memory_optimizer_summary(None, model, 1e-3).endswith("sparse gradients")
