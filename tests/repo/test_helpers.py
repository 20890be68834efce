"""The shared test helpers (tests/helpers.py) and conftest's state reset: a script loads as a fresh module, a torchrun
launch that hangs or fails fails its test with the output's tail and leaves no process behind, and accelerate's
process-wide state never leaks from one test into the next."""

import ast
import os
import re
import sys
import time

import pytest

from helpers import REPO_ROOT, load_script, torchrun


def test_load_script_runs_a_fresh_module_registered_only_while_it_executes(tmp_path):
    (tmp_path / "tool.py").write_text("import sys\nREGISTERED = sys.modules[__name__] is not None\nCOUNT = [0]\n")
    sys.modules["tool"] = placeholder = object()
    try:
        first, second = load_script("tool", tmp_path), load_script("tool", tmp_path)
        assert first.REGISTERED and first.__name__ == "tool"
        assert first.COUNT is not second.COUNT  # executed again, not taken from sys.modules
        assert sys.modules["tool"] is placeholder  # what was there before is put back
    finally:
        sys.modules.pop("tool", None)
    load_script("tool", tmp_path)
    assert "tool" not in sys.modules


def test_load_script_finds_the_scripts_and_benchmarks():
    assert callable(load_script("seed_sweep").main)
    assert callable(load_script("runner", folder="benchmarks/studies/reproduce_paper").main)


HANGING = """
import os, sys, time
open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
print(f"rank {os.environ['RANK']} waits forever", flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multiprocess
def test_a_hung_launch_fails_with_the_output_and_leaves_no_process(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING)
    with pytest.raises(pytest.fail.Exception) as failure:
        torchrun(script, [tmp_path], processes=2, timeout=20)
    message = str(failure.value)
    assert "hang.py on 2 processes did not finish in 20 s" in message
    assert "rank 0 waits forever" in message and "rank 1 waits forever" in message
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids)), "a worker outlived its launch"


@pytest.mark.multiprocess
def test_a_failed_launch_names_the_exit_and_the_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os\nraise SystemExit(f\"rank {os.environ['RANK']}: bad input\")\n")
    with pytest.raises(pytest.fail.Exception, match=r"fail.py on 1 processes exited with 1;(.|\n)*rank 0: bad input"):
        torchrun(script, processes=1, timeout=120)


_LEFT_BY_PREVIOUS_TEST = []


def test_accelerate_state_set_by_a_test(request):
    from accelerate import Accelerator

    Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=3)
    _LEFT_BY_PREVIOUS_TEST.append(request.node.name)


def test_is_forgotten_before_the_next_test():
    """Runs after the test above (file order): the autouse fixture of conftest reset what it left."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if not _LEFT_BY_PREVIOUS_TEST:
        pytest.skip("the previous test did not run (-k selection)")
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}
    assert GradientState._shared_state == {}


# ---- the suite's shape: folders by subject, helpers in helpers.py ----

FOLDERS = {"layer", "models", "scripts", "compat", "repo"}  # tests/<folder>/test_*.py, by what they test
ALL_TESTS = sorted(path for path in (REPO_ROOT / "tests").rglob("test_*.py")
                   if "fixtures" not in path.relative_to(REPO_ROOT / "tests").parts)  # fmt: skip


def test_every_test_file_is_in_a_folder_of_its_subject_under_a_name_of_its_own():
    """pytest imports the test files of these package-less folders by their basenames: two files of one name in two
    folders would not both import."""
    folders = {path.relative_to(REPO_ROOT / "tests").parent.as_posix() for path in ALL_TESTS}
    assert folders <= FOLDERS, f"test files outside tests/{{{','.join(sorted(FOLDERS))}}}: {sorted(folders - FOLDERS)}"
    names = [path.name for path in ALL_TESTS]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
    assert len(ALL_TESTS) >= 50 and "test_helpers.py" in names  # the glob sees the suite


def imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }  # fmt: skip


def test_helpers_come_from_helpers_py_and_conftest_is_only_pytests():
    """Test modules import shared functions from tests/helpers.py, never from conftest (pytest's file, loaded its own
    way) nor from another test module; conftest imports no helper either."""
    wrong = {path.relative_to(REPO_ROOT).as_posix(): sorted(m for m in imported_modules(path)
                                                         if m == "conftest" or m.startswith("test_"))
             for path in ALL_TESTS}  # fmt: skip
    assert {path: modules for path, modules in wrong.items() if modules} == {}
    assert "helpers" not in imported_modules(REPO_ROOT / "tests" / "conftest.py")


