"""BERT / DistilBERT checkpoints -> BertPkm models ("+Init" of Kim & Jung 2020), saved as complete Hub folders."""

import dataclasses
import fnmatch
import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub.constants
import torch
import transformers
from huggingface_hub import HfApi, ModelCard, ModelCardData, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects, validate_repo_id
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, BertConfig, PreTrainedModel

from .. import modeling_bert_pkm
from ..training.arguments import DEFAULT_LICENSE, redact_command
from ..configuration_bert_pkm import AUTO_MAP, REMOTE_CODE_FILES, BertPkmConfig
from ..modeling_bert_pkm import BertPkmPreTrainedModel


PKM_FIELDS = [f.name for f in dataclasses.fields(BertPkmConfig) if f.name.startswith("pkm_")]
TARGET_CLASSES = [target.split(".")[-1] for auto, target in AUTO_MAP.items() if auto != "AutoConfig"]

# source architecture -> (transformers class loaded to read every tensor of the checkpoint, default BertPkm class);
# BERT and DistilBERT bodies without a task head are read through their pre-training class so that an MLM head,
# pooler or NSP head present in the checkpoint is seen whatever `architectures` says
SOURCE_ARCHITECTURES = {
    "BertModel": ("BertForPreTraining", "BertPkmModel"),
    "BertForPreTraining": ("BertForPreTraining", "BertPkmForMaskedLM"),
    "BertForMaskedLM": ("BertForPreTraining", "BertPkmForMaskedLM"),
    "BertForNextSentencePrediction": ("BertForPreTraining", "BertPkmModel"),
    "BertLMHeadModel": ("BertForPreTraining", "BertPkmForCausalLM"),
    "BertForSequenceClassification": ("BertForSequenceClassification", "BertPkmForSequenceClassification"),
    "BertForMultipleChoice": ("BertForMultipleChoice", "BertPkmForMultipleChoice"),
    "BertForTokenClassification": ("BertForTokenClassification", "BertPkmForTokenClassification"),
    "BertForQuestionAnswering": ("BertForQuestionAnswering", "BertPkmForQuestionAnswering"),
    "DistilBertModel": ("DistilBertForMaskedLM", "BertPkmModel"),
    "DistilBertForMaskedLM": ("DistilBertForMaskedLM", "BertPkmForMaskedLM"),
    "DistilBertForSequenceClassification": ("DistilBertForSequenceClassification", "BertPkmForSequenceClassification"),
    "DistilBertForMultipleChoice": ("DistilBertForMultipleChoice", "BertPkmForMultipleChoice"),
    "DistilBertForTokenClassification": ("DistilBertForTokenClassification", "BertPkmForTokenClassification"),
    "DistilBertForQuestionAnswering": ("DistilBertForQuestionAnswering", "BertPkmForQuestionAnswering"),
}
SUPPORTED_MODEL_TYPES = ("bert", "distilbert")
# the shape of the network: weights are copied, so these cannot change in a conversion
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)
# BertConfig fields that describe a run or a file, not the model
_RUNTIME_FIELDS = {"transformers_version", "architectures", "dtype", "output_hidden_states", "return_dict"}

# DistilBERT names (without the "distilbert." prefix) -> BERT names; bodies as in BertModel, heads as in BertFor*
_DISTILBERT_RENAMES = [
    (r"embeddings\.(word_embeddings|position_embeddings|LayerNorm)\.", r"embeddings.\1."),
    (r"transformer\.layer\.(\d+)\.attention\.q_lin\.", r"encoder.layer.\1.attention.self.query."),
    (r"transformer\.layer\.(\d+)\.attention\.k_lin\.", r"encoder.layer.\1.attention.self.key."),
    (r"transformer\.layer\.(\d+)\.attention\.v_lin\.", r"encoder.layer.\1.attention.self.value."),
    (r"transformer\.layer\.(\d+)\.attention\.out_lin\.", r"encoder.layer.\1.attention.output.dense."),
    (r"transformer\.layer\.(\d+)\.sa_layer_norm\.", r"encoder.layer.\1.attention.output.LayerNorm."),
    (r"transformer\.layer\.(\d+)\.ffn\.lin1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"transformer\.layer\.(\d+)\.ffn\.lin2\.", r"encoder.layer.\1.output.dense."),
    (r"transformer\.layer\.(\d+)\.output_layer_norm\.", r"encoder.layer.\1.output.LayerNorm."),
    (r"vocab_transform\.", "cls.predictions.transform.dense."),
    (r"vocab_layer_norm\.", "cls.predictions.transform.LayerNorm."),
    (r"vocab_projector\.weight", "cls.predictions.decoder.weight"),
    (r"vocab_projector\.bias", "cls.predictions.bias"),
    (r"pre_classifier\.", "pooler.dense."),
    (r"(classifier|qa_outputs)\.", r"\1."),
]
_HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")
_TASK_HEAD_PREFIXES = ("classifier.", "qa_outputs.")  # sized by num_labels: may differ after config_overrides

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
CODE_FILES_RE = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)
# accelerate checkpoints (step_*/epoch_*), pickles and hidden files of a training output folder stay local
PUSH_IGNORE_PATTERNS = ["step_*", "epoch_*", "*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt", ".*"]
PIPELINE_TAGS = {
    "BertPkmModel": "feature-extraction",
    "BertPkmForMaskedLM": "fill-mask",
    "BertPkmForSequenceClassification": "text-classification",
    "BertPkmForTokenClassification": "token-classification",
    "BertPkmForQuestionAnswering": "question-answering",
    "BertPkmForCausalLM": "text-generation",
}
_AUTO_CLASS_OF = {target.split(".")[-1]: auto for auto, target in AUTO_MAP.items()}
_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
_HUB_LOOKUP_ERRORS = (EntryNotFoundError, HfHubHTTPError, HFValidationError, OSError)


