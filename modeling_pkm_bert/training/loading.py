"""Loading the model a training script trains: a Hub/local checkpoint, converted to BertPkm on load when `--pkm_*`
flags ask for memory (the paper's "+Init"), or a config from scratch; the `--pkm_*` flags as config fields."""

import argparse
import dataclasses
import os

import torch

from ..configuration_bert_pkm import BertPkmConfig
from ..configuration_modernbert_pkm import ModernBertPkmConfig
from ..configuration_roberta_pkm import RobertaPkmConfig
from ..utils.input_errors import InputError, one_line


# the model types of this package's models: a checkpoint of one is loaded as it is, never converted
PKM_MODEL_TYPES = (BertPkmConfig.model_type, RobertaPkmConfig.model_type, ModernBertPkmConfig.model_type)


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

    - a BertPkm, RobertaPkm or ModernBertPkm checkpoint: loaded as is (runtime pkm_* fields such as dropouts may be
      overridden);
    - a plain BERT/DistilBERT/RoBERTa/XLM-RoBERTa/ModernBERT checkpoint with pkm_kwargs: converted on load (+Init,
      into the RobertaPkm / ModernBertPkm class of the task for those families), new memories initialised;
    - a plain checkpoint without pkm_kwargs: the plain transformers model (the baseline).
    """
    import transformers

    from .. import modeling_bert_pkm, modeling_modernbert_pkm, modeling_roberta_pkm
    from .. import register_auto_classes
    from ..hub.conversion import convert_to_pkm

    register_auto_classes()  # a BertPkm checkpoint loads with this package's classes, without trust_remote_code

    if task not in TASK_CLASSES:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASK_CLASSES)}")
    pkm_class_name, auto_class_name = TASK_CLASSES[task]
    pkm_kwargs, config_overrides = dict(pkm_kwargs or {}), dict(config_overrides or {})
    config = read_config(model_name_or_path, trust_remote_code=trust_remote_code)

    if config.model_type in PKM_MODEL_TYPES:
        _check_runtime_fields(config, pkm_kwargs, model_name_or_path)
        if config.model_type == RobertaPkmConfig.model_type:
            pkm_class = getattr(modeling_roberta_pkm, pkm_class_name.replace("BertPkm", "RobertaPkm", 1))
        elif config.model_type == ModernBertPkmConfig.model_type:
            pkm_class = getattr(modeling_modernbert_pkm, pkm_class_name.replace("BertPkm", "ModernBertPkm", 1), None)
            if pkm_class is None:
                raise InputError(f"{model_name_or_path} is a ModernBertPkm model (an encoder): it has no {task} head")
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


def _check_runtime_fields(config, pkm_kwargs: dict, model_name_or_path: str) -> None:
    structural = {k: v for k, v in pkm_kwargs.items() if k not in RUNTIME_PKM_FIELDS and getattr(config, k) != v}
    if structural:
        raise InputError(
            f"{model_name_or_path} is already a PKM model ({config.model_type}); its {sorted(structural)} cannot"
            " change without new weights (convert the plain BERT / RoBERTa checkpoint instead)"
        )


def planned_config(args: argparse.Namespace, task: str, config_overrides: dict | None = None):
    """The config of the model a script will train, from its flags and the model's config alone (no weight loads): what
    `load_model` builds for `--model_name_or_path` (a PKM checkpoint with runtime `--pkm_*` overrides, a conversion, or
    the plain model), else `config_from_scratch`. Raises the ValueError of each check and of the config's own checks
    (e.g. `--pkm_knn` above `--pkm_n_keys`); None where the model's config cannot be read here (a Hub id outside
    the cache: the load names it)."""
    from ..hub.conversion import conversion_target
    from ..hub.model_card import hub_id_or_none

    pkm_kwargs = pkm_kwargs_from_args(args)
    source = getattr(args, "model_name_or_path", None)
    if not source:
        return config_from_scratch(args, pkm_kwargs)
    try:
        config = read_config(source, trust_remote_code=getattr(args, "trust_remote_code", False))
    except InputError:
        if hub_id_or_none(source) is not None:
            return None  # perhaps on the Hub: the load says what it finds
        raise
    if config.model_type in PKM_MODEL_TYPES:
        _check_runtime_fields(config, pkm_kwargs, source)
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
        return type(config)(**{**fields, **pkm_kwargs})  # the runtime overrides pass the config's own checks
    if pkm_kwargs:
        return conversion_target(config, source, TASK_CLASSES[task][0], config_overrides, pkm_kwargs)[1]
    return config


def read_config(model_name_or_path: str, option: str = "--model_name_or_path", trust_remote_code: bool = False):
    """`AutoConfig.from_pretrained(model_name_or_path)`; InputError naming `option` where there is no such folder or
    Hub model, or it holds no readable config (transformers' OSError: a missing folder, file or repository)."""
    import transformers

    from .. import register_auto_classes
    from ..hub.model_card import hub_id_or_none

    register_auto_classes()  # a BertPkm config resolves to this package's class, without trust_remote_code
    if not os.path.exists(model_name_or_path) and hub_id_or_none(str(model_name_or_path)) is None:
        raise InputError(f"{option} {str(model_name_or_path)!r}: no such folder, and not a Hub model id either")
    from huggingface_hub.errors import StrictDataclassError

    try:
        return transformers.AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    except OSError as error:
        where = "" if os.path.exists(model_name_or_path) else "no such folder, and as a Hub model id: "
        raise InputError(f"{option} {str(model_name_or_path)!r}: {where}{error}") from None
    except InputError:
        raise
    except (StrictDataclassError, ValueError) as error:  # a field of the wrong type, or a value the config refuses
        problem = one_line(error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error)
        raise InputError(f"{option} {str(model_name_or_path)!r}: config.json: {problem}") from None


def load_tokenizer(source: str, option: str = "--model_name_or_path", trust_remote_code: bool = False, **kwargs):
    """`AutoTokenizer.from_pretrained(source, **kwargs)`; InputError naming `option` where a folder holds no tokenizer
    files (transformers would fail with a message about converting a slow tokenizer) or it cannot be read."""
    import transformers

    from ..hub.upload import TOKENIZER_FILES

    names = (*TOKENIZER_FILES, "sentencepiece.bpe.model", "spiece.model", "vocab.json")
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, name)) for name in names):
        raise InputError(f"{option} {source!r} holds no tokenizer (none of {', '.join(names)}); save one into it")
    try:
        return transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except OSError as error:
        where = "" if os.path.exists(source) else "no such folder, and as a Hub model id: "
        raise InputError(f"{option} {source!r}: {where}{error}") from None


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
        config = read_config(args.config_name, "--config_name", trust_remote_code=args.trust_remote_code)
    else:
        config = transformers.CONFIG_MAPPING[args.model_type]()
        if logger is not None:
            logger.warning("You are instantiating a new config instance from scratch.")
    overrides = getattr(args, "config_overrides", None)
    if overrides:
        try:
            config.update_from_string(overrides)
        except ValueError as error:
            raise InputError(f"--config_overrides {overrides!r}: {error}") from error
    config.update(dict(extra_fields or {}))
    if not pkm_kwargs and config.model_type != BertPkmConfig.model_type:
        return config
    if config.model_type not in ("bert", BertPkmConfig.model_type):
        raise InputError(f"--pkm_* flags need a BERT or BertPkm config, got model_type {config.model_type!r}")
    fields = {
        k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")
    }
    return BertPkmConfig(**{**fields, **pkm_kwargs})
