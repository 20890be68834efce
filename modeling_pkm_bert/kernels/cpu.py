"""The native product-key selection for CPU, built at run time with the system C compiler.

`torch.topk` over the 512 sub-key scores of every (token, head, half) is most of a memory's inference time on CPU;
`csrc/product_key_select.c` selects the same top-`knn` product keys faster (AVX-512 where the compiler targets it,
portable C elsewhere). `register()` (called by `modeling_pkm_bert` when a model class is first resolved) registers it as
the torch op `torch.ops.pkm_bert.select_product_keys`; the plan of a memory (`product_key_memory_ops.plan_lookup`) takes
it for every fp32 CPU lookup outside compile and export: without gradients as it is, in training inside
`ProductKeySearch` (the op has no backward of its own), models loaded with `trust_remote_code=True` included once the
package is imported. docs/performance.md has its measured gain.

The library is compiled once (`cc -O3 -march=native`, about a second) into `$PKM_BERT_CACHE` (default
`~/.cache/modeling_pkm_bert`) and loaded with ctypes. Without a compiler the op computes the same result with torch
(logged once). `PKM_BERT_NATIVE=0` leaves the op unregistered.

The cache is trusted only as far as it must be: its folder is created private (0700) and must be owned by this user
and not writable by others; a library is built in a private scratch folder, hashed, and published by an atomic rename
next to a json sidecar recording its SHA-256. A cached library is loaded only when it is a regular file owned by this
user, not group/world-writable, and its bytes hash to the recorded value; it is loaded through the very file
descriptor that was hashed (`/proc/self/fd/N` on Linux), so nothing can be swapped in between. Anything else is
rebuilt; a library that still fails to load leaves the torch selection in charge, with a warning.

`use_huge_pages(model)` moves the value tables into memory backed by transparent huge pages (Linux): a lookup reads
random rows of a 768 MiB table, and with 4 KiB pages nearly every row costs a TLB miss and a page walk.
"""

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from ..product_key_memory import candidate_pairs, select_from_scores


logger = logging.getLogger(__name__)

OP_NAME = "pkm_bert::select_product_keys"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
PORTABLE_FLAGS = ("-O3", "-fPIC", "-shared")
# below this many (token, head) pairs per thread, a second thread costs more than it saves
_ROWS_PER_THREAD = 512

_lock = threading.Lock()
_libraries: dict[tuple[str, ...], ctypes.CDLL | None] = {}
_pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_open_libraries: list[int] = []  # descriptors of the loaded libraries (see `_load_verified`)
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _source() -> str:
    return resources.files(__package__).joinpath("csrc/product_key_select.c").read_text()


