"""The declared transformers range, tested (issue: remote code that survives transformers releases).

Folders written under the declared minimum load through remote code under the newest tested release and the other way
round, with the package not importable; the committed release fixtures load under both; importing the package and
loading a folder print nothing. The minimum's environment is `.venv-min` (`make test` builds it and sets
PKM_COMPAT_MIN_PYTHON); the newest is the interpreter that runs the suite (PKM_COMPAT_NEWEST_PYTHON overrides it):
`make test` runs it on constraints.txt's versions, `make test-latest` in a fresh environment of the newest releases.
"""

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import FIXTURE_CODE, FIXTURES as RELEASES, REPO_ROOT, assemble_fixture, release_folders

from modeling_pkm_bert.configuration_bert_pkm import PKM_CODE_VERSION


pytestmark = pytest.mark.multiprocess  # the suite runs other interpreters (.venv-min, the newest releases)

COMPAT = REPO_ROOT / "tests" / "compat"
# the releases whose folders every later one must still load (tests/fixtures/<family>_<version>, assembled by
# helpers.release_folders), and what check_folders.py checks in them
FIXTURES = {
    "0.2.0": ["mlm", "causal_memory_plus", "fill-mask", "train:causal_memory_plus"],
    # n-gram memories and the RoBERTa family arrived
    "0.3.0": ["mlm", "causal_memory_plus", "mlm_ngram", "causal_ngram", "roberta_mlm", "fill-mask",
              "train:causal_memory_plus", "train:causal_ngram"],
    # int8/4-bit n-gram tables; n-gram tables as ProductKeyValues
    "0.4.0": ["mlm", "causal_memory_plus", "mlm_ngram", "causal_ngram", "mlm_ngram_int8", "roberta_mlm", "fill-mask",
              "train:causal_memory_plus", "train:causal_ngram"],
    # the ModernBertPkm family arrived (tests/fixtures/modernbert_pkm_0.5.0)
    "0.5.0": ["modernbert_mlm", "modernbert_cls_memory_plus", "modernbert_tok_replace", "modernbert_choice",
              "modernbert_mlm_int8", "fill-mask:modernbert_mlm", "train:modernbert_mlm", "train:modernbert_cls_memory_plus"],
    # a folder of each family, so that the release's fixture holds every shipped file (tests/fixtures/bert_pkm_0.6.0)
    "0.6.0": ["mlm_ngram_int8", "roberta_mlm", "modernbert_mlm_int8"],
}
MIN_PYTHON = os.environ.get("PKM_COMPAT_MIN_PYTHON")
NEWEST_PYTHON = os.environ.get("PKM_COMPAT_NEWEST_PYTHON", sys.executable)
PYTHONS = {"newest": NEWEST_PYTHON, **({"min": MIN_PYTHON} if MIN_PYTHON else {})}
needs_min = pytest.mark.skipif(not MIN_PYTHON, reason="PKM_COMPAT_MIN_PYTHON is not set: `make test` builds .venv-min")
# transformers' own weight-loading progress bars are not ours to silence; everything else must be
QUIET_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(python: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([python, *args], capture_output=True, text=True, env=QUIET_ENV, timeout=600)
    assert result.returncode == 0, f"{python} {' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def transformers_version(python: str) -> str:
    return run(python, "-c", "import transformers; print(transformers.__version__)").stdout.strip()


def declared_minimum() -> str:
    """The lower bound of `transformers` in setup.py's install_requires."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    requirements = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    (requirement,) = [r for r in requirements if r.startswith("transformers>=")]
    return requirement.split(">=")[1].split(",")[0]


@needs_min
def test_the_minimum_environment_is_the_declared_minimum():
    from modeling_pkm_bert.configuration_bert_pkm import SUPPORTED_TRANSFORMERS

    minimum = declared_minimum()
    assert minimum == ".".join(map(str, SUPPORTED_TRANSFORMERS[0]))
    assert transformers_version(MIN_PYTHON) in (minimum, minimum + ".0")
    assert transformers_version(NEWEST_PYTHON) != transformers_version(MIN_PYTHON)


@needs_min
@pytest.mark.parametrize("writer, reader", [("min", "newest"), ("newest", "min")])
def test_folders_written_under_one_version_run_under_the_other(writer, reader, tmp_path):
    """Every head, plain and with the Memory+ options, a causal LM: equal outputs, the same greedy generation, the
    fill-mask pipeline and training steps, through remote code with the package not importable."""
    run(PYTHONS[writer], str(COMPAT / "write_folders.py"), str(tmp_path))
    report = json.loads(run(PYTHONS[reader], str(COMPAT / "check_folders.py"), str(tmp_path)).stdout.splitlines()[-1])
    assert report["written_with"] == transformers_version(PYTHONS[writer])
    assert report["transformers"] == transformers_version(PYTHONS[reader])
    folders = json.loads((tmp_path / "expected.json").read_text())["folders"]
    trained = ["mlm_memory_plus", "cls", "causal", "causal_memory_plus", "causal_ngram", "modernbert_mlm",
               "modernbert_cls_memory_plus"]  # check_folders.py's
    pipelines = ["fill-mask", "fill-mask:modernbert_mlm"]
    assert report["checked"] == [*folders, *pipelines, *(f"train:{name}" for name in trained)]


@pytest.mark.parametrize("release", list(FIXTURES))
@pytest.mark.parametrize("env", ["newest", pytest.param("min", marks=needs_min)])
def test_the_fixture_folders_of_each_release_still_run_through_their_own_code(env, release, tmp_path):
    """A change (ours or transformers') that breaks folders already on the Hub fails here."""
    folder, checked = release_folders(release, tmp_path), FIXTURES[release]
    report = json.loads(run(PYTHONS[env], str(COMPAT / "check_folders.py"), str(folder)).stdout.splitlines()[-1])
    assert report["checked"] == checked


@pytest.mark.parametrize("release", list(FIXTURES))
def test_the_fixture_weights_load_into_the_current_classes(release, tmp_path):
    import modeling_pkm_bert

    sys.path.insert(0, str(COMPAT))
    try:
        from inputs import fixed_inputs, forward_kwargs
    finally:
        sys.path.remove(str(COMPAT))
    folder = release_folders(release, tmp_path)
    expected = json.loads((folder / "expected.json").read_text())
    for name, record in expected["folders"].items():
        model = getattr(modeling_pkm_bert, record["class"]).from_pretrained(folder / name).eval()
        with torch.no_grad():
            outputs = model(**fixed_inputs(name, model.config.vocab_size), **forward_kwargs(name))
        torch.testing.assert_close(outputs[0], torch.tensor(record["outputs"]), atol=1e-5, rtol=1e-5, msg=name)


def files_of(root) -> dict:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("release", sorted(path.name for path in RELEASES.glob("*_*.*.*")))  # every family's
def test_a_release_fixture_keeps_each_code_file_once(release):
    """The release's code files in code/ and nowhere else; each saved folder of expected.json holds its own files
    (config, weights, tokenizer), nothing else is there."""
    root = RELEASES / release
    assert {path.parent.name for path in root.rglob("*.py")} == {FIXTURE_CODE}
    folders = json.loads((root / "expected.json").read_text())["folders"]
    assert {path.name for path in root.iterdir() if path.is_dir()} == {FIXTURE_CODE, *folders}
    for name in folders:
        assert (root / name / "config.json").is_file() and (root / name / "model.safetensors").is_file(), name


def test_a_fixture_written_with_the_fixture_flag_assembles_to_what_write_folders_writes(tmp_path):
    """`write_folders.py --fixture` (a new release's fixture) keeps the code once, and the folders assembled from it are
    byte for byte those written without the flag (a BertPkm and a RobertaPkm folder: each gets its family's files)."""
    names = ["mlm", "roberta_mlm"]
    run(sys.executable, str(COMPAT / "write_folders.py"), str(tmp_path / "plain"), *names)
    run(sys.executable, str(COMPAT / "write_folders.py"), "--fixture", str(tmp_path / "fixture"), *names)
    assert {path.parent.name for path in (tmp_path / "fixture").rglob("*.py")} == {FIXTURE_CODE}
    assembled = assemble_fixture(tmp_path / "fixture", tmp_path / "assembled")
    plain = files_of(tmp_path / "plain")
    assert "roberta_mlm/modeling_roberta_pkm.py" in plain and "mlm/modeling_roberta_pkm.py" not in plain
    assert files_of(assembled) == plain


LOAD_SCRIPT = r"""
import sys
sys.modules["modeling_pkm_bert"] = None
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer
folder = sys.argv[1]
AutoConfig.from_pretrained(folder, trust_remote_code=True)
AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
"""


@pytest.mark.parametrize("env", ["newest", pytest.param("min", marks=needs_min)])
def test_importing_the_package_and_loading_a_folder_print_nothing(env, tmp_path):
    folder = release_folders("0.2.0", tmp_path) / "mlm"
    for args in (["-c", "import modeling_pkm_bert; modeling_pkm_bert.BertPkmForMaskedLM"], ["-c", LOAD_SCRIPT, str(folder)]):
        result = run(PYTHONS[env], *args)
        assert (result.stdout, result.stderr) == ("", ""), args


def test_an_unsupported_transformers_is_named_with_the_code_version_and_the_range():
    from modeling_pkm_bert.configuration_bert_pkm import check_transformers_version

    check_transformers_version("5.4.0")
    check_transformers_version("5.99.1.dev0")
    for version in ("5.3.0", "6.0.0", "4.57.1"):
        with pytest.raises(ImportError, match=rf"modeling_pkm_bert {PKM_CODE_VERSION}\) runs on transformers >=5.4,<6.0; transformers {version} is installed"):
            check_transformers_version(version)




def outdated_code_files(folder) -> list[str]:
    """The remote-code files that the installed package would write anew into `folder`."""
    from modeling_pkm_bert.hub.refresh import code_files_of

    package = REPO_ROOT / "modeling_pkm_bert"
    return [name for name in code_files_of("bert_pkm") if not (folder / name).is_file() or (folder / name).read_text() != (package / name).read_text()]


def test_a_folder_written_before_0_2_0_runs_again_after_refresh_code(tmp_path):
    """0.1.0's code imports BERT internals that transformers 5.24 changed; `push_to_hub.py --refresh_code` replaces it
    and the folder computes what 0.1.0 computed, through remote code without the package."""
    from modeling_pkm_bert.hub.refresh import code_files_of

    # written by 0.1.0 (transformers 5.4), before the fix
    folder, released = release_folders("0.1.0", tmp_path / "refreshed"), release_folders("0.1.0", tmp_path / "released")
    weights = (folder / "mlm" / "model.safetensors").read_bytes()
    result = run(sys.executable, str(REPO_ROOT / "run_scripts" / "push_to_hub.py"), "--model_dir", str(folder / "mlm"), "--refresh_code")
    assert f"Refreshed {', '.join(outdated_code_files(released / 'mlm'))}, config.json" in result.stdout
    # 0.2.0 split product_key_memory.py: the layer, and its fast paths in product_key_memory_ops.py (a new file)
    assert sorted(path.name for path in (folder / "mlm").glob("*.py")) == sorted(code_files_of("bert_pkm"))
    config = json.loads((folder / "mlm" / "config.json").read_text())
    assert config["pkm_code_version"] == PKM_CODE_VERSION and config["auto_map"]["AutoModelForCausalLM"].endswith("BertPkmForCausalLM")
    assert (folder / "mlm" / "model.safetensors").read_bytes() == weights
    report = json.loads(run(sys.executable, str(COMPAT / "check_folders.py"), str(folder)).stdout.splitlines()[-1])
    assert report["checked"] == ["mlm", "fill-mask"]
    again = run(sys.executable, str(REPO_ROOT / "run_scripts" / "push_to_hub.py"), "--model_dir", str(folder / "mlm"), "--refresh_code")
    assert "code files up to date" in again.stdout


def test_refresh_code_writes_nothing_when_the_refreshed_folder_computes_something_else(tmp_path, monkeypatch):
    from modeling_pkm_bert.hub import refresh as code_refresh

    folder = release_folders("0.1.0", tmp_path) / "mlm"
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    shifted = lambda folder, auto_class, inputs: torch.full((*inputs["input_ids"].shape, 64), 1e3)  # noqa: E731
    monkeypatch.setattr(code_refresh, "_remote_outputs", shifted)
    with pytest.raises(RuntimeError, match="outputs differ from the package's by .*nothing was changed"):
        code_refresh.refresh_code(folder)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    assert code_refresh.refresh_code(folder, dry_run=True) == [*outdated_code_files(folder), "config.json"]
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_refresh_code_names_what_is_wrong_with_the_folder(tmp_path):
    from modeling_pkm_bert.hub.refresh import refresh_code

    with pytest.raises(FileNotFoundError, match="has no config.json: not a saved model folder"):
        refresh_code(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match="holds a 'bert' model, not a BertPkm one"):
        refresh_code(tmp_path)
