"""What goes to the Hub, and the push: an allow-list of what a model repository needs (weights, configs, exactly the
remote-code files `REMOTE_CODE_FILES`, tokenizer, card, results), the check that a folder is a complete loadable
repository, `push_folder_to_hub`, and `quantize_folder` (a folder's copy with int8 / 4-bit value tables)."""

import fnmatch
import glob
import json
import os
import re
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

from ..configuration_bert_pkm import AUTO_MAP, REMOTE_CODE_FILES, BertPkmConfig
from ..configuration_modernbert_pkm import MODERNBERT_AUTO_MAP, ModernBertPkmConfig
from ..configuration_roberta_pkm import ROBERTA_AUTO_MAP, RobertaPkmConfig
from ..utils.input_errors import InputError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")


CODE_FILES_RE = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)


# accelerate checkpoints (step_*/epoch_*), pickles and hidden files of a training output folder stay local
PUSH_IGNORE_PATTERNS = ["step_*", "epoch_*", "*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt", ".*"]


def check_hub_folder(folder: str | os.PathLike) -> None:
    """Raise ValueError naming every reason `folder` is not a loadable BertPkm Hub repository."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json, not a saved model folder")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    problems = []
    auto_maps = {
        BertPkmConfig.model_type: AUTO_MAP,
        RobertaPkmConfig.model_type: ROBERTA_AUTO_MAP,
        ModernBertPkmConfig.model_type: MODERNBERT_AUTO_MAP,
    }
    if config.get("model_type") not in auto_maps:
        problems.append(f"model_type is {config.get('model_type')!r}, not one of {sorted(auto_maps)}")
    auto_map = config.get("auto_map") or {}
    expected = auto_maps.get(config.get("model_type"), AUTO_MAP)
    absent = {k: v for k, v in expected.items() if auto_map.get(k) != v}
    if absent:
        problems.append(f"config.json auto_map lacks {sorted(absent)}")
    modules = {target.split(".")[0] for target in auto_map.values()}
    todo, seen = list(modules), set()
    while todo:  # the code files named by auto_map and what they import relatively
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = folder / f"{module}.py"
        if not path.is_file():
            problems.append(f"remote-code file {path.name} is missing")
            continue
        todo += CODE_FILES_RE.findall(path.read_text(encoding="utf-8"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        outside = sorted(s for s in shards if Path(s).name != s or s.startswith(".") or not s.endswith(".safetensors"))
        problems += [f"shard {s!r} is not a .safetensors file name inside the folder" for s in outside]
        problems += [f"shard {s} is missing" for s in sorted(set(shards) - set(outside)) if not (folder / s).is_file()]
    elif not (folder / "model.safetensors").is_file():
        problems.append("no model.safetensors (or model.safetensors.index.json)")
    if problems:
        raise ValueError(f"{folder} is not a complete BertPkm Hub folder: " + "; ".join(problems))


# What a model repository needs, and nothing else (an allow-list: a training folder also holds checkpoints with
# pickles, tracker logs with the run's arguments, `.env` files, ...). Top level: weights, configs, remote code,
# tokenizer, card and results; one level down: sentence-transformers module folders (`1_Pooling/config.json`) and the
# memory report (`memory_report/*.png`).
UPLOAD_TOP_LEVEL_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    *REMOTE_CODE_FILES,  # the remote code: exactly the shipped files
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.model",  # sentencepiece
    "README.md",
    "all_results.json",
    "*_results.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "memory_report.*",
)


UPLOAD_MODULE_FOLDER = re.compile(r"^\d+_[A-Za-z]\w*$")  # sentence-transformers: 1_Pooling, 2_Normalize, 2_Dense


UPLOAD_MODULE_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model")


UPLOAD_REPORT_FOLDER = "memory_report"


UPLOAD_REPORT_PATTERNS = ("*.png", "*.svg", "*.pdf", "*.json", "*.md", "*.csv")


def upload_allowed(relative_path: str) -> bool:
    """Whether the allow-list lets `relative_path` (posix, inside the folder) go to the Hub."""
    parts = relative_path.split("/")
    if any(part.startswith(".") or not part for part in parts):  # hidden files and folders, at any depth
        return False
    name = parts[-1]
    if len(parts) == 1:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in UPLOAD_TOP_LEVEL_PATTERNS)
    if len(parts) == 2 and UPLOAD_MODULE_FOLDER.match(parts[0]):
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in UPLOAD_MODULE_PATTERNS)
    if parts[0] == UPLOAD_REPORT_FOLDER:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in UPLOAD_REPORT_PATTERNS)
    return False


def files_to_upload(folder: str | os.PathLike, ignore_patterns: list[str] = PUSH_IGNORE_PATTERNS) -> list[str]:
    """The files of `folder` that an upload sends: those `upload_allowed` (an allow-list of what a model repository
    needs), minus `ignore_patterns`. ValueError when a symlink would be sent (its target may lie outside the folder)."""
    folder = Path(folder)
    files, links = [], []
    for root, directories, names in os.walk(folder, followlinks=False):
        relative_root = Path(root).relative_to(folder)
        for name in names + [d for d in directories if (Path(root) / d).is_symlink()]:
            relative = (relative_root / name).as_posix()
            path = Path(root) / name
            if path.is_symlink():
                if upload_allowed(relative) or (relative_root == Path(".") and (
                    UPLOAD_MODULE_FOLDER.match(name) or name == UPLOAD_REPORT_FOLDER
                )):
                    links.append(f"{relative} -> {os.readlink(path)}")
            elif upload_allowed(relative):
                files.append(relative)
    if links:
        raise InputError(
            f"{folder}: refusing to upload symlinks (their targets may lie outside the folder): {', '.join(links)}; "
            "replace them with the files themselves"
        )
    files = sorted(files)
    return list(filter_repo_objects(files, ignore_patterns=list(ignore_patterns) + DEFAULT_IGNORE_PATTERNS))


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload BertPkm model",
    ignore_patterns: list[str] = PUSH_IGNORE_PATTERNS,
):
    """Create `repo_id` if needed and upload the `files_to_upload` of `folder` (each by its exact name: nothing the
    allow-list leaves out is sent); the token comes from `token`, HF_TOKEN or the login."""
    files = files_to_upload(folder, ignore_patterns)  # before any call: a refused folder contacts nothing
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        commit_message=commit_message,
        allow_patterns=[glob.escape(name) for name in files],
    )


def quantize_folder(model_dir, output_dir, bits: int = 8) -> str:
    """Writes `output_dir`: the Hub folder `model_dir` (converted or trained) with its value tables quantized
    ([`serving.quantize_memory_values`]); the tokenizer, card and other uploadable files are copied, `model_dir` is
    left as it is. Refuses an existing non-empty `output_dir`. Returns `output_dir`."""
    import shutil

    from .. import modeling_bert_pkm, modeling_roberta_pkm
    from ..serving.quantization import BITS, quantize_memory_values

    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits={bits!r}: quantize_memory_values packs 8 (int8) or 4 (4-bit) bits per value")
    source, target = Path(model_dir), Path(output_dir)
    if target.exists() and any(target.iterdir()):
        raise InputError(f"{target} exists and is not empty: give another folder for the quantized model")
    config = json.loads((source / "config.json").read_text())
    architecture = (config.get("architectures") or ["BertPkmModel"])[0]
    module = modeling_roberta_pkm if architecture.startswith("RobertaPkm") else modeling_bert_pkm
    model_class = getattr(module, architecture, None)
    if model_class is None:
        raise InputError(f"{source}: architectures={config.get('architectures')} names no BertPkm or RobertaPkm class")
    model = model_class.from_pretrained(source)
    quantize_memory_values(model, bits)
    target.mkdir(parents=True, exist_ok=True)
    weights = (".safetensors", ".bin", "model.safetensors.index.json", "config.json")
    for name in files_to_upload(source):
        if not name.endswith(weights) and not name.endswith(".py"):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target / name)
    model.save_pretrained(target)
    return str(target)
