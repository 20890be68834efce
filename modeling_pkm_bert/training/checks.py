"""Checks a training script runs before it starts: the arguments together, the output folder, the data files, and that
`--freeze_memory` froze what it says. Each failure is a clear message, before any model is loaded."""

import argparse
import os

import torch

from ..utils.input_errors import InputError, usage_errors
from ..utils.memories import memory_modules
from ..utils.output_folders import check_command_paths, check_output_folder, mark_output_folder
from .arguments import check_push_arguments


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
    check_push_arguments(parser, args, ("hub_token", "hub_private_repo"))
    output_dir = getattr(args, "output_dir", None)
    needs_output_dir = [
        flag
        for flag, given in (
            ("--checkpointing_steps", checkpointing is not None),
            ("--resume_from_checkpoint latest", resume == "latest"),
            ("--push_to_hub", getattr(args, "push_to_hub", False)),
            ("--memory_report", getattr(args, "memory_report", False)),
        )
        if given
    ]
    if needs_output_dir and output_dir is None:
        parser.error(f"{' and '.join(needs_output_dir)} write into the output folder: give an --output_dir")
    if output_dir is not None:
        problem = output_dir_problem(output_dir)
        if problem:
            parser.error(f"--output_dir {output_dir!r}: {problem}")
        from .checkpoints import CHECKPOINT_NAME, latest_checkpoint

        # a resume of `latest` finds its checkpoint now, before anything is created or marked
        if resume == "latest" and latest_checkpoint(output_dir) is None:
            parser.error(f"--resume_from_checkpoint latest: no step_<N>/epoch_<E> folder in --output_dir {output_dir!r}")
        # the output-folder contract: the script's marker (`.run_mlm`) recognises its own output (a rerun); a resume
        # counts only where the checkpoint it resumes is a step_<N>/epoch_<E> folder of the output folder (one copied
        # or left by an older release): asking for a resume is no permission to overwrite a folder
        args.output_tool = os.path.splitext(parser.prog)[0]
        checkpoint = latest_checkpoint(output_dir) if resume == "latest" else resume
        resumes_here = (
            checkpoint is not None
            and CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(checkpoint))) is not None
            and os.path.realpath(os.path.dirname(os.path.abspath(checkpoint))) == os.path.realpath(output_dir)
        )
        reads = [(f"--{name}", getattr(args, name, None)) for name in ("model_name_or_path", "config_name", "tokenizer_name")]
        with usage_errors(parser):
            overwrite = getattr(args, "overwrite_output_dir", False) or resumes_here
            check_output_folder(output_dir, args.output_tool, overwrite=overwrite, reads=reads)
    check_command_paths(parser, args, os.path.splitext(parser.prog)[0])  # no output inside what the run reads
    check_parallel_arguments(parser, args)


def check_model_config(parser: argparse.ArgumentParser, args: argparse.Namespace, task: str) -> None:
    """The config of the model the script will train, built from the flags and the model's config alone
    (`loading.planned_config`, no weight): `parser.error` where a folder is missing or the config refuses a value
    (`--pkm_knn 32` above `--pkm_n_keys 16`, a `--config_overrides` field), before anything is loaded or created."""
    from .loading import planned_config

    with usage_errors(parser, ValueError):  # only configs are built here: a ValueError is the flags' or the folder's
        planned_config(args, task)


def check_parallel_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--fsdp2` / `--memory_parallel`: a torch with FSDP2, and for memory parallel a v_dim (the memories' value
    width, the model's hidden_size) that the number of processes (WORLD_SIZE, set by torchrun and accelerate launch)
    divides, each process keeping v_dim / processes columns of every value table. `parser.error` before any model is
    loaded (only its config is read). FSDP2 alone shards by rows and pads uneven shards: any v_dim."""
    from ..parallel.arguments import fsdp2_torch_problem

    memory_parallel = getattr(args, "memory_parallel", False)
    if not (memory_parallel or getattr(args, "fsdp2", False)):
        return
    flag = "--memory_parallel" if memory_parallel else "--fsdp2"
    problem = fsdp2_torch_problem(torch.__version__)
    if problem:
        parser.error(f"{flag}: {problem}")
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if not memory_parallel or processes == 1:
        return
    source, v_dim = memory_width(args)
    if v_dim is not None and v_dim % processes:
        parser.error(
            f"--memory_parallel on {processes} processes: the memories' v_dim={v_dim} (hidden_size of {source}) is not "
            f"divisible by {processes}; launch a number of processes that divides {v_dim}, or use --fsdp2"
        )


def memory_width(args: argparse.Namespace) -> tuple[str, int | None]:
    """(where it comes from, the v_dim of the memories the script's model will have): the hidden_size of the
    --model_name_or_path config, or of the config a model from scratch gets (--config_name, --config_overrides); None
    when the model will have no memory or its config cannot be read here (loading the model reports that)."""
    from .. import register_auto_classes
    from .loading import config_from_scratch, pkm_kwargs_from_args

    register_auto_classes()  # bert_pkm configs resolve without trust_remote_code
    pkm_kwargs = pkm_kwargs_from_args(args)
    source = getattr(args, "model_name_or_path", None) or getattr(args, "config_name", None)
    try:
        if getattr(args, "model_name_or_path", None):
            import transformers

            config = transformers.AutoConfig.from_pretrained(
                args.model_name_or_path, trust_remote_code=getattr(args, "trust_remote_code", False)
            )
        else:
            config = config_from_scratch(args, pkm_kwargs)
    except (OSError, ValueError, KeyError, AttributeError):
        return source, None
    if not (pkm_kwargs.get("pkm_layers") or getattr(config, "pkm_layers", None)):
        return source, None
    return source or f"model_type {config.model_type}", getattr(config, "hidden_size", None)


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


def prepare_output_dir(output_dir: str, tool: str | None = None) -> None:
    """Creates `output_dir` and proves it writable (a probe file written and removed) before any data is loaded or
    any step is trained: a run never discovers at the end that its model cannot be saved. With `tool` the folder also
    gets its marker; the training scripts leave that to `mark_run_output`, once every check has passed."""
    import tempfile

    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write-probe-"):
            pass
        if tool is not None:
            mark_output_folder(output_dir, tool)
    except OSError as error:
        raise ValueError(f"--output_dir {output_dir!r} cannot be written: {error.strerror or error}") from error


def mark_run_output(args: argparse.Namespace, is_main_process: bool = True) -> None:
    """Marks `--output_dir` as the script's own (`.run_mlm`: a rerun or a resume writes into it without
    --overwrite_output_dir), called once every check of the run has passed (its resume included), right before its
    first training step or its final outputs: a run that fails before marks nothing."""
    tool = getattr(args, "output_tool", None)
    if is_main_process and tool is not None and args.output_dir is not None:
        mark_output_folder(args.output_dir, tool)


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
        raise InputError(
            f"--freeze_memory: the model ({type(model).__name__}) has no product key memory to freeze; give --pkm_* "
            "flags to convert it, or drop --freeze_memory"
        )
