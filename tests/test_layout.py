"""The package layout: the flat files at the package root are exactly the shipped remote code, a saved folder holds
exactly those, `import modeling_pkm_bert` is lazy (no torch, no op registered), and the module paths of release 0.2.0
still import (with a DeprecationWarning) as the modules at their new places."""

import importlib
import json
import subprocess
import sys
import warnings

import pytest
from conftest import REPO_ROOT, tiny_config

import modeling_pkm_bert
from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES


PACKAGE = REPO_ROOT / "modeling_pkm_bert"


def test_package_root_holds_exactly_the_remote_code_files():
    flat = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert flat == sorted(["__init__.py", *REMOTE_CODE_FILES])
    # everything else lives in subpackages
    for folder in (path for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"):
        assert (folder / "__init__.py").is_file(), f"{folder.name}/ is not a package"


def test_save_pretrained_writes_exactly_the_remote_code_files(tmp_path):
    from modeling_pkm_bert import BertPkmForMaskedLM

    BertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.glob("*.py")) == sorted(REMOTE_CODE_FILES)


def test_upload_list_takes_the_remote_code_files(tmp_path):
    from modeling_pkm_bert.hub.conversion import files_to_upload

    for name in (*REMOTE_CODE_FILES, "train.py", "utils_qa.py"):
        (tmp_path / name).write_text("")
    assert files_to_upload(tmp_path) == sorted(REMOTE_CODE_FILES)


LAZY_IMPORT = """
import json, sys
import modeling_pkm_bert
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
before = {"heavy": heavy}
import torch
before["ops"] = hasattr(torch.ops.pkm_bert, "select_product_keys")
from modeling_pkm_bert import BertPkmForMaskedLM  # a model class: the native kernels register on first use
before["ops_after_class"] = hasattr(torch.ops.pkm_bert, "select_product_keys")
print(json.dumps(before))
"""


def test_import_is_lazy_and_the_first_class_registers_the_kernels():
    done = subprocess.run([sys.executable, "-c", LAZY_IMPORT], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["ops"] is False
    from modeling_pkm_bert.kernels import cpu

    assert result["ops_after_class"] is (cpu.library() is not None)


@pytest.mark.parametrize("old, new", sorted(modeling_pkm_bert.LEGACY_MODULES.items()))
def test_old_module_paths_import_with_a_deprecation_warning(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    # `from modeling_pkm_bert.<old> import name` gives the name at its new place
    public = [name for name in vars(module) if not name.startswith("_")]
    assert public and getattr(importlib.import_module(old), public[0]) is getattr(module, public[0])


def test_names_of_the_old_training_module_still_import():
    from modeling_pkm_bert.training import (  # noqa: F401 (what run scripts of release 0.2.0 imported)
        MEMORY_OPTIMIZERS,
        atomic_write_json,
        check_checkpoint,
        clip_memory_gradients,
        create_memory_optimizer,
        load_model,
        memory_modules,
        optimizer_param_groups,
        save_checkpoint,
    )


def test_public_names_resolve():
    for name in modeling_pkm_bert.__all__:
        assert getattr(modeling_pkm_bert, name) is not None
    with pytest.raises(AttributeError):
        modeling_pkm_bert.no_such_name  # noqa: B018


def package_modules():
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def test_every_module_says_what_it_is_for():
    import ast

    for path in package_modules():
        assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), f"{path.relative_to(REPO_ROOT)} has no docstring"


def test_no_private_name_crosses_a_module_boundary():
    """`from .x import _name` (or of the package by its name) imports a private name of another module: none does."""
    import ast

    for path in [*package_modules(), *sorted((REPO_ROOT / "run_scripts").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("modeling_pkm_bert")):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{path.relative_to(REPO_ROOT)} imports {private} from {node.module}"


def test_the_memory_optimizer_logged_is_the_one_used():
    import argparse

    from modeling_pkm_bert import BertPkmForMaskedLM
    from modeling_pkm_bert.training import create_memory_optimizer, memory_optimizer_summary, optimizer_param_groups

    model = BertPkmForMaskedLM(tiny_config())
    _, memory_groups = optimizer_param_groups(model, weight_decay=0.0)
    for name, logged in (("adam", "Adam"), ("sgd", "SGD"), ("sparse_row_adam", "SparseRowAdam")):
        args = argparse.Namespace(memory_optimizer=name, memory_learning_rate=1e-3)
        optimizer = create_memory_optimizer(memory_groups, args, model)
        assert memory_optimizer_summary(optimizer, model, 1e-3).startswith(f"Memory values: {logged}, constant lr 0.001")
