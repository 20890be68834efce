"""No code of the project imports through a deprecated module alias (`modeling_pkm_bert.LEGACY_MODULES`): such an
import warns today and breaks when the aliases go. The scan reads every import statement, those inside functions
included (a lazy import would escape an import-everything check)."""

import ast

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


def deprecated_imports(path) -> list[str]:
    name = module_name(path)
    imports = imported_modules(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
    found = {
        (line, old) for line, module in imports for old in LEGACY_MODULES if module == old or module.startswith(old + ".")
    }
    return [f"{path.relative_to(REPO_ROOT)}:{line} imports {old} (deprecated: use {LEGACY_MODULES[old]})" for line, old in sorted(found)]


def test_the_scan_finds_a_lazy_relative_import_of_an_alias(tmp_path):
    """The scan itself: a function-level `from ..conversion import x` in a subpackage module is found."""
    source = "def f():\n    from ..conversion import files_to_upload\n"
    modules = imported_modules(source, "modeling_pkm_bert.serving.quantization", is_package=False)
    assert (2, "modeling_pkm_bert.conversion") in modules
    assert (1, "modeling_pkm_bert.training.optimization") in imported_modules(
        "from .optimization import SparseRowAdam", "modeling_pkm_bert.training", is_package=True
    )


@pytest.mark.parametrize("folder", SCANNED)
def test_no_module_imports_through_a_deprecated_alias(folder):
    problems = [problem for path in sorted((REPO_ROOT / folder).rglob("*.py")) for problem in deprecated_imports(path)]
    assert problems == []
