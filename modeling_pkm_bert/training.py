"""What every training script shares: PKM command-line options, model loading (+Init), optimizer groups."""

import argparse
import dataclasses

import torch

from .configuration_bert_pkm import BertPkmConfig
from .product_key_memory import ProductKeyMemory


PKM_FIELDS = {f.name: f for f in dataclasses.fields(BertPkmConfig) if f.name.startswith("pkm_")}


def _field_parser(field: dataclasses.Field):
    """argparse `type`/`nargs` for a pkm_* config field, from its annotation."""
    annotation = str(field.type)
    if "list" in annotation:
        return dict(type=int, nargs="*")
    if annotation.startswith("bool") or field.type is bool:
        return dict(type=lambda text: {"true": True, "false": False}[text.lower()], metavar="{true,false}")
    if "float" in annotation:
        return dict(type=float)
    if "int" in annotation:
        return dict(type=int)
    return dict(type=str)


def add_pkm_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `--pkm_<field>` for every pkm_* field of BertPkmConfig, and the memory optimisation options."""
    group = parser.add_argument_group(
        "product key memory",
        "Given any --pkm_* flag and a plain BERT/DistilBERT checkpoint, the model is converted on load (+Init); "
        "on a BertPkm checkpoint the flags override its config (only where the weights still fit).",
    )
    for name, field in PKM_FIELDS.items():
        default = field.default if field.default is not dataclasses.MISSING else None
        group.add_argument(f"--{name}", default=None, help=f"BertPkmConfig.{name} (config default: {default})", **_field_parser(field))
    group.add_argument(
        "--memory_learning_rate",
        type=float,
        default=1e-3,
        help="Constant learning rate of the memory values, in their own Adam group without weight decay or warm-up "
        "(XLM and the paper: 1e-3).",
    )
    group.add_argument(
        "--freeze_memory", action="store_true", help="Keep all memory parameters fixed (the paper's Table 5 ablation)."
    )
    return parser


def pkm_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The pkm_* fields the user gave on the command line."""
    return {name: getattr(args, name) for name in PKM_FIELDS if getattr(args, name, None) is not None}


def memory_modules(model: torch.nn.Module) -> dict[str, ProductKeyMemory]:
    return {name: module for name, module in model.named_modules() if isinstance(module, ProductKeyMemory)}


def memory_value_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The value tables of every memory: they get their own optimizer group."""
    return [memory.values.weight for memory in memory_modules(model).values()]


def freeze_memory(model: torch.nn.Module) -> int:
    """Fixes every memory parameter (keys, query network, values); returns how many parameters were frozen."""
    frozen = 0
    for memory in memory_modules(model).values():
        for parameter in memory.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], list[dict]]:
    """(main groups, memory groups): main = everything but the values, decayed except biases and norms as in the
    transformers examples; memory = the value tables, no weight decay."""
    values = {id(p) for p in memory_value_parameters(model)}
    no_decay_modules = (torch.nn.LayerNorm, torch.nn.BatchNorm1d)
    no_decay = {
        id(p) for module in model.modules() if isinstance(module, no_decay_modules) for p in module.parameters(recurse=False)
    }
    decay, plain, memory = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if id(parameter) in values:
            memory.append(parameter)
        elif id(parameter) in no_decay or name.endswith("bias"):
            plain.append(parameter)
        else:
            decay.append(parameter)
    main_groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}) if g["params"]]
    memory_groups = [{"params": memory, "weight_decay": 0.0}] if memory else []
    return main_groups, memory_groups


def create_memory_optimizer(memory_groups: list[dict], args: argparse.Namespace) -> torch.optim.Optimizer | None:
    """The values' own optimizer: Adam at a constant `--memory_learning_rate` (no scheduler is attached to it)."""
    if not memory_groups:
        return None
    return torch.optim.Adam(memory_groups, lr=args.memory_learning_rate)


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

    - a BertPkm checkpoint: loaded as is (runtime pkm_* fields such as dropouts may be overridden);
    - a plain BERT/DistilBERT checkpoint with pkm_kwargs: converted on load (+Init), new memories initialised;
    - a plain checkpoint without pkm_kwargs: the plain transformers model (the baseline).
    """
    import transformers

    from . import modeling_bert_pkm
    from .conversion import convert_to_pkm

    if task not in TASK_CLASSES:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASK_CLASSES)}")
    pkm_class_name, auto_class_name = TASK_CLASSES[task]
    pkm_kwargs, config_overrides = dict(pkm_kwargs or {}), dict(config_overrides or {})
    config = transformers.AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)

    if config.model_type == BertPkmConfig.model_type:
        structural = {k: v for k, v in pkm_kwargs.items() if k not in RUNTIME_PKM_FIELDS and getattr(config, k) != v}
        if structural:
            raise ValueError(
                f"{model_name_or_path} is already a BertPkm model; its {sorted(structural)} cannot change without "
                "new weights (convert the plain BERT checkpoint instead)"
            )
        pkm_class = getattr(modeling_bert_pkm, pkm_class_name)
        model = pkm_class.from_pretrained(
            model_name_or_path, dtype=torch.float32, **pkm_kwargs, **config_overrides
        )
    elif pkm_kwargs:
        model, report = convert_to_pkm(
            model_name_or_path,
            getattr(modeling_bert_pkm, pkm_class_name),
            config_overrides=config_overrides,
            **pkm_kwargs,
        )
        if logger is not None:
            logger.info(f"Converted {model_name_or_path} into {type(model).__name__} (+Init):\n{report}")
    else:
        auto_class = getattr(transformers, auto_class_name)
        model = auto_class.from_pretrained(
            model_name_or_path, dtype=torch.float32, trust_remote_code=trust_remote_code, **config_overrides
        )
    return model.float()
