"""No code of the project imports through a deprecated path: a module alias (`modeling_pkm_bert.LEGACY_MODULES`), or
a name that moved out of a module that stays (the `moved_names` / `lazy_exports(..., moved=...)` tables, e.g.
`training.optimization.SparseRowAdam`, now `methods.optimizers.SparseRowAdam`): such an import warns today and breaks
when the old paths go. The scan reads every import statement, those inside functions included (a lazy import would
escape an import-everything check). Every old path still gives the object at its new place, with a
DeprecationWarning that names it."""

import ast
import importlib
import importlib.util
import warnings

import pytest
from conftest import REPO_ROOT

from modeling_pkm_bert import LEGACY_MODULES


SCANNED = ("modeling_pkm_bert", "run_scripts", "benchmarks")


def module_name(path) -> str:
    """`modeling_pkm_bert/serving/quantization.py` -> `modeling_pkm_bert.serving.quantization` (a package: its
    `__init__` dropped); a script outside the package: its path, dotted."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every module an import statement of `source` may load: `import a.b`, `from a
    import b` (a.b, when b is a submodule, and a), relative imports resolved against the module `name`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def lazy_tables(path) -> dict[str, dict[str, str]]:
    """The lazy-import tables of a module (`utils.lazy_imports`), read from its source: {"exports": {name: module},
    "moved": {name: new module}} with absolute module names. A table is a dict literal, in the call or bound to a
    module-level name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    literals = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                literals[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass

    def table(node) -> dict[str, str]:
        value = literals[node.id] if isinstance(node, ast.Name) else ast.literal_eval(node)
        return {item: importlib.util.resolve_name(module, package) for module, names in value.items() for item in names}

    tables = {"exports": {}, "moved": {}}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "lazy_exports":
                tables["exports"].update(table(node.args[1]))
                for keyword in node.keywords:
                    if keyword.arg == "moved":
                        tables["moved"].update(table(keyword.value))
            elif node.func.id == "moved_names":
                tables["moved"].update(table(node.args[1]))
    return tables


def moved_names_of_the_package() -> dict[str, dict[str, str]]:
    """{old module: {name: new module}} of every name that moved out of a module of the package."""
    moved = {}
    for path in sorted((REPO_ROOT / "modeling_pkm_bert").rglob("*.py")):
        if table := lazy_tables(path)["moved"]:
            moved[module_name(path)] = table
    return moved


MOVED = moved_names_of_the_package()


def names_imported_from(source: str, name: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, absolute module, name) of every `from module import name` of `source` (relative ones resolved)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            (line, module), *_ = imported_modules(ast.unparse(node), name, is_package)
            found += [(node.lineno, module, alias.name) for alias in node.names]
    return found


def deprecated_imports(path) -> list[str]:
    name = module_name(path)
    source, is_package = path.read_text(encoding="utf-8"), path.name == "__init__.py"
    imports = imported_modules(source, name, is_package)
    found = {
        (line, old) for line, module in imports for old in LEGACY_MODULES if module == old or module.startswith(old + ".")
    }
    problems = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {old} (deprecated: use {LEGACY_MODULES[old]})"
        for line, old in sorted(found)
    ]
    for line, module, imported in names_imported_from(source, name, is_package):
        if imported in MOVED.get(module, {}):
            problems.append(
                f"{path.relative_to(REPO_ROOT)}:{line} imports {imported} from {module} (deprecated: from "
                f"{MOVED[module][imported]})"
            )
    return problems


def test_the_scan_finds_a_lazy_relative_import_of_an_alias(tmp_path):
    """The scan itself: a function-level `from ..conversion import x` in a subpackage module is found."""
    source = "def f():\n    from ..conversion import files_to_upload\n"
    modules = imported_modules(source, "modeling_pkm_bert.serving.quantization", is_package=False)
    assert (2, "modeling_pkm_bert.conversion") in modules
    assert (1, "modeling_pkm_bert.training.optimization") in imported_modules(
        "from .optimization import SparseRowAdam", "modeling_pkm_bert.training", is_package=True
    )


def test_the_scan_finds_a_moved_name_imported_from_its_old_module(tmp_path):
    """The scan itself: a function-level `from .optimization import SparseRowAdam` in a training module (the name moved
    to methods.optimizers; training.optimization stays) is found, and a harness name of the same module is not."""
    assert MOVED["modeling_pkm_bert.training.optimization"]["SparseRowAdam"] == "modeling_pkm_bert.methods.optimizers"
    source = "def f():\n    from .optimization import SparseRowAdam, create_memory_optimizer\n"
    found = names_imported_from(source, "modeling_pkm_bert.training.loop", is_package=False)
    assert found == [
        (2, "modeling_pkm_bert.training.optimization", "SparseRowAdam"),
        (2, "modeling_pkm_bert.training.optimization", "create_memory_optimizer"),
    ]
    assert [name for _, module, name in found if name in MOVED.get(module, {})] == ["SparseRowAdam"]


@pytest.mark.parametrize("folder", SCANNED)
def test_no_module_imports_through_a_deprecated_alias(folder):
    problems = [problem for path in sorted((REPO_ROOT / folder).rglob("*.py")) for problem in deprecated_imports(path)]
    assert problems == []


OLD_PATHS = sorted((old, name, new) for old, table in MOVED.items() for name, new in table.items())


@pytest.mark.parametrize("old, name, new", OLD_PATHS, ids=[f"{old}.{name}" for old, name, _ in OLD_PATHS])
def test_a_moved_name_imports_from_its_old_module_with_a_deprecation_warning(old, name, new):
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)  # `from <old> import <name>`
    assert value is getattr(importlib.import_module(new), name)
    assert [w.category for w in caught] == [DeprecationWarning], f"{old}.{name} gave no warning (imported there?)"
    assert f"{new}.{name}" in str(caught[0].message)
    assert name not in getattr(module, "__all__", ())
