"""Refresh the remote-code files of a saved BertPkm folder from the installed package, checked before anything is
written: the folder must compute the same outputs through its refreshed code (in a process that cannot import this
package, as a Hub user's) as through the package's own classes. A folder whose old code no longer runs under the
installed transformers (e.g. one written before 0.2.0, under transformers 5.24) runs again after it."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..configuration_bert_pkm import AUTO_MAP, PKM_CODE_VERSION, REMOTE_CODE_FILES
from ..configuration_modernbert_pkm import MODERNBERT_AUTO_MAP
from ..configuration_roberta_pkm import ROBERTA_AUTO_MAP
from ..utils.input_errors import InputError


# model_type -> the auto_map its folders carry
AUTO_MAPS = {"bert_pkm": AUTO_MAP, "roberta_pkm": ROBERTA_AUTO_MAP, "modernbert_pkm": MODERNBERT_AUTO_MAP}


def code_files_of(model_type: str) -> list[str]:
    """The remote-code files a refreshed folder of `model_type` holds: every shipped file but those of the other
    family (BertPkm and RobertaPkm folders: without ModernBertPkm's files; ModernBertPkm folders: without RobertaPkm's)."""
    other = "roberta" if model_type == "modernbert_pkm" else "modernbert"
    return [name for name in REMOTE_CODE_FILES if not name.startswith((f"configuration_{other}", f"modeling_{other}"))]


PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the package root: the remote-code files
CHECK_TOLERANCE = 1e-5

# Runs in a fresh interpreter that cannot import the package: the folder's own code only. Prints the outputs as JSON.
_REMOTE_OUTPUTS = r"""
import json, sys
sys.modules["modeling_pkm_bert"] = None
import torch, transformers
folder, auto_class, inputs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
with torch.no_grad():
    output = model(**{name: torch.tensor(value) for name, value in inputs.items()})[0]
print(json.dumps(output.tolist()))
"""


def check_inputs(config: dict, architecture: str) -> dict:
    """Fixed ids (with a padded row) within the folder's vocabulary, shaped for its head."""
    generator = torch.Generator().manual_seed(0)
    length = min(12, config.get("max_position_embeddings", 512))
    input_ids = torch.randint(0, config["vocab_size"], (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, length // 2 :] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if architecture.endswith("ForMultipleChoice"):
        inputs = {name: value[None] for name, value in inputs.items()}
    if architecture.endswith("ForCausalLM"):
        inputs["use_cache"] = False
    return inputs


def _remote_outputs(folder: Path, auto_class: str, inputs: dict) -> torch.Tensor:
    serialised = json.dumps({k: v.tolist() if torch.is_tensor(v) else v for k, v in inputs.items()})
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _REMOTE_OUTPUTS, str(folder), auto_class, serialised],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{folder} does not run through its refreshed code:\n{result.stderr[-4000:]}")
    return torch.tensor(json.loads(result.stdout.splitlines()[-1]))


def refresh_code(folder: str | os.PathLike, dry_run: bool = False) -> list[str]:
    """Writes the installed package's remote-code files (`code_files_of` its model type) into the saved `folder`, and
    the full `auto_map` and `pkm_code_version` into its config.json, after checking in a staging copy that the
    refreshed folder computes the outputs of the package's own classes on the folder's weights (max abs difference
    <= 1e-5). Returns the names of the files that change (nothing is written with `dry_run`). Other files are kept."""
    import modeling_pkm_bert  # the package's classes give the reference outputs

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a saved model folder")
    config = json.loads(config_path.read_text())
    auto_map = AUTO_MAPS.get(config.get("model_type"))
    if auto_map is None:
        raise InputError(
            f"{folder} holds a {config.get('model_type')!r} model, not a BertPkm one (model_type 'bert_pkm'), a"
            " RobertaPkm one ('roberta_pkm') or a ModernBertPkm one ('modernbert_pkm')"
        )
    architecture = (config.get("architectures") or [auto_map["AutoModel"].split(".")[-1]])[0]
    auto_class = {target.split(".")[-1]: auto for auto, target in auto_map.items()}.get(architecture)
    if auto_class is None:
        raise InputError(f"{folder}: unknown architecture {architecture!r}; expected one of {sorted(auto_map.values())}")

    new_config = {**config, "auto_map": {**config.get("auto_map", {}), **auto_map}, "pkm_code_version": PKM_CODE_VERSION}
    new_files = {name: (PACKAGE_DIR / name).read_text() for name in code_files_of(config.get("model_type"))}
    new_files["config.json"] = json.dumps(new_config, indent=2, sort_keys=True) + "\n"
    changed = [
        name for name, text in new_files.items() if not (folder / name).is_file() or (folder / name).read_text() != text
    ]
    if dry_run or not changed:
        return changed

    inputs = check_inputs(config, architecture)
    reference_model = getattr(modeling_pkm_bert, architecture).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = reference_model(**inputs)[0]
    with tempfile.TemporaryDirectory(prefix=".refresh-", dir=folder.parent) as staging:
        staging = Path(staging)
        for entry in folder.iterdir():  # the weights and the rest by link, the refreshed files written anew
            if entry.name not in new_files:
                (staging / entry.name).symlink_to(entry.resolve())
        for name, text in new_files.items():
            (staging / name).write_text(text)
        refreshed = _remote_outputs(staging, auto_class, inputs)
    difference = (refreshed - reference).abs().max().item()
    if not difference <= CHECK_TOLERANCE:
        raise RuntimeError(
            f"{folder}: through the refreshed code the outputs differ from the package's by {difference:.3g} (> "
            f"{CHECK_TOLERANCE}); nothing was changed"
        )
    for name in changed:  # each file replaced whole (a rename), never half-written
        temporary = folder / f".{name}.refresh-tmp"
        temporary.write_text(new_files[name])
        os.replace(temporary, folder / name)
    return changed
