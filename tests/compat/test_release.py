"""Release hygiene: the versions that saved folders and registered ops carry tell the truth.

- `PKM_CODE_VERSION` is recorded in every saved config and is the package's version (setup.py reads it): while it equals
  the newest release's, the shipped files (REMOTE_CODE_FILES) must be that release's code as its fixtures hold it (every
  family's: tests/fixtures/<family>_<version>/code/, e.g. bert_pkm_0.4.0, modernbert_pkm_0.5.0), or a folder saved
  today would claim code it does not hold. A change needs a newer PKM_CODE_VERSION; its release freezes fixtures that
  hold every shipped file.
- `OPS_VERSION` is in the names of the custom ops (`torch.ops.pkm_bert.<name>_v<OPS_VERSION>`), which the first copy
  of product_key_memory_ops.py a process imports registers for every other copy (a model's remote code beside the
  package, folders of other releases). Each op's signature and implementation (its functions and everything of the
  module they reach, docstrings and comments aside) is recorded per version in tests/custom_ops.json: a change that is
  not a new version fails here, and a fixture release with the current version must hold the same ops.

After changing an op: bump OPS_VERSION, then `python tests/compat/test_release.py --record-ops` adds the version's
record.
"""

import ast
import copy
import hashlib
import json
import re
import sys
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]  # a script too (--record-ops): no helpers
PACKAGE = REPO_ROOT / "modeling_pkm_bert"
FIXTURES = REPO_ROOT / "tests" / "fixtures"
OPS_FILE = "product_key_memory_ops.py"
OPS_RECORD = REPO_ROOT / "tests" / "custom_ops.json"


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def release_fixtures() -> dict[str, list[Path]]:
    """{version: its fixture folders} over every family: tests/fixtures/<family>_<version> (bert_pkm_0.4.0,
    modernbert_pkm_0.5.0, ...)."""
    releases = {}
    for folder in sorted(FIXTURES.iterdir()):
        match = re.fullmatch(r"[a-z_]+_(\d+\.\d+\.\d+)", folder.name)
        if match and folder.is_dir():
            releases.setdefault(match[1], []).append(folder)
    return releases


def newest_release() -> tuple[str, list[Path]]:
    """(version, fixture folders) of the newest release, whichever families its fixtures are of."""
    releases = release_fixtures()
    version = max(releases, key=version_tuple)
    return version, releases[version]


def fixture_copies(folder: Path, name: str) -> set[str]:
    """The texts of the file `name` in the fixture release's code (its code/ folder holds the one copy of each file
    that every saved folder of the release held: a release ships one code)."""
    return {path.read_text(encoding="utf-8") for path in folder.glob(f"*/{name}")}


def test_the_fixtures_of_every_family_are_read():
    releases = release_fixtures()
    assert {"0.1.0", "0.4.0", "0.5.0"} <= releases.keys() and FIXTURES / "modernbert_pkm_0.5.0" in releases["0.5.0"]


def test_the_package_has_one_version():
    import modeling_pkm_bert
    from modeling_pkm_bert.configuration_bert_pkm import PKM_CODE_VERSION

    assert modeling_pkm_bert.__version__ == PKM_CODE_VERSION  # setup.py's: test_the_wheel_holds_the_package_data


def test_a_changed_code_file_comes_with_a_newer_code_version():
    from modeling_pkm_bert.configuration_bert_pkm import PKM_CODE_VERSION, REMOTE_CODE_FILES

    released, folders = newest_release()
    assert version_tuple(PKM_CODE_VERSION) >= version_tuple(released), f"{PKM_CODE_VERSION} is older than {released}"
    copies = {name: set().union(*(fixture_copies(folder, name) for folder in folders)) for name in REMOTE_CODE_FILES}
    assert all(len(texts) <= 1 for texts in copies.values()), {name: len(texts) for name, texts in copies.items()}
    if PKM_CODE_VERSION != released:
        return  # the next release's code, free to change until its fixtures are frozen
    changed = [name for name in REMOTE_CODE_FILES if (PACKAGE / name).read_text(encoding="utf-8") not in copies[name]]
    assert not changed, (
        f"{', '.join(changed)} changed since (or are not in) the {released} fixtures "
        f"({', '.join(folder.name for folder in folders)}) but PKM_CODE_VERSION is still {released}: bump it"
    )


# ---------------------------------------------------------------------------------------------------- custom ops


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(getattr(statement.value, "value", None), str)


def _without_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_docstring(inner.body[0]):
            inner.body = inner.body[1:] or [ast.Pass()]
    return node


