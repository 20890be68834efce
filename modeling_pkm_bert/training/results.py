"""What a training run leaves behind: the final outputs written atomically (weights, tokenizer, `all_results.json`), the
model card with the run's results, the tracker config (secrets redacted), and the peak memory of the device."""

import argparse
import os
import re

import torch

from ..configuration_bert_pkm import BertPkmConfig
from ..configuration_modernbert_pkm import ModernBertPkmConfig
from ..configuration_roberta_pkm import RobertaPkmConfig
from ..hub.card_command import redact_secrets


def write_results_model_card(
    folder: str,
    results: dict,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    command: str | None = None,
    title: str = "Fine-tuning results",
) -> str:
    """Writes `folder/README.md` for a trained model: `hub.model_card.write_model_card` for a BertPkm folder (a short
    card for a plain BERT baseline) with a `title` section ("Fine-tuning results") holding the curated results
    (perplexities, task metrics, memory usage per layer; the rest stays in `all_results.json`) and the command that
    produced them, without secrets or this machine's paths. `base_model` is named only when it is a Hub id
    (`hub.model_card.card_base_model` finds it); `license` defaults to apache-2.0. Returns the card's text."""
    import json

    from ..hub.model_card import card_metadata, hub_id_or_none, results_section, write_model_card

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    details = dict(command=command, dataset=dataset, task=task)
    if config.get("model_type") in (BertPkmConfig.model_type, RobertaPkmConfig.model_type, ModernBertPkmConfig.model_type):
        card = write_model_card(
            folder, repo_id=repo_id, base_model=base_model, license=license, results=results, results_title=title, **details
        )
        return str(card)
    architecture = (config.get("architectures") or ["a BERT model"])[0]
    base_model = hub_id_or_none(base_model)
    name = repo_id or os.path.basename(os.path.abspath(folder))
    text = card_metadata(base_model, license, ["bert", "baseline"]) + f"# {name}\n\n`{architecture}` without product"
    text += f" key memory (the baseline), trained from `{base_model}`.\n" if base_model else " key memory (the baseline).\n"
    text += "\n" + "\n".join(results_section(results, title, output_dir=folder, **details)) + "\n"
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(text)
    return text


# argument names that hold secrets (`hub_token`, `wandb_api_key`, ...): never sent to a tracker or saved in a checkpoint
def tracker_config(args: argparse.Namespace) -> dict:
    """The run's arguments for `accelerator.init_trackers`, secrets removed (`redact_secrets`), each value a type
    every tracker takes (enums by value; lists, dicts and paths as strings)."""
    config = {}
    for key, value in redact_secrets(vars(args)).items():
        value = getattr(value, "value", value)  # SchedulerType and other enums
        config[key] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return config


def atomic_write_json(path: str, obj) -> None:
    """Writes json to a temporary file in the same folder, flushed to disk, then renamed into place: a crash leaves
    the old file or the new one, never half of one."""
    import json
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(obj, handle, indent=4)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FINAL_STAGING = ".final.tmp"


WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")


def save_final_outputs(accelerator, output_dir: str, write) -> None:
    """Writes the final model folder atomically per file: `write(staging_folder)` (on every process: it may call
    `save_pretrained(..., is_main_process=...)`) fills `output_dir/.final.tmp`, whose files are then renamed into
    `output_dir` (each rename atomic; config.json last, so a folder with a new config has all of the new weights)."""
    import shutil

    staging = os.path.join(output_dir, FINAL_STAGING)
    if accelerator.is_main_process and os.path.exists(staging):
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    write(staging)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        names = sorted(os.listdir(staging), key=lambda name: name == "config.json")
        for name in names:
            target = os.path.join(output_dir, name)
            if os.path.isdir(os.path.join(staging, name)):
                if os.path.isdir(target):  # a module folder of the same name (1_Pooling): the folder passed the
                    shutil.rmtree(target)  # output-folder contract when the run started (utils.output_folders)
            os.replace(os.path.join(staging, name), target)
        os.rmdir(staging)
        if any(WEIGHT_FILE.match(name) for name in names):  # as save_pretrained does: drop an older save's shards
            for name in os.listdir(output_dir):
                if WEIGHT_FILE.match(name) and name not in names:
                    os.remove(os.path.join(output_dir, name))
    accelerator.wait_for_everyone()


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak memory of this process so far: the GPU's allocated peak on CUDA, else the peak resident set size."""
    import sys

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
