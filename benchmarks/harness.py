"""What every benchmark shares: where things are, interleaved timing and paired ratios, memory (RSS), the machine a run
ran on, and files written atomically (a results JSON, a report of sections such as RESULTS.md).

Timing: each variant runs once per round, all of them in every round in a rotating order (`interleaved`), and a ratio
is the median of the per-round ratios (`paired_ratio`): on a shared machine a slow spell slows every variant of its
round alike, so the ratios hold where absolute times do not. Standard library only at import (torch is imported where
a function needs it), so that an entry's `--help` stays fast.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import threading
import time
from pathlib import Path


BENCHMARKS = Path(__file__).resolve().parent  # the package: entries, reports (*.md) and gpu_check.sh
REPO_ROOT = BENCHMARKS.parent
RUN_SCRIPTS = REPO_ROOT / "run_scripts"
RESULTS = BENCHMARKS / "results"  # the committed JSON and figures, a folder per study
MiB = 2**20


def results_dir(study: str) -> Path:
    """`benchmarks/results/<study>/`: the committed JSON and figures of one study (its report stays in benchmarks/)."""
    return RESULTS / study


# ----------------------------------------------------------------------------------------------- timing


def interleaved(functions: dict, rounds: int, warmup: int = 1, before=None, clock=time.perf_counter) -> dict:
    """Times each function once per round, all functions in every round (order rotated); returns the samples (s).
    `clock`: wall time by default; `time.thread_time` counts the CPU time of this thread only (single-threaded host
    work on a shared machine: the time another process holds the core does not count)."""
    names = list(functions)
    for _ in range(warmup):
        for name in names:
            if before:
                before(name)
            functions[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if before:
                before(name)
            start = clock()
            functions[name]()
            samples[name].append(clock() - start)
    return samples


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def median(values):
    return statistics.median(values)


def paired_ratio(samples: dict, numerator: str, denominator: str) -> float:
    """Median over rounds of time[numerator] / time[denominator]."""
    return median([a / b for a, b in zip(samples[numerator], samples[denominator])])


def min_ratio(samples: dict, numerator: str, denominator: str) -> float:
    """min time[numerator] / min time[denominator]: interference only ever slows a run down, so on a shared machine
    the fastest round is the least disturbed one (a cross-check of the paired median)."""
    return min(samples[numerator]) / min(samples[denominator])


def clearly_lower(peak: int, others: list[int], noise: int = 15 * MiB) -> bool:
    """Whether `peak` is below every one of `others` by more than the run-to-run noise of a fresh process's peak RSS
    (about +-15 MiB on this machine): a tie within the noise does not count as lower."""
    return all(peak < other - noise for other in others)


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


# ----------------------------------------------------------------------------------------------- memory


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak RSS growth over the block, sampled every millisecond from /proc/self/statm (approximate)."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.growth = self.peak - self.start


def peak_rss() -> int:
    """VmHWM: the peak RSS of this process image (unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mem_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ----------------------------------------------------------------------------------------------- the machine


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages as /proc/loadavg gives them (n/a where it is not)."""
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform.processor()` says, else n/a."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "n/a"


def machine() -> dict:
    """The machine of a run as a results JSON records it: processor, cores, torch, the 1-minute load."""
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "load": round(os.getloadavg()[0], 2)}  # fmt: skip


def git_commit(root: Path = REPO_ROOT, paths: tuple[str, ...] = ("modeling_pkm_bert",)) -> str:
    """The commit of the code measured (`+changes` when `paths` differ from it), or n/a outside a checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "n/a"
    return commit + ("+changes" if dirty else "")


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------- files


def write_atomic(path, text: str) -> None:
    """Writes `text` to `path` through a temporary beside it: a reader (or a stopped run) never sees half a file."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def read_json(path, default=None):
    """The JSON at `path`, or `default` (a fresh copy of it) where there is no file."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else json.loads(json.dumps(default))


def write_json(path, data, **dumps) -> None:
    """`data` as indented JSON, written atomically (`dumps`: more `json.dumps` options, e.g. sort_keys)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1, **dumps) + "\n")


def section_marks(name: str) -> tuple[str, str]:
    return f"<!-- section {name} -->", f"<!-- /section {name} -->"


def read_sections(path) -> tuple[dict[str, list[str]], list[str]]:
    """The sections (`{name: lines}`, each between its `section_marks`) and history rows (table rows outside the
    sections that start with a date) of a report written by `write_sections`."""
    sections, history = {}, []
    lines = Path(path).read_text(encoding="utf-8").splitlines() if Path(path).exists() else []
    name = None
    for line in lines:
        if line.startswith("<!-- section ") and line.endswith(" -->"):
            name = line[len("<!-- section ") : -len(" -->")]
            sections[name] = []
        elif name is not None and line == section_marks(name)[1]:
            name = None
        elif name is not None:
            sections[name].append(line)
        elif line.startswith("| 20"):  # a history row starts with its date
            history.append(line)
    return sections, history


def write_sections(path, ran: dict[str, list[str]], order, head: list[str], history_head: list[str],
                   history: str | None = None, tail: list[str] = ()) -> None:  # fmt: skip
    """Rewrites the report at `path`: `head`, the history table (`history_head`, the rows it has, the new `history`
    row), then its sections with those in `ran` replaced and the others kept (the names of `order` first, in that order),
    then `tail`; written atomically, so a stopped run leaves the last complete report."""
    sections, rows = read_sections(path)
    sections.update(ran)
    names = [name for name in order if name in sections] + [name for name in sections if name not in order]
    lines = [*head, *history_head, *rows, *([history] if history else []), ""]
    for name in names:
        lines += [section_marks(name)[0], *sections[name], section_marks(name)[1], ""]
    write_atomic(path, "\n".join([*lines, *tail]) + "\n")
