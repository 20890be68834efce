"""What every training script shares: PKM command-line options, model loading (+Init), optimizer groups."""

import argparse
import dataclasses
import os
import re

import torch

# the flags live in a torch-free module (a fast --help); imported here for the old import paths
from .arguments import (  # noqa: F401
    MEMORY_OPTIMIZERS,
    add_pkm_arguments,
    add_reliability_arguments,
    redact_argv,
    redact_secrets,
)
from .configuration_bert_pkm import BertPkmConfig
from .optimization import (  # noqa: F401 (memory_modules: public here)
    PKM_VALUES_GROUP,
    clip_grad_norm_,
    memory_modules,
    pkm_param_groups,
    pkm_value_parameters,
)


# the pkm_* fields a user sets (pkm_weights_checksum is written by save_pretrained)
PKM_FIELDS = {
    f.name: f for f in dataclasses.fields(BertPkmConfig) if f.name.startswith("pkm_") and f.name != "pkm_weights_checksum"
}


def clip_memory_gradients(accelerator, model: torch.nn.Module, memory_optimizer, max_norm: float | None, smf=None):
    """`--memory_max_grad_norm`: clips the value tables' gradient to `max_norm` on its own (each shared table once),
    after unscaling it under fp16 loss scaling; call it between `accelerator.backward` and the optimizer steps.
    With sparse memory finetuning (`smf`, a `SparseMemoryFinetuning`), the step's rows are chosen and the gradient
    masked first, at every optimizer step: the clipping norm counts only the rows the step trains, and the choice
    uses up the step's reads even when the loss scaler then skips the step.
    Returns the norm before clipping (None when there is nothing to clip)."""
    if not accelerator.sync_gradients:
        return None
    if smf is not None:
        smf.mask_gradients()
    if not max_norm:
        return None
    if getattr(accelerator, "scaler", None) is not None and memory_optimizer is not None:
        accelerator.unscale_gradients(optimizer=memory_optimizer)
    parameters = [p for p in pkm_value_parameters(accelerator.unwrap_model(model)) if p.grad is not None]
    return clip_grad_norm_(parameters, max_norm) if parameters else None


def pkm_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The pkm_* fields the user gave on the command line."""
    return {name: getattr(args, name) for name in PKM_FIELDS if getattr(args, name, None) is not None}


def freeze_memory(model: torch.nn.Module) -> int:
    """Fixes every memory parameter (keys, query network, values) and the query BatchNorm's running statistics, so the
    memory is the same function after training (Table 5); returns how many parameters were frozen."""
    frozen = 0
    for memory in memory_modules(model).values():
        for batchnorm in memory.query_batchnorms():
            batchnorm.momentum = 0.0  # batch statistics still normalise in training; the running ones stay
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


def save_checkpoint(
    accelerator, output_dir: str | None, name: str, settings: dict | None = None, staleness=None
) -> str:
    """`accelerator.save_state` into `output_dir/name` atomically: written to `name.tmp`, then renamed, so an
    interrupted save never leaves a half-written `step_N`/`epoch_N` that a resume would pick up. `settings`
    (`run_settings`) go to `run_settings.json`, a `StalenessTracker`'s state to `staleness.safetensors` (never a
    pickle), both inside the folder before it is renamed."""
    import shutil

    from .serving import check_not_quantized

    for model in getattr(accelerator, "_models", []):  # quantized value tables are inference only: no checkpoint
        check_not_quantized(accelerator.unwrap_model(model))
    final = os.path.join(output_dir, name) if output_dir else name
    temporary = f"{final}.tmp"
    if accelerator.is_main_process and os.path.exists(temporary):
        shutil.rmtree(temporary)
    accelerator.wait_for_everyone()
    accelerator.save_state(temporary)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if settings is not None:
            atomic_write_json(os.path.join(temporary, RUN_SETTINGS_FILE), settings)
        if staleness is not None:
            from .staleness import STALENESS_FILE

            staleness.save(os.path.join(temporary, STALENESS_FILE))
        _pause_for_tests(name, temporary)
        old = None
        if os.path.exists(final):  # moved aside, not deleted first: a crash here keeps one complete copy
            old = f"{final}.old"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(temporary, final)
        if old is not None:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _pause_for_tests(name: str, temporary: str) -> None:
    """`PKM_BERT_PAUSE_BEFORE_PUBLISHING=step_4`: the save of that checkpoint stops with its `.tmp` folder written
    but not yet renamed (a `.paused` file in it marks the moment), so a test can kill the run mid-save
    deterministically."""
    if os.environ.get("PKM_BERT_PAUSE_BEFORE_PUBLISHING") == name:
        import time

        with open(os.path.join(temporary, ".paused"), "w") as marker:
            marker.write(str(os.getpid()))
        while True:
            time.sleep(1)


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
    license: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    command: str | None = None,
    title: str = "Fine-tuning results",
) -> str:
    """Writes `folder/README.md` for a trained model: `conversion.write_model_card` for a BertPkm folder (a short
    card for a plain BERT baseline) with a `title` section ("Fine-tuning results") holding the curated results
    (perplexities, task metrics, memory usage per layer; the rest stays in `all_results.json`) and the command that
    produced them, without secrets or this machine's paths. `base_model` is named only when it is a Hub id
    (`conversion.card_base_model` finds it); `license` defaults to apache-2.0. Returns the card's text."""
    import json

    from .conversion import _card_metadata, hub_id_or_none, results_section, write_model_card

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    details = dict(command=command, dataset=dataset, task=task)
    if config.get("model_type") == BertPkmConfig.model_type:
        card = write_model_card(
            folder, repo_id=repo_id, base_model=base_model, license=license, results=results, results_title=title, **details
        )
        return str(card)
    architecture = (config.get("architectures") or ["a BERT model"])[0]
    base_model = hub_id_or_none(base_model)
    name = repo_id or os.path.basename(os.path.abspath(folder))
    text = _card_metadata(base_model, license, ["bert", "baseline"]) + f"# {name}\n\n`{architecture}` without product"
    text += f" key memory (the baseline), trained from `{base_model}`.\n" if base_model else " key memory (the baseline).\n"
    text += "\n" + "\n".join(results_section(results, title, output_dir=folder, **details)) + "\n"
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(text)
    return text