@dataclass
class ConversionReport:
    """What a conversion did: target tensors `carried` from the source or `new`, source tensors `dropped`."""

    source: str
    source_architecture: str
    target_class: str
    carried: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)  # target name -> source name, where they differ
    notes: list[str] = field(default_factory=list)
    source_parameters: int = 0
    target_parameters: int = 0
    carried_parameters: int = 0
    new_parameters: int = 0
    dropped_parameters: int = 0
    memory_layers: list[int] = field(default_factory=list)
    memory_value_parameters: int = 0
    memory_other_parameters: int = 0

    def __str__(self):
        lines = [
            f"{self.source} ({self.source_architecture}, {self.source_parameters:,} parameters)"
            f" -> {self.target_class} ({self.target_parameters:,} parameters)",
            f"  carried {len(self.carried):4d} tensors {self.carried_parameters:>14,} parameters",
            f"  new     {len(self.new):4d} tensors {self.new_parameters:>14,} parameters",
            *(f"    {name}" for name in group_names(self.new)),
            f"  dropped {len(self.dropped):4d} tensors {self.dropped_parameters:>14,} parameters",
            *(f"    {name}" for name in group_names(self.dropped)),
            f"  memory at layers {self.memory_layers}: values {self.memory_value_parameters:,} parameters,"
            f" other memory parameters {self.memory_other_parameters:,}",
            *(f"  note: {note}" for note in self.notes),
        ]
        return "\n".join(lines)


def group_names(names: list[str]) -> list[str]:
    """Tensor names folded over layer indices and leaves: `a.layer.{2,4}.memory.query_proj.{weight,bias}`."""
    by_layer: dict[str, list[str]] = {}
    for name in names:
        match = re.search(r"\.layer\.(\d+)\.", name)
        key = name if match is None else name[: match.start(1)] + "{}" + name[match.end(1) :]
        by_layer.setdefault(key, []).append("" if match is None else match.group(1))
    by_leaf: dict[str, list[str]] = {}
    for key, layers in by_layer.items():
        folded = key.format("{" + ",".join(layers) + "}" if len(layers) > 1 else layers[0])
        parent, dot, leaf = folded.rpartition(".")
        by_leaf.setdefault(parent + dot, []).append(leaf)
    return [parent + (leaf[0] if len(leaf) == 1 else "{" + ",".join(leaf) + "}") for parent, leaf in by_leaf.items()]


# ----------------------------------------------------------------------------------------------------------------------
# Conversion


