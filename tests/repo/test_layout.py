"""The package layout: the flat files at the package root are exactly the shipped remote code, a saved folder holds
exactly those, `import modeling_pkm_bert` is lazy (no torch, no op registered), the subpackages import each other without
a cycle, every package resolves its lazy names through the one helper from the module that defines them, the
scripts and benchmarks import each name from its module, and ruff (ruff.toml) finds nothing."""

import ast
import importlib
import importlib.util
import json
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, bert_pkm_code_files, tiny_config, tiny_roberta_config

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
    from modeling_pkm_bert import BertPkmForMaskedLM, RobertaPkmForMaskedLM

    BertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path / "bert")
    assert sorted(path.name for path in (tmp_path / "bert").glob("*.py")) == sorted(bert_pkm_code_files())
    # a RobertaPkm model imports the BertPkm files too: its folder holds every shipped file but ModernBertPkm's
    RobertaPkmForMaskedLM(tiny_roberta_config()).save_pretrained(tmp_path / "roberta")
    roberta_files = [name for name in REMOTE_CODE_FILES if "modernbert" not in name]
    assert sorted(path.name for path in (tmp_path / "roberta").glob("*.py")) == sorted(roberta_files)


def test_upload_list_takes_the_remote_code_files(tmp_path):
    from modeling_pkm_bert.hub.upload import files_to_upload

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
    from modeling_pkm_bert.methods.optimizers.scripts import create_memory_optimizer, memory_optimizer_summary, optimizer_param_groups

    model = BertPkmForMaskedLM(tiny_config())
    _, memory_groups = optimizer_param_groups(model, weight_decay=0.0)
    for name, logged in (("adam", "Adam"), ("sgd", "SGD"), ("sparse_row_adam", "SparseRowAdam")):
        args = argparse.Namespace(memory_optimizer=name, memory_learning_rate=1e-3)
        optimizer = create_memory_optimizer(memory_groups, args, model)
        assert memory_optimizer_summary(optimizer, model, 1e-3).startswith(f"Memory values: {logged}, constant lr 0.001")


# ---- the import graph between subpackages ----

SHIPPED, PACKAGE_API = "shipped files", "modeling_pkm_bert/__init__"


def node_of(module: str) -> str | None:
    """The node of the graph a module (or a name of a package) belongs to: a subpackage, the shipped flat files, or
    the package's own `__init__` (its public names and `register_auto_classes`); None outside the package."""
    parts = module.split(".")
    if parts[0] != "modeling_pkm_bert":
        return None
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    if len(parts) > 1 and (PACKAGE / f"{parts[1]}.py").is_file():
        return SHIPPED
    return PACKAGE_API


def is_module(module: str) -> bool:
    path = REPO_ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path) -> list[tuple[str, int]]:
    """(module or package name, line) of everything `path` imports from the package: every import statement, those
    inside functions included (`from .x import y` is module x.y where y is a submodule, else x), and the entries of
    its lazy-export table (a lazy import by name). Imports under `if TYPE_CHECKING:` run for a type checker only."""
    name = module_name_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                found.append((f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base, node.lineno))
    found += [(module, 0) for module in lazy_table(path).values()]
    return found


def runtime_nodes(tree):
    """Every node of `tree` but those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def module_graph() -> dict[str, dict[str, list[str]]]:
    """{module: {module of the package it imports: ["path:line", ...]}}: the import statements of every module (those
    inside functions included), without the lazy-export tables (a name resolved on use, not an import)."""
    graph = {}
    for path in package_modules():
        source = module_name_of(path)
        for module, line in imports_of(path):
            if line and module.startswith("modeling_pkm_bert") and module != source:
                graph.setdefault(source, {}).setdefault(module, []).append(f"{path.relative_to(REPO_ROOT)}:{line}")
    return graph


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{node: {node it imports: ["path:line", ...]}} over every module of the package (line 0: a lazy-export table)."""
    graph = {}
    for path in package_modules():
        source = node_of(module_name_of(path))
        for module, line in imports_of(path):
            target = node_of(module)
            if target is not None and target != source:
                graph.setdefault(source, {}).setdefault(target, []).append(f"{path.relative_to(REPO_ROOT)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_and_the_import_scan():
    """The checks themselves: a cycle is found and named; a lazy import inside a function, a package's name
    (`from .. import register_auto_classes`) and a lazy-export table entry each count as an edge."""
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {}}) is None
    imported = dict(imports_of(PACKAGE / "training" / "checks.py"))
    assert "modeling_pkm_bert" in imported and "modeling_pkm_bert.parallel.arguments" in imported
    assert imported["modeling_pkm_bert.parallel.arguments"] > 0  # inside a function
    assert ("modeling_pkm_bert.methods.optimizers.memory_optimizer", 0) in imports_of(PACKAGE / "methods" / "__init__.py")
    assert node_of("modeling_pkm_bert.register_auto_classes") == PACKAGE_API
    assert node_of("modeling_pkm_bert.modeling_bert_pkm") == SHIPPED


def test_modules_import_each_other_without_a_cycle():
    """Within a subpackage too (analysis.ngram_usage drew its figures with analysis.report's helpers while the report
    imported it: both now take them from analysis.figures)."""
    graph = module_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(where)
    analysis = "modeling_pkm_bert.analysis."
    assert f"{analysis}figures" in graph[f"{analysis}ngram_usage"] and f"{analysis}report" not in graph[f"{analysis}ngram_usage"]
    # a type checker's import is no edge (hub.model_card names hub.conversion's ConversionReport in an annotation)
    assert "modeling_pkm_bert.hub.conversion" not in graph["modeling_pkm_bert.hub.model_card"]


