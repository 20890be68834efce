"""Checkpoints of a training run: atomic `step_N` / `epoch_N` folders (`accelerator.save_state` plus the run's
position), finding and resolving the one to resume from, and the run settings a resume must match (exact resume)."""

import argparse
import os
import re

from ..hub.card_command import redact_secrets
from ..methods.registry import method_resume_settings
from ..utils.input_errors import InputError
from .results import atomic_write_json


CHECKPOINT_NAME = re.compile(r"^(step|epoch)_(\d+)$")


def save_checkpoint(
    accelerator, output_dir: str | None, name: str, settings: dict | None = None, staleness=None,
    loss_state: dict | None = None,
) -> str:  # fmt: skip
    """`accelerator.save_state` into `output_dir/name` atomically: written to `name.tmp`, then renamed, so an
    interrupted save never leaves a half-written `step_N`/`epoch_N` that a resume would pick up. `settings`
    (`run_settings`) go to `run_settings.json`, a `StalenessTracker`'s state to `staleness.safetensors` (never a
    pickle), the training loop's running loss (`loss_state`) to `loss_state.json`, all inside the folder before it is
    renamed."""
    import shutil

    from ..serving import check_not_quantized

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
        if loss_state is not None:
            atomic_write_json(os.path.join(temporary, LOSS_STATE_FILE), loss_state)
        if staleness is not None:
            from ..analysis.staleness import STALENESS_FILE

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


LOSS_STATE_FILE = "loss_state.json"


def read_loss_state(checkpoint: str) -> dict | None:
    """The training loop's running loss saved with `checkpoint` (`loss_state.json`), or None where it has none."""
    import json

    path = os.path.join(checkpoint, LOSS_STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


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
        raise InputError(f"cannot resume from {checkpoint!r}: the folder must be named step_<N> or epoch_<E>")
    kind, number = match.group(1), int(match.group(2))
    if kind == "epoch":
        return number + 1, (number + 1) * num_update_steps_per_epoch, 0
    epoch, steps_into_epoch = divmod(number, num_update_steps_per_epoch)
    return epoch, number, steps_into_epoch * gradient_accumulation_steps


def latest_checkpoint(output_dir: str, steps_per_epoch: int | None = None) -> str | None:
    """The most advanced `step_N` / `epoch_E` folder in `output_dir`, or None. With `steps_per_epoch` both kinds are
    ordered by the optimizer steps they hold (`epoch_E`: (E + 1) * steps_per_epoch), so the step checkpoint that a
    `--max_train_steps` stop writes in an unfinished epoch comes after the finished epochs; without it an `epoch_E`
    counts as after every `step_N` (SMF's statistics, read before the steps are planned, are the same in all).
    Half-written `*.tmp` folders are never picked."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_NAME.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            is_epoch, number = match.group(1) == "epoch", int(match.group(2))
            if steps_per_epoch:
                steps = (number + 1) * steps_per_epoch if is_epoch else number
                found.append(((steps, is_epoch), name))
            else:
                found.append(((is_epoch, number), name))
    return os.path.join(output_dir, max(found)[1]) if found else None


def resolve_checkpoint(resume_from_checkpoint: str, output_dir: str | None, steps_per_epoch: int | None = None) -> str:
    """The folder `--resume_from_checkpoint` names: a path, or `latest` for `latest_checkpoint(output_dir, ...)`."""
    if resume_from_checkpoint != "latest":
        return resume_from_checkpoint
    checkpoint = latest_checkpoint(output_dir, steps_per_epoch)
    if checkpoint is None:
        raise InputError(f"--resume_from_checkpoint latest: no step_<N>/epoch_<E> folder in {output_dir}")
    return checkpoint


RUN_SETTINGS_FILE = "run_settings.json"


# settings whose change makes a resumed run differ from the uninterrupted one (with each training method's own:
# `TrainingMethod.resume_settings`)
RESUME_SETTINGS = (
    "per_device_train_batch_size",
    "num_processes",
    "gradient_accumulation_steps",
    "learning_rate",
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
    "whole_word_masking",
    "span_column",
    "span_mask_probability",
    "mask_replace_prob",
    "random_replace_prob",
    "train_data",
)
# without the same value here, the checkpoint's state cannot even be loaded (other optimizer parameter groups):
# refused even with --allow_inexact_resume
STRUCTURAL_SETTINGS = ("sparse_memory_finetuning",)


def run_settings(args: argparse.Namespace, accelerator, train_dataset=None) -> dict:
    """What an exact resume depends on: the RESUME_SETTINGS of `args` and those of the training methods it uses
    (secrets never included; a background file by its size and SHA-256), the number of processes, and the training
    data (its datasets fingerprint and size)."""
    names = (*RESUME_SETTINGS, *method_resume_settings(args))
    settings = {name: getattr(args, name) for name in names if hasattr(args, name)}
    settings = {k: getattr(v, "value", v) for k, v in settings.items()}
    if settings.get("smf_background_file") is not None:
        settings["smf_background_file"] = file_signature(settings["smf_background_file"])
    settings["num_processes"] = accelerator.num_processes
    if train_dataset is not None:
        settings["train_data"] = dataset_signature(train_dataset)
    return redact_secrets(settings)


def file_signature(path: str) -> dict:
    """A file's identity whatever its path: its size and the SHA-256 of its content."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


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
        raise InputError(
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
        raise InputError(
            f"{states}: the random states of the checkpoint cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); a resume from it would not be exact"
        ) from error
    saved_file = os.path.join(checkpoint, RUN_SETTINGS_FILE)
    differences, saved = [], None
    if not os.path.isfile(saved_file):
        differences.append(f"{RUN_SETTINGS_FILE} is missing, nothing can be compared")
    else:
        try:
            with open(saved_file, encoding="utf-8") as handle:
                saved = json.load(handle)
        except (OSError, ValueError) as error:
            raise InputError(f"{saved_file} cannot be read: {error}") from error
        for name in sorted(set(saved) | set(settings)):
            if saved.get(name) != settings.get(name):
                differences.append(f"{name}: checkpoint {saved.get(name)!r}, now {settings.get(name)!r}")
    if not differences:
        return
    message = f"{checkpoint} was saved by a run with other settings, so this resume would not be exact: " + "; ".join(
        differences
    )
    structural = [name for name in STRUCTURAL_SETTINGS if saved is not None and saved.get(name) != settings.get(name)]
    if structural:
        raise InputError(f"{message}. Resume with the checkpoint's {', '.join(structural)} (its state needs it)")
    if not allow_inexact:
        raise InputError(message + ". Resume with the checkpoint's settings, or pass --allow_inexact_resume.")
    if logger is not None:
        logger.warning(message + " (--allow_inexact_resume: continuing)")