def convert_to_pkm(
    source: str | os.PathLike | PreTrainedModel,
    target_class: type[BertPkmPreTrainedModel] | str | None = None,
    *,
    config_overrides: dict | None = None,
    **pkm_kwargs,
) -> tuple[BertPkmPreTrainedModel, ConversionReport]:
    """
    Build a BertPkm model from a BERT or DistilBERT checkpoint (a folder, a Hub id or a loaded model): every source
    tensor that has a place in the target is copied (DistilBERT renamed onto BERT, with zero token-type embeddings),
    the FFN of `"replace"` layers is dropped, the memories and any head missing in the source are initialised new.

    `target_class` defaults to the BertPkm class of the source's head; `config_overrides` sets other config fields
    (e.g. `{"num_labels": 3}`); `pkm_kwargs` are `pkm_*` fields of [`BertPkmConfig`]. With `pkm_mode="resm"` and
    `pkm_value_init="zeros"` the result computes exactly what the source computes, with any Memory+ option (shared
    values, swilu: its output bias starts at zero, qk-norm, ReLU scores, memory scale): the memories then read zeros. Returns the model (in eval mode)
    and a [`ConversionReport`].
    """
    source_model, architecture, not_in_checkpoint, unread = _load_source(source)
    source_name = _source_name(source)
    src_config = source_model.config
    target_class = _resolve_target_class(target_class, architecture)
    config = _target_config(src_config, source_name, config_overrides or {}, pkm_kwargs)

    model = target_class(config)
    report = ConversionReport(source=source_name, source_architecture=architecture, target_class=target_class.__name__)
    src_tensors = source_model.state_dict(keep_vars=True)
    tgt_tensors = model.state_dict(keep_vars=True)
    target_prefix = model.base_model_prefix + "." if model.base_model is not model else ""

    state_dict = {}
    for src_name, tensor in src_tensors.items():
        if src_name in not_in_checkpoint:
            continue  # initialised by transformers when the source was loaded, not a weight of the checkpoint
        canonical = _canonical_name(src_name, source_model)
        if canonical is None:
            continue
        head = canonical.startswith(_HEAD_PREFIXES)
        if head and not target_prefix:
            continue  # a head has no place in BertPkmModel
        tgt_name = canonical if head else target_prefix + canonical
        if tgt_name not in tgt_tensors:
            continue
        if tgt_tensors[tgt_name].shape != tensor.shape:
            if canonical.startswith(_TASK_HEAD_PREFIXES):
                report.notes.append(
                    f"{src_name} {tuple(tensor.shape)} does not fit {tgt_name} {tuple(tgt_tensors[tgt_name].shape)}"
                    f" (num_labels={config.num_labels}): initialised new"
                )
                continue
            raise ValueError(
                f"{source_name}: tensor {src_name} has shape {tuple(tensor.shape)} but {target_class.__name__} expects"
                f" {tuple(tgt_tensors[tgt_name].shape)} for {tgt_name}"
            )
        state_dict[tgt_name] = tensor.detach()
        if tgt_name != src_name:
            report.renamed[tgt_name] = src_name

    zeros = {}
    if src_config.model_type == "distilbert":
        name = target_prefix + "embeddings.token_type_embeddings.weight"
        zeros[name] = torch.zeros_like(tgt_tensors[name])
        report.notes.append(f"{name} set to zeros: DistilBERT has no token types; the model ignores them until trained")
        if any(src.startswith("pre_classifier.") for src in report.renamed.values()):
            report.notes.append(
                "DistilBERT's pre_classifier (ReLU) became BERT's pooler (tanh): the classification logits differ from"
                " the source's until the model is fine-tuned"
            )

    with torch.no_grad():
        result = model.load_state_dict({**state_dict, **zeros}, strict=False)
    if result.unexpected_keys:  # cannot happen: every name was checked against the target
        raise RuntimeError(f"tensors not loaded into {target_class.__name__}: {result.unexpected_keys}")

    # tied tensors (decoder.weight = word_embeddings.weight, ...) are one object under several names
    carried_ids = {id(tgt_tensors[name]) for name in state_dict}
    carried_src_ids = {id(src_tensors[report.renamed.get(name, name)]) for name in state_dict}
    report.carried = [name for name, t in tgt_tensors.items() if id(t) in carried_ids]
    report.new = [name for name, t in tgt_tensors.items() if id(t) not in carried_ids]
    report.dropped = [
        name
        for name, t in src_tensors.items()
        if name not in not_in_checkpoint and id(t) not in carried_src_ids
    ] + sorted(unread)

    params = dict(model.named_parameters())
    src_params = {n: p for n, p in source_model.named_parameters() if n not in not_in_checkpoint}
    report.source_parameters = sum(p.numel() for p in src_params.values())
    report.target_parameters = sum(p.numel() for p in params.values())
    report.carried_parameters = sum(p.numel() for p in params.values() if id(p) in carried_ids)
    report.new_parameters = report.target_parameters - report.carried_parameters
    report.dropped_parameters = sum(p.numel() for p in src_params.values() if id(p) not in carried_src_ids)
    tables = set()  # a value table shared by the memories (pkm_shared_values) counts once
    for i, layer in enumerate(model.base_model.encoder.layer):
        if layer.memory is not None:
            values = layer.memory.values.weight.numel()
            report.memory_layers.append(i)
            if id(layer.memory.values.weight) not in tables:
                tables.add(id(layer.memory.values.weight))
                report.memory_value_parameters += values
            report.memory_other_parameters += sum(p.numel() for p in layer.memory.parameters()) - values

    if config.pkm_mode == "replace" and config.pkm_layers:
        report.notes.append(f"pkm_mode='replace': the FFN of layers {config.pkm_layers} is dropped")
    missing_heads = sorted({n.split(".")[0] for n in report.new if n.startswith(_HEAD_PREFIXES)})
    if missing_heads:
        report.notes.append(f"head {', '.join(missing_heads)} initialised new (not in the source): train it")
    if unread:
        reader = type(source_model).__name__
        report.notes.append(f"checkpoint tensors that transformers' {reader} does not read: {sorted(unread)}")
    return model.eval(), report


def _source_name(source) -> str:
    if isinstance(source, PreTrainedModel):
        return source.config._name_or_path or type(source).__name__
    return str(source)


