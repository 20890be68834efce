"""What every training script shares: PKM command-line options, model loading (+Init), optimizer groups."""

import argparse
import dataclasses
import os
import re

import torch

from .configuration_bert_pkm import BertPkmConfig
from .optimization import PKM_VALUES_GROUP, pkm_param_groups
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


def add_pkm_arguments(parser: argparse.ArgumentParser, training_options: bool = True) -> argparse.ArgumentParser:
    """Adds `--pkm_<field>` for every pkm_* field of BertPkmConfig, and (for training scripts) the memory
    optimisation options `--memory_learning_rate` and `--freeze_memory`."""
    group = parser.add_argument_group(
        "product key memory",
        "Given any --pkm_* flag and a plain BERT/DistilBERT checkpoint, the model is converted on load (+Init); "
        "on a BertPkm checkpoint the flags override its config (only where the weights still fit).",
    )
    for name, field in PKM_FIELDS.items():
        default = field.default if field.default is not dataclasses.MISSING else None
        group.add_argument(f"--{name}", default=None, help=f"BertPkmConfig.{name} (config default: {default})", **_field_parser(field))
    if not training_options:
        return parser
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
    group.add_argument(
        "--memory_optimizer",
        choices=MEMORY_OPTIMIZERS,
        default="adam",
        help="adam: torch Adam on dense value gradients (XLM's published setting; works with every backend). "
        "sparse_row_adam: optimization.SparseRowAdam, a lazy row-wise Adam that updates only the rows a step read "
        "(the paper's 'sparse update' of the values; bf16 first moment and one second moment per row, 1.5x the table "
        "instead of Adam's 4x), fed sparse value gradients on one process or gloo and dense ones under NCCL, which "
        "has no sparse all-reduce. It pays off when a step reads a small part of the table "
        "(tokens per step * heads * knn well below pkm_n_keys ** 2). "
        "sgd: plain SGD without momentum or weight decay (sparse memory finetuning's choice, Lin et al. 2025, with "
        "--memory_learning_rate up to ~2): a row without gradient does not move.",
    )
    return parser


def pkm_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The pkm_* fields the user gave on the command line."""
    return {name: getattr(args, name) for name in PKM_FIELDS if getattr(args, name, None) is not None}


def memory_modules(model: torch.nn.Module) -> dict[str, ProductKeyMemory]:
    return {name: module for name, module in model.named_modules() if isinstance(module, ProductKeyMemory)}


def freeze_memory(model: torch.nn.Module) -> int:
    """Fixes every memory parameter (keys, query network, values) and the query BatchNorm's running statistics, so the
    memory is the same function after training (Table 5); returns how many parameters were frozen."""
    frozen = 0
    for memory in memory_modules(model).values():
        if isinstance(memory.query_batchnorm, torch.nn.BatchNorm1d):
            memory.query_batchnorm.momentum = 0.0  # batch statistics still normalise in training; the running ones stay
        for parameter in memory.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], list[dict]]:
    """(main groups, memory groups) of `optimization.pkm_param_groups`: main = everything but the values, decayed
    except biases and norms; memory = the value tables without weight decay, for their own optimizer. The groups carry
    no learning rate: each optimizer gives its own."""
    groups = pkm_param_groups(model, lr=0.0, weight_decay=weight_decay)
    for group in groups:
        del group["lr"]
    main_groups = [group for group in groups if group["name"] != PKM_VALUES_GROUP]
    memory_groups = [group for group in groups if group["name"] == PKM_VALUES_GROUP]
    return main_groups, memory_groups


MEMORY_OPTIMIZERS = ("adam", "sparse_row_adam", "sgd")


def sparse_gradients_supported() -> bool:
    """Whether sparse value gradients can be all-reduced here: one process, or a gloo process group (not NCCL)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_backend() == "gloo"


def create_memory_optimizer(
    memory_groups: list[dict], args: argparse.Namespace, model: torch.nn.Module | None = None
) -> torch.optim.Optimizer | None:
    """The values' own optimizer at a constant `--memory_learning_rate` (no scheduler is attached to it): Adam, plain
    SGD with `--memory_optimizer sgd`, or with `--memory_optimizer sparse_row_adam` the row-wise lazy `SparseRowAdam`.
    For the latter, pass `model` (before
    `accelerator.prepare`: DDP reads the flag when it wraps the model) to switch its value gradients to sparse where
    the process group can all-reduce them; without it, or under NCCL, the gradients stay dense (same update)."""
    if not memory_groups:
        return None
    if getattr(args, "memory_optimizer", "adam") == "sgd":
        return torch.optim.SGD(memory_groups, lr=args.memory_learning_rate)
    if getattr(args, "memory_optimizer", "adam") == "sparse_row_adam":
        from .optimization import SparseRowAdam, set_sparse_values

        if model is not None:
            set_sparse_values(model, sparse_gradients_supported())
        return SparseRowAdam(memory_groups, lr=args.memory_learning_rate)
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

    from . import modeling_bert_pkm, register_auto_classes
    from .conversion import convert_to_pkm

    register_auto_classes()  # a BertPkm checkpoint loads with this package's classes, without trust_remote_code

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
        model = in_process_memory(
            pkm_class.from_pretrained(model_name_or_path, dtype=torch.float32, **pkm_kwargs, **config_overrides)
        )
    elif pkm_kwargs:  # the conversion copies every weight into new tensors
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
        model = in_process_memory(
            auto_class.from_pretrained(
                model_name_or_path, dtype=torch.float32, trust_remote_code=trust_remote_code, **config_overrides
            )
        )
    return model.float()


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


