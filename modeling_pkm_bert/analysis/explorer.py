r"""The memory explorer: one static HTML page (no server, no network) that shows what each memory slot holds.

Per memory layer, on the same text sequences as the memory report (`report.text_sequences`), the page shows

1. the slots ranked by use (top-1 picks and summed weight, the counts of `memory_usage.MemoryUsageAccumulator`), the
   sorted usage curve and the share of slots never picked, with the report's metrics (MU, top-1 MU, KL, Gini);
2. for one slot: the contexts that selected it (the token with a window of text around it, the weight `w(x)_i` it
   gave the slot, whether the slot was its top-1 pick) and the tokens its value promotes (below);
3. a search: the slots that a token's or word's occurrences select, per layer (their top-1 pick) and per head (the
   head's best slot).

The value projection (Geva et al. 2021 project a feed-forward value through the output embedding): in both
`pkm_mode`s the memory's output is added to the layer's residual before the layer's closing LayerNorm
(`LN(x + FFN(x) + PKM(x))` for resm, `LN(x + PKM(x))` for replace), so a value row `v` moves the layer's output by
`gamma * (v - mean(v)) / sigma`, `sigma` the token's standard deviation (positive, the same for every slot: it does not
change a ranking, and is left out). The page ranks the vocabulary by

    logits = E @ (gamma * (s * v - mean(s * v)))

`E` the output embedding (`model.get_output_embeddings()`, the MLM decoder; the word embeddings when the model has no
LM head: BERT ties the two), `gamma` the layer's LayerNorm gain, `s` the memory's `memory_scale` (1 without one).
Left out: the decoder bias and the LayerNorm bias (the same for every slot: they would make every slot promote the same
frequent tokens), the MLM head's transform (dense + GELU + LayerNorm, nonlinear, trained on the last layer's output,
not on one value alone) and the layers after the memory. With `pkm_output_gate="swilu"` the value passes an
input-dependent gate: the projection of the row as stored is then an approximation (the page says so).

Hashed n-gram memories (`ngram_memory.NgramMemory`, named `layer_1_ngram`) get the same views per bucket (a row of
one of its tables): the buckets ranked by reads (every position reads one bucket of every table) and summed gate `g`
(the position's `sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(hidden_size))`), the usage metrics of `memory_usage` over the
reads (MU, KL_u, Gini_u; there is no top-1 pick), per bucket the contexts with the largest gate (the n-gram
highlighted) and its collisions: the distinct n-grams, as the memory hashes them (canonical ids, a boundary id beyond
the sequence's edges), that landed in it. A bucket's row `r` of table `t` enters the output as `g * W_v[:, t] @ r`
(plus its neighbours' through the convolution, which starts at zero), added to the residual before the layer's
attention block, whose LayerNorm closes it: the page projects `E @ (gamma * (d - mean(d)))`, `d = W_v[:, t] @ r`,
`gamma` the gain of `attention.output.LayerNorm`. Only buckets read at least once are projected.

Files (`output_dir`):

    index.html                 the page (inline script and style), opened from disk
    explorer.json              the summary (every layer's metrics, ranked slot counts, usage curve): usable on its own
    data/explorer.js           the same, for the page
    data/tokens.js             the token stream the model read (sequences of `sequence_length` tokens, back to back)
    data/<layer>/selections.js per token: its top-1 slot and each head's best slot (the search)
    data/<layer>/slots_<k>.js  per slot of chunk k: its top contexts and promoted tokens, loaded when a slot opens

Each `data/*.js` file is `pkmExplorerData("<name>", <JSON>);` (a browser blocks reading JSON files from disk, not
scripts); `read_explorer_data(output_dir, name)` returns its JSON. The page's state is in the URL
(`index.html#layer=layer_4&sort=top1&page=0&slot=123&q=word`), so a view can be linked.
"""

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..hub.conversion import replace_folder, staging_folder
from ..utils.memories import is_ngram_memory, ngram_memory_modules, readable_name
from ..utils.output_folders import check_output_folder, mark_output_folder, model_folder
from .memory_usage import MemoryUsageAccumulator, MemoryUsageTracker, merge_duplicate_slots
from .report import MemoryReportError, model_batches, sequence_length_of, text_sequences


TOOL = "memory_explorer"  # its output folders hold the marker `.memory_explorer` (`utils.output_folders`)
SUMMARY_NAME = "explorer.json"
PAGE_NAME = "index.html"
PAGE_FILES = (PAGE_NAME, "explorer.css", "explorer.js")  # explorer_page/, copied beside the data
DATA_FOLDER = "data"
DATA_CALLBACK = "pkmExplorerData"
FORMAT = "modeling_pkm_bert.memory_explorer"
FORMAT_VERSION = 1
CURVE_POINTS = 200
# candidate contexts kept between prunings (per layer): bounds memory for any number of tokens
PRUNE_AT = 1 << 22
PROJECTION_BLOCK = 1024  # value rows projected at once: (1024, vocab) logits, 125 MB for BERT's vocabulary


class MemoryExplorerError(MemoryReportError):
    """Input the memory explorer cannot use: it names what is wrong."""


