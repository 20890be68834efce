"""BERT / DistilBERT checkpoints -> BertPkm models ("+Init" of Kim & Jung 2020), saved as complete Hub folders
(weights, config, remote code, tokenizer, model card), atomically.

The model card is written by `model_card`, the upload list and push are in `upload`.
"""

import dataclasses
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
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoTokenizer, BertConfig, ModernBertConfig, PreTrainedModel

from .. import kernels, modeling_bert_pkm, modeling_modernbert_pkm, modeling_roberta_pkm
from ..configuration_bert_pkm import AUTO_MAP, BertPkmConfig
from ..configuration_modernbert_pkm import MODERNBERT_AUTO_MAP, ModernBertPkmConfig
from ..configuration_roberta_pkm import ROBERTA_AUTO_MAP, RobertaPkmConfig
from ..modeling_bert_pkm import BertPkmPreTrainedModel
from ..modeling_modernbert_pkm import ModernBertPkmPreTrainedModel
from ..modeling_pkm_utils import PkmPreTrainedModel
from ..modeling_roberta_pkm import RobertaPkmPreTrainedModel
from ..utils.input_errors import InputError
from ..utils.output_folders import check_output_folder, mark_output_folder
from .model_card import (
    HEAD_PREFIXES,
    PKM_FIELDS,
    hub_file,
    hub_id_or_none,
    write_model_card,
)
from .upload import (
    TOKENIZER_FILES,
    check_hub_folder,
)


TOOL = "convert_to_pkm"  # a converted folder holds the marker `.convert_to_pkm` (`utils.output_folders`)


TARGET_CLASSES = [target.split(".")[-1] for auto, target in AUTO_MAP.items() if auto != "AutoConfig"]
ROBERTA_TARGET_CLASSES = [target.split(".")[-1] for auto, target in ROBERTA_AUTO_MAP.items() if auto != "AutoConfig"]
MODERNBERT_TARGET_CLASSES = [t.split(".")[-1] for auto, t in MODERNBERT_AUTO_MAP.items() if auto != "AutoConfig"]


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
    # RoBERTa, DistilRoBERTa and XLM-RoBERTa: the same tensor names (`roberta.`, `lm_head.`, `classifier.`), read
    # through their own class (no RoBERTa class holds both an LM head and the pooler)
    **{
        f"{family}{head}": (f"{family}{head}", f"RobertaPkm{head}")
        for family in ("Roberta", "XLMRoberta")
        for head in ("Model", "ForMaskedLM", "ForCausalLM", "ForSequenceClassification", "ForMultipleChoice",
                     "ForTokenClassification", "ForQuestionAnswering")
    },
    # ModernBERT, Ettin's encoders, mmBERT: transformers' names are ModernBertPkm's (`model.`, `head.`, `decoder`,
    # `classifier`), read through their own class
    **{
        f"ModernBert{head}": (f"ModernBert{head}", f"ModernBertPkm{head}")
        for head in ("Model", "ForMaskedLM", "ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification",
                     "ForQuestionAnswering")
    },
}


# model_type -> the architecture of a checkpoint whose config names none
SOURCE_BASE_ARCHITECTURES = {
    "bert": "BertModel",
    "distilbert": "DistilBertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "modernbert": "ModernBertModel",
}
SUPPORTED_MODEL_TYPES = tuple(SOURCE_BASE_ARCHITECTURES)
ROBERTA_MODEL_TYPES = ("roberta", "xlm-roberta")  # converted into the RobertaPkm classes
MODERNBERT_MODEL_TYPES = ("modernbert",)  # converted into the ModernBertPkm classes
# family -> (its target classes, its modeling module, its base class, its config class)
FAMILIES = {
    "bert": (TARGET_CLASSES, modeling_bert_pkm, BertPkmPreTrainedModel, BertPkmConfig),
    "roberta": (ROBERTA_TARGET_CLASSES, modeling_roberta_pkm, RobertaPkmPreTrainedModel, RobertaPkmConfig),
    "modernbert": (MODERNBERT_TARGET_CLASSES, modeling_modernbert_pkm, ModernBertPkmPreTrainedModel, ModernBertPkmConfig),
}
PKM_MODEL_TYPES = {"bert_pkm": "BertPkm", "roberta_pkm": "RobertaPkm", "modernbert_pkm": "ModernBertPkm"}


def family_of(model_type: str) -> str:
    """The BertPkm family a source of `model_type` converts into: "bert", "roberta" or "modernbert"."""
    if model_type in ROBERTA_MODEL_TYPES:
        return "roberta"
    return "modernbert" if model_type in MODERNBERT_MODEL_TYPES else "bert"