def test_subpackages_import_each_other_without_a_cycle():
    graph = import_graph()
    shown = "\n".join(f"{node} -> {', '.join(sorted(targets))}" for node, targets in sorted(graph.items()))
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(where) + "\n\n" + shown
    # the helpers everyone shares import nothing of the package but the shipped files
    assert set(graph["utils"]) == {SHIPPED}


# lowest first (docs/DESIGN: the shipped files; the shared helpers; kernels/serving/parallel; methods; hub/analysis;
# the harness; integrations); the package root's public names come from the layers below methods
LAYERS = [
    SHIPPED,
    "utils",
    "kernels",
    "serving",
    "parallel",
    PACKAGE_API,
    "methods",
    "hub",
    "analysis",
    "training",
    "integrations",
]


def test_subpackages_import_only_the_layers_below():
    graph = import_graph()
    assert set(graph) | {t for targets in graph.values() for t in targets} <= set(LAYERS), "a new subpackage: add it"
    upward = [
        f"{node} -> {target}: {', '.join(where[:3])}"
        for node, targets in graph.items()
        for target, where in targets.items()
        if LAYERS.index(target) > LAYERS.index(node)
    ]
    assert upward == []


def test_every_package_resolves_its_names_lazily_through_one_helper():
    """Every package `__init__` gets `__getattr__` from `utils.lazy_imports.lazy_exports` (none writes its own, the
    package root only registers the kernels first), and each name of a table is defined in the module the table names
    (not imported there): one known module per name, no search."""
    for path in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
        table = lazy_table(path)
        if path.parent == PACKAGE:
            assert own and table, "the package root resolves its public names through lazy_exports"
        else:
            assert not own, f"{path.relative_to(REPO_ROOT)} writes its own __getattr__: use lazy_exports"
        for name, module in table.items():
            file = REPO_ROOT.joinpath(*module.split("."))
            file = file / "__init__.py" if file.is_dir() else file.with_suffix(".py")
            assert name in defined_names(file), f"{path.relative_to(REPO_ROOT)}: {name} is not defined in {module}"
        # (the root's __all__ leaves out AUTO_MAP, ProductKeyValues, ...)
        if table and path.parent != PACKAGE:
            package = importlib.import_module(module_name_of(path))
            assert package.__all__ == sorted(table) and set(package.__all__) <= set(dir(package))


def module_name_of(path) -> str:
    """`modeling_pkm_bert/serving/quantization.py` -> `modeling_pkm_bert.serving.quantization` (a package: its
    `__init__` dropped)."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lazy_table(path) -> dict[str, str]:
    """{name: absolute module} of the `lazy_exports` table of a package `__init__`, read from its source (a dict
    literal, in the call or bound to a module-level name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    literals = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                literals[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    table = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_exports":
            value = literals[node.args[1].id] if isinstance(node.args[1], ast.Name) else ast.literal_eval(node.args[1])
            table |= {item: importlib.util.resolve_name(module, package) for module, names in value.items() for item in names}
    return table


def defined_names(path) -> set[str]:
    """The names a module defines at its top level: functions, classes, assignments (not its imports)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_a_package_exports_only_the_names_of_its_own_modules():
    """No subpackage re-exports a name of another (an old path kept alive): `training.SparseRowAdam` is an
    AttributeError, `methods.optimizers` is where it lives. The package root is the public API and takes its names
    from everywhere."""
    import modeling_pkm_bert.training as training
    from modeling_pkm_bert.training.loading import load_model

    for path in PACKAGE.rglob("__init__.py"):
        if path.parent != PACKAGE:
            package = module_name_of(path)
            foreign = {name: module for name, module in lazy_table(path).items() if not module.startswith(package + ".")}
            assert foreign == {}, f"{package} re-exports names of other packages"
    assert training.load_model is load_model
    for name in ("SparseRowAdam", "memory_modules", "no_such_name"):
        with pytest.raises(AttributeError, match=name):
            getattr(training, name)


def script_imports(path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from modeling_pkm_bert... import name` of a script where name is not a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("modeling_pkm_bert") and not node.level:
            found += [
                (node.lineno, node.module, alias.name)
                for alias in node.names
                if not is_module(f"{node.module}.{alias.name}")
            ]
    return found


@pytest.mark.parametrize("folder", ["run_scripts", "benchmarks"])
def test_scripts_import_each_name_from_the_module_that_defines_it(folder):
    """Not through a subpackage's lazy `__init__` nor a re-export, so that a reader finds the name where the import
    says. The package root is the exception: it is the public API, and resolving a model class there registers the
    native kernels (what a user gets)."""
    problems = []
    for path in sorted((REPO_ROOT / folder).glob("*.py" if folder == "run_scripts" else "**/*.py")):  # the package
        for line, module, name in script_imports(path):
            if module == "modeling_pkm_bert":
                continue
            file = REPO_ROOT.joinpath(*module.split("."))
            file = file / "__init__.py" if file.is_dir() else file.with_suffix(".py")
            if name not in defined_names(file):
                problems.append(f"{path.relative_to(REPO_ROOT)}:{line}: {name} is not defined in {module}")
    assert problems == []


def test_ruff_finds_nothing():
    """`make lint` as part of the suite (CI runs only `make test`): ruff with ruff.toml over the repository."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -c constraints.txt ruff; it is in the dev extras)")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, f"ruff check (see ruff.toml):\n{done.stdout}{done.stderr}"
