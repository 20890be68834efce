"""Command-line flags the scripts share: the model and its memories, training, language-modeling data, resuming and
the model card. The flags of the methods (the memory optimizer, TRIME, sparse memory finetuning), the memory report and
parallel training live beside their code: `methods/<method>/arguments.py`, `analysis.arguments`, `parallel.arguments`.

This module imports the standard library only, so that `python run_scripts/<script>.py --help` prints every flag in
a fraction of a second: the scripts import it without the package's `__init__` (which loads torch, transformers and
the native kernels) when `-h`/`--help` is given. It reads the pkm_* fields of `BertPkmConfig` from the source of
`configuration_bert_pkm.py` rather than importing it (that imports transformers, and so torch);
`tests/scripts/test_script_help.py` checks that both agree.
"""

import argparse
import ast
import os
import re
import sys
from pathlib import Path

from ..hub.card_command import DEFAULT_LICENSE
from ..methods.optimizers.arguments import add_memory_optimizer_arguments


def help_requested(module_name: str) -> bool:
    """Whether a script (`module_name` is its `__name__`) runs with `-h`/`--help`. The scripts then import nothing
    but their flag modules (standard library only): torch, transformers, datasets and accelerate take ~6 s of CPU to
    import, and the help prints in a fraction of a second without them."""
    return module_name == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])


def _config_source() -> tuple[dict[str, tuple[str, object]], dict[str, str], dict[str, tuple]]:
    """({pkm field: (annotation, default)}, AUTO_MAP, {module constant: tuple}) of configuration_bert_pkm.py, read
    without importing it."""
    tree = ast.parse((Path(__file__).parent.parent / "configuration_bert_pkm.py").read_text(encoding="utf-8"))
    fields, auto_map, constants = {}, {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "AUTO_MAP":
                auto_map = ast.literal_eval(node.value)
            elif isinstance(node.value, ast.Tuple):
                constants[name] = ast.literal_eval(node.value)
        if isinstance(node, ast.ClassDef) and node.name == "BertPkmConfig":
            for item in node.body:
                # pkm_weights_checksum is written by save_pretrained(..., checksum=True), not set by a user
                if isinstance(item, ast.AnnAssign) and item.target.id.startswith(("pkm_", "ngram_")):
                    if item.target.id != "pkm_weights_checksum":
                        default = ast.literal_eval(item.value) if item.value is not None else None
                        fields[item.target.id] = (ast.unparse(item.annotation), default)
    # the option tuples of the layer (defined once, in product_key_memory_ops.py; the config imports them)
    layer = ast.parse((Path(__file__).parent.parent / "product_key_memory_ops.py").read_text(encoding="utf-8"))
    for node in layer.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Tuple):
                constants[node.targets[0].id] = ast.literal_eval(node.value)
    return fields, auto_map, constants


PKM_FLAG_FIELDS, _AUTO_MAP, _CONFIG_CONSTANTS = _config_source()
TARGET_CLASSES = [target.split(".")[-1] for auto, target in _AUTO_MAP.items() if auto != "AutoConfig"]
# the str fields take one of these values
PKM_CHOICES = {
    "pkm_mode": _CONFIG_CONSTANTS["PKM_MODES"],
    "pkm_value_init": _CONFIG_CONSTANTS["PKM_VALUE_INITS"],
    "pkm_output_gate": _CONFIG_CONSTANTS["OUTPUT_GATES"],
    "pkm_score_activation": _CONFIG_CONSTANTS["SCORE_ACTIVATIONS"],
}


