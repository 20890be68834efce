"""`python run_scripts/<script>.py --help` prints the full help and exits 0 without importing torch, transformers,
datasets or accelerate, and lists exactly the flags that a real run parses."""

import contextlib
import dataclasses
import io
import json
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, load_script

from modeling_pkm_bert import BertPkmConfig
from modeling_pkm_bert.training.arguments import PKM_FLAG_FIELDS, TARGET_CLASSES


SCRIPTS = sorted(p.stem for p in (REPO_ROOT / "run_scripts").glob("*.py"))
HEAVY = ("torch", "transformers", "datasets", "accelerate", "numpy")

# runs a script as `python <script> --help` would, then reports what it imported
LIGHT_HELP = """
import io, json, runpy, sys, contextlib
script = sys.argv[1]
sys.argv = [script.rsplit("/", 1)[-1], "--help"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path(script, run_name="__main__")
        code = "returned"
    except SystemExit as exit:
        code = exit.code
print(json.dumps({"code": code, "help": out.getvalue(), "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def light_help(script: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LIGHT_HELP, str(REPO_ROOT / "run_scripts" / f"{script}.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "COLUMNS": "100", "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def full_help(script: str, monkeypatch) -> str:
    """The help of the script's parser with every import done (imported as a module, as the tests do)."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.syspath_prepend(str(REPO_ROOT / "run_scripts"))
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        module.parse_args() if script == "demo" else module.parse_args(["--help"])
    assert exit.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_complete_and_imports_nothing_heavy(script, monkeypatch):
    light = light_help(script)
    assert light["code"] == 0, light
    assert light["heavy"] == [], f"{script}.py --help imported {light['heavy']}"
    assert light["help"].startswith(f"usage: {script}.py") and "  -h, --help" in light["help"]
    assert light["help"] == full_help(script, monkeypatch)  # the same flags, defaults and texts as a real run's parser


def test_pkm_flags_follow_the_config():
    """The flag module reads the pkm_* and ngram_* fields from configuration_bert_pkm.py's source: they match the
    class."""
    from modeling_pkm_bert.hub import conversion
    from modeling_pkm_bert import training

    # every pkm_* / ngram_* field a user sets (pkm_weights_checksum is written by save_pretrained: no flag)
    fields = {f.name: f.default for f in dataclasses.fields(BertPkmConfig) if f.name.startswith(("pkm_", "ngram_"))}
    fields.pop("pkm_weights_checksum")
    assert {name: default for name, (_, default) in PKM_FLAG_FIELDS.items()} == fields == {
        name: field.default for name, field in training.PKM_FIELDS.items()
    }

    assert TARGET_CLASSES == conversion.TARGET_CLASSES
    assert training.add_pkm_arguments.__module__.endswith("arguments")