# ---- security and reliability (issue 13): no secrets in trackers, bad flags/files/output folders caught before any
# work, atomic final outputs, resumes that are exact or stop ----

# argument names that hold secrets (`hub_token`, `wandb_api_key`, ...): never sent to a tracker or saved in a checkpoint
def tracker_config(args: argparse.Namespace) -> dict:
    """The run's arguments for `accelerator.init_trackers`, secrets removed (`redact_secrets`), each value a type
    every tracker takes (enums by value; lists, dicts and paths as strings)."""
    config = {}
    for key, value in redact_secrets(vars(args)).items():
        value = getattr(value, "value", value)  # SchedulerType and other enums
        config[key] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return config


# (argument, lowest allowed value, what it means); checked only where the script has the argument and it is given
_MINIMUMS = (
    ("gradient_accumulation_steps", 1, "batches per optimizer step"),
    ("per_device_train_batch_size", 1, "sequences per batch"),
    ("per_device_eval_batch_size", 1, "sequences per batch"),
    ("max_train_steps", 0, "optimizer steps; 0 trains nothing"),
    ("num_train_epochs", 0, "epochs; 0 trains nothing"),
    ("num_warmup_steps", 0, "steps"),
    ("max_train_samples", 1, "examples"),
    ("max_eval_samples", 1, "examples"),
    ("max_seq_length", 1, "tokens"),
    ("max_length", 1, "tokens"),
    ("preprocessing_num_workers", 1, "processes"),
    ("eval_steps", 1, "optimizer steps"),
    ("staleness_bins", 1, "step ranges"),
    ("doc_stride", 1, "tokens"),
    ("n_best_size", 1, "candidates"),
    ("max_answer_length", 1, "tokens"),
)


def validate_training_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks every training script shares: `parser.error` (exit 2) naming the flag, the value given and what is
    allowed, before any work. Each script adds its own checks after this one."""
    import math

    for name, minimum, unit in _MINIMUMS:
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            parser.error(f"--{name} must be >= {minimum} ({unit}), got {value}")
    for name, positive in (("learning_rate", True), ("memory_learning_rate", False), ("weight_decay", False)):
        value = getattr(args, name, None)
        if value is not None and (not math.isfinite(value) or value < 0 or (positive and value == 0)):
            parser.error(f"--{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    warmup_ratio = getattr(args, "warmup_ratio", None)
    if warmup_ratio is not None and not 0 <= warmup_ratio <= 1:
        parser.error(f"--warmup_ratio must be in [0, 1], got {warmup_ratio}")
    percentage = getattr(args, "validation_split_percentage", None)
    if percentage is not None and not 0 < percentage < 100:
        parser.error(f"--validation_split_percentage must be in 1..99 (percent of the training data), got {percentage}")
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < 2**32:
        parser.error(f"--seed must be in [0, 2**32 - 1] (numpy's range), got {seed}")
    checkpointing = getattr(args, "checkpointing_steps", None)
    if checkpointing is not None and checkpointing != "epoch" and not (checkpointing.isdigit() and int(checkpointing)):
        parser.error(f"--checkpointing_steps must be a positive integer or 'epoch', got {checkpointing!r}")
    resume = getattr(args, "resume_from_checkpoint", None)
    if resume is not None and resume != "latest" and not os.path.isdir(resume):
        parser.error(f"--resume_from_checkpoint {resume!r} is not a folder (a step_<N>/epoch_<E> folder, or 'latest')")
    output_dir = getattr(args, "output_dir", None)
    if output_dir is not None:
        problem = output_dir_problem(output_dir)
        if problem:
            parser.error(f"--output_dir {output_dir!r}: {problem}")


def output_dir_problem(output_dir: str) -> str | None:
    """Why `output_dir` cannot receive the run's outputs (without creating anything), or None."""
    path = os.path.abspath(output_dir)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: {parent} is not writable"