def _check_model_type(config, source_name):
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source_name}: model_type {config.model_type!r} is not supported; convert_to_pkm converts BERT"
            f" (model_type 'bert') and DistilBERT ('distilbert') checkpoints"
        )
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise ValueError(
            f"{source_name}: position_embedding_type={position_embedding_type!r} is not supported (transformers 5 and"
            f" BertPkm have absolute position embeddings only)"
        )


def _check_architecture(architecture, source_name):
    if architecture not in SOURCE_ARCHITECTURES:
        raise ValueError(
            f"{source_name}: architecture {architecture!r} is not supported; supported: {sorted(SOURCE_ARCHITECTURES)}"
        )


def check_source(source: str | os.PathLike, offline: bool = False) -> None:
    """Raises ValueError, before anything loads, where `source` (a folder or Hub id) cannot be converted: no such folder
    and no Hub id, or a BertPkm model already (whose config transformers would refuse as custom code); with `offline`
    (HF_HUB_OFFLINE=1) also a Hub id not in the cache. Reads only the folder and the Hub cache, never the network."""
    path = Path(source)
    if path.is_dir():
        config_file = path / "config.json"
    elif hub_id_or_none(str(source)) is None:
        raise ValueError(f"{str(source)!r}: no such folder, and not a Hub model id ('name' or 'namespace/name') either")
    else:
        config_file = try_to_load_from_cache(str(source), "config.json")
        config_file = Path(config_file) if isinstance(config_file, str) else None
        if config_file is None and offline:
            raise ValueError(
                f"{str(source)!r}: no such folder, and as a Hub model id not in the local cache, the only place "
                "HF_HUB_OFFLINE=1 reads"
            )
    if config_file is not None and config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return  # transformers' own error names the file
        if model_type == BertPkmConfig.model_type:
            raise ValueError(
                f"{str(source)!r} is already a BertPkm model (model_type {model_type!r}): fine-tune it as it is "
                "(run_mlm.py, run_glue.py, run_squad.py --model_name_or_path take it), or convert its BERT source again "
                "to change its memories"
            )


def _load_source(source) -> tuple[PreTrainedModel, str, set[str], set[str]]:
    """The source model, its architecture, the names it holds that the checkpoint did not, checkpoint names unread."""
    source_name = _source_name(source)
    if isinstance(source, PreTrainedModel):
        _check_model_type(source.config, source_name)
        _check_architecture(type(source).__name__, source_name)
        return source, type(source).__name__, set(), set()

    check_source(source, offline=huggingface_hub.constants.HF_HUB_OFFLINE)
    config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    _check_model_type(config, source_name)
    base = "BertModel" if config.model_type == "bert" else "DistilBertModel"
    architecture = (config.architectures or [base])[0]
    _check_architecture(architecture, source_name)
    load_class = getattr(transformers, SOURCE_ARCHITECTURES[architecture][0])
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # our report replaces the MISSING/UNEXPECTED table of transformers
    try:
        model, info = load_class.from_pretrained(source, config=config, dtype=torch.float32, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model, architecture, set(info["missing_keys"]), set(info["unexpected_keys"])


def _resolve_target_class(target_class, architecture) -> type[BertPkmPreTrainedModel]:
    if target_class is None:
        target_class = SOURCE_ARCHITECTURES[architecture][1]
    if isinstance(target_class, str):
        if target_class not in TARGET_CLASSES:
            raise ValueError(f"target_class {target_class!r} is not a BertPkm model class: {TARGET_CLASSES}")
        target_class = getattr(modeling_bert_pkm, target_class)
    if not (isinstance(target_class, type) and issubclass(target_class, BertPkmPreTrainedModel)):
        raise ValueError(f"target_class must be a BertPkm model class {TARGET_CLASSES}, got {target_class!r}")
    return target_class


def _bert_fields(src_config) -> dict:
    """The BertConfig fields of a BERT or DistilBERT config (DistilBERT: zero token types, LayerNorm eps 1e-12)."""
    if src_config.model_type == "bert":
        names = [f.name for f in dataclasses.fields(BertConfig) if f.name not in _RUNTIME_FIELDS]
        return {name: getattr(src_config, name) for name in names}
    c = src_config
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "intermediate_size": c.hidden_dim,
        "hidden_act": c.activation,
        "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.attention_dropout,
        "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": 2,
        "initializer_range": c.initializer_range,
        "layer_norm_eps": 1e-12,  # hard-coded in every DistilBERT LayerNorm
        "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "tie_word_embeddings": c.tie_word_embeddings,
        "classifier_dropout": c.seq_classif_dropout,
        "chunk_size_feed_forward": c.chunk_size_feed_forward,
        "id2label": c.id2label,
        "label2id": c.label2id,
        "problem_type": c.problem_type,
    }


