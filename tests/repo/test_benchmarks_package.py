"""The benchmarks as a package (issue 62, fourth restructuring, item 1): no file of benchmarks/ or run_scripts/ edits
`sys.path` (an entry run by path finds the package through benchmarks/_package.py; the scripts import the installed
package), the package's modules import nothing that imports them (no cycles, function-level imports included), every
study has its entry and its report, and results stay apart from code."""

import ast
import re
import subprocess
import sys

import pytest

from helpers import REPO_ROOT


BENCHMARKS = REPO_ROOT / "benchmarks"
FILES = sorted([*BENCHMARKS.rglob("*.py"), *(REPO_ROOT / "run_scripts").rglob("*.py")])


def module_name(path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


EDIT = re.compile(r"sys\.path(\.(insert|append|extend|remove)\(|\[[^\]]*\]\s*=|\s*[+]?=[^=])")  # in code or in code as text


def sys_path_uses(tree) -> list[int]:
    """Lines whose code touches `sys.path` at all (`sys.path`, `from sys import path`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_an_edit():
    assert sys_path_uses(ast.parse("import sys\nsys.path.insert(0, 'x')")) == [2]
    assert sys_path_uses(ast.parse("from sys import path\npath.append('x')")) == [1]
    assert EDIT.search('CODE = "sys.path[:0] = [tree]"') and not EDIT.search("no `sys.path` edit anywhere")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(REPO_ROOT)) for p in FILES])
def test_no_file_edits_sys_path(path):
    """Neither in its code nor in code it hands a child process (`python -c`)."""
    text = path.read_text(encoding="utf-8")
    assert sys_path_uses(ast.parse(text)) == [], f"{path.relative_to(REPO_ROOT)}: sys.path at lines {sys_path_uses(ast.parse(text))}"
    assert not EDIT.search(text), f"{path.relative_to(REPO_ROOT)}: {EDIT.search(text).group(0)!r}"


def imports_of(path) -> set[str]:
    """The modules of the benchmarks package that `path` imports, at any depth of its code."""
    found = set()
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from benchmarks.speed import layer`
    modules = {module_name(p) for p in BENCHMARKS.rglob("*.py")}
    return {name for name in found if name in modules and name != module_name(path)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_module_that_imports_its_importer():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_benchmarks_package_has_no_import_cycles():
    graph = {}
    for path in BENCHMARKS.rglob("*.py"):
        # a package's __init__ is imported by its submodules' import anyway: only its own imports are edges
        graph[module_name(path)] = imports_of(path) - {"benchmarks"}
    assert graph["benchmarks.studies.knowledge_editing.report"] >= {"benchmarks.studies.knowledge_editing.config"}
    assert cycles(graph) == []


def test_every_study_has_its_entry_and_report_and_results_hold_no_code():
    studies = sorted(p.name for p in (BENCHMARKS / "studies").iterdir() if (p / "runner.py").exists())
    assert len(studies) >= 9
    for study in studies:
        entry = (BENCHMARKS / f"{study}.py").read_text(encoding="utf-8")
        assert f"from benchmarks.studies.{study}.runner import main" in entry, study
    assert not list((BENCHMARKS / "results").rglob("*.py"))
    reports = {p.name for p in BENCHMARKS.glob("*.md")}
    assert {"REPRODUCTION.md", "CONTINUAL_LEARNING.md", "KNOWLEDGE_CAPACITY.md", "KNOWLEDGE_EDITING.md",
            "NGRAM_MEMORY.md", "RESULTS.md"} <= reports  # fmt: skip
    assert not [name for name in reports if name.startswith("KNOWLEDGE_EDITING_")]  # one report per study


@pytest.mark.multiprocess
def test_an_entry_runs_by_path_from_any_folder_and_as_a_module(tmp_path):
    for command, cwd in (([str(BENCHMARKS / "knowledge_capacity.py"), "--help"], tmp_path),
                         (["-m", "benchmarks.knowledge_editing", "--help"], REPO_ROOT),
                         ([str(BENCHMARKS / "run_benchmarks.py"), "--help"], tmp_path)):  # fmt: skip
        done = subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