def prepare_output_dir(output_dir: str) -> None:
    """Creates `output_dir` and proves it writable (a probe file written and removed) before any data is loaded or
    any step is trained: a run never discovers at the end that its model cannot be saved."""
    import tempfile

    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise ValueError(f"--output_dir {output_dir!r} cannot be written: {error.strerror or error}") from error


def check_data_file_contents(path: str, kind: str | None = None) -> str | None:
    """Why a training/evaluation file cannot be read (not UTF-8, malformed json / json lines, a csv row with another
    number of fields than its header), naming the line; None when it reads. `kind`: the extension by default."""
    import codecs
    import csv
    import json

    kind = (kind or path.rsplit(".", 1)[-1]).lower()
    decoder, offset, line = codecs.getincrementaldecoder("utf-8")(), 0, 1
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                position = offset + error.start
                line += chunk[: error.start].count(b"\n")
                return f"is not UTF-8 text: byte {position} (line {line}) is {chunk[error.start:error.start + 1]!r}"
            offset, line = offset + len(chunk), line + chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f"is not UTF-8 text: it ends inside a multi-byte character (byte {offset})"
    if kind in ("json", "jsonl"):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        try:
            document = json.loads(text)
            if not isinstance(document, (dict, list)):
                return f"is a JSON {type(document).__name__}, expected records (json lines, a list, or an object)"
            return None
        except json.JSONDecodeError as whole:
            invalid = f"is not valid JSON: {whole.msg} at line {whole.lineno} column {whole.colno}"
        first = True
        for number, row in enumerate(text.splitlines(), 1):
            if row.strip():
                try:
                    if not isinstance(json.loads(row), dict):
                        return f"line {number} is not a JSON object (json lines hold one object a line)"
                except json.JSONDecodeError as error:
                    if first:  # not json lines either: the document's own error says most
                        return invalid
                    return f"is neither a JSON document nor JSON lines: line {number}: {error.msg} (col {error.colno})"
                first = False
    if kind == "csv":
        with open(path, encoding="utf-8", newline="") as handle:
            rows = csv.reader(handle)
            header = next(rows, None)
            for row in rows:
                if row and header is not None and len(row) != len(header):
                    return (
                        f"line {rows.line_num} has {len(row)} fields, the header {len(header)} ({header}); "
                        "quote fields that hold commas"
                    )
    return None


def check_data_files(parser: argparse.ArgumentParser, files: list[tuple[str, str | None]]) -> None:
    """`check_data_file_contents` on each (flag, path) given: `parser.error` naming the flag, the file and the
    problem, before any data is loaded."""
    for option, path in files:
        if path is not None and os.path.isfile(path):
            problem = check_data_file_contents(path)
            if problem:
                parser.error(f"{option} {path!r} {problem}")


def check_freeze_memory(model: torch.nn.Module) -> None:
    """`--freeze_memory` on a model without product key memory would silently train everything: refuse."""
    if not memory_modules(model):
        raise ValueError(
            f"--freeze_memory: the model ({type(model).__name__}) has no product key memory to freeze; give --pkm_* "
            "flags to convert it, or drop --freeze_memory"
        )


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
                if os.path.isdir(target):
                    shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
        os.rmdir(staging)
        if any(WEIGHT_FILE.match(name) for name in names):  # as save_pretrained does: drop an older save's shards
            for name in os.listdir(output_dir):
                if WEIGHT_FILE.match(name) and name not in names:
                    os.remove(os.path.join(output_dir, name))
    accelerator.wait_for_everyone()