def memory_layers_of(model) -> torch.nn.ModuleList:
    """The layers of a converted model (BertPkm, RobertaPkm: `encoder.layer`; ModernBertPkm: `layers`)."""
    base = model.base_model
    return base.layers if isinstance(model, ModernBertPkmPreTrainedModel) else base.encoder.layer


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


_TASK_HEAD_PREFIXES = ("classifier.", "qa_outputs.")  # sized by num_labels: may differ after config_overrides


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
    kernels.register()  # the converted model runs the native CPU selection, as one built through the package root
    source_model, architecture, not_in_checkpoint, unread = _load_source(source)
    source_name = _source_name(source)
    src_config = source_model.config
    target_class, config = conversion_target(src_config, source_name, target_class, config_overrides, pkm_kwargs,
                                             architecture=architecture)  # fmt: skip

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
        head = canonical.startswith(HEAD_PREFIXES)
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
            raise InputError(
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
    for i, layer in enumerate(memory_layers_of(model)):
        if layer.memory is not None:
            values = layer.memory.values.weight.numel()
            report.memory_layers.append(i)
            if id(layer.memory.values.weight) not in tables:
                tables.add(id(layer.memory.values.weight))
                report.memory_value_parameters += values
            report.memory_other_parameters += sum(p.numel() for p in layer.memory.parameters()) - values

    if config.pkm_mode == "replace" and config.pkm_layers:
        report.notes.append(f"pkm_mode='replace': the FFN of layers {config.pkm_layers} is dropped")
    if config.ngram_layers:
        report.notes.append(
            f"n-gram memories at layers {config.ngram_layers} start function-preserving (zero value projection)"
        )
        if config.ngram_token_map:
            report.notes.append(_fill_ngram_token_map(model, source, source_name))
    missing_heads = sorted({n.split(".")[0] for n in report.new if n.startswith(HEAD_PREFIXES)})
    if missing_heads:
        report.notes.append(f"head {', '.join(missing_heads)} initialised new (not in the source): train it")
    if unread:
        reader = type(source_model).__name__
        report.notes.append(f"checkpoint tensors that transformers' {reader} does not read: {sorted(unread)}")
    return model.eval(), report


def normalized_token_map(tokenizer, vocab_size: int) -> torch.Tensor:
    """`token_map` of the n-gram memories (`ngram_token_map`): each id -> the first id whose token has the same
    lowercase, accent-folded form (NFKD without combining marks), so that "The", "the" and "thé" hash alike; special
    tokens and ids beyond the tokenizer's vocabulary map to themselves."""
    import unicodedata

    def folded(token: str) -> str:
        return "".join(c for c in unicodedata.normalize("NFKD", token.lower()) if not unicodedata.combining(c))

    token_map = torch.arange(vocab_size)
    special = set(tokenizer.all_special_ids)
    first = {}
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if index >= vocab_size or index in special:
            continue
        token_map[index] = first.setdefault(folded(token), index)
    return token_map


def _fill_ngram_token_map(model, source, source_name) -> str:
    tokenizer = load_source_tokenizer(source)
    if tokenizer is None:
        raise InputError(
            f"{source_name}: ngram_token_map=True folds the tokenizer's vocabulary, but the source has no tokenizer"
            " files; convert without --ngram_token_map"
        )
    token_map = normalized_token_map(tokenizer, model.config.vocab_size)
    with torch.no_grad():
        for layer in memory_layers_of(model):
            if layer.ngram is not None:
                layer.ngram.token_map.copy_(token_map)
    folded = int((token_map != torch.arange(len(token_map))).sum())
    return f"ngram_token_map: {folded} of {len(token_map)} ids hash as a lowercase / accent-folded twin"


def _source_name(source) -> str:
    if isinstance(source, PreTrainedModel):
        return source.config._name_or_path or type(source).__name__
    return str(source)


def _check_model_type(config, source_name):
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError(
            f"{source_name}: model_type {config.model_type!r} is not supported; convert_to_pkm converts BERT"
            f" (model_type 'bert'), DistilBERT ('distilbert'), RoBERTa and DistilRoBERTa ('roberta'), XLM-RoBERTa"
            f" ('xlm-roberta') and ModernBERT, Ettin and mmBERT encoders ('modernbert') checkpoints"
        )
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise InputError(
            f"{source_name}: position_embedding_type={position_embedding_type!r} is not supported (transformers 5 and"
            f" BertPkm have absolute position embeddings only)"
        )


def _check_architecture(architecture, source_name):
    if architecture not in SOURCE_ARCHITECTURES:
        raise InputError(
            f"{source_name}: architecture {architecture!r} is not supported; supported: {sorted(SOURCE_ARCHITECTURES)}"
        )


def check_source(source: str | os.PathLike, offline: bool = False) -> None:
    """Raises InputError (a ValueError), before anything loads, where `source` (a folder or Hub id) cannot be converted: no such folder
    and no Hub id, or a BertPkm model already (whose config transformers would refuse as custom code); with `offline`
    (HF_HUB_OFFLINE=1) also a Hub id not in the cache. Reads only the folder and the Hub cache, never the network."""
    path = Path(source)
    if path.is_dir():
        config_file = path / "config.json"
    elif hub_id_or_none(str(source)) is None:
        raise InputError(f"{str(source)!r}: no such folder, and not a Hub model id ('name' or 'namespace/name') either")
    else:
        config_file = try_to_load_from_cache(str(source), "config.json")
        config_file = Path(config_file) if isinstance(config_file, str) else None
        if config_file is None and offline:
            raise InputError(
                f"{str(source)!r}: no such folder, and as a Hub model id not in the local cache, the only place "
                "HF_HUB_OFFLINE=1 reads"
            )
    if config_file is not None and config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return  # transformers' own error names the file
        if model_type in PKM_MODEL_TYPES:
            family = PKM_MODEL_TYPES[model_type]
            raise InputError(
                f"{str(source)!r} is already a {family} model (model_type {model_type!r}): fine-tune it as it is "
                "(run_mlm.py, run_glue.py, run_squad.py --model_name_or_path take it), or convert its source again "
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
    architecture = (config.architectures or [SOURCE_BASE_ARCHITECTURES[config.model_type]])[0]
    _check_architecture(architecture, source_name)
    load_class = getattr(transformers, SOURCE_ARCHITECTURES[architecture][0])
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # our report replaces the MISSING/UNEXPECTED table of transformers
    try:
        model, info = load_class.from_pretrained(source, config=config, dtype=torch.float32, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model, architecture, set(info["missing_keys"]), set(info["unexpected_keys"])


def conversion_target(
    src_config, source_name: str, target_class=None, config_overrides: dict | None = None, pkm_kwargs: dict | None = None,
    *, architecture: str | None = None,
) -> tuple[type[BertPkmPreTrainedModel], BertPkmConfig]:  # fmt: skip
    """(target class, target config) of the conversion of a source with config `src_config`, from that config alone:
    every check of [`convert_to_pkm`] that needs no weight (model type, architecture, target class, the config's own
    checks of the `pkm_*` fields), so a script can make them before any weight loads. ValueError naming the problem."""
    _check_model_type(src_config, source_name)
    architecture = architecture or (src_config.architectures or [SOURCE_BASE_ARCHITECTURES[src_config.model_type]])[0]
    _check_architecture(architecture, source_name)
    target_class = _resolve_target_class(target_class, architecture, family_of(src_config.model_type))
    return target_class, _target_config(src_config, source_name, config_overrides or {}, dict(pkm_kwargs or {}))


def _resolve_target_class(target_class, architecture, family: str) -> type[BertPkmPreTrainedModel]:
    """The class to build: the source head's by default; a RoBERTa- or ModernBERT-family source takes its family's
    class of a BertPkm name (`BertPkmForSequenceClassification` -> `RobertaPkmForSequenceClassification`,
    `ModernBertPkmForSequenceClassification`), as the scripts pass."""
    if target_class is None:
        target_class = SOURCE_ARCHITECTURES[architecture][1]
    names, module, base_class, _ = FAMILIES[family]
    prefix = {"bert": "BertPkm", "roberta": "RobertaPkm", "modernbert": "ModernBertPkm"}[family]
    if isinstance(target_class, str):
        if family != "bert" and target_class in TARGET_CLASSES:
            target_class = target_class.replace("BertPkm", prefix, 1)
        if target_class not in names:
            raise ValueError(f"target_class {target_class!r} is not a {prefix} model class: {names}")
        target_class = getattr(module, target_class)
    if not (isinstance(target_class, type) and issubclass(target_class, PkmPreTrainedModel)):
        raise ValueError(f"target_class must be a model class {names}, got {target_class!r}")
    others = [other for name, (_, _, other, _) in FAMILIES.items() if name not in ("bert", family)]
    if not issubclass(target_class, base_class) or issubclass(target_class, tuple(others)):
        raise ValueError(
            f"target_class {target_class.__name__} does not fit a {architecture} source: RoBERTa-family checkpoints"
            f" convert into the RobertaPkm classes, ModernBERT-family ones into the ModernBertPkm classes, BERT and"
            f" DistilBERT ones into the BertPkm classes ({names})"
        )
    return target_class


def _bert_fields(src_config) -> dict:
    """The BertConfig fields of a BERT or DistilBERT config (DistilBERT: zero token types, LayerNorm eps 1e-12); a
    ModernBERT config's own fields (its attention pattern, rotary thetas, norms and heads)."""
    if src_config.model_type in MODERNBERT_MODEL_TYPES:
        names = [f.name for f in dataclasses.fields(ModernBertConfig) if f.name not in _RUNTIME_FIELDS]
        return {name: getattr(src_config, name) for name in names if hasattr(src_config, name)}
    if src_config.model_type in ("bert", *ROBERTA_MODEL_TYPES):  # RoBERTa's config has BERT's fields
        names = [f.name for f in dataclasses.fields(BertConfig) if f.name not in _RUNTIME_FIELDS]
        return {name: getattr(src_config, name) for name in names if hasattr(src_config, name)}
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
    changed = [k for k in ARCHITECTURE_FIELDS if k in config_overrides and config_overrides[k] != fields.get(k)]
    if changed:
        raise ValueError(
            f"config_overrides cannot change {changed} (source: {[fields.get(k) for k in changed]}): the conversion copies"
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
    return FAMILIES[family_of(src_config.model_type)][3](**kwargs)


def _canonical_name(src_name: str, source_model: PreTrainedModel) -> str | None:
    """A source tensor's name in BERT terms: body as in BertModel (`encoder.layer.0...`), heads as in BertFor*."""
    prefix = source_model.base_model_prefix + "."
    name = src_name[len(prefix) :] if src_name.startswith(prefix) else src_name
    if source_model.config.model_type != "distilbert":  # BERT, RoBERTa, ModernBERT names are already their family's
        return name
    for pattern, replacement in _DISTILBERT_RENAMES:
        new, n = re.subn("^" + pattern, replacement, name)
        if n:
            return new
    return None


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
        raise InputError(f"{source / 'modules.json'}: expected a non-empty list of modules, got {modules!r}")
    files = [name for name in SENTENCE_TRANSFORMERS_FILES if (source / name).is_file()]
    for name in files[1:]:
        _read_json(source / name)
    for i, module in enumerate(modules):
        if not (isinstance(module, dict) and isinstance(module.get("path"), str) and isinstance(module.get("type"), str)):
            raise InputError(f"{source / 'modules.json'}: module {i} must have string 'path' and 'type', got {module!r}")
        path, kind = Path(module["path"]), module["type"].rsplit(".", 1)[-1]
        if path.is_absolute() or ".." in path.parts:
            raise InputError(f"{source / 'modules.json'}: module {i} path {module['path']!r} leaves the folder")
        if kind == "Transformer":
            if module["path"] not in ("", "."):
                raise InputError(
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
            raise InputError(
                f"{source / 'modules.json'}: module {i} ({module['type']}) is at {module['path']!r}, but {source / path} "
                "is missing"
            )
    return files


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path} is not valid JSON: {error}") from error


def load_source_tokenizer(source):
    """The source's tokenizer, or None where it has no tokenizer files (AutoTokenizer would invent a 5-token one)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    if Path(source).is_dir():
        found = any((Path(source) / name).is_file() for name in TOKENIZER_FILES)
    else:
        found = any(hub_file(str(source), name) for name in TOKENIZER_FILES)
    return AutoTokenizer.from_pretrained(source) if found else None


def check_output_dir(output_dir: str | os.PathLike, overwrite: bool = False, source=None) -> None:
    """OutputFolderError (a ValueError) where the conversion may not write `output_dir`: the contract of
    `utils.output_folders` (a new or empty folder, or a converted one; any other only with `overwrite`; never the
    `source` folder or one containing it)."""
    reads = {"the source": source if isinstance(source, (str, os.PathLike)) else None}
    check_output_folder(output_dir, TOOL, overwrite=overwrite, reads=reads, option="output_dir",
                        overwrite_option="overwrite=True")  # fmt: skip


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
    folder that is renamed to `output_dir` at the end, so a failure leaves no half-written output. `output_dir` is
    new, empty or converted before (its marker file `.convert_to_pkm`), any other folder only with `overwrite`; never
    the source folder ([`check_output_dir`]).
    """
    check_output_dir(output_dir, overwrite, report.source if report is not None else None)
    output_dir = Path(output_dir).absolute()
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
        if source is not None and not Path(source).is_dir() and hub_id_or_none(source) and hub_file(source, "modules.json"):
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
        mark_output_folder(tmp, TOOL)
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
    the new one is in place, and restored if that fails, so `target` is never half-written. It removes whatever
    `target` held: every caller first checks that it may (`utils.output_folders.check_output_folder`)."""
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
