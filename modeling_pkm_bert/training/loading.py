"""Loading the model a training script trains: a Hub/local checkpoint, converted to BertPkm on load when `--pkm_*`
flags ask for memory (the paper's "+Init"), or a config from scratch; the `--pkm_*` flags as config fields."""

import argparse
import dataclasses

import torch

from ..configuration_bert_pkm import BertPkmConfig
from ..configuration_roberta_pkm import RobertaPkmConfig


# the model types of this package's models: a checkpoint of one is loaded as it is, never converted
PKM_MODEL_TYPES = (BertPkmConfig.model_type, RobertaPkmConfig.model_type)


# the pkm_* and ngram_* fields a user sets (pkm_weights_checksum is written by save_pretrained)
PKM_FIELDS = {
    f.name: f
    for f in dataclasses.fields(BertPkmConfig)
    if f.name.startswith(("pkm_", "ngram_")) and f.name != "pkm_weights_checksum"
}


def pkm_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The pkm_* and ngram_* fields the user gave on the command line."""
    return {name: getattr(args, name) for name in PKM_FIELDS if getattr(args, name, None) is not None}


TASK_CLASSES = {
    # task: (BertPkm class name, transformers Auto class name)
    "masked-lm": ("BertPkmForMaskedLM", "AutoModelForMaskedLM"),
    "sequence-classification": ("BertPkmForSequenceClassification", "AutoModelForSequenceClassification"),
    "question-answering": ("BertPkmForQuestionAnswering", "AutoModelForQuestionAnswering"),
    "token-classification": ("BertPkmForTokenClassification", "AutoModelForTokenClassification"),
    "multiple-choice": ("BertPkmForMultipleChoice", "AutoModelForMultipleChoice"),
    "causal-lm": ("BertPkmForCausalLM", "AutoModelForCausalLM"),
    "base": ("BertPkmModel", "AutoModel"),
}


# fields that change no tensor shape: they may be overridden on a trained BertPkm checkpoint
RUNTIME_PKM_FIELDS = {"pkm_input_dropout", "pkm_query_dropout", "pkm_value_dropout", "pkm_knn"}


def load_model(
    task: str,
    model_name_or_path: str,
    pkm_kwargs: dict | None = None,
    config_overrides: dict | None = None,
    trust_remote_code: bool = False,
    logger=None,
):
    """Loads the model a script trains, in fp32.

    - a BertPkm or RobertaPkm checkpoint: loaded as is (runtime pkm_* fields such as dropouts may be overridden);
    - a plain BERT/DistilBERT/RoBERTa/XLM-RoBERTa checkpoint with pkm_kwargs: converted on load (+Init, into the
      RobertaPkm class of the task for the RoBERTa family), new memories initialised;
    - a plain checkpoint without pkm_kwargs: the plain transformers model (the baseline).
    """
    import transformers

    from .. import modeling_bert_pkm, modeling_roberta_pkm
    from .. import register_auto_classes
    from ..hub.conversion import convert_to_pkm

    register_auto_classes()  # a BertPkm checkpoint loads with this package's classes, without trust_remote_code

    if task not in TASK_CLASSES:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASK_CLASSES)}")
    pkm_class_name, auto_class_name = TASK_CLASSES[task]
    pkm_kwargs, config_overrides = dict(pkm_kwargs or {}), dict(config_overrides or {})
    config = transformers.AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)

    if config.model_type in PKM_MODEL_TYPES:
        structural = {k: v for k, v in pkm_kwargs.items() if k not in RUNTIME_PKM_FIELDS and getattr(config, k) != v}
        if structural:
            raise ValueError(
                f"{model_name_or_path} is already a PKM model ({config.model_type}); its {sorted(structural)} cannot"
                " change without new weights (convert the plain BERT / RoBERTa checkpoint instead)"
            )
        if config.model_type == RobertaPkmConfig.model_type:
            pkm_class = getattr(modeling_roberta_pkm, pkm_class_name.replace("BertPkm", "RobertaPkm", 1))
        else:
            pkm_class = getattr(modeling_bert_pkm, pkm_class_name)
        model = in_process_memory(
            pkm_class.from_pretrained(model_name_or_path, dtype=torch.float32, **pkm_kwargs, **config_overrides)
        )
    elif pkm_kwargs:  # the conversion copies every weight into new tensors
        model, report = convert_to_pkm(
            model_name_or_path,
            pkm_class_name,  # a name: the RobertaPkm class of the task for a RoBERTa-family source
            config_overrides=config_overrides,
            **pkm_kwargs,
        )
        if logger is not None:
            logger.info(f"Converted {model_name_or_path} into {type(model).__name__} (+Init):\n{report}")
    else:
        auto_class = getattr(transformers, auto_class_name)
        model = in_process_memory(
            auto_class.from_pretrained(
                model_name_or_path, dtype=torch.float32, trust_remote_code=trust_remote_code, **config_overrides
            )
        )
    return model.float()


# RoBERTa-family model types: their positions start at pad_token_id + 1
ROBERTA_FAMILY_MODEL_TYPES = ("roberta", "xlm-roberta", RobertaPkmConfig.model_type)


def usable_positions(config) -> int | None:
    """The most tokens a sequence of the model may hold: `max_position_embeddings` (GPT-2: `n_positions`), less the
    `pad_token_id + 1` positions a RoBERTa-family model skips (roberta-base: 514 -> 512); None where unknown."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and config.model_type in ROBERTA_FAMILY_MODEL_TYPES:
        positions -= config.pad_token_id + 1
    return positions


@torch.no_grad()
def in_process_memory(model: torch.nn.Module) -> torch.nn.Module:
    """Copies every CPU parameter and buffer that `from_pretrained` left as a copy-on-write memory map of the
    safetensors file into ordinary process memory; returns `model`.

    Training writes those pages: each first write (and, once the kernel dropped a clean page, each read) faults. The
    sparse value update touches new rows of the 100M-parameter value tables for many steps, so without this copy a
    BertPkm checkpoint trains with steps up to 30x slower at first (measured on CPU), and unevenly. Tied parameters
    stay tied (each parameter object is copied once)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
    return model


def config_from_scratch(args: argparse.Namespace, pkm_kwargs: dict, extra_fields: dict | None = None, logger=None):
    """The config of a model trained from scratch: `--config_name` or `--model_type`, then `--config_overrides`
    ("num_hidden_layers=4,hidden_size=256", where the script has that flag) and `extra_fields` (e.g. `is_decoder`),
    turned into a BertPkm config when --pkm_* flags are given (the paper's rows without +Init). A BertPkm config is
    rebuilt, so its fields are validated after the overrides."""
    import transformers

    if args.config_name:
        config = transformers.AutoConfig.from_pretrained(args.config_name, trust_remote_code=args.trust_remote_code)
    else:
        config = transformers.CONFIG_MAPPING[args.model_type]()
        if logger is not None:
            logger.warning("You are instantiating a new config instance from scratch.")
    overrides = getattr(args, "config_overrides", None)
    if overrides:
        try:
            config.update_from_string(overrides)
        except ValueError as error:
            raise ValueError(f"--config_overrides {overrides!r}: {error}") from error
    config.update(dict(extra_fields or {}))
    if not pkm_kwargs and config.model_type != BertPkmConfig.model_type:
        return config
    if config.model_type not in ("bert", BertPkmConfig.model_type):
        raise ValueError(f"--pkm_* flags need a BERT or BertPkm config, got model_type {config.model_type!r}")
    fields = {
        k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")
    }
    return BertPkmConfig(**{**fields, **pkm_kwargs})