# ---- resume: the run's settings in every checkpoint, checked before `load_state` ----

RUN_SETTINGS_FILE = "run_settings.json"
# settings whose change makes a resumed run differ from the uninterrupted one
RESUME_SETTINGS = (
    "per_device_train_batch_size",
    "num_processes",
    "gradient_accumulation_steps",
    "learning_rate",
    "memory_learning_rate",
    "memory_optimizer",
    "memory_max_grad_norm",
    "weight_decay",
    "lr_scheduler_type",
    "num_warmup_steps",
    "warmup_ratio",
    "max_train_steps",
    "seed",
    "max_seq_length",
    "max_length",
    "block_size",
    "mlm_probability",
    "trime",
    "train_data",
)


def run_settings(args: argparse.Namespace, accelerator, train_dataset=None) -> dict:
    """What an exact resume depends on: the RESUME_SETTINGS of `args` (secrets never included), the number of
    processes, and the training data (its datasets fingerprint and size)."""
    settings = {name: getattr(args, name) for name in RESUME_SETTINGS if hasattr(args, name)}
    settings = {k: getattr(v, "value", v) for k, v in settings.items()}
    settings["num_processes"] = accelerator.num_processes
    if train_dataset is not None:
        settings["train_data"] = dataset_signature(train_dataset)
    return redact_secrets(settings)


def dataset_signature(dataset, samples: int = 64) -> dict:
    """A cheap identity of a processed training set: its size and the SHA-256 of `samples` rows spread over it (the
    first and the last included), so other text, another tokenizer or sequence length shows up without hashing
    everything."""
    import hashlib
    import json

    rows = len(dataset)
    digest = hashlib.sha256()
    for index in sorted({rows * i // samples for i in range(samples)} | ({rows - 1} if rows else set())):
        digest.update(json.dumps(dataset[index], sort_keys=True, default=str).encode())
    return {"rows": rows, "sha256": digest.hexdigest()}


def check_checkpoint(checkpoint: str, settings: dict, allow_inexact: bool, process_index: int = 0, logger=None) -> None:
    """Before `accelerator.load_state(checkpoint)`: ValueError when the checkpoint holds pickled custom objects
    (`custom_checkpoint_N.pkl`), when its random states are unreadable (accelerate would skip them with an INFO line
    and the resume would not be exact), or when the run's settings
    differ from those saved in the checkpoint (`run_settings.json`), unless `allow_inexact` (then a warning)."""
    import json

    from accelerate.utils.other import load as accelerate_load  # torch.load(weights_only=True) + numpy's safe types

    pickled = sorted(name for name in os.listdir(checkpoint) if re.fullmatch(r"custom_checkpoint_\d+\.pkl", name))
    if pickled:  # accelerate would unpickle them with weights_only=False: code could run
        raise ValueError(
            f"{checkpoint} holds pickled custom state {pickled}, which this version never writes nor loads (it "
            "would run code on loading): an older checkpoint or a planted file. Delete it to resume."
        )
    states = os.path.join(checkpoint, f"random_states_{process_index}.pkl")
    try:
        random_states = accelerate_load(states)
        if not isinstance(random_states, dict) or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(
            random_states
        ):
            raise ValueError("not a dict of random, numpy and torch states")
    except Exception as error:  # noqa: BLE001 - any failure means the states cannot be restored
        raise ValueError(
            f"{states}: the random states of the checkpoint cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); a resume from it would not be exact"
        ) from error
    saved_file = os.path.join(checkpoint, RUN_SETTINGS_FILE)
    differences = []
    if not os.path.isfile(saved_file):
        differences.append(f"{RUN_SETTINGS_FILE} is missing, nothing can be compared")
    else:
        try:
            with open(saved_file, encoding="utf-8") as handle:
                saved = json.load(handle)
        except (OSError, ValueError) as error:
            raise ValueError(f"{saved_file} cannot be read: {error}") from error
        for name in sorted(set(saved) | set(settings)):
            if saved.get(name) != settings.get(name):
                differences.append(f"{name}: checkpoint {saved.get(name)!r}, now {settings.get(name)!r}")
    if not differences:
        return
    message = f"{checkpoint} was saved by a run with other settings, so this resume would not be exact: " + "; ".join(
        differences
    )
    if not allow_inexact:
        raise ValueError(message + ". Resume with the checkpoint's settings, or pass --allow_inexact_resume.")
    if logger is not None:
        logger.warning(message + " (--allow_inexact_resume: continuing)")
# ---- shared by the language-modeling scripts (run_mlm, run_clm) ----


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
