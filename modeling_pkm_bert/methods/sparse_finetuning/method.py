r"""Sparse memory finetuning (SMF): learn new data in a few memory value rows, forget little (Lin et al. 2025,
"Continual Learning via Sparse Memory Finetuning", arXiv 2510.15103; the KL ranker of Goyal et al. 2026).

Recipe:

1. **Background statistics** ([`compute_background_statistics`]): the frozen model (eval mode, no gradient) reads
   background text; for every slot of every memory layer we record its *document frequency* `df` (in how many
   background documents it was read at least once) and its total *reads*. A read is one (token, head, knn) entry of
   the lookup, so a slot chosen by two heads of one token is read twice; padding tokens are never looked up, so never
   counted. `N` is the number of background documents. **A document is what one training step ranks**: as many
   sequences as an optimizer step's global batch (per-device batch x gradient accumulation x processes), so that the
   term frequencies of a step and the document frequencies are counted over the same unit. Saved as safetensors
   beside a model ([`BackgroundStatistics.save`], `smf_background_statistics.safetensors`), with each layer's slot
   count, so that
   statistics of another model are refused.
2. **Ranking** ([`tfidf_scores`], [`kl_scores`], [`choose_slots`]): per training step and memory layer, `c_i` = the
   step's reads of slot `i` (all micro-batches of a gradient accumulation, all processes: one document); the top `t`
   slots by
   - TF-IDF: `(c_i / sum_j c_j) * log((N + 1) / (df_i + 1))`;
   - KL: `p_i * log(p_i / q_i)`, `p_i = c_i / sum_j c_j`, `q_i = (reads_i + 1) / sum_j (reads_j + 1)`;
   - gradient ([`gradient_scores`]): `||g_i||^2`, the squared norm of the step's value gradient on slot `i` (all
     micro-batches and processes, as the optimizer sees it; [`row_gradient_norms`]), no background needed: the rows
     where this step's loss says most should change. Memories sharing one table rank the table's gradient, each
     layer among the slots it read;
   - gradient KL: KL's `p_i * log(p_i / q_i)` with `p_i = ||g_i||^2 / sum_j ||g_j||^2`, the step's gradient mass in
     place of its reads: rows the step's loss wants changed that the background reads little.
   - unread: `c_i` among the slots no background document read (`df_i == 0`), the others never: TF-IDF's limit
     for a background that must stay intact (the knowledge a model holds). A small background is such a case, where
     the IDF hardly separates a row read in one document from a row never read (`log(37 / 2)` against `log(37)` at
     `N = 36`), so TF-IDF writes rows the background reads. Outputs on the background itself stay bit-identical;
     a masked LM's facts are recalled at [MASK] positions, whose rows unmasked text does not read, so they are not
     protected (`benchmarks/KNOWLEDGE_EDITING.md`, its History: it forgot more than TF-IDF).
   Slots the step did not read are never chosen (fewer than `t` read: all of them). Ties are broken by the lower slot
   index (a stable descending sort of float64 scores; every process computes the same choice from the same
   all-reduced counts).
   The reads a step ranks are those the background counts: while everything but the values is frozen, the training
   forwards run in eval mode (running BatchNorm statistics, no dropout; the values still get their gradient), as the
   background pass and inference do. In training mode the query BatchNorm would normalise with the batch's own
   statistics and dropout would move the queries, so the slots ranked would not be the slots inference reads: on
   all-MiniLM-L6-v2 converted with fresh ResM memories at layers 2 and 4 (64^2 slots), the top-16 of a batch of 8x64
   tokens overlapped the eval-mode top-16 by 0.11 and 0.03 on average (top-64: 0.20 and 0.08). With `--smf_train_rest`
   (`smf_train_rest` parameters trainable) the model trains in training mode and its reads are training-mode reads.
3. **The update** ([`SparseMemoryFinetuning`]): after the backward and *before any gradient clipping*, the value
   gradient is zeroed outside the chosen rows (dense gradients: `masked_fill`, so an inf/NaN of an unchosen row is
   zeroed too; sparse COO gradients of `set_sparse_values`: filtered), so a clipping norm counts only the rows the
   step trains. The choice consumes the step's reads: the next training forward starts a new count even when the
   optimizer step is then skipped (fp16 loss scaling found an inf), so a step never ranks two steps' reads. Memories
   that share one value table (`pkm_shared_values`) keep per-layer counts and choices; the table's rows are the union
   of its layers' choices. Everything else is frozen by default ([`freeze_all_but_values`]).

   A zero gradient is not enough for every optimizer: Adam/AdamW keep moving a row with their momentum (and AdamW
   decays it), so a row chosen at step 1 would keep changing at step 2. Plain SGD (`--memory_optimizer sgd`, no
   momentum, no weight decay: the paper's choice) and `optimizers.SparseRowAdam` (which updates only rows with a
   nonzero gradient) leave unchosen rows alone by construction; for any other optimizer the unchosen rows are
   restored after its step (a copy of the table is kept across the step), so "only the chosen rows change" holds for
   every optimizer. Adam's moments of the unchosen rows still decay (they are not restored).

Hashed n-gram memories (`ngram_layers`) are memory layers too: their value table is `tables`, the rows of all their
hash tables, and a read is one (position, hash table) row of the window the memory looks up (the convolution's
neighbours and the boundary rows at padding and the sequence's ends included; the memory's output at padding is zero,
so those rows get no gradient from it). Their rows are addressed by the input's own n-grams, not by a query; whether
a fact gets rows of its own depends on the tables' size and on the words its sentence shares with others (measured in
`benchmarks/KNOWLEDGE_EDITING.md`: mostly not, on the models there).

Several processes: each runs its share of every background document and the document's reads are summed over the
processes before it is counted ([`compute_background_statistics`] with `num_processes`), so the statistics equal
those of one process running the whole documents; a *training* step's counts are likewise summed over processes
before ranking, so all processes choose the same rows.

Usage::

    stats = compute_background_statistics(model, background_documents)     # or BackgroundStatistics.load(path)
    freeze_all_but_values(model)
    optimizer = torch.optim.SGD(pkm_value_parameters(model), lr=1.0)
    smf = SparseMemoryFinetuning(model, stats, top_t=500, ranker="tfidf").attach(optimizer)
    for batch in loader:
        model(**batch).loss.backward()
        smf.mask_gradients()            # before clipping or a GradScaler's step (else the optimizer step does it)
        optimizer.step(); optimizer.zero_grad()   # only chosen rows move

With `transformers.Trainer`: `SparseMemoryFinetuningCallback(stats, top_t=...)` (see its docstring).
"""

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from ...utils.input_errors import InputError
from ...utils.memories import (
    is_product_key_memory,
    memory_modules,
    memory_table,
    ngram_memory_modules,
    readable_name,
    unwrap_model,
)
from .arguments import GRADIENT_RANKERS, SMF_RANKERS, STATISTICS_NAME
from ..optimizers.memory_optimizer import clip_grad_norm_, unscale_once