# ---- checkpoints: atomic `accelerator.save_state` and exact resume ----

CHECKPOINT_NAME = re.compile(r"^(step|epoch)_(\d+)$")


def save_checkpoint(accelerator, output_dir: str | None, name: str) -> str:
    """`accelerator.save_state` into `output_dir/name` atomically: written to `name.tmp`, then renamed, so an
    interrupted save never leaves a half-written `step_N`/`epoch_N` that a resume would pick up."""
    import shutil

    final = os.path.join(output_dir, name) if output_dir else name
    temporary = f"{final}.tmp"
    if accelerator.is_main_process and os.path.exists(temporary):
        shutil.rmtree(temporary)
    accelerator.wait_for_everyone()
    accelerator.save_state(temporary)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(temporary, final)
    accelerator.wait_for_everyone()
    return final


def resume_position(
    checkpoint: str, num_update_steps_per_epoch: int, gradient_accumulation_steps: int = 1
) -> tuple[int, int, int]:
    """Where training continues after `accelerator.load_state(checkpoint)`: (starting epoch, completed optimizer steps,
    batches of the starting epoch to skip), read from the folder name `step_N` (N optimizer steps done) or `epoch_E`
    (epoch E, 0-based, finished). Exact for any gradient accumulation, the last accumulation of an epoch being short."""
    name = os.path.basename(os.path.normpath(checkpoint))
    match = CHECKPOINT_NAME.match(name)
    if match is None:
        raise ValueError(f"cannot resume from {checkpoint!r}: the folder must be named step_<N> or epoch_<E>")
    kind, number = match.group(1), int(match.group(2))
    if kind == "epoch":
        return number + 1, (number + 1) * num_update_steps_per_epoch, 0
    epoch, steps_into_epoch = divmod(number, num_update_steps_per_epoch)
    return epoch, number, steps_into_epoch * gradient_accumulation_steps


def latest_checkpoint(output_dir: str) -> str | None:
    """The most advanced `step_N` / `epoch_E` folder in `output_dir` (by optimizer steps; an `epoch_E` counts as the
    end of epoch E, after every step of it), or None. Half-written `*.tmp` folders are never picked."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_NAME.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            number = int(match.group(2))
            # order: by epoch for epoch_E (after its steps), by step for step_N; the two kinds are not mixed in a run
            found.append(((match.group(1) == "epoch", number), name))
    return os.path.join(output_dir, max(found)[1]) if found else None


def resolve_checkpoint(resume_from_checkpoint: str, output_dir: str | None) -> str:
    """The folder `--resume_from_checkpoint` names: a path, or `latest` for `latest_checkpoint(output_dir)`."""
    if resume_from_checkpoint != "latest":
        return resume_from_checkpoint
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        raise ValueError(f"--resume_from_checkpoint latest: no step_<N>/epoch_<E> folder in {output_dir}")
    return checkpoint


# ---- model card with fine-tuning results (run_glue, run_squad) ----


def write_results_model_card(
    folder: str,
    results: dict,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    command: str | None = None,
    title: str = "Fine-tuning results",
) -> str:
    """Writes `folder/README.md` for a fine-tuned model: `conversion.write_model_card` for a BertPkm folder (a short
    card for a plain BERT baseline), followed by a `title` section ("Fine-tuning results") with every scalar of
    `results` and the command that produced them. Returns the card's text."""
    import json

    from .conversion import write_model_card

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    if config.get("model_type") == BertPkmConfig.model_type:
        text = str(write_model_card(folder, repo_id=repo_id, base_model=base_model))
    else:
        architecture = (config.get("architectures") or ["a BERT model"])[0]
        text = f"# {repo_id or os.path.basename(os.path.abspath(folder))}\n\n`{architecture}` without product key memory"
        text += f" (the baseline), fine-tuned from `{base_model}`.\n" if base_model else " (the baseline).\n"
    lines = ["", f"## {title}", ""]
    if dataset or task:
        lines += [f"Task: {task or '-'}; data: `{dataset or '-'}`.", ""]
    lines += ["| metric | value |", "|---|---:|"]
    for key, value in results.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lines.append(f"| `{key}` | {value:.4f} |" if isinstance(value, float) else f"| `{key}` | {value} |")
    if command:
        lines += ["", "Produced by:", "", "```bash", command, "```"]
    text = text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(text)
    return text