def _target_config(src_config, source_name, config_overrides, pkm_kwargs) -> BertPkmConfig:
    unknown = sorted(set(pkm_kwargs) - set(PKM_FIELDS))
    if unknown:
        raise TypeError(f"unknown PKM option(s) {unknown}; BertPkmConfig's PKM fields are {PKM_FIELDS}")
    fields = _bert_fields(src_config)
    changed = [k for k in ARCHITECTURE_FIELDS if k in config_overrides and config_overrides[k] != fields[k]]
    if changed:
        raise ValueError(
            f"config_overrides cannot change {changed} (source: {[fields[k] for k in changed]}): the conversion copies"
            f" the source weights, so the network keeps its shape"
        )
    if "num_labels" in config_overrides and config_overrides["num_labels"] != len(fields.get("id2label") or {}):
        del fields["id2label"], fields["label2id"]  # the labels of the source's head do not fit the new one
    kwargs = {**fields, **config_overrides, **pkm_kwargs}
    layers, depth = kwargs.get("pkm_layers"), fields["num_hidden_layers"]
    if layers is not None and any(not 0 <= int(i) < depth for i in layers):
        raise ValueError(
            f"pkm_layers={list(layers)} does not fit {source_name}: it has {depth} layers (num_hidden_layers), so"
            f" memory layer indices must be in [0, {depth - 1}] (0-based)"
        )
    return BertPkmConfig(**kwargs)


def _canonical_name(src_name: str, source_model: PreTrainedModel) -> str | None:
    """A source tensor's name in BERT terms: body as in BertModel (`encoder.layer.0...`), heads as in BertFor*."""
    prefix = source_model.base_model_prefix + "."
    name = src_name[len(prefix) :] if src_name.startswith(prefix) else src_name
    if source_model.config.model_type == "bert":
        return name
    for pattern, replacement in _DISTILBERT_RENAMES:
        new, n = re.subn("^" + pattern, replacement, name)
        if n:
            return new
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Hub folder: tokenizer, license, model card, checks, atomic save


SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def sentence_transformers_files(source) -> list[str]:
    """The files of a local sentence-transformers folder (`modules.json`, its configs, the pooling/dense/... module
    folders) that make a converted folder a sentence-transformers model too, relative to `source`; [] for anything
    else. Raises ValueError naming the file and the problem where they are malformed or missing."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).is_dir():
        return []
    source = Path(source)
    if not (source / "modules.json").is_file():
        return []
    modules = _read_json(source / "modules.json")
    if not isinstance(modules, list) or not modules:
        raise ValueError(f"{source / 'modules.json'}: expected a non-empty list of modules, got {modules!r}")
    files = [name for name in SENTENCE_TRANSFORMERS_FILES if (source / name).is_file()]
    for name in files[1:]:
        _read_json(source / name)
    for i, module in enumerate(modules):
        if not (isinstance(module, dict) and isinstance(module.get("path"), str) and isinstance(module.get("type"), str)):
            raise ValueError(f"{source / 'modules.json'}: module {i} must have string 'path' and 'type', got {module!r}")
        path, kind = Path(module["path"]), module["type"].rsplit(".", 1)[-1]
        if path.is_absolute() or ".." in path.parts:
            raise ValueError(f"{source / 'modules.json'}: module {i} path {module['path']!r} leaves the folder")
        if kind == "Transformer":
            if module["path"] not in ("", "."):
                raise ValueError(
                    f"{source / 'modules.json'}: the Transformer module is at {module['path']!r}; only a Transformer at "
                    "the folder's root (path '') is converted with it"
                )
            continue
        if (source / path).is_dir():
            found = sorted(p for p in (source / path).rglob("*") if p.is_file())
            for file in found:
                if file.suffix == ".json":
                    _read_json(file)
            files += [file.relative_to(source).as_posix() for file in found]
        elif kind != "Normalize":  # Normalize has no files; every other module reads its folder
            raise ValueError(
                f"{source / 'modules.json'}: module {i} ({module['type']}) is at {module['path']!r}, but {source / path} "
                "is missing"
            )
    return files


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def load_source_tokenizer(source):
    """The source's tokenizer, or None where it has no tokenizer files (AutoTokenizer would invent a 5-token one)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    if Path(source).is_dir():
        found = any((Path(source) / name).is_file() for name in TOKENIZER_FILES)
    else:
        found = any(_hub_file(str(source), name) for name in TOKENIZER_FILES)
    return AutoTokenizer.from_pretrained(source) if found else None


def _hub_file(repo_id: str, filename: str) -> Path | None:
    try:
        return Path(hf_hub_download(repo_id, filename))
    except _HUB_LOOKUP_ERRORS:
        return None