def _boolean(text: str) -> bool:
    """argparse `type` of a true/false flag: a clear error, not a KeyError, for anything else."""
    value = {"true": True, "false": False}.get(str(text).lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _field_parser(name: str, annotation: str) -> dict:
    """argparse `type`/`nargs`/`choices` for a pkm_* config field, from its annotation."""
    if name in PKM_CHOICES:
        return dict(type=str, choices=PKM_CHOICES[name])
    if "list" in annotation:
        return dict(type=int, nargs="*")
    if annotation.startswith("bool"):
        return dict(type=_boolean, metavar="{true,false}")
    if "float" in annotation:  # float, float | int, float | int | None: a number (None = leave the field unset)
        return dict(type=float)
    if "int" in annotation:
        return dict(type=int)
    return dict(type=str)


def add_pkm_arguments(parser: argparse.ArgumentParser, training_options: bool = True) -> argparse.ArgumentParser:
    """Adds `--pkm_<field>` / `--ngram_<field>` for every pkm_* / ngram_* field of BertPkmConfig, and (for training
    scripts) the memory values' optimizer flags (`methods.optimizers.arguments`) in the same group."""
    group = parser.add_argument_group(
        "product key memory",
        "Given any --pkm_* flag and a plain BERT/DistilBERT checkpoint, the model is converted on load (+Init); "
        "on a BertPkm checkpoint the flags override its config (only where the weights still fit).",
    )
    ngram_group = parser.add_argument_group(
        "n-gram memory",
        "Hashed n-gram memories (Engram-style) at --ngram_layers, beside or without product keys; added to a plain "
        "BERT/DistilBERT checkpoint by conversion on load (+Init, function-preserving). --pkm_layers with no index "
        "gives a model with n-gram memories only.",
    )
    for name, (annotation, default) in PKM_FLAG_FIELDS.items():
        target = ngram_group if name.startswith("ngram_") else group
        target.add_argument(f"--{name}", default=None, help=f"BertPkmConfig.{name} (config default: {default})", **_field_parser(name, annotation))
    if not training_options:
        return parser
    add_memory_optimizer_arguments(group)
    return parser


# transformers' SchedulerType values the scripts offer (the memory values keep a constant rate whatever is chosen)
LR_SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


def add_training_arguments(parser: argparse.ArgumentParser, warmup_ratio: float | None = None, **defaults):
    """The flags of `training.loop.TrainingLoop` and of the official no_trainer examples that all four scripts share:
    batch sizes, optimisation and schedule, precision, output, seed, checkpoints and resume, evaluation cadence,
    staleness, trackers, Hub. `defaults` overrides a default (`learning_rate=2e-5`); `warmup_ratio` adds
    `--warmup_ratio` (then `--num_warmup_steps` defaults to None: the ratio decides)."""
    add = parser.add_argument
    add("--per_device_train_batch_size", type=int, default=8, help="Batch size (per device) for training.")
    add("--per_device_eval_batch_size", type=int, default=8, help="Batch size (per device) for evaluation.")
    add("--learning_rate", type=float, default=5e-5, help="Initial learning rate after warm-up (default: %(default)s).")
    add("--weight_decay", type=float, default=0.0, help="Weight decay of the main optimizer (default: %(default)s).")
    add("--num_train_epochs", type=int, default=3, help="Total number of training epochs (default: %(default)s).")
    add("--max_train_steps", type=int, default=None, help="Total number of optimizer steps; overrides num_train_epochs.")
    add(
        "--gradient_accumulation_steps",
        type=int,
        default=1,
        help="Number of batches to accumulate before each optimizer step.",
    )
    add(
        "--lr_scheduler_type",
        type=str,
        default="linear",
        choices=LR_SCHEDULER_TYPES,
        help="The main optimizer's schedule (the memory values keep a constant learning rate).",
    )
    if warmup_ratio is not None:
        add("--warmup_ratio", type=float, default=warmup_ratio, help="Warm-up fraction of the steps (default: %(default)s).")
    add(
        "--num_warmup_steps",
        type=int,
        default=None if warmup_ratio is not None else 0,
        help="Warm-up steps" + ("; overrides --warmup_ratio when given." if warmup_ratio is not None else "."),
    )
    add(
        "--mixed_precision",
        type=str,
        default=None,
        choices=["no", "fp16", "bf16"],
        help="Mixed precision (default: accelerate's configuration or ACCELERATE_MIXED_PRECISION, else fp32).",
    )
    add(
        "--output_dir",
        type=str,
        default=None,
        help="Where to store the final model, results and checkpoints: a new or empty folder, or this script's earlier "
        "output (a rerun, a resume).",
    )
    add(
        "--overwrite_output_dir",
        action="store_true",
        help="Write into a non-empty --output_dir this script did not write (its files of the same names are replaced);"
        " never the model's folder, the current directory or the home folder.",
    )
    add(
        "--seed",
        type=int,
        default=None,
        help="A seed for reproducible training; without one a seed is drawn and logged. Resume with the same seed.",
    )
    add(
        "--checkpointing_steps",
        type=str,
        default=None,
        help="Save the complete training state every n optimizer steps (an integer), or 'epoch' at each epoch's end.",
    )
    add(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="A step_<N> or epoch_<E> folder to continue from, or 'latest' for the newest one in output_dir.",
    )
    add(
        "--eval_steps",
        type=int,
        default=None,
        help="Evaluate every n optimizer steps instead of at the end of every epoch (the final evaluation, with the "
        "memory usage, always runs).",
    )
    add(
        "--track_staleness",
        action="store_true",
        help="Record for every memory slot the last training step at which it was a top-1 pick (Figure 2).",
    )
    add("--staleness_bins", type=int, default=5, help="Step ranges of the staleness histogram (the paper: 5).")
    add(
        "--trust_remote_code",
        action="store_true",
        help="Allow custom code from the Hub for datasets, configs, tokenizers and models (trusted repos only).",
    )
    add("--with_tracking", action="store_true", help="Whether to enable experiment trackers for logging.")
    add(
        "--report_to",
        type=str,
        default="all",
        help='The integration to report the results and logs to: "tensorboard", "wandb", "comet_ml", "clearml" or '
        '"all". Only applicable when `--with_tracking` is passed.',
    )
    add("--push_to_hub", action="store_true", help="Whether or not to push the model to the Hub.")
    add("--hub_model_id", type=str, help="The name of the repository to keep in sync with the local `output_dir`.")
    add("--hub_token", type=str, help="The token to use to push to the Model Hub.")
    add("--hub_private_repo", action="store_true", help="Create the Hub repository as private.")
    parser.set_defaults(**defaults)
    return parser


def add_language_modeling_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The data and model flags of run_mlm.py and run_clm.py (`lm_data.check_language_modeling_arguments` checks
    them together)."""
    add = parser.add_argument
    add("--dataset_name", type=str, default=None, help="The name of the dataset to use (via the datasets library).")
    add("--dataset_config_name", type=str, default=None, help="The configuration name of the dataset to use.")
    add("--train_file", type=str, default=None, help="Training data: a txt, csv or json file.")
    add("--validation_file", type=str, default=None, help="An evaluation file (txt, csv or json); see --validation_files.")
    add(
        "--validation_files",
        type=str,
        nargs="+",
        default=None,
        metavar="[NAME=]FILE",
        help="Several evaluation sets, each reported with its own loss and perplexity (Table 2: WikiText-2, "
        "WikiText-103, PG-19), e.g. `wt2=wiki.test.raw pg19=book.txt`; the name defaults to the file's name. "
        "The memory usage is measured on the first one.",
    )
    add(
        "--text_column_name",
        type=str,
        default=None,
        help="The column of a csv/json file holding the text (default: `text`, or the file's only column).",
    )
    add(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="The percentage of the train set used as validation set when there is no validation split or file.",
    )
    add("--max_train_samples", type=int, default=None, help="Keep the first n training examples (after grouping).")
    add("--max_eval_samples", type=int, default=None, help="Keep the first n examples of each evaluation set.")
    add(
        "--model_name_or_path",
        type=str,
        default=None,
        help="A BERT/DistilBERT checkpoint (converted to BertPkm on load when any --pkm_* flag is given), a BertPkm "
        "checkpoint, or any model of the task; without it a model is trained from scratch from --config_name / "
        "--model_type.",
    )
    add("--config_name", type=str, default=None, help="Pretrained config name or path if not the same as model_name.")
    add("--model_type", type=str, default=None, help="Model type to use if training from scratch (e.g. bert).")
    add("--tokenizer_name", type=str, default=None, help="Pretrained tokenizer name or path if not the same as model.")
    add("--use_slow_tokenizer", action="store_true", help="Use a slow tokenizer (not backed by 🤗 Tokenizers).")
    add("--preprocessing_num_workers", type=int, default=None, help="The number of processes for preprocessing.")
    add("--overwrite_cache", action="store_true", help="Overwrite the cached training and evaluation sets.")
    add(
        "--evaluate_before_training",
        action="store_true",
        help="Also evaluate the model as loaded (perplexities and memory usage, `initial_*` in the results): the "
        "starting point of Figure 3. Skipped when resuming.",
    )
    return parser


def add_reliability_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--allow_inexact_resume",
        action="store_true",
        help="Resume even when this run's batch size, gradient accumulation, learning rates, seed, schedule or data "
        "differ from the checkpoint's (default: such a resume stops and names what differs).",
    )
    return parser


def check_push_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """The one rule of every script that uploads: its upload flags (`flags`, destinations such as `hub_token`) are
    refused without `--push_to_hub` (a token given for nothing is a secret handed out for nothing)."""
    given = [f"--{name}" for name in flags if getattr(args, name, None)]
    if given and not getattr(args, "push_to_hub", False):
        listed = [f"--{name}" for name in flags]
        names = ", ".join(listed[:-1]) + f" and {listed[-1]}" if len(listed) > 1 else listed[0]
        parser.error(f"{names} need --push_to_hub (given: {' '.join(given)})")


_HUB_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]{1,96}")


def hub_model_id(name: str) -> str:
    """argparse type of `--base_model`: a Hub model id (`org/name` or `name`), not a local path."""
    if not _HUB_ID.fullmatch(name) or ".." in name or "--" in name or name.startswith((".", "-")) or os.path.exists(name):
        raise argparse.ArgumentTypeError(f"{name!r} is not a Hub model id such as google-bert/bert-base-uncased")
    return name


def add_model_card_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--base_model` and `--license`: what the model card's metadata says when the source cannot tell."""
    group = parser.add_argument_group("model card")
    group.add_argument(
        "--base_model",
        type=hub_model_id,
        default=None,
        help="Hub id of the model this one derives from, for the model card's `base_model` (default: "
        "--model_name_or_path when it is a Hub id, else the `base_model` of the source folder's own card).",
    )
    group.add_argument(
        "--license",
        type=str,
        default=None,
        help=f"License for the model card (default: the source model's, from its card or config, else {DEFAULT_LICENSE}).",
    )
    return parser


__all__ = [
    "LR_SCHEDULER_TYPES",
    "PKM_CHOICES",
    "PKM_FLAG_FIELDS",
    "TARGET_CLASSES",
    "add_language_modeling_arguments",
    "add_model_card_arguments",
    "add_pkm_arguments",
    "add_reliability_arguments",
    "add_training_arguments",
    "check_push_arguments",
    "help_requested",
    "hub_model_id",
]