def custom_op_definitions(path: Path) -> tuple[int, dict[str, dict[str, str]]]:
    """(OPS_VERSION, {op name: {"signature", "implementation"}}) of an ops file, read statically (also an old
    release's copy): each `_custom_op("<name>", function, fake, backward, setup_context)` of the module, its
    function's signature, and the SHA-256 of the code of every module-level definition the op reaches (functions,
    classes, constants, the other ops), without docstrings and comments."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    definitions, version, registrations = {}, None, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)):
                definitions[name] = node
                if name == "OPS_VERSION":
                    version = ast.literal_eval(node.value)
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "_custom_op":
                registrations.append(call)
    ops = {}
    for call in registrations:
        name = ast.literal_eval(call.args[0])
        reached, pending = set(), ["_custom_op", *(arg.id for arg in call.args[1:] if isinstance(arg, ast.Name))]
        while pending:
            current = pending.pop()
            if current in reached or current not in definitions:
                continue
            reached.add(current)
            pending += [n.id for n in ast.walk(definitions[current]) if isinstance(n, ast.Name)]
        code = "\n".join(ast.unparse(_without_docstrings(definitions[n])) for n in sorted(reached))
        function = definitions[call.args[1].id]
        returns = f" -> {ast.unparse(function.returns)}" if function.returns else ""
        signature = f"{name}({ast.unparse(function.args)}){returns}"
        ops[name] = {"signature": signature, "implementation": hashlib.sha256(code.encode()).hexdigest()}
    return version, ops


def test_the_custom_ops_of_this_version_are_the_recorded_ones():
    from modeling_pkm_bert.product_key_memory_ops import OPS_VERSION

    version, ops = custom_op_definitions(PACKAGE / OPS_FILE)
    assert version == OPS_VERSION and ops
    record = json.loads(OPS_RECORD.read_text(encoding="utf-8"))
    assert str(OPS_VERSION) in record, (
        f"no record of OPS_VERSION {OPS_VERSION} in {OPS_RECORD.name}: python tests/compat/test_release.py --record-ops"
    )
    recorded = record[str(OPS_VERSION)]
    changed = [name for name in sorted(ops.keys() | recorded.keys()) if ops.get(name) != recorded.get(name)]
    assert not changed, "; ".join(f"custom op {name} changed" for name in changed) + (
        ": bump OPS_VERSION and update the record (python tests/compat/test_release.py --record-ops)"
    )


def test_a_released_copy_of_the_ops_with_this_version_holds_the_same_ops():
    """The fixture releases whose ops file registers the current OPS_VERSION register the same ops (a process that
    loads one of their folders beside the package shares one implementation); each version's record is that of the
    releases that carry it."""
    from modeling_pkm_bert.product_key_memory_ops import OPS_VERSION

    current = custom_op_definitions(PACKAGE / OPS_FILE)[1]
    record = json.loads(OPS_RECORD.read_text(encoding="utf-8"))
    newest = newest_release()[1]
    for folder in [folder for _, folders in sorted(release_fixtures().items()) for folder in folders]:
        (text,) = fixture_copies(folder, OPS_FILE) or {None}
        if text is None:
            continue  # 0.1.0: no ops file
        path = next(folder.glob(f"*/{OPS_FILE}"))
        version, ops = custom_op_definitions(path)
        if version == OPS_VERSION:
            assert ops == current, f"{folder.name} registers OPS_VERSION {version} with other ops: bump OPS_VERSION"
        if folder in newest and str(version) in record:
            assert record[str(version)] == ops, f"the record of OPS_VERSION {version} is not {folder.name}'s ops"


def test_the_ops_check_fails_on_a_changed_op(tmp_path):
    """A planted change in a function an op reaches (not the op's own), and one in a signature, change the record."""
    source = (PACKAGE / OPS_FILE).read_text(encoding="utf-8")
    _, ops = custom_op_definitions(PACKAGE / OPS_FILE)
    planted = tmp_path / OPS_FILE
    # a statement before the last one of the plain-ops value backward (a function the backward op reaches)
    (function,) = [n for n in ast.parse(source).body if getattr(n, "name", None) == "_plain_gradients"]
    lines = source.splitlines(keepends=True)
    last = function.body[-1]
    lines.insert(last.lineno - 1, " " * last.col_offset + "grad_weight = grad_weight\n")
    planted.write_text("".join(lines), encoding="utf-8")
    changed = custom_op_definitions(planted)[1]
    assert changed["weighted_row_sum_backward"] != ops["weighted_row_sum_backward"]
    unreached = source.replace("    if _forced:\n", "    if _forced:  # planted\n        pass\n", 1)
    assert unreached != source
    planted.write_text(unreached, encoding="utf-8")
    assert custom_op_definitions(planted)[1] == ops  # no op reaches the plan
    planted.write_text(source.replace("def _row_sum(weight: torch.Tensor,", "def _row_sum(table: torch.Tensor,", 1), encoding="utf-8")
    signature = custom_op_definitions(planted)[1]["weighted_row_sum"]["signature"]
    assert signature != ops["weighted_row_sum"]["signature"]
    # comments and docstrings are no change
    planted.write_text(source.replace("def _row_sum(", "# a comment\ndef _row_sum(", 1), encoding="utf-8")
    assert custom_op_definitions(planted)[1] == ops

if __name__ == "__main__" and sys.argv[1:] == ["--record-ops"]:
    record = json.loads(OPS_RECORD.read_text(encoding="utf-8")) if OPS_RECORD.is_file() else {}
    version, ops = custom_op_definitions(PACKAGE / OPS_FILE)
    if str(version) in record and record[str(version)] != ops:
        sys.exit(f"OPS_VERSION {version} is recorded with other ops: bump OPS_VERSION first")
    record[str(version)] = ops
    OPS_RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"recorded the {len(ops)} custom ops of OPS_VERSION {version} in {OPS_RECORD.relative_to(REPO_ROOT)}")


def test_the_wheel_holds_the_package_data(tmp_path):
    """A user's `pip install` gets what the package reads from disk: the explorer's page (HTML, CSS, JavaScript) and
    the native selection's C source (built on first use)."""
    import shutil
    import subprocess
    import zipfile

    from modeling_pkm_bert.analysis.explorer import PAGE_FILES

    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info beside setup.py
    shutil.copytree(PACKAGE, source / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    from modeling_pkm_bert.configuration_bert_pkm import PKM_CODE_VERSION

    assert wheel.name.startswith(f"modeling_pkm_bert-{PKM_CODE_VERSION}-"), wheel.name  # setup.py reads the one version
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"modeling_pkm_bert/analysis/explorer_page/{name}" for name in PAGE_FILES}
    expected |= {f"modeling_pkm_bert/kernels/csrc/{path.name}" for path in (PACKAGE / "kernels" / "csrc").glob("*.c")}
    assert expected <= names, sorted(expected - names)