def source_license(source) -> str | None:
    """The license in the source's README YAML, else in its config.json, else None."""
    if not isinstance(source, (str, os.PathLike)):
        return getattr(getattr(source, "config", None), "license", None)
    local = Path(source).is_dir()
    readme = Path(source) / "README.md" if local else _hub_file(str(source), "README.md")
    if readme is not None and readme.is_file():
        license = ModelCard.load(readme, ignore_metadata_errors=True).data.license
        if license:
            return license
    config = Path(source) / "config.json" if local else _hub_file(str(source), "config.json")
    if config is not None and config.is_file():
        return json.loads(config.read_text(encoding="utf-8")).get("license")
    return None


def hub_id_or_none(name) -> str | None:
    """`name` if it can be a Hub model id (not a local path), else None."""
    if name is None or not isinstance(name, str) or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def folder_parameter_counts(folder: str | os.PathLike) -> dict[str, int]:
    """Parameter counts of a saved model from its safetensors headers: total, memory values, other memory params."""
    counts = {"total": 0, "memory_values": 0, "memory_other": 0}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name.endswith(_BUFFER_SUFFIXES):
                    continue
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                counts["total"] += n
                if ".memory." in name:
                    counts["memory_values" if name.endswith("memory.values.weight") else "memory_other"] += n
    return counts


def card_base_model(model_name_or_path, base_model: str | None = None) -> str | None:
    """The Hub id a model card names as `base_model`: `base_model` (a flag), else `model_name_or_path` when it is a
    Hub id, else the `base_model` of a local source folder's own card (a converted or trained folder); never a local
    path."""
    if base_model is not None:
        if hub_id_or_none(base_model) is None:
            raise ValueError(f"base_model {base_model!r} is not a Hub model id (e.g. google-bert/bert-base-uncased)")
        return base_model
    if not isinstance(model_name_or_path, (str, os.PathLike)):
        return None
    hub_id = hub_id_or_none(str(model_name_or_path))
    if hub_id is not None:
        return hub_id
    readme = Path(model_name_or_path) / "README.md"
    if readme.is_file():
        found = ModelCard.load(readme, ignore_metadata_errors=True).data.base_model
        found = found[0] if isinstance(found, list) and len(found) == 1 else found
        return hub_id_or_none(found) if isinstance(found, str) else None
    return None


def card_license(model_name_or_path, license: str | None = None) -> str:
    """The license a model card declares: `license` (a flag), else the source's (its card or config), else
    `apache-2.0`, the license of BERT's and MiniLM's weights and of this code."""
    return license or source_license(model_name_or_path) or DEFAULT_LICENSE


def _shown_name(name: str) -> str:
    """A source or data set as a card names it: a Hub id as is, a local path by its last component only."""
    return name if hub_id_or_none(name) is not None else (Path(str(name)).name or "<path>")


# curated results of a card: (label, all_results.json key pattern), in this order; the rest stays in all_results.json
_TASK_METRICS = {
    "accuracy": "accuracy",
    "f1": "F1",
    "exact_match": "exact match",
    "exact": "exact match",
    "matthews_correlation": "Matthews correlation",
    "pearson": "Pearson",
    "spearmanr": "Spearman",
    "HasAns_f1": "F1, answerable",
    "NoAns_f1": "F1, unanswerable",
}
_MEMORY_METRICS = {"mu": ("MU %", 100, 2), "top1_mu": ("top-1 MU %", 100, 3), "kl_u": ("KL_u", 1, 3), "kl_w": ("KL_w", 1, 3)}
_BEFORE_PREFIXES = ("initial_", "pretrained_")


def _number(value: float) -> str:
    return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4f}"