def _cache_dir() -> Path:
    root = os.environ.get("PKM_BERT_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modeling_pkm_bert"


def _cpu_signature() -> str:
    """What `-march=native` depends on: a library built on one CPU may not run on another sharing the cache."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _private_cache_dir() -> Path | None:
    """The cache folder, created 0700; None (with a warning) when it is not ours or others may write into it."""
    cache = _cache_dir()
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(cache)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and info.st_mode & 0o022:
            os.chmod(cache, stat.S_IMODE(info.st_mode) & ~0o077)  # ours but lax (an old umask): make it private
            info = os.lstat(cache)
    except OSError as error:
        logger.warning("native kernel cache %s is unusable (%s): product-key selection stays on torch", cache, error)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        logger.warning(
            "native kernel cache %s is not a folder owned by this user and closed to others (uid %d, mode %o): "
            "product-key selection stays on torch (set PKM_BERT_CACHE to a private folder)",
            cache, info.st_uid, stat.S_IMODE(info.st_mode),
        )  # fmt: skip
        return None
    return cache


def _read_trusted(path: Path) -> tuple[int, bytes] | None:
    """(an open descriptor, the bytes) of `path` if it is a regular file of ours that others cannot write, else None.
    The descriptor stays open: the caller loads exactly the bytes it checked."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        os.close(fd)
        logger.warning("ignoring %s: not a regular file owned by this user and closed to others", path)
        return None
    with os.fdopen(os.dup(fd), "rb") as handle:
        return fd, handle.read()


def _recorded_hash(sidecar: Path) -> str | None:
    trusted = _read_trusted(sidecar)
    if trusted is None:
        return None
    fd, data = trusted
    os.close(fd)
    try:
        return json.loads(data)["sha256"]
    except (ValueError, KeyError, TypeError):
        return None


def _load_verified(path: Path, sha256: str | None) -> ctypes.CDLL | None:
    """Loads `path` if it is trusted (`_read_trusted`) and its content hashes to `sha256`; the dynamic loader reads
    the checked file through its descriptor, so a rename after the check changes nothing."""
    trusted = _read_trusted(path)
    if trusted is None:
        return None
    fd, data = trusted
    try:
        if sha256 is None or hashlib.sha256(data).hexdigest() != sha256:
            logger.warning("ignoring %s: its content does not match the hash recorded when it was built", path)
            os.close(fd)
            return None
        by_descriptor = f"/proc/self/fd/{fd}"
        library = ctypes.CDLL(by_descriptor if os.path.exists(by_descriptor) else str(path))
        function = library.pkm_select_product_keys
    except (OSError, AttributeError) as error:
        logger.warning("could not load the product-key selection kernel %s: %s", path, error)
        os.close(fd)
        return None
    # the descriptor stays open while the library is loaded: the loader knows libraries by name, and a later
    # `/proc/self/fd/N` with a reused N would be taken for this one
    _open_libraries.append(fd)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # fmt: skip
    return library


def _build_and_publish(compiler: str, flags: tuple[str, ...], source: str, cache: Path, path: Path, sidecar: Path):
    """Compiles into a private scratch folder, hashes, publishes the library (atomic rename), then its sidecar."""
    with tempfile.TemporaryDirectory(dir=cache) as scratch:  # mkdtemp: 0700
        c_file, so_file = Path(scratch) / "product_key_select.c", Path(scratch) / "product_key_select.so"
        c_file.write_text(source)
        subprocess.run([compiler, *flags, str(c_file), "-o", str(so_file)], check=True, capture_output=True, text=True)
        os.chmod(so_file, 0o700)
        sha256 = hashlib.sha256(so_file.read_bytes()).hexdigest()
        record = Path(scratch) / "record.json"
        record.write_text(json.dumps({"sha256": sha256, "compiler": compiler, "flags": list(flags)}))
        os.chmod(record, 0o600)
        os.replace(so_file, path)  # atomic: a concurrent build or reader never sees half a library
        os.replace(record, sidecar)
    return sha256


def build_library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """Compiles (once, atomically, into the private cache) and loads the kernel; `None` when no compiler can build it
    or it cannot be loaded (the torch selection is used then). A cached library is loaded only when it passes
    `_load_verified`; otherwise, or when it fails to load, it is rebuilt once."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        logger.info("no C compiler found: product-key selection stays on torch.topk")
        return None
    cache = _private_cache_dir()
    if cache is None:
        return None
    source = _source()
    key = hashlib.sha256("\0".join([source, compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    path, sidecar = cache / f"product_key_select-{key}.so", cache / f"product_key_select-{key}.json"
    if os.path.lexists(path):
        library = _load_verified(path, _recorded_hash(sidecar))
        if library is not None:
            return library
        logger.warning("rebuilding the product-key selection kernel %s", path)
    try:
        sha256 = _build_and_publish(compiler, flags, source, cache, path, sidecar)
    except (OSError, subprocess.CalledProcessError) as error:
        details = getattr(error, "stderr", "") or error
        logger.info("could not build the product-key selection kernel with %s %s: %s", compiler, " ".join(flags), details)
        return None
    library = _load_verified(path, sha256)
    if library is None:
        logger.warning("the freshly built kernel %s does not load: product-key selection stays on torch", path)
    return library


def library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The loaded kernel (built on first use): native flags, else portable ones; `None` without a compiler."""
    candidates = [flags] if flags is not None else [FLAGS, PORTABLE_FLAGS]
    with _lock:
        for candidate in candidates:
            if candidate not in _libraries:
                _libraries[candidate] = build_library(candidate)
            if _libraries[candidate] is not None:
                return _libraries[candidate]
    return None


def _pair_tensors(knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    if knn not in _pairs:
        _pairs[knn] = tuple(torch.tensor(ranks, dtype=torch.int32) for ranks in candidate_pairs(knn))
    return _pairs[knn]


def _torch_selection(subkey_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection with torch ops (`ProductKeyMemory.search`'s own path)."""
    return select_from_scores(subkey_scores, knn)


def select_product_keys_native(
    subkey_scores: torch.Tensor, knn: int, flags: tuple[str, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel on `(heads * 2, tokens, n_keys)` fp32 CPU scores -> `(tokens, heads, knn)` scores and indices.

    `None` when the kernel is unavailable or a score is NaN (then torch's ordering of NaN applies: use torch).
    """
    global _pool, _pool_size
    kernel = library(flags)
    if kernel is None:
        return None
    groups, tokens, n_keys = subkey_scores.shape
    heads = groups // 2
    subkey_scores = subkey_scores.contiguous()
    first, second = _pair_tensors(knn)
    scores = torch.empty(tokens, heads, knn, dtype=torch.float32)
    indices = torch.empty(tokens, heads, knn, dtype=torch.int64)

    def run(begin: int, end: int) -> int:  # ctypes releases the GIL: chunks run in parallel
        return kernel.pkm_select_product_keys(
            subkey_scores.data_ptr(), heads, tokens, n_keys, knn, first.data_ptr(), second.data_ptr(), first.numel(),
            scores.data_ptr(), indices.data_ptr(), begin, end,
        )  # fmt: skip

    threads = max(1, min(torch.get_num_threads(), tokens * heads // _ROWS_PER_THREAD))
    if threads == 1:
        status = run(0, tokens)
    else:
        with _lock:
            if _pool_size < threads:
                _pool, _pool_size = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pkm_select"), threads
        bounds = [tokens * i // threads for i in range(threads + 1)]
        status = max(_pool.map(run, bounds[:-1], bounds[1:]))
    if status == -1:
        raise MemoryError("product-key selection kernel: out of memory")
    return (scores, indices) if status == 0 else None


def _check_arguments(subkey_scores: torch.Tensor, knn: int) -> None:
    """The op's contract, on metadata only (shapes, dtype, `knn`): the same checks run eagerly and while tracing."""
    if not isinstance(subkey_scores, torch.Tensor) or subkey_scores.dim() != 3:
        shape = tuple(subkey_scores.shape) if isinstance(subkey_scores, torch.Tensor) else type(subkey_scores).__name__
        raise ValueError(f"select_product_keys: subkey_scores must be (heads * 2, tokens, n_keys), got {shape}")
    if not subkey_scores.dtype.is_floating_point:
        raise ValueError(f"select_product_keys: subkey_scores must be floating point, got {subkey_scores.dtype}")
    groups, _, n_keys = subkey_scores.shape
    if groups == 0 or groups % 2:
        raise ValueError(f"select_product_keys: the first dimension must be heads * 2 (even, > 0), got {groups}")
    if isinstance(knn, bool) or not isinstance(knn, (int, torch.SymInt)) or not 1 <= knn <= n_keys:
        raise ValueError(f"select_product_keys: knn must be an int in [1, n_keys={n_keys}], got {knn!r}")


def _select_product_keys(subkey_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_arguments(subkey_scores, knn)
    if subkey_scores.dtype == torch.float32 and subkey_scores.device.type == "cpu":
        result = select_product_keys_native(subkey_scores, knn)
        if result is not None:
            return result
    return _torch_selection(subkey_scores, knn)


def _fake_select_product_keys(subkey_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_arguments(subkey_scores, knn)
    groups, tokens, _ = subkey_scores.shape
    shape = (tokens, groups // 2, knn)
    return subkey_scores.new_empty(shape), subkey_scores.new_empty(shape, dtype=torch.int64)


def register() -> bool:
    """Registers `torch.ops.pkm_bert.select_product_keys` (once); False when `PKM_BERT_NATIVE=0` disables it."""
    if os.environ.get("PKM_BERT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if hasattr(torch.ops.pkm_bert, "select_product_keys"):
        return True
    op = torch.library.custom_op(OP_NAME, mutates_args=(), device_types="cpu")(_select_product_keys)
    op.register_fake(_fake_select_product_keys)
    return True


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # linux/mman.h


def _madvise():
    if platform.system() != "Linux":
        return None
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    if "[never]" in enabled:
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def _huge_page_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The 2 MiB-aligned address range inside `tensor`'s bytes (empty when it holds none)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE


def huge_page_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of anonymous huge pages (`AnonHugePages` in /proc/self/smaps) in the mappings that hold `tensors`' aligned
    ranges; 0 where that file does not exist."""
    ranges = [r for r in map(_huge_page_range, tensors) if r[0] < r[1]]
    total, overlaps = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    begin, end = (int(address, 16) for address in head.split("-"))
                    overlaps = any(begin < b and a < end for a, b in ranges)
                elif overlaps and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


@torch.no_grad()
def use_huge_pages(model: nn.Module, min_bytes: int = 32 << 20) -> int:
    """Moves every CPU parameter and buffer of `model` of at least `min_bytes` (the memories' value tables; in BERT-base
    also the word embeddings) into fresh memory backed by transparent huge pages; returns the bytes on huge pages.

    The value lookup reads `heads * knn` random rows of a 768 MiB table per token: with 4 KiB pages nearly every row
    costs a TLB miss and a page walk, and the gather runs at about half the memory bandwidth. With 2 MiB pages the
    lookup of 128 tokens takes 1.4-1.6x less time on the CPU of benchmarks/RESULTS.md. The tensors are copied (this also
    detaches them from a memory-mapped checkpoint file) and set as `param.data`, so parameters keep their identity
    (optimizers, tied weights). Tensors that share storage with another tensor are left alone. Linux only, and only
    where transparent huge pages are not disabled (`/sys/kernel/mm/transparent_hugepage/enabled`); elsewhere it
    changes nothing and returns 0. Call it again after moving the model between devices or dtypes.
    """
    if not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
    madvise = _madvise()
    if madvise is None:
        return 0
    named = [*model.named_parameters(), *model.named_buffers()]  # each tensor once
    storage_users = Counter(tensor.untyped_storage().data_ptr() for _, tensor in named)
    moved = []
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or size < min_bytes or storage_users[tensor.untyped_storage().data_ptr()] > 1:
            continue
        fresh = torch.empty(tensor.shape, dtype=tensor.dtype)
        begin, end = _huge_page_range(fresh)
        if begin < end:
            madvise(begin, end - begin, _MADV_HUGEPAGE)  # before the first touch: the copy's page faults map 2 MiB pages
        fresh.copy_(tensor)
        if begin < end:
            madvise(begin, end - begin, _MADV_COLLAPSE)  # Linux >= 6.1: collapse what the faults left in 4 KiB pages
        if isinstance(tensor, nn.Parameter):
            tensor.data = fresh
        else:
            module_name, _, attribute = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attribute] = fresh
        moved.append(fresh)
    return huge_page_bytes(moved)


__all__ = ["build_library", "huge_page_bytes", "library", "register", "select_product_keys_native", "use_huge_pages"]
