"""A json-lines log of a training run's metrics: what the training-curve figure (Figure 3) of the memory report reads.

The training scripts write `<output_dir>/metrics.jsonl`, one object per logged event: `{"step": N, "loss": ...}` after
every optimizer step and `{"step": N, "eval_<set>_perplexity": ..., ...}` after every evaluation. Python's json
writes an infinite perplexity as `Infinity`, which `read_metrics_log` reads back.
"""

import json
import math
import os
import time

from ..utils.input_errors import InputError


METRICS_LOG_NAME = "metrics.jsonl"


class MetricsLog:
    """Appends one json line per `log(...)` to `output_dir/metrics.jsonl` (on the main process only).

    Args:
        output_dir: The run's output folder; None disables the log.
        enabled: False on the processes other than the main one.
        resume: Keep the lines of an earlier, interrupted run (the scripts' `--resume_from_checkpoint`); otherwise a
            new run starts a new log.
    """

    def __init__(self, output_dir: str | None, enabled: bool = True, resume: bool = False):
        self.path = os.path.join(output_dir, METRICS_LOG_NAME) if output_dir is not None and enabled else None
        if self.path is not None:
            os.makedirs(output_dir, exist_ok=True)
            if not resume and os.path.exists(self.path):
                os.remove(self.path)

    def truncate(self, step: int) -> None:
        """Drops the records after `step` (a resumed run continues from its checkpoint's step: the interrupted run's
        later records are trained again), rewriting the log atomically."""
        if self.path is None or not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as handle:
            lines = [line for line in handle if _step_of(line) is not None and _step_of(line) <= step]
        temporary = f"{self.path}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.writelines(lines)
        os.replace(temporary, self.path)

    def log(self, metrics: dict, step: int) -> None:
        if self.path is None:
            return
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: float(v) if isinstance(v, float) else v for k, v in metrics.items() if _is_scalar(v)})
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _step_of(line: str) -> int | None:
    """The step of a log line; None for a blank or torn one (a run killed while writing it)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record.get("step") if isinstance(record, dict) else None


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def read_metrics_log(run_dir: str) -> list[dict]:
    """The records of `run_dir/metrics.jsonl`, in order.

    Raises:
        FileNotFoundError: When the run directory has no metrics log (a run made before the scripts wrote one).
        ValueError: When a line is not a json object (a corrupted log), naming the line.
    """
    path = os.path.join(run_dir, METRICS_LOG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{run_dir} has no {METRICS_LOG_NAME}: the training curves need the metrics log that run_mlm.py, "
            "run_clm.py, run_glue.py and run_squad.py write into their --output_dir"
        )
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}, line {number}: not a json object ({error})") from None
            if not isinstance(record, dict) or "step" not in record:
                raise InputError(f"{path}, line {number}: expected an object with a 'step', got {line.strip()[:80]!r}")
            records.append(record)
    return records


def is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