# ---- every test file uses them, and the process-launching tests are marked ----

# every test file but this one (it names what it looks for)
TESTS = [path for path in ALL_TESTS if path.name != "test_helpers.py"]
# what each test file used to carry its own copy of, now in helpers.py
COPIED = {
    "spec_from_file_location": "load_script",
    "torch.distributed.run": "torchrun",
    "_reset_state(": "reset_accelerate_state",
}


@pytest.mark.parametrize("path", TESTS, ids=lambda path: path.name)
def test_no_test_file_carries_its_own_copy_of_a_helper(path):
    text = path.read_text(encoding="utf-8")
    assert [f"{copy} (use helpers.{helper})" for copy, helper in COPIED.items() if copy in text] == []


LAUNCHERS = {"torchrun", "spawn", "start_processes"}  # helpers.torchrun, torch.multiprocessing's two


def launching_tests(tree: ast.Module) -> dict[str, bool]:
    """{test name: whether it is marked multiprocess} for the tests of a file that launch processes or use the second
    environment, directly or through a function or fixture of the same file."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def called(node):
        return {(n.func.id if isinstance(n.func, ast.Name) else n.func.attr) for n in ast.walk(node)
                if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}  # fmt: skip

    def second_environment(node):
        return any(isinstance(n, ast.Constant) and n.value == "PKM_COMPAT_MIN_PYTHON" for n in ast.walk(node))

    launching = {name for name, node in functions.items() if called(node) & LAUNCHERS or second_environment(node)}
    while True:  # what calls a launching function, or takes a launching fixture as an argument, launches too
        more = {name for name, node in functions.items()
                if called(node) & launching or {a.arg for a in node.args.args} & launching} - launching  # fmt: skip
        if not more:
            break
        launching |= more
    file_marked = any(
        isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
        and "multiprocess" in ast.unparse(node.value) for node in tree.body
    )  # fmt: skip
    return {
        name: file_marked or any("mark.multiprocess" in ast.unparse(d) for d in functions[name].decorator_list)
        for name in sorted(launching) if name.startswith("test_")
    }  # fmt: skip


def test_the_marker_finder_on_a_sample():
    sample = '''
import pytest
@pytest.fixture
def group(tmp_path):
    mp.spawn(work, nprocs=2)
def launch(script):
    return torchrun(script, [])
def test_through_a_fixture(group): ...
@pytest.mark.multiprocess
def test_through_a_function(): launch("x.py")
def test_second_environment(): os.environ["PKM_COMPAT_MIN_PYTHON"]
def test_alone(): subprocess.run([sys.executable, "-c", "print(1)"])
'''
    found = launching_tests(ast.parse(sample))
    assert found == {"test_through_a_fixture": False, "test_through_a_function": True, "test_second_environment": False}
    assert set(launching_tests(ast.parse("pytestmark = pytest.mark.multiprocess\n" + sample)).values()) == {True}


def recipe(target: str) -> str:
    """The commands of a Makefile target."""
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.MULTILINE)
    assert match, f"no target {target} in the Makefile"
    return match.group(1)


def test_make_test_fast_leaves_out_the_multiprocess_and_slow_tests_and_make_test_runs_all(request):
    markers = {line.split(":")[0] for line in request.config.getini("markers")}
    assert {"multiprocess", "slow", "cuda"} <= markers
    assert '-m "not multiprocess and not slow" tests' in recipe("test-fast")
    (pytest_call,) = [line for line in recipe("test").splitlines() if " -m pytest " in line]
    assert " -m \"" not in pytest_call and " -k " not in pytest_call and pytest_call.endswith(" tests"), pytest_call


@pytest.mark.parametrize("path", TESTS, ids=lambda path: path.name)
def test_every_process_launching_test_is_marked_multiprocess(path):
    """`make test-fast` (-m "not multiprocess") leaves out every test that launches processes."""
    found = launching_tests(ast.parse(path.read_text(encoding="utf-8")))
    unmarked = [name for name, marked in found.items() if not marked]
    assert unmarked == [], "mark them @pytest.mark.multiprocess (or the file: pytestmark = pytest.mark.multiprocess)"