_FORMAT = "modeling_pkm_bert.smf_background_statistics/1"


def memory_layers(model: nn.Module) -> dict[str, nn.Module]:
    """`{layer name: memory}` for every memory of `model`: the product key memories (`utils.memory_modules`), named as
    `memory_usage` does (`layer_4` for `bert.encoder.layer.4.memory`), then the hashed n-gram memories
    (`ngram_layer_1`); the module paths when those names would be ambiguous."""
    product_keys, ngrams = memory_modules(model), ngram_memory_modules(model)
    found = {**product_keys, **ngrams}
    names = [readable_name(path) for path in product_keys] + [f"ngram_{readable_name(path)}" for path in ngrams]
    if len(set(names)) < len(names):
        names = [path or "memory" for path in found]
    return dict(zip(names, found.values()))


def _mem_size(memory: nn.Module) -> int:
    return memory_table(memory).weight.shape[0]


# ---- background statistics ----


class BackgroundStatistics:
    """Per memory layer, the document frequency and total reads of every slot over `num_batches` background documents.

    Attributes:
        document_frequency: `{layer: int64 (mem_size,)}`: number of background documents (one optimizer step's batch
            each) that read the slot.
        reads: `{layer: int64 (mem_size,)}`: total reads (tokens x heads x knn entries) of the slot.
        num_batches: `N`, the number of background documents counted.
    """

    def __init__(self, mem_sizes: Mapping[str, int]):
        self.document_frequency = {name: torch.zeros(size, dtype=torch.long) for name, size in mem_sizes.items()}
        self.reads = {name: torch.zeros(size, dtype=torch.long) for name, size in mem_sizes.items()}
        self.num_batches = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> "BackgroundStatistics":
        layers = memory_layers(model)
        if not layers:
            raise InputError(
                "the model has no memory layer (product key or n-gram): sparse memory finetuning needs one"
            )
        return cls({name: _mem_size(memory) for name, memory in layers.items()})

    @property
    def mem_sizes(self) -> dict[str, int]:
        return {name: counts.numel() for name, counts in self.reads.items()}

    def add_batch(self, counts: Mapping[str, torch.Tensor]) -> None:
        """Counts one background batch: `counts[layer]` = the batch's reads of every slot."""
        for name, batch_reads in counts.items():
            batch_reads = batch_reads.to("cpu", torch.long)
            self.document_frequency[name] += batch_reads > 0
            self.reads[name] += batch_reads
        self.num_batches += 1

    def check_model(self, model: nn.Module, source: str = "the background statistics") -> None:
        """Raises ValueError unless `model` has exactly these memory layers with these slot counts."""
        expected = {name: _mem_size(memory) for name, memory in memory_layers(model).items()}
        if expected != self.mem_sizes:
            raise InputError(
                f"{source} are for memory layers {self.mem_sizes} (name: slots), but the model has {expected}: "
                "compute the statistics with this model"
            )

    def merge(self, other: "BackgroundStatistics") -> "BackgroundStatistics":
        """Adds `other` (e.g. another process's batches) to these statistics and returns `self`."""
        if not isinstance(other, BackgroundStatistics) or other.mem_sizes != self.mem_sizes:
            raise ValueError(
                f"can only merge statistics of the same memory layers {self.mem_sizes}, got "
                f"{getattr(other, 'mem_sizes', type(other).__name__)}"
            )
        for name in self.reads:
            self.document_frequency[name] += other.document_frequency[name]
            self.reads[name] += other.reads[name]
        self.num_batches += other.num_batches
        return self

    def all_reduce(self, device: torch.device | str = "cpu") -> "BackgroundStatistics":
        """Sums the statistics of all processes in place (a collective: call it on every process); no-op on one."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self
        names = list(self.reads)
        flat = torch.cat(
            [torch.tensor([self.num_batches])]
            + [self.document_frequency[name] for name in names]
            + [self.reads[name] for name in names]
        ).to(device)
        torch.distributed.all_reduce(flat)
        flat = flat.cpu()
        self.num_batches = int(flat[0])
        offset = 1
        for table in (self.document_frequency, self.reads):
            for name in names:
                size = table[name].numel()
                table[name] = flat[offset : offset + size].clone()
                offset += size
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {f"{name}.document_frequency": df.contiguous() for name, df in self.document_frequency.items()}
        tensors.update({f"{name}.reads": reads.contiguous() for name, reads in self.reads.items()})
        return tensors

    def save(self, path: str | os.PathLike) -> str:
        """Writes the statistics to `path` (a `.safetensors` file, or a folder: `folder/smf_background_statistics.
        safetensors`) atomically; returns the file written."""
        from safetensors.torch import save_file

        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, STATISTICS_NAME)
        metadata = {"format": _FORMAT, "num_batches": str(self.num_batches), "mem_sizes": json.dumps(self.mem_sizes)}
        temporary = f"{path}.tmp"
        save_file(self.state_dict(), temporary, metadata=metadata)
        os.replace(temporary, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BackgroundStatistics":
        """Reads statistics written by `save` (a file, or a folder holding `smf_background_statistics.safetensors`)."""
        from safetensors import safe_open

        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, STATISTICS_NAME)
        if not os.path.isfile(path):
            raise InputError(f"background statistics file {path!r} does not exist")
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise InputError(f"{path!r} is not a background statistics file (format {metadata.get('format')!r})")
            statistics = cls(json.loads(metadata["mem_sizes"]))
            statistics.num_batches = int(metadata["num_batches"])
            for name in statistics.reads:
                statistics.document_frequency[name] = handle.get_tensor(f"{name}.document_frequency")
                statistics.reads[name] = handle.get_tensor(f"{name}.reads")
        if statistics.num_batches < 1:
            raise InputError(f"{path!r} counts no background batch")
        return statistics

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, BackgroundStatistics)
            and other.num_batches == self.num_batches
            and other.mem_sizes == self.mem_sizes
            and all(torch.equal(self.reads[n], other.reads[n]) for n in self.reads)
            and all(torch.equal(self.document_frequency[n], other.document_frequency[n]) for n in self.reads)
        )

    def __repr__(self) -> str:
        return f"BackgroundStatistics(num_batches={self.num_batches}, mem_sizes={self.mem_sizes})"


class ReadCounter:
    """Counts, per memory layer, the reads of every slot while attached (the value lookups' indices: tokens x heads x
    knn, padding excluded), by hooking each memory's value lookup as `memory_usage` does. Layers sharing one value
    table are told apart by a pre-hook on each memory that names the layer about to read.

    Args:
        model: The model whose memories are counted.
        training_only: Count only forwards that record a gradient (the SMF step), not no-grad evaluations in between.

    Attributes:
        stale: Set it once the counts have been used (a step's choice): the next counted read starts a new count.
    """

    def __init__(self, model: nn.Module, training_only: bool = False):
        self.memories = memory_layers(model)
        self.counts = {
            name: torch.zeros(_mem_size(memory), dtype=torch.long, device=memory_table(memory).weight.device)
            for name, memory in self.memories.items()
        }
        self.training_only = training_only
        self.stale = False
        self._reading: str | None = None
        self._hooks = []

    def attach(self) -> "ReadCounter":
        if self._hooks:
            return self
        tables = {}
        for name, memory in self.memories.items():
            self._hooks.append(memory.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(memory.register_forward_hook(self._leave))
            tables.setdefault(id(memory_table(memory)), memory_table(memory))
        for values in tables.values():  # one hook per (possibly shared) value table
            self._hooks.append(values.register_forward_hook(self._count, with_kwargs=True))
        return self

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _enter(self, name: str):
        def enter(module, args):
            self._reading = name if (torch.is_grad_enabled() or not self.training_only) else None

        return enter

    def _leave(self, module, args, output):
        self._reading = None

    def _count(self, values, args, kwargs, output):
        if self._reading is None:
            return
        if self.stale:  # the first read after a step's choice: a new step
            self.reset()
        indices = args[0] if args else kwargs["input"]
        counts = self.counts[self._reading]
        counts += torch.bincount(indices.reshape(-1), minlength=counts.numel()).to(counts.device)

    def reset(self) -> None:
        for counts in self.counts.values():
            counts.zero_()
        self.stale = False

    def __enter__(self) -> "ReadCounter":
        return self.attach()

    def __exit__(self, *exc_info) -> None:
        self.detach()


def _model_inputs(batch: Mapping) -> dict:
    """The inputs of a forward without loss: labels dropped (a background pass needs no target)."""
    drop = {"labels", "label", "start_positions", "end_positions", "special_tokens_mask", "next_sentence_label"}
    return {key: value for key, value in batch.items() if key not in drop}


@torch.no_grad()
def compute_background_statistics(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: Callable[[Iterable], Iterable] | None = None,
    micro_batch_size: int | None = None,
    process_index: int = 0,
    num_processes: int = 1,
) -> BackgroundStatistics:
    """Runs `model` frozen (eval mode, no gradient) over background `batches`, each one *document* (dicts of model
    inputs; labels are ignored; as many sequences as a training step's global batch), and counts, per memory slot, in
    how many documents it was read and how often.

    A document may be run in pieces: `micro_batch_size` sequences per forward, and with `num_processes > 1` (a
    collective: call it on every process with the same documents) process `process_index` runs its contiguous share
    of each document's sequences and the document's reads are summed over the processes before they are counted, so
    every process ends with the statistics of the whole documents, equal to those of one process (eval-mode reads do
    not depend on how sequences are batched).

    Raises:
        ValueError: The model has no memory, `max_batches < 1`, or there is no background batch.
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches={max_batches} must be >= 1 (or None for every batch)")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 (or None: a document per forward)")
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index={process_index} must be in [0, num_processes={num_processes})")
    distributed = num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
    statistics = BackgroundStatistics.for_model(model)
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with ReadCounter(model) as counter:
            for index, batch in enumerate(progress(batches) if progress else batches):
                if max_batches is not None and index >= max_batches:
                    break
                counter.reset()
                inputs = _model_inputs(batch)
                size = len(next(iter(inputs.values())))
                share = -(-size // num_processes)  # this process's contiguous slice of the document
                start, stop = min(process_index * share, size), min((process_index + 1) * share, size)
                step = micro_batch_size or max(stop - start, 1)
                for first in range(start, stop, step):
                    model(**{k: v[first : min(first + step, stop)].to(device) for k, v in inputs.items()})
                counts = counter.counts
                if distributed:
                    names = list(counts)
                    flat = torch.cat([counts[name] for name in names])
                    torch.distributed.all_reduce(flat)
                    counts = dict(zip(names, flat.split([counts[name].numel() for name in names])))
                statistics.add_batch(counts)
    finally:
        model.train(was_training)
    if statistics.num_batches == 0:
        raise InputError("the background set is empty: give at least one background batch")
    return statistics


# ---- rankers ----


def tfidf_scores(counts: torch.Tensor, document_frequency: torch.Tensor, num_batches: int) -> torch.Tensor:
    """`(c_i / sum_j c_j) * log((N + 1) / (df_i + 1))` in float64; `-inf` for unread slots (`c_i == 0`)."""
    counts = counts.double()
    total = counts.sum().clamp_min(1.0)
    idf = torch.log((num_batches + 1.0) / (document_frequency.to(counts.device).double() + 1.0))
    return torch.where(counts > 0, counts / total * idf, -math.inf)


def kl_scores(counts: torch.Tensor, background_reads: torch.Tensor) -> torch.Tensor:
    """`p_i * log(p_i / q_i)`, `p = c / sum c`, `q = (reads + 1) / sum (reads + 1)`, in float64; `-inf` for unread
    slots."""
    counts = counts.double()
    p = counts / counts.sum().clamp_min(1.0)
    smoothed = background_reads.to(counts.device).double() + 1.0
    q = smoothed / smoothed.sum()
    return torch.where(counts > 0, p * torch.log(p / q), -math.inf)


def choose_slots(scores: torch.Tensor, top_t: int) -> torch.Tensor:
    """The (at most) `top_t` best slots among those with a finite score, ascending: highest score first, exact ties
    broken by the lower slot index (stable sort)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    eligible = int(torch.isfinite(scores).sum())
    return order[: min(top_t, eligible)].sort().values


def gradient_scores(counts: torch.Tensor, row_gradient: torch.Tensor) -> torch.Tensor:
    """The squared norm of each slot's value gradient `||g_i||^2` in float64 (a non-finite one ranks first); `-inf`
    for unread slots."""
    largest = torch.finfo(torch.float64).max
    squared = torch.nan_to_num(row_gradient.to(counts.device).double(), nan=largest, posinf=largest)
    return torch.where(counts > 0, squared, -math.inf)


def rank_slots(
    counts: torch.Tensor,
    statistics: "BackgroundStatistics | None",
    layer: str,
    top_t: int,
    ranker: str = "tfidf",
    row_gradient: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slots of `layer` that a step with reads `counts` trains (see `choose_slots`); the gradient rankers need
    `row_gradient` (each slot's squared gradient norm, `row_gradient_norms`), `gradient` no statistics."""
    if ranker == "tfidf":
        scores = tfidf_scores(counts, statistics.document_frequency[layer], statistics.num_batches)
    elif ranker == "kl":
        scores = kl_scores(counts, statistics.reads[layer])
    elif ranker == "unread":
        unread = statistics.document_frequency[layer].to(counts.device) == 0
        scores = torch.where((counts > 0) & unread, counts.double(), -math.inf)
    elif ranker in GRADIENT_RANKERS:
        if row_gradient is None:
            raise ValueError(f"the {ranker} ranker needs row_gradient (each slot's squared gradient norm)")
        scores = gradient_scores(counts, row_gradient)
        if ranker == "gradient_kl":  # the KL ranker with the step's gradient mass in place of its read counts
            mass = torch.where(counts > 0, scores, 0.0)
            # a read row without gradient scores p log(p / q) -> 0: eligible, as every read row is
            scores = torch.where(mass > 0, kl_scores(mass, statistics.reads[layer]), scores)
    else:
        raise ValueError(f"ranker={ranker!r}: expected one of {SMF_RANKERS}")
    return choose_slots(scores, top_t)


@torch.no_grad()
def row_gradient_norms(weight: torch.Tensor) -> torch.Tensor:
    """The squared norm of every row of `weight.grad` in float64 (zeros without a gradient): dense, sparse COO
    (`set_sparse_values`) or a DTensor (memory parallel's column shards, FSDP2's row shards; summed over the mesh, so
    every process ranks the same norms)."""
    grad = weight.grad
    rows = weight.shape[0]
    if grad is None:
        return torch.zeros(rows, dtype=torch.float64)
    if hasattr(grad, "full_tensor"):  # a DTensor: the rows' sums over every shard
        return grad.double().pow(2).sum(1).full_tensor().cpu()
    if grad.is_sparse:
        grad = grad.coalesce()
        squared = torch.zeros(rows, dtype=torch.float64, device=grad.device)
        return squared.index_add_(0, grad.indices()[0], grad.values().double().pow(2).sum(1)).cpu()
    return grad.double().pow(2).sum(1).cpu()


# ---- the update ----


def freeze_all_but_values(model: nn.Module) -> int:
    """Keeps every parameter fixed except the memory value tables, and the memories' query BatchNorm running statistics
    too (momentum 0), so that only value rows can change; returns the number of trainable parameters left."""
    tables = {id(memory_table(memory).weight) for memory in memory_layers(model).values()}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in tables)
    for memory in memory_layers(model).values():
        for batchnorm in memory.query_batchnorms() if is_product_key_memory(memory) else ():
            batchnorm.momentum = 0.0
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _moves_only_rows_with_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` leaves a parameter row with zero gradient exactly as it is."""
    if type(optimizer).__name__ == "SparseRowAdam":  # updates (and decays) the rows with a nonzero gradient only
        return True
    if type(optimizer) is torch.optim.SGD:
        return all(group["momentum"] == 0 and group["weight_decay"] == 0 for group in optimizer.param_groups)
    return False


def validate_top_t(top_t: int, model_or_sizes) -> None:
    sizes = (
        model_or_sizes
        if isinstance(model_or_sizes, Mapping)
        else {n: _mem_size(m) for n, m in memory_layers(model_or_sizes).items()}
    )
    if not sizes:
        raise InputError("the model has no memory layer (product key or n-gram): sparse memory finetuning needs one")
    smallest = min(sizes.values())
    if isinstance(top_t, bool) or not isinstance(top_t, int) or not 1 <= top_t <= smallest:
        raise InputError(f"top_t={top_t!r} must be an integer in [1, {smallest}] (the slots of the smallest memory)")


class SparseMemoryFinetuning:
    """Restricts each optimizer step of the memory values to the top-`t` slots of every layer (module docstring).

    Args:
        model: The model (the one that runs forwards; a DDP wrapper is fine).
        statistics: Its `BackgroundStatistics` (checked against the model's memories); None with the `gradient`
            ranker, which needs none.
        top_t: Slots kept per layer and step, in [1, slots of a layer].
        ranker: `"tfidf"`, `"kl"`, `"unread"`, `"gradient"` or `"gradient_kl"` (`SMF_RANKERS`).

    Attributes:
        chosen: `{layer: LongTensor}`, the slots chosen at the last step (ascending).
        steps: Number of restricted optimizer steps.
        eval_mode_reads: Whether the training forwards run in eval mode (set by `attach`: when nothing but the value
            tables is trainable), so that the reads ranked are those the background statistics count.
    """

    def __init__(self, model: nn.Module, statistics: BackgroundStatistics | None, top_t: int, ranker: str = "tfidf"):
        if ranker not in SMF_RANKERS:
            raise ValueError(f"ranker={ranker!r}: expected one of {SMF_RANKERS}")
        if statistics is None and ranker != "gradient":
            raise InputError(f"the {ranker} ranker needs background statistics (only the gradient ranker needs none)")
        if statistics is not None:
            statistics.check_model(model)
        validate_top_t(top_t, model)
        self.statistics, self.top_t, self.ranker = statistics, top_t, ranker
        self.model = unwrap_model(model)
        self.memories = memory_layers(model)
        self.counter = ReadCounter(model, training_only=True)
        self.eval_mode_reads = False
        self._modes: list[nn.Module] = []
        self._model_hooks = []
        self.tables: dict[int, tuple[nn.Parameter, list[str]]] = {}  # id(weight) -> (weight, its layers)
        for name, memory in self.memories.items():
            weight = memory_table(memory).weight
            self.tables.setdefault(id(weight), (weight, []))[1].append(name)
        self.chosen: dict[str, torch.Tensor] = {}
        self.steps = 0
        self._optimizer_hooks = []
        self._saved_tables: dict[int, torch.Tensor] = {}

    # -- wiring --

    def attach(self, optimizer: torch.optim.Optimizer | None = None, restore_unchosen: bool | None = None):
        """Starts counting the training forwards' reads; with `optimizer` (the one stepping the values; an accelerate
        `AcceleratedOptimizer` is unwrapped) its steps are restricted automatically (`mask_gradients` before each step
        unless already called for it, `restore_unchosen_rows` after it where the optimizer could move rows without
        gradient; `restore_unchosen` forces that choice). While only the value tables are trainable, the training
        forwards run in eval mode (see the module docstring). Returns `self`."""
        if not self.counter._hooks:
            tables = {id(weight) for weight, _ in self.tables.values()}
            frozen = all(id(p) in tables for p in self.model.parameters() if p.requires_grad)
            self.eval_mode_reads = frozen
            if frozen:
                self._model_hooks.append(self.model.register_forward_pre_hook(self._enter_eval_mode))
                self._model_hooks.append(self.model.register_forward_hook(self._leave_eval_mode))
        self.counter.attach()
        if optimizer is not None and not self._optimizer_hooks:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper steps the torch optimizer
            restore = not _moves_only_rows_with_gradient(inner) if restore_unchosen is None else restore_unchosen
            self._optimizer_hooks.append(inner.register_step_pre_hook(lambda *_: self.before_step(restore)))
            self._optimizer_hooks.append(inner.register_step_post_hook(lambda *_: self.after_step()))
        return self

    def detach(self) -> None:
        self.counter.detach()
        for handle in self._optimizer_hooks + self._model_hooks:
            handle.remove()
        self._optimizer_hooks, self._model_hooks = [], []

    def _enter_eval_mode(self, module, args):
        # a training forward of the frozen model reads as the background pass and inference do (no batch statistics
        # in the query BatchNorm, no dropout); the values' gradient is the same computation either way
        if torch.is_grad_enabled() and module.training:
            self._modes = [m for m in module.modules() if m.training]
            module.eval()

    def _leave_eval_mode(self, module, args, output):
        for m in self._modes:
            m.training = True
        self._modes = []

    def before_step(self, restore: bool = False) -> None:
        if self.counter.stale:  # already masked for this step (before clipping): the same choice
            self._apply_masks(self._masks)
        else:
            self.mask_gradients()
        if restore:
            self._saved_tables = {key: weight.detach().clone() for key, (weight, _) in self.tables.items()}

    def after_step(self) -> None:
        if self._saved_tables:
            self.restore_unchosen_rows()
        self.steps += 1

    # -- the step --

    def select(self) -> dict[int, torch.Tensor]:
        """Ranks this step's reads (summed over processes); returns `{id(table): boolean row mask}`, sets `chosen`.
        The reads are then used up: the next training forward starts the next step's count (also when this step's
        optimizer step is skipped)."""
        counts = self.counter.counts
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            names = list(counts)
            flat = torch.cat([counts[name] for name in names])
            torch.distributed.all_reduce(flat)
            counts = dict(zip(names, flat.split([counts[name].numel() for name in names])))
        gradients = {}  # the gradient ranker: each table's rows (a shared table's gradient serves all its layers)
        if self.ranker in GRADIENT_RANKERS:
            for weight, layers in self.tables.values():
                gradients.update(dict.fromkeys(layers, row_gradient_norms(weight)))
        self.chosen = {
            name: rank_slots(counts[name].cpu(), self.statistics, name, self.top_t, self.ranker, gradients.get(name))
            for name in counts
        }
        masks = {}
        for key, (weight, layers) in self.tables.items():
            mask = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
            for name in layers:  # shared table: the union of its layers' choices
                mask[self.chosen[name].to(weight.device)] = True
            masks[key] = mask
        self._masks = masks
        self.counter.stale = True
        return masks

    @torch.no_grad()
    def mask_gradients(self) -> dict[int, torch.Tensor]:
        """Chooses this step's rows and zeroes the value gradients outside them (dense: masked; sparse: rows
        filtered). Call it after the backward (gradients synchronised), before any gradient clipping, loss unscaling
        or optimizer step (the attached optimizer's step calls it when it was not); returns the masks."""
        masks = self.select()
        self._apply_masks(masks)
        return masks

    @torch.no_grad()
    def _apply_masks(self, masks: dict[int, torch.Tensor]) -> None:
        for key, (weight, _) in self.tables.items():
            grad, mask = weight.grad, masks[key]
            if grad is None:
                continue
            grad = getattr(grad, "_local_tensor", grad)  # a column-sharded table (memory parallel): its columns
            if grad.is_sparse:
                grad = grad.coalesce()
                rows, values = grad.indices(), grad.values()
                keep = mask[rows[0]]
                weight.grad = torch.sparse_coo_tensor(
                    rows[:, keep], values[keep], grad.shape, is_coalesced=True, check_invariants=False
                )
            else:  # not grad * mask: an inf or NaN of an unchosen row times 0 would be NaN
                grad.masked_fill_(~mask.unsqueeze(1), 0)

    @torch.no_grad()
    def restore_unchosen_rows(self) -> None:
        """Puts back the rows that were not chosen, as saved before the step (for optimizers with momentum/decay)."""
        for key, (weight, _) in self.tables.items():
            saved = self._saved_tables.get(key)
            if saved is not None:
                unchosen = ~self._masks[key]
                weight, saved = getattr(weight, "_local_tensor", weight), getattr(saved, "_local_tensor", saved)
                weight[unchosen] = saved[unchosen]
        self._saved_tables = {}

    # -- checkpoints --

    def save_state(self, folder: str) -> None:
        """Writes the background statistics into a checkpoint folder (call it on the main process)."""
        if self.statistics is not None:
            self.statistics.save(os.path.join(folder, STATISTICS_NAME))

    def load_state(self, folder: str) -> None:
        """Reads the background statistics back from a checkpoint folder, checked against the model."""
        if self.statistics is None:  # the gradient ranker keeps no statistics
            return
        path = os.path.join(folder, STATISTICS_NAME)
        if not os.path.isfile(path):
            raise InputError(f"{folder} holds no {STATISTICS_NAME}: resume it without --sparse_memory_finetuning")
        statistics = BackgroundStatistics.load(path)
        statistics.check_model(self.model, path)
        self.statistics = statistics

    def register_for_checkpointing(self, accelerator) -> None:
        """Saves the background statistics into every `accelerator.save_state` folder (as safetensors) and loads them
        back on `load_state`, so a resumed run ranks exactly as the uninterrupted one."""

        def save(models, weights, output_dir):
            if accelerator.is_main_process:
                self.save_state(output_dir)

        accelerator.register_save_state_pre_hook(save)
        accelerator.register_load_state_pre_hook(lambda models, input_dir: self.load_state(input_dir))


# ---- transformers.Trainer ----


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class SparseMemoryFinetuningCallback(_trainer_callback_base()):
    """SMF for `transformers.Trainer`: restricts the Trainer's optimizer steps to the chosen value rows.

        freeze_all_but_values(model)                       # unless the rest should train too (before the Trainer)
        callback = SparseMemoryFinetuningCallback(statistics, top_t=500, ranker="tfidf")
        trainer = Trainer(model=model, args=args, train_dataset=..., callbacks=[callback])
        trainer.train()

    The gradients are masked before the gradient clipping: the Trainer clips before any callback runs, so the callback
    takes the clipping over for the run (`args.max_grad_norm` is set to 0 and put back at the end) and, at each
    optimizer step, masks, then clips to `max_grad_norm` (unscaling first under fp16), so the unchosen rows' gradients
    never shrink the chosen rows' step. The choice is made at every step, skipped by the loss scaler or not. With an
    Adam-family optimizer the unchosen rows are restored after the step.
    """

    def __init__(self, statistics: BackgroundStatistics | None, top_t: int, ranker: str = "tfidf"):
        self.statistics, self.top_t, self.ranker = statistics, top_t, ranker
        self.smf: SparseMemoryFinetuning | None = None
        self.max_grad_norm: float | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.smf = SparseMemoryFinetuning(model, self.statistics, self.top_t, self.ranker).attach(optimizer)
        self.optimizer, self.model = optimizer, model
        self.max_grad_norm, args.max_grad_norm = args.max_grad_norm, 0.0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.smf.mask_gradients()
        if self.max_grad_norm and self.max_grad_norm > 0:
            # fp16 loss scaling: clip unscaled gradients (Trainer's gradient-norm log may have unscaled them already)
            unscale_once(getattr(self.optimizer, "scaler", None), self.optimizer)
            clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], self.max_grad_norm)

    def on_train_end(self, args, state, control, **kwargs):
        if self.smf is not None:
            self.smf.detach()
        if self.max_grad_norm is not None:
            args.max_grad_norm, self.max_grad_norm = self.max_grad_norm, None


# ---- batches of background text ----


def background_batches(
    tokenizer,
    texts: list[str],
    max_seq_length: int,
    batch_size: int,
    max_batches: int | None = None,
    causal: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Background batches: the texts tokenized, concatenated and cut into blocks of `max_seq_length` tokens, as the
    script's training blocks are, `batch_size` blocks a batch (the last one may be short). A masked LM's blocks lie
    between [CLS] and [SEP] (`run_mlm.py`); a causal LM's (`causal=True`, `run_clm.py`) have no special token, each
    text followed by the separator (the tokenizer's end-of-text token, else [SEP])."""
    if not texts:
        return []
    lines = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if causal:
        separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        ids = [token for line in lines for token in (line + [separator] if separator is not None else line)]
        starts = range(0, len(ids) - max_seq_length + 1, max_seq_length)
        blocks = [ids[start : start + max_seq_length] for start in starts]
    else:
        ids = [token for line in lines for token in line]
        inner = max_seq_length - 2  # [CLS] ... [SEP]
        if inner < 1:
            raise InputError(f"max_seq_length={max_seq_length} is too short for a background block")
        blocks = [
            [tokenizer.cls_token_id, *ids[start : start + inner], tokenizer.sep_token_id]
            for start in range(0, len(ids) - inner + 1, inner)
        ]
    batches = []
    for start in range(0, len(blocks), batch_size):
        input_ids = torch.tensor(blocks[start : start + batch_size])
        batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
        if max_batches is not None and len(batches) >= max_batches:
            break
    return batches


__all__ = [
    "BackgroundStatistics",
    "ReadCounter",
    "SparseMemoryFinetuning",
    "SparseMemoryFinetuningCallback",
    "background_batches",
    "choose_slots",
    "compute_background_statistics",
    "freeze_all_but_values",
    "kl_scores",
    "memory_layers",
    "gradient_scores",
    "rank_slots",
    "row_gradient_norms",
    "tfidf_scores",
    "validate_top_t",
]