def curated_results(results: dict) -> list[str]:
    """The results table of a model card: perplexities, task metrics (accuracy, F1, exact match, ...) and the memory
    usage of each memory layer, before training (`initial_*`, `pretrained_*`) and after, as markdown lines."""
    rows = {}  # key after training -> [label, before, after]

    def add(key, label, before_keys, scale=1.0, digits=None):
        def shown(k):
            value = results.get(k)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return None
            return f"{value * scale:.{digits}f}" if digits is not None else _number(value)

        before = next((v for v in map(shown, before_keys) if v is not None), None)
        rows[key] = [label, before, shown(key)]

    for key in results:
        if key.startswith(_BEFORE_PREFIXES):
            continue
        match = re.fullmatch(r"(?:eval_)?(?:(.+)_)?perplexity", key)
        if match and not match.group(1) and any(re.fullmatch(r"eval_.+_perplexity", k) for k in results):
            continue  # the first evaluation set's, shown under its name
        if match:
            name = f"perplexity, {match.group(1)}" if match.group(1) else "perplexity"
            add(key, f"{name} (`{key}`)", [p + key for p in _BEFORE_PREFIXES])
            continue
        match = re.fullmatch(r"eval_(" + "|".join(_TASK_METRICS) + r")(_[a-z0-9]+)?", key)
        if match:
            add(key, f"{_TASK_METRICS[match.group(1)]}{match.group(2) or ''} (`{key}`)", [])
            continue
        match = re.fullmatch(r"eval_memory/([^/]+)/(" + "|".join(_MEMORY_METRICS) + ")", key)
        if match:
            label, scale, digits = _MEMORY_METRICS[match.group(2)]
            tail = key[len("eval_") :]
            add(key, f"{match.group(1)} {label}", ["initial_" + key, "pretrained_" + tail], scale, digits)
    if not rows:
        return []
    with_before = any(before is not None for _, before, _ in rows.values())
    lines = ["| | before training | after training |", "|---|---:|---:|"] if with_before else ["| | |", "|---|---:|"]
    for label, before, after in rows.values():
        cells = [label, before or "-", after or "-"] if with_before else [label, after or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def results_section(
    results: dict,
    title: str = "Results",
    *,
    command: str | None = None,
    output_dir: str | os.PathLike | None = None,
    dataset: str | None = None,
    task: str | None = None,
) -> list[str]:
    """A card's results: what was trained on, the curated table, where the rest is, the command ("Produced by")."""
    lines = [f"## {title}", ""]
    if dataset or task:
        lines += [f"Task: {task or '-'}; data: `{_shown_name(dataset) if dataset else '-'}`.", ""]
    table = curated_results(results)
    numeric = [k for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    lines += table + ([""] if table else [])
    lines.append(
        f"All {len(numeric)} numbers of the run (every memory statistic, sample counts, runtimes on the machine that"
        " trained it) are in `all_results.json`."
    )
    if command:
        lines += ["", "Produced by:", "", "```bash", redact_command(command, output_dir), "```"]
    return lines


def _card_metadata(base_model, license, tags, pipeline_tag=None) -> str:
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        base_model=hub_id_or_none(base_model),
        license=license or DEFAULT_LICENSE,
    )
    return f"---\n{data.to_yaml()}\n---\n\n"


def write_model_card(
    folder: str | os.PathLike,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    report: ConversionReport | None = None,
    model_name: str | None = None,
    results: dict | None = None,
    results_title: str = "Results",
    command: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
) -> ModelCard:
    """Write `README.md` for a saved BertPkm folder: YAML metadata (`library_name`, `license`, `base_model` when it
    is a Hub id, tags), usage, memory settings, parameter counts and, given `results`, their curated table and the
    `command` that produced the folder, without secrets or this machine's paths."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    architecture = (config.get("architectures") or ["BertPkmModel"])[0]
    auto_class = _AUTO_CLASS_OF.get(architecture, "AutoModel")
    base_model = hub_id_or_none(base_model)
    tags = ["pkm", "product-key-memory", "bert", "bert_pkm", f"pkm-{config['pkm_mode']}", "custom_code"]
    if report is not None and report.source_architecture.startswith("DistilBert"):
        tags.insert(3, "distilbert")
    metadata = _card_metadata(base_model, license, tags, PIPELINE_TAGS.get(architecture))
    counts = folder_parameter_counts(folder)
    name = model_name or repo_id or folder.name
    load_from = repo_id or "path/to/this/folder"
    source = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a BERT checkpoint"
    if report is not None and not base_model:
        source = f"`{_shown_name(report.source)}`"
    mode = {"resm": "beside the feed-forward network (ResM)", "replace": "instead of the feed-forward network"}
    settings = "\n".join(f"| `{k}` | `{json.dumps(config[k])}` |" for k in PKM_FIELDS if k in config)
    lines = [
        f"# {name}",
        "",
        f"BERT with product key memory (PKM, Lample et al. 2019) at layers {config['pkm_layers']},"
        f" {mode[config['pkm_mode']]}, as in Kim & Jung 2020 (*Large Product Key Memory for Pretrained Language"
        f" Models*). Architecture: `{architecture}`.",
    ]
    if report is not None:
        lines += [
            "",
            f"Converted from {source} ({report.source_architecture}): {report.carried_parameters:,} parameters"
            f" carried over, {report.new_parameters:,} new (the memories"
            + (", the head" if any(n.startswith(_HEAD_PREFIXES) for n in report.new) else "")
            + f"), {report.dropped_parameters:,} dropped. "
            + (
                "Its memory values are zero and sit beside the FFN, so it computes exactly what the source"
                " computes until trained"
                if config["pkm_mode"] == "resm" and config["pkm_value_init"] == "zeros"
                else "Its memories are freshly initialised, so its outputs differ from the source's until trained"
            )
            + " (e.g. with masked language modeling).",
        ]
    elif base_model:
        lines += ["", f"Trained from {source}."]
    if results is not None:
        lines += ["", *results_section(results, results_title, command=command, output_dir=folder, dataset=dataset, task=task)]
    elif command:
        lines += ["", "Produced by:", "", "```bash", redact_command(command, folder), "```"]
    lines += [
        "",
        "## Usage",
        "",
        "The model code ships with the checkpoint (`trust_remote_code=True`); it needs `transformers>=5.4,<6`.",
        "",
        "```python",
        f"from transformers import AutoTokenizer, {auto_class}",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{load_from}", trust_remote_code=True)  # reads the config',
        f'model = {auto_class}.from_pretrained("{load_from}", trust_remote_code=True)',
        'outputs = model(**tokenizer("Product keys make a large memory cheap to read.", return_tensors="pt"))',
        "```",
        "",
        "## Memory settings",
        "",
        "| setting | value |",
        "|---|---|",
        settings,
        f"| memory slots per layer | {config['pkm_n_keys'] ** 2:,} |",
        "",
        "## Parameters",
        "",
        "| | parameters |",
        "|---|---:|",
        f"| total | {counts['total']:,} |",
        f"| memory values | {counts['memory_values']:,} |",
        f"| other memory parameters (keys, query network) | {counts['memory_other']:,} |",
        f"| rest of the model | {counts['total'] - counts['memory_values'] - counts['memory_other']:,} |",
        "",
        "Memory values are best trained in their own optimizer group (Adam, constant learning rate 1e-3, no weight"
        " decay), as in XLM and the paper.",
        "",
    ]
    card = ModelCard(metadata + "\n".join(lines))
    card.save(folder / "README.md")
    return card


def check_hub_folder(folder: str | os.PathLike) -> None:
    """Raise ValueError naming every reason `folder` is not a loadable BertPkm Hub repository."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json, not a saved model folder")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    problems = []
    if config.get("model_type") != BertPkmConfig.model_type:
        problems.append(f"model_type is {config.get('model_type')!r}, not {BertPkmConfig.model_type!r}")
    auto_map = config.get("auto_map") or {}
    absent = {k: v for k, v in AUTO_MAP.items() if auto_map.get(k) != v}
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