def build_memory_explorer(
    model: nn.Module,
    tokenizer,
    output_dir: str,
    texts: Sequence[str],
    *,
    layers: Sequence[int | str] | None = None,
    max_seq_length: int | None = None,
    max_tokens: int | None = 100_000,
    contexts_per_slot: int = 10,
    top_tokens: int = 10,
    window: int = 12,
    max_projected_slots: int | None = None,
    chunk_size: int = 4096,
    batch_size: int = 8,
    title: str | None = None,
    progress: bool = False,
    overwrite: bool = False,
) -> dict:
    """Writes the memory explorer of `model` over `texts` into `output_dir` (replaced when complete); returns the
    summary (the content of `explorer.json`). `output_dir` is new, empty or an earlier explorer's (its marker file
    `.memory_explorer`), any other folder only with `overwrite`; never the model's own folder or one containing it
    (`utils.output_folders`).

    Args:
        model: Any model holding product key or hashed n-gram memories (BertPkm or loaded with
            `trust_remote_code=True`).
        tokenizer: Its tokenizer.
        texts: The text to run: tokenized, concatenated and cut into sequences of `max_seq_length` tokens, as the
            memory report does (the same texts and lengths give the report's numbers).
        max_seq_length: Tokens per sequence (default: the report's, 128 at most the model's positions).
        layers: The memory layers to explore, by encoder layer index (`4`: its memories of both kinds) or name
            (`"layer_4"`, `"layer_1_ngram"`); default all.
        max_tokens: Run at most this many tokens (whole sequences); None: all of the text.
        contexts_per_slot: Contexts kept per slot (the heaviest; ties: the earlier token).
        top_tokens: Promoted tokens shown per slot.
        window: Tokens shown on each side of a context's token (the page can change it).
        max_projected_slots: Project only the values of this many most-used slots (default: every slot).
        chunk_size: Slots per lazily loaded data file.
        progress: Show tqdm progress bars.

    Raises:
        MemoryExplorerError: The model has no memory; a requested layer has none; the texts are empty or shorter than
            one sequence; `max_seq_length` exceeds the model's positions; an option is out of range.
        OutputFolderError: `output_dir` may not be written (why: the message).
    """
    check_output_folder(output_dir, TOOL, overwrite=overwrite, reads={"the model's folder": model_folder(model)},
                        option="output_dir", overwrite_option="overwrite=True")  # fmt: skip
    for name, value, low in (("contexts_per_slot", contexts_per_slot, 1), ("top_tokens", top_tokens, 1),
                             ("window", window, 0), ("chunk_size", chunk_size, 1), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or value < low:
            raise MemoryExplorerError(f"{name}={value!r} must be an integer >= {low}")
    if max_projected_slots is not None and max_projected_slots < 0:
        raise MemoryExplorerError(f"max_projected_slots={max_projected_slots} must be >= 0 (or None: every slot)")
    memories = explored_memories(model, layers)
    max_seq_length = sequence_length_of(model, max_seq_length, MemoryExplorerError)
    if isinstance(texts, str):
        texts = [texts]
    if not texts or not any(text.strip() for text in texts):
        raise MemoryExplorerError("the texts are empty: give text files, a dataset or leave them out for the default")
    max_sequences = None
    if max_tokens is not None:
        if max_tokens < max_seq_length:
            raise MemoryExplorerError(f"max_tokens={max_tokens} is less than one sequence of {max_seq_length} tokens")
        max_sequences = max_tokens // max_seq_length
    try:
        sequences = text_sequences(tokenizer, texts, max_seq_length, max_sequences)
    except MemoryReportError as error:  # the report's wording names its --validation_file
        raise MemoryExplorerError(str(error).replace("the validation text", "the text")) from None

    tracker, selections, ngram_recorder = _run(model, tokenizer, sequences, memories, contexts_per_slot, batch_size,
                                               progress)
    token_ids = [i for sequence in sequences for i in sequence["input_ids"]]
    summary = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "title": title or "Memory explorer",
        "tokens": len(token_ids),
        "sequences": len(sequences),
        "sequence_length": max_seq_length,
        "contexts_per_slot": contexts_per_slot,
        "top_tokens": top_tokens,
        "window": window,
        "chunk_size": chunk_size,
        "layers": [],
    }
    output_dir = Path(output_dir).absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output_dir)
    try:
        _write_data(staging, "tokens", {"tokens": tokenizer.convert_ids_to_tokens(token_ids)})
        for name, memory in memories.items():
            if is_ngram_memory(memory):
                layer = _write_ngram_layer(staging, model, tokenizer, name, memory, ngram_recorder, token_ids, summary,
                                           max_projected_slots, progress)
            else:
                layer = _write_layer(staging, model, tokenizer, name, memory, tracker, selections[name], summary,
                                     max_projected_slots, progress)
            summary["layers"].append(layer)
        _write_data(staging, "explorer", summary)
        (staging / SUMMARY_NAME).write_text(json.dumps(summary), encoding="utf-8")
        _write_page(staging, summary["title"])
        mark_output_folder(staging, TOOL)
        replace_folder(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def explored_memories(model: nn.Module, layers: Sequence[int | str] | None = None) -> dict[str, nn.Module]:
    """`{name: memory}` of the memories to explore: product key memories named as the memory report names them
    (`layer_4`), hashed n-gram memories `layer_1_ngram`. `layers`: encoder layer indices (every memory of the layer)
    or names."""
    try:
        found = dict(MemoryUsageTracker(model).memories)
        found.update({f"{readable_name(path)}_ngram": module for path, module in ngram_memory_modules(model).items()})
    except ValueError as error:  # a config asking for memories that are not there
        raise MemoryExplorerError(str(error)) from None
    if not found:
        raise MemoryExplorerError(
            f"the model ({type(model).__name__}) has no memory layer (product key or hashed n-gram): nothing to explore "
            "(a plain BERT, or a BertPkm config with pkm_layers=[] and ngram_layers=[])"
        )
    order = {id(module): i for i, module in enumerate(model.modules())}
    found = dict(sorted(found.items(), key=lambda item: order[id(item[1])]))  # model order: layer_1_ngram, layer_2
    if layers is None:
        return found
    chosen = {}
    for layer in layers:
        if isinstance(layer, int) or str(layer).isdigit():
            names = [name for name in found if name in (f"layer_{layer}", f"layer_{layer}_ngram")]
        else:
            names = [str(layer)] if str(layer) in found else []
        if not names:
            indices = sorted({int(n.split("_")[1]) for n in found if n.split("_")[1:2] and n.split("_")[1].isdigit()})
            raise MemoryExplorerError(
                f"layer {layer!r} has no memory: the model's memory layers are {', '.join(found)} "
                f"(--layers {' '.join(map(str, indices))})"
            )
        chosen.update({name: found[name] for name in names})
    return chosen


# ---- running the model ----


class SlotSelections:
    """What one memory selected for each token, in token order: its top-1 slot (largest summed weight, as
    `MemoryUsageAccumulator` counts it) and each head's best slot, and per slot the heaviest `contexts_per_slot`
    (token position, weight `w(x)_i`, whether it was the token's top-1 pick).

    `normalized=False` (n-gram memories: every table's bucket is read, each of the `heads` tables with one weight,
    the position's gate): the weights count as given, and there is no top-1 pick."""

    def __init__(self, mem_size: int, heads: int, contexts_per_slot: int, normalized: bool = True):
        self.mem_size, self.heads, self.contexts_per_slot = mem_size, heads, contexts_per_slot
        self.normalized = normalized
        self.tokens = 0
        self.top1, self.top1_weight, self.head_top1, self.head_top1_weight = [], [], [], []
        self._candidates = []  # (slot, position, weight, top1) tensors, pruned to contexts_per_slot per slot
        self._candidate_count = 0

    @torch.no_grad()
    def update(self, indices: torch.Tensor, weights: torch.Tensor) -> None:
        """A forward's lookups: `indices`, `weights` of shape `(tokens, heads * knn)` (the value table's input)."""
        tokens = indices.shape[0]
        indices = indices.reshape(tokens, -1).to("cpu", torch.long)
        weights = weights.detach().reshape(tokens, -1).to("cpu", torch.float64)
        per_head = weights.view(tokens, self.heads, -1)
        best = per_head.argmax(-1, keepdim=True)
        self.head_top1.append(indices.view(tokens, self.heads, -1).gather(-1, best).squeeze(-1))
        self.head_top1_weight.append(per_head.gather(-1, best).squeeze(-1).float())
        if not self.normalized:
            self._add_candidates(indices, weights, torch.zeros_like(indices, dtype=torch.bool))
            return
        # w(x) as MemoryUsageAccumulator.update computes it: the same top-1 picks
        totals = weights.sum(1, keepdim=True)
        has_weight = totals.squeeze(1) > 0
        weights = weights / torch.where(has_weight[:, None], totals, 1.0)
        slots, slot_weights = merge_duplicate_slots(indices, weights)
        top1_column = slot_weights.argmax(1, keepdim=True)
        top1 = torch.where(has_weight, slots.gather(1, top1_column).squeeze(1), -1)
        self.top1.append(top1)
        self.top1_weight.append(slot_weights.gather(1, top1_column).squeeze(1).float())
        self._add_candidates(slots, slot_weights, slots == top1[:, None])

    def _add_candidates(self, slots, weights, top1):
        selected = weights > 0
        positions = (self.tokens + torch.arange(slots.shape[0]))[:, None].expand_as(slots)
        self._candidates.append((slots[selected], positions[selected], weights[selected], top1[selected]))
        self._candidate_count += int(selected.sum())
        if self._candidate_count > PRUNE_AT:
            self._prune()
        self.tokens += slots.shape[0]

    def _prune(self) -> None:
        slots, positions, weights, top1 = (torch.cat(parts) for parts in zip(*self._candidates))
        # heaviest first; a stable sort keeps earlier tokens first among equal weights, then group by slot
        order = weights.sort(descending=True, stable=True).indices
        order = order[slots[order].sort(stable=True).indices]
        slots, positions, weights, top1 = slots[order], positions[order], weights[order], top1[order]
        counts = torch.bincount(slots, minlength=self.mem_size)
        rank = torch.arange(slots.numel()) - (counts.cumsum(0) - counts)[slots]
        keep = rank < self.contexts_per_slot
        self._candidates = [(slots[keep], positions[keep], weights[keep], top1[keep])]
        self._candidate_count = int(keep.sum())

    def contexts(self) -> tuple[torch.Tensor, ...]:
        """(slot, position, weight, top1) of the kept contexts, grouped by slot, heaviest first within a slot."""
        if not self._candidates:
            empty = torch.zeros(0, dtype=torch.long)
            return empty, empty, empty.double(), empty.bool()
        self._prune()
        return self._candidates[0]

    def per_token(self) -> dict[str, torch.Tensor]:
        """`top1` (-1 for a token with no weight), `top1_weight` (both only when normalized), `head_top1` (heads,
        tokens), `head_top1_weight`."""
        found = {"head_top1": torch.cat(self.head_top1).T, "head_top1_weight": torch.cat(self.head_top1_weight).T}
        if self.normalized:
            found.update(top1=torch.cat(self.top1), top1_weight=torch.cat(self.top1_weight))
        return found


class SelectionRecorder:
    """Hooks the value lookups of `memories` (`{name: memory}`) into one `SlotSelections` each, as
    `MemoryUsageTracker` hooks them (a value table shared by several memories is told apart by the memory running)."""

    def __init__(self, memories: dict[str, nn.Module], contexts_per_slot: int):
        self.memories = memories
        self.layers = {
            name: SlotSelections(memory.mem_size, memory.heads, contexts_per_slot) for name, memory in memories.items()
        }
        self._running = None
        self._hooks = []

    def __enter__(self) -> "SelectionRecorder":
        tables = {}
        for name, memory in self.memories.items():
            self._hooks.append(memory.register_forward_pre_hook(lambda module, args, name=name: self._set(name)))
            self._hooks.append(memory.register_forward_hook(lambda module, args, output: self._set(None)))
            tables[id(memory.values)] = memory.values
        for values in tables.values():
            self._hooks.append(values.register_forward_hook(self._record, with_kwargs=True))
        return self

    def _set(self, name):
        self._running = name

    def _record(self, values, args, kwargs, output):
        if self._running is None:
            return  # a memory that is not explored reads a shared table
        weights = kwargs.get("per_sample_weights", args[2] if len(args) > 2 else None)
        if weights is None:
            raise MemoryExplorerError("the memory values were read without per_sample_weights: no weights to record")
        self.layers[self._running].update(args[0] if args else kwargs["input"], weights)

    def __exit__(self, *exc_info) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class NgramRecorder:
    """Hooks hashed n-gram memories (`{name: NgramMemory}`): per position the bucket (row of `tables`) each table read
    and the position's gate `g` (`NgramMemory.forward`: `sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(hidden_size))`, from
    its two norms' outputs), into one `SlotSelections(normalized=False)` each, and per bucket its reads and summed
    gate. The sequences have no padding (full sequences), so every position counts."""

    def __init__(self, memories: dict[str, nn.Module], contexts_per_slot: int):
        self.memories = memories
        self.layers = {
            name: SlotSelections(memory.tables.num_embeddings, memory.num_tables, contexts_per_slot, normalized=False)
            for name, memory in memories.items()
        }
        self.reads = {name: torch.zeros(memory.tables.num_embeddings, dtype=torch.long) for name, memory in memories.items()}
        self.gate_sums = {name: torch.zeros(memory.tables.num_embeddings, dtype=torch.float64) for name, memory in memories.items()}
        self._seen = {}
        self._hooks = []

    def __enter__(self) -> "NgramRecorder":
        for name, memory in self.memories.items():
            def keep(key, name=name):
                return lambda module, args, output: self._seen.__setitem__((name, key), (args, output))

            self._hooks += [
                memory.tables.register_forward_hook(keep("tables")),
                memory.hidden_norm.register_forward_hook(keep("hidden")),
                memory.key_norm.register_forward_hook(keep("key")),
                memory.register_forward_hook(lambda module, args, output, name=name: self._record(name, module, args)),
            ]
        return self

    def _record(self, name, memory, args):
        (indices,), _ = self._seen.pop((name, "tables"))
        _, hidden = self._seen.pop((name, "hidden"))
        _, key = self._seen.pop((name, "key"))
        gate = torch.sigmoid((hidden * key).sum(-1) / memory.hidden_size**0.5)  # (batch, seq), as forward computes it
        length = gate.shape[1]
        # (batch, positions, num_tables); packed serving tables are read with the indices flattened
        indices = indices.reshape(gate.shape[0], -1, memory.num_tables)
        indices = indices[:, memory.conv_left : memory.conv_left + length].reshape(-1, memory.num_tables).cpu()
        gate = gate.reshape(-1, 1).expand(-1, memory.num_tables).double().cpu()
        self.layers[name].update(indices, gate)
        self.reads[name].index_add_(0, indices.flatten(), torch.ones_like(indices.flatten()))
        self.gate_sums[name].index_add_(0, indices.flatten(), gate.flatten())

    def __exit__(self, *exc_info) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


@torch.no_grad()
def _run(model, tokenizer, sequences, memories, contexts_per_slot, batch_size, progress):
    """The model (eval mode) over `sequences` with the usage tracker and the selection recorders attached; returns
    (tracker, {name: SlotSelections}, NgramRecorder)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    product_key = {name: memory for name, memory in memories.items() if not is_ngram_memory(memory)}
    ngram = {name: memory for name, memory in memories.items() if is_ngram_memory(memory)}
    tracker = MemoryUsageTracker(model)
    recorder, ngram_recorder = SelectionRecorder(product_key, contexts_per_slot), NgramRecorder(ngram, contexts_per_slot)
    bar = _progress(progress, total=len(sequences) * len(sequences[0]["input_ids"]), desc="running the model",
                    unit="token")
    try:
        with tracker, recorder, ngram_recorder:
            for batch, _ in model_batches(tokenizer, sequences, batch_size, device):
                model(**batch)
                bar.update(batch["input_ids"].numel())
    finally:
        bar.close()
        model.train(was_training)
    tokens = sum(len(s["input_ids"]) for s in sequences)
    selections = {**recorder.layers, **ngram_recorder.layers}
    for name, recorded in selections.items():
        if recorded.tokens != tokens:  # every token (no padding: full sequences) is looked up once, in order
            raise MemoryExplorerError(f"{name}: {recorded.tokens} lookups recorded for {tokens} tokens")
    return tracker, selections, ngram_recorder


def _progress(enabled: bool, **kwargs):
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(**kwargs)

    class Silent:
        def update(self, n=1):
            pass

        def close(self):
            pass

    return Silent()


# ---- the value projection ----


def value_projection_embeddings(model: nn.Module) -> tuple[torch.Tensor, str]:
    """`E` `(vocab, hidden)`: the output embedding, or the word embeddings of a model without an LM head; and which."""
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is not None:
        return embeddings.weight, "output embedding (the LM head's decoder)"
    return model.get_input_embeddings().weight, "word embeddings (the model has no LM head; BERT ties them)"


def value_projection(model: nn.Module, memory: nn.Module) -> tuple[torch.Tensor, nn.Module | None, dict]:
    """`(E, norm, description)`: the output embedding `(vocab, hidden)`, the LayerNorm closing the memory's layer (None
    where there is none) and a description of the projection (the module docstring's formula), for the page."""
    embeddings, source = value_projection_embeddings(model)
    path = next(path for path, module in model.named_modules() if module is memory)
    layer = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else None
    norm = getattr(getattr(layer, "output", None), "LayerNorm", None)
    scale = getattr(memory, "memory_scale", None)
    description = {
        "formula": "E @ (gamma * (s * v - mean(s * v)))",
        "E": source,
        "gamma": f"{path.rsplit('.', 1)[0]}.output.LayerNorm.weight" if norm is not None else None,
        "s": "memory_scale" if scale is not None else 1,
        "exact": getattr(memory, "output_gate", "none") == "none",
        "note": "biases, the MLM head's transform and the later layers left out; see analysis/explorer.py",
    }
    if description["gamma"] is None:
        description["formula"] = "E @ (s * v)"
        description["note"] = "no LayerNorm after the memory found: the value row through E alone"
    if not description["exact"]:
        description["note"] += "; the swilu output gate depends on the input: the row as stored is projected"
    return embeddings, norm, description


@torch.no_grad()
def project_values(model: nn.Module, memory: nn.Module, slots: torch.Tensor) -> torch.Tensor:
    """The vocabulary logits `(len(slots), vocab)` of the value rows `slots` of `memory` (the module docstring)."""
    embeddings, norm, _ = value_projection(model, memory)
    values = memory.values
    rows = values.dequantize()[slots] if hasattr(values, "dequantize") else values.weight[slots]
    rows = rows.float()
    if getattr(memory, "memory_scale", None) is not None:
        rows = rows * memory.memory_scale.float()
    if norm is not None:
        rows = (rows - rows.mean(-1, keepdim=True)) * norm.weight.float()
    return rows.to(embeddings.device) @ embeddings.float().T


# ---- files ----


def _write_data(folder: Path, name: str, payload) -> None:
    path = folder / DATA_FOLDER / f"{name}.js"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        # json.dumps, not json.dump: dump encodes in Python, dumps in C (5x faster on the chunk files)
        handle.write(f"{DATA_CALLBACK}({json.dumps(name)},{json.dumps(payload, separators=(',', ':'))});\n")


def read_explorer_data(output_dir: str, name: str = "explorer"):
    """The JSON of `output_dir/data/<name>.js` (e.g. `"tokens"`, `"layer_4/selections"`, `"layer_4/slots_00000"`)."""
    text = (Path(output_dir) / DATA_FOLDER / f"{name}.js").read_text(encoding="utf-8")
    prefix = f"{DATA_CALLBACK}({json.dumps(name)},"
    if not text.startswith(prefix) or not text.rstrip().endswith(");"):
        raise MemoryExplorerError(f"{name}.js in {output_dir} is not a memory explorer data file")
    return json.loads(text[len(prefix) : text.rstrip().rindex(")")])


def _ranked_slots(counts: dict[str, torch.Tensor], used: torch.Tensor) -> dict[str, list]:
    """The slots with `used > 0`, by the columns of `counts` in order (descending; ties: the next column, then the
    slot number), with those columns' values."""
    slots = used.cpu().nonzero().squeeze(1)
    for values in reversed(list(counts.values())):  # stable sorts, the last key first
        slots = slots[values.cpu()[slots].sort(descending=True, stable=True).indices]
    return {"slot": slots.tolist(), **{key: values.cpu()[slots].tolist() for key, values in counts.items()}}


def _usage_curve(counts: dict[str, torch.Tensor]) -> dict[str, list]:
    """The report's sorted usage curve (share of lookups held by the most-used share of slots), at most
    `CURVE_POINTS + 1` points."""
    size = next(iter(counts.values())).numel()
    points = torch.linspace(0, size, min(size, CURVE_POINTS) + 1).round().long()
    curve = {"x": (points.double() / size).tolist()}
    for key, values in counts.items():
        held = torch.cat([torch.zeros(1, dtype=torch.float64), values.cpu().double().sort(descending=True).values.cumsum(0)])
        curve[key] = (held[points] / held[-1].clamp_min(1e-300)).tolist()
    return curve


def _projected(size: int, ranked: dict, max_projected_slots: int | None, only_used: bool = False) -> torch.Tensor:
    """The slots whose values are projected: every slot (every used one), or the most used (ranked order, then the
    unused by number)."""
    used = torch.tensor(ranked["slot"], dtype=torch.long)
    if max_projected_slots is None or max_projected_slots >= size:
        return used.sort().values if only_used else torch.arange(size)
    mask = torch.ones(size, dtype=torch.bool)
    mask[used] = False
    candidates = used if only_used else torch.cat([used, mask.nonzero().squeeze(1)])
    return candidates[:max_projected_slots].sort().values


def _write_selections(folder, name, selections):
    per_token = selections.per_token()
    data = {key: values.tolist() for key, values in per_token.items() if not key.endswith("weight")}
    data.update({key: [[round(w, 4) for w in row] for row in values.tolist()] if values.dim() > 1 else
                 [round(w, 4) for w in values.tolist()] for key, values in per_token.items() if key.endswith("weight")})
    _write_data(folder, f"{name}/selections", data)


def _write_chunks(folder, name, size, summary, tokenizer, model, selections, projected, project, spans=None,
                  collisions=None, progress=False) -> list[int]:
    """The `slots_<k>.js` files of one layer: per slot of each chunk its kept contexts (`[position, weight, top1]`,
    and for hashed memories the span `spans(slots, positions)` of the n-gram), its promoted tokens (the top of
    `project(slots)`'s logits) and, for hashed memories, `collisions[chunk]`; returns the chunk numbers written (chunks
    with nothing are left out)."""
    chunk_size, top_tokens = summary["chunk_size"], min(summary["top_tokens"], _vocab_size(model))
    context_slots, positions, weights, top1 = selections.contexts()
    context_counts = torch.bincount(context_slots, minlength=size)
    context_starts = context_counts.cumsum(0) - context_counts
    chunks = []
    bar = _progress(progress, total=size, desc=f"{name}: contexts and values", unit="row")
    for first in range(0, size, chunk_size):
        last = min(first + chunk_size, size)
        start, stop = int(context_starts[first]), int(context_starts[last - 1] + context_counts[last - 1])
        contexts = {}
        columns = [positions[start:stop].tolist(), [float(f"{w:.6g}") for w in weights[start:stop].tolist()],
                   top1[start:stop].int().tolist()]  # fmt: skip
        if spans is not None:
            columns += [span.tolist() for span in spans(context_slots[start:stop], positions[start:stop])]
        for slot, *entry in zip(context_slots[start:stop].tolist(), *columns):
            contexts.setdefault(str(slot), []).append(entry)
        promoted = {}
        here = projected[(projected >= first) & (projected < last)]
        for block in here.split(PROJECTION_BLOCK):
            logits, ids = project(block).topk(top_tokens, dim=-1)
            for slot, row_ids, row_logits in zip(block.tolist(), ids.tolist(), logits.tolist()):
                tokens = tokenizer.convert_ids_to_tokens(row_ids)
                promoted[str(slot)] = [[token, round(logit, 4)] for token, logit in zip(tokens, row_logits)]
        data = {"first": first, "contexts": contexts, "promoted": promoted}
        if collisions is not None:
            data["collisions"] = collisions.get(first // chunk_size, {})
        if contexts or promoted:
            _write_data(folder, f"{name}/slots_{first // chunk_size:05d}", data)
            chunks.append(first // chunk_size)
        bar.update(last - first)
    bar.close()
    return chunks


def _write_layer(folder, model, tokenizer, name, memory, tracker, selections, summary, max_projected_slots, progress):
    """A product key memory's data files; returns its entry in the summary."""
    accumulator = tracker.accumulators[name]
    size = accumulator.mem_size
    counts = {"top1": accumulator.top1_counts, "weight": accumulator.weight_sums, "used": accumulator.used_counts}
    ranked = _ranked_slots(counts, accumulator.used_counts)
    _write_selections(folder, name, selections)
    projected = _projected(size, ranked, max_projected_slots)
    chunks = _write_chunks(
        folder, name, size, summary, tokenizer, model, selections, projected,
        project=lambda slots: project_values(model, memory, slots), progress=progress,
    )  # fmt: skip
    return {
        "name": name,
        "kind": "product_key",
        "unit": "slot",
        "path": _path_of(model, memory),
        "size": size,
        "n_keys": getattr(memory, "n_keys", None) or math.isqrt(size),
        "heads": getattr(memory, "heads", None),
        "knn": getattr(memory, "knn", None),
        "columns": [["top1", "top-1 picks"], ["weight", "summed weight"], ["used", "selected"]],
        "metrics": accumulator.compute(),
        "never_picked": int((accumulator.top1_counts == 0).sum()),
        "never_selected": int((accumulator.used_counts == 0).sum()),
        "ranked": ranked,
        "curve": _usage_curve(counts),
        "chunks": chunks,
        "projected_slots": int(projected.numel()),
        "projection": value_projection(model, memory)[2],
    }


def _path_of(model, memory) -> str:
    return next(path for path, module in model.named_modules() if module is memory)


# ---- hashed n-gram memories ----


def ngram_tables(memory: nn.Module) -> list[dict]:
    """Per table of an n-gram memory (in row order): its n-gram order, which side of the position (`ending` at it or
    `starting` at it), its hash head, its first row and its size (a prime)."""
    return [
        {"order": order, "side": "ending" if direction < 0 else "starting", "hash": head,
         "offset": memory.offsets[index * memory.heads + head], "size": memory.primes[index * memory.heads + head]}
        for index, (order, direction) in enumerate(memory.kinds) for head in range(memory.heads)
    ]  # fmt: skip


def ngram_spans(memory: nn.Module, positions: torch.Tensor, table: torch.Tensor, sequence_length: int):
    """`(first, last)` token positions (inclusive) of the n-gram that table `table` hashes at each of `positions`,
    cut at the sequence's edges (beyond them the memory hashes a boundary id)."""
    orders = torch.tensor([order for order, _ in memory.kinds]).repeat_interleave(memory.heads)[table]
    ending = torch.tensor([direction < 0 for _, direction in memory.kinds]).repeat_interleave(memory.heads)[table]
    first = torch.where(ending, positions - orders + 1, positions)
    last = torch.where(ending, positions, positions + orders - 1)
    start = positions - positions % sequence_length
    return first.clamp(min=start), last.clamp(max=start + sequence_length - 1)


@torch.no_grad()
def project_ngram_buckets(model: nn.Module, memory: nn.Module, buckets: torch.Tensor) -> torch.Tensor:
    """The vocabulary logits `(len(buckets), vocab)` of n-gram memory buckets (rows of `memory.tables`): the row
    through its table's columns of the value projection, `d = W_v[:, table] @ row` (the part of `v = W_v x` that the
    row gives; the convolution's part depends on the neighbours and starts at zero), then as a product key value:
    `E @ (gamma * (d - mean(d)))` with the gain of the LayerNorm that closes the attention block the memory adds to
    (`attention.output.LayerNorm`), the gate (a positive factor per position) and the biases left out."""
    embeddings, norm, _ = ngram_projection(model, memory)
    offsets = torch.tensor(memory.offsets)
    tables = torch.searchsorted(offsets, buckets, right=True) - 1
    if memory.tables.weight.is_floating_point():
        rows = memory.tables.weight[buckets].float()  # (buckets, dim)
    else:  # packed serving rows (pkm_values_quantization), dequantised
        rows = memory.tables(buckets.to(memory.tables.weight.device)[:, None]).float()
    columns = memory.value.weight.float().view(memory.hidden_size, memory.num_tables, memory.dim)[:, tables]
    directions = torch.einsum("htd,td->th", columns, rows)
    if norm is not None:
        directions = (directions - directions.mean(-1, keepdim=True)) * norm.weight.float()
    return directions.to(embeddings.device) @ embeddings.float().T


def ngram_projection(model: nn.Module, memory: nn.Module) -> tuple[torch.Tensor, nn.Module | None, dict]:
    """`(E, norm, description)` of `project_ngram_buckets`."""
    embeddings, source = value_projection_embeddings(model)
    path = _path_of(model, memory)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    layer = model.get_submodule(parent) if parent else None
    norm = getattr(getattr(getattr(layer, "attention", None), "output", None), "LayerNorm", None)
    description = {
        "formula": "E @ (gamma * (d - mean(d))), d = W_v[:, table] @ row",
        "E": source,
        "gamma": f"{parent}.attention.output.LayerNorm.weight" if norm is not None else None,
        "s": 1,
        "exact": False,
        "note": "the gate (per position), the convolution's part and the biases left out; see analysis/explorer.py",
    }
    if norm is None:
        description["formula"] = "E @ d, d = W_v[:, table] @ row"
    return embeddings, norm, description


def _ngram_collisions(memory, token_ids, buckets_per_token, sequence_length, tokenizer, limit, chunk_size):
    """`{chunk: {bucket: {"ngrams": [[n-gram, count], ...], "distinct": count}}}`: per bucket read, the distinct n-grams
    (as the memory hashes them: canonical ids, the boundary beyond a sequence's edge) that landed in it with their
    counts, most frequent first (at most `limit`), and how many distinct n-grams there were."""
    ids = torch.tensor(token_ids)
    if getattr(memory, "token_map", None) is not None:
        ids = memory.token_map.cpu()[ids]
    positions = torch.arange(len(token_ids))
    width = max(memory.orders)
    rows = []
    for table in range(memory.num_tables):
        order, direction = memory.kinds[table // memory.heads]
        first = positions - order + 1 if direction < 0 else positions
        gram = torch.full((len(token_ids), width), -2)  # -2: beyond the order, -1: the boundary
        for j in range(order):
            at = first + j
            inside = (at // sequence_length == positions // sequence_length) & (at >= 0) & (at < len(token_ids))
            gram[:, j] = torch.where(inside, ids[at.clamp(0, len(token_ids) - 1)], -1)
        rows.append(torch.cat([buckets_per_token[:, table : table + 1], gram], dim=1))
    unique, counts = torch.unique(torch.cat(rows), dim=0, return_counts=True)  # sorted by bucket
    collisions = {}
    for row, count in zip(unique.tolist(), counts.tolist()):
        collisions.setdefault(row[0], []).append((count, row[1:]))
    names = {}

    def text(gram):
        parts = []
        for token in gram:
            if token == -1:
                parts.append("\u2205")  # the boundary id: an edge of the sequence
            elif token >= 0:
                if token not in names:
                    names[token] = tokenizer.convert_ids_to_tokens(token)
                parts.append(names[token])
        return " ".join(parts).replace(" ##", "")  # wordpieces joined, as the page shows text

    chunks = {}
    for bucket, grams in collisions.items():
        top = sorted(grams, key=lambda g: (-g[0], g[1]))[:limit]
        chunks.setdefault(bucket // chunk_size, {})[str(bucket)] = {
            "ngrams": [[text(gram), count] for count, gram in top], "distinct": len(grams)
        }
    return chunks


def _write_ngram_layer(folder, model, tokenizer, name, memory, recorder, token_ids, summary, max_projected_slots,
                       progress):
    """A hashed n-gram memory's data files (per bucket: reads, summed gate, contexts with the n-gram's span,
    collisions, promoted tokens); returns its entry in the summary."""
    selections = recorder.layers[name]
    reads, gates = recorder.reads[name], recorder.gate_sums[name]
    size = reads.numel()
    counts = {"used": reads, "weight": gates}
    ranked = _ranked_slots(counts, reads)
    _write_selections(folder, name, selections)
    # the usage metrics of memory_usage over the reads (a bucket read once per position and table, unit weights)
    accumulator = MemoryUsageAccumulator(size)
    per_token = selections.per_token()["head_top1"].T  # (tokens, tables): the bucket of each table
    accumulator.update(per_token, torch.ones_like(per_token, dtype=torch.float64))
    computed = accumulator.compute()
    metrics = {key: computed[key] for key in ("tokens", "mu", "kl_u", "gini_u", "top50_u", "top90_u", "top99_u")}
    collisions = _ngram_collisions(memory, token_ids, per_token, summary["sequence_length"], tokenizer,
                                   limit=2 * summary["contexts_per_slot"], chunk_size=summary["chunk_size"])
    offsets = torch.tensor(memory.offsets)

    def spans(buckets, positions):
        tables = torch.searchsorted(offsets, buckets, right=True) - 1
        return ngram_spans(memory, positions, tables, summary["sequence_length"])

    projected = _projected(size, ranked, max_projected_slots, only_used=True)
    chunks = _write_chunks(
        folder, name, size, summary, tokenizer, model, selections, projected,
        project=lambda buckets: project_ngram_buckets(model, memory, buckets), spans=spans, collisions=collisions,
        progress=progress,
    )  # fmt: skip
    return {
        "name": name,
        "kind": "ngram",
        "unit": "bucket",
        "path": _path_of(model, memory),
        "size": size,
        "heads": memory.num_tables,
        "tables": ngram_tables(memory),
        "columns": [["used", "reads"], ["weight", "summed gate"]],
        "metrics": metrics,
        "never_picked": None,
        "never_selected": int((reads == 0).sum()),
        "ranked": ranked,
        "curve": _usage_curve(counts),
        "chunks": chunks,
        "projected_slots": int(projected.numel()),
        "projection": ngram_projection(model, memory)[2],
    }


def _vocab_size(model) -> int:
    return value_projection_embeddings(model)[0].shape[0]


def _write_page(folder: Path, title: str) -> None:
    """The page: `explorer_page/` (package data: plain HTML, CSS and JavaScript, no network), its title filled in.
    Its data comes from `data/*.js` files (`pkmExplorerData(name, json)`), loaded with script tags because browsers
    refuse `fetch()` of files opened from disk."""
    import html
    from importlib.resources import files

    page = files(__package__) / "explorer_page"
    for name in PAGE_FILES:
        text = (page / name).read_text(encoding="utf-8")
        if name == PAGE_NAME:
            text = text.replace("{{TITLE}}", html.escape(title))
        (folder / name).write_text(text, encoding="utf-8")


__all__ = [
    "MemoryExplorerError",
    "NgramRecorder",
    "SelectionRecorder",
    "SlotSelections",
    "build_memory_explorer",
    "explored_memories",
    "ngram_tables",
    "project_ngram_buckets",
    "project_values",
    "read_explorer_data",
    "value_projection",
]