def check_output_dir(output_dir: str | os.PathLike, overwrite: bool = False) -> None:
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir {output_dir} exists and is not a folder")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise ValueError(f"output_dir {output_dir} exists and is not empty; use --overwrite_output_dir to replace it")


def save_converted(
    model: BertPkmPreTrainedModel,
    report: ConversionReport | None,
    output_dir: str | os.PathLike,
    tokenizer=None,
    source_name: str | None = None,
    license: str | None = None,
    *,
    repo_id: str | None = None,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    command: str | None = None,
) -> Path:
    """
    Write a complete Hub repository: config with the full auto_map, the remote-code files, safetensors weights
    (sharded above `max_shard_size`), the tokenizer, a model card and, when the source is a local sentence-transformers
    folder, its module files ([`sentence_transformers_files`]). Everything is written into a temporary sibling
    folder that is renamed to `output_dir` at the end, so a failure leaves no half-written output.
    """
    output_dir = Path(output_dir).absolute()
    check_output_dir(output_dir, overwrite)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_folder(output_dir)
    try:
        if tokenizer is not None:
            model.config.tokenizer_class = type(tokenizer).__name__
            tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        source = report.source if report is not None else None
        for name in sentence_transformers_files(source):  # a sentence-transformers source stays one
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(source) / name, tmp / name)
        if source is not None and not Path(source).is_dir() and hub_id_or_none(source) and _hub_file(source, "modules.json"):
            transformers.logging.get_logger(__name__).warning(
                f"{source} is a sentence-transformers repository: its modules (pooling, normalisation) are carried over "
                f"from a local folder only; download it (`hf download {source} --local-dir ...`) and convert the folder"
            )
        base_model = source_name if source_name is not None else (report.source if report is not None else None)
        write_model_card(
            tmp,
            repo_id=repo_id,
            base_model=base_model,
            license=license,
            report=report,
            model_name=repo_id or output_dir.name,
            command=command,
        )
        check_hub_folder(tmp)
        replace_folder(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def staging_folder(target: Path) -> Path:
    """An empty folder beside `target` in which to build its replacement (same file system: `replace_folder` renames
    it), with the permissions of a new folder (mkdtemp makes it private)."""
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    return folder


def replace_folder(new: Path, target: Path) -> None:
    """Puts the folder `new` in place of `target` (renames on one file system): the old `target` is kept aside until
    the new one is in place, and restored if that fails, so `target` is never half-written."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(old / target.name)
    try:
        new.rename(target)
    except BaseException:
        if old is not None:
            (old / target.name).rename(target)
        raise
    finally:
        if old is not None and target.exists():
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------------
# Hub upload


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
        raise ValueError(
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


__all__ = [
    "ConversionReport",
    "card_base_model",
    "card_license",
    "check_hub_folder",
    "check_output_dir",
    "check_source",
    "convert_to_pkm",
    "curated_results",
    "files_to_upload",
    "folder_parameter_counts",
    "group_names",
    "hub_id_or_none",
    "load_source_tokenizer",
    "push_folder_to_hub",
    "replace_folder",
    "staging_folder",
    "save_converted",
    "sentence_transformers_files",
    "upload_allowed",
    "source_license",
    "write_model_card",
]
