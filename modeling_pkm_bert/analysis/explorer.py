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
from .memory_usage import MemoryUsageTracker, merge_duplicate_slots
from .report import MemoryReportError, model_batches, text_sequences


SUMMARY_NAME = "explorer.json"
PAGE_NAME = "index.html"
DATA_FOLDER = "data"
DATA_CALLBACK = "pkmExplorerData"
FORMAT = "modeling_pkm_bert.memory_explorer"
FORMAT_VERSION = 1
CURVE_POINTS = 200
# candidate contexts kept between prunings (per layer): bounds memory for any number of tokens
PRUNE_AT = 1 << 22
PROJECTION_BLOCK = 1024


class MemoryExplorerError(MemoryReportError):
    """Input the memory explorer cannot use: it names what is wrong."""


def build_memory_explorer(
    model: nn.Module,
    tokenizer,
    output_dir: str,
    texts: Sequence[str],
    *,
    layers: Sequence[int | str] | None = None,
    max_seq_length: int = 128,
    max_tokens: int | None = 100_000,
    contexts_per_slot: int = 10,
    top_tokens: int = 10,
    window: int = 12,
    max_projected_slots: int | None = None,
    chunk_size: int = 4096,
    batch_size: int = 8,
    title: str | None = None,
    progress: bool = False,
) -> dict:
    """Writes the memory explorer of `model` over `texts` into `output_dir` (replaced when complete); returns the
    summary (the content of `explorer.json`).

    Args:
        model: Any model holding product key memories (BertPkm or loaded with `trust_remote_code=True`).
        tokenizer: Its tokenizer.
        texts: The text to run: tokenized, concatenated and cut into sequences of `max_seq_length` tokens, as the
            memory report does (the same texts and lengths give the report's numbers).
        layers: The memory layers to explore, by encoder layer index (`4`) or name (`"layer_4"`); default all.
        max_tokens: Run at most this many tokens (whole sequences); None: all of the text.
        contexts_per_slot: Contexts kept per slot (the heaviest; ties: the earlier token).
        top_tokens: Promoted tokens shown per slot.
        window: Tokens shown on each side of a context's token (the page can change it).
        max_projected_slots: Project only the values of this many most-used slots (default: every slot).
        chunk_size: Slots per lazily loaded data file.
        progress: Show tqdm progress bars.

    Raises:
        MemoryExplorerError: The model has no memory; a requested layer has none; the texts are empty or shorter than
            one sequence; an option is out of range.
    """
    for name, value, low in (("contexts_per_slot", contexts_per_slot, 1), ("top_tokens", top_tokens, 1),
                             ("window", window, 0), ("chunk_size", chunk_size, 1), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or value < low:
            raise MemoryExplorerError(f"{name}={value!r} must be an integer >= {low}")
    if max_projected_slots is not None and max_projected_slots < 0:
        raise MemoryExplorerError(f"max_projected_slots={max_projected_slots} must be >= 0 (or None: every slot)")
    memories = explored_memories(model, layers)
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

    tracker, recorder = _run(model, tokenizer, sequences, memories, contexts_per_slot, batch_size, progress)
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
            summary["layers"].append(
                _write_layer(staging, model, tokenizer, name, memory, tracker, recorder.layers[name],
                             summary, max_projected_slots, progress)
            )
        _write_data(staging, "explorer", summary)
        with open(staging / SUMMARY_NAME, "w", encoding="utf-8") as handle:
            json.dump(summary, handle)
        (staging / PAGE_NAME).write_text(_page_html(summary["title"]), encoding="utf-8")
        replace_folder(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def explored_memories(model: nn.Module, layers: Sequence[int | str] | None = None) -> dict[str, nn.Module]:
    """`{name: memory}` of the memories to explore, named as the memory report names them (`layer_4`)."""
    try:
        found = MemoryUsageTracker(model).memories
    except ValueError as error:  # a config asking for memories that are not there
        raise MemoryExplorerError(str(error)) from None
    if not found:
        raise MemoryExplorerError(
            f"the model ({type(model).__name__}) has no product key memory layer: nothing to explore (a plain BERT, "
            "or a BertPkm config with pkm_layers=[])"
        )
    if layers is None:
        return found
    chosen = {}
    for layer in layers:
        name = f"layer_{layer}" if isinstance(layer, int) or str(layer).isdigit() else str(layer)
        if name not in found:
            available = ", ".join(found)
            raise MemoryExplorerError(
                f"layer {layer!r} has no memory: the model's memory layers are {available} "
                f"(--layers {' '.join(n.removeprefix('layer_') for n in found)})"
            )
        chosen[name] = found[name]
    return chosen


# ---- running the model ----


class SlotSelections:
    """What one memory selected for each token, in token order: its top-1 slot (largest summed weight, as
    `MemoryUsageAccumulator` counts it) and each head's best slot, and per slot the heaviest `contexts_per_slot`
    (token position, weight `w(x)_i`, whether it was the token's top-1 pick)."""

    def __init__(self, mem_size: int, heads: int, contexts_per_slot: int):
        self.mem_size, self.heads, self.contexts_per_slot = mem_size, heads, contexts_per_slot
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
        # w(x) as MemoryUsageAccumulator.update computes it: the same top-1 picks
        totals = weights.sum(1, keepdim=True)
        has_weight = totals.squeeze(1) > 0
        weights = weights / torch.where(has_weight[:, None], totals, 1.0)
        slots, slot_weights = merge_duplicate_slots(indices, weights)
        top1_column = slot_weights.argmax(1, keepdim=True)
        top1 = torch.where(has_weight, slots.gather(1, top1_column).squeeze(1), -1)
        self.top1.append(top1)
        self.top1_weight.append(slot_weights.gather(1, top1_column).squeeze(1).float())

        selected = slot_weights > 0
        positions = (self.tokens + torch.arange(tokens))[:, None].expand_as(slots)
        self._candidates.append(
            (slots[selected], positions[selected], slot_weights[selected], (slots == top1[:, None])[selected])
        )
        self._candidate_count += int(selected.sum())
        if self._candidate_count > PRUNE_AT:
            self._prune()
        self.tokens += tokens

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
        """`top1` (-1 for a token with no weight), `top1_weight`, `head_top1` (heads, tokens), `head_top1_weight`."""
        return {
            "top1": torch.cat(self.top1),
            "top1_weight": torch.cat(self.top1_weight),
            "head_top1": torch.cat(self.head_top1).T,
            "head_top1_weight": torch.cat(self.head_top1_weight).T,
        }


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


@torch.no_grad()
def _run(model, tokenizer, sequences, memories, contexts_per_slot, batch_size, progress):
    """The model (eval mode) over `sequences` with the usage tracker and the selection recorder attached."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tracker, recorder = MemoryUsageTracker(model), SelectionRecorder(memories, contexts_per_slot)
    bar = _progress(progress, total=len(sequences) * len(sequences[0]["input_ids"]), desc="running the model",
                    unit="token")
    try:
        with tracker, recorder:
            for batch, _ in model_batches(tokenizer, sequences, batch_size, device):
                model(**batch)
                bar.update(batch["input_ids"].numel())
    finally:
        bar.close()
        model.train(was_training)
    tokens = sum(len(s["input_ids"]) for s in sequences)
    for name, selections in recorder.layers.items():
        if selections.tokens != tokens:  # every token (no padding: full sequences) is looked up once, in order
            raise MemoryExplorerError(f"{name}: {selections.tokens} lookups recorded for {tokens} tokens")
    return tracker, recorder


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
        handle.write(f"{DATA_CALLBACK}({json.dumps(name)},")
        json.dump(payload, handle, separators=(",", ":"))
        handle.write(");\n")


def read_explorer_data(output_dir: str, name: str = "explorer"):
    """The JSON of `output_dir/data/<name>.js` (e.g. `"tokens"`, `"layer_4/selections"`, `"layer_4/slots_00000"`)."""
    text = (Path(output_dir) / DATA_FOLDER / f"{name}.js").read_text(encoding="utf-8")
    prefix = f"{DATA_CALLBACK}({json.dumps(name)},"
    if not text.startswith(prefix) or not text.rstrip().endswith(");"):
        raise MemoryExplorerError(f"{name}.js in {output_dir} is not a memory explorer data file")
    return json.loads(text[len(prefix) : text.rstrip().rindex(")")])


def _ranked_slots(accumulator) -> dict[str, list]:
    """The slots selected at least once, by top-1 picks, then summed weight (descending), then slot number."""
    used = accumulator.used_counts.cpu()
    top1, weight = accumulator.top1_counts.cpu(), accumulator.weight_sums.cpu()
    slots = used.nonzero().squeeze(1)
    slots = slots[weight[slots].sort(descending=True, stable=True).indices]
    slots = slots[top1[slots].sort(descending=True, stable=True).indices]
    return {
        "slot": slots.tolist(),
        "top1": top1[slots].tolist(),
        "weight": weight[slots].tolist(),
        "used": used[slots].tolist(),
    }


def _usage_curve(accumulator) -> dict[str, list]:
    """The report's sorted usage curve (share of lookups held by the most-used share of slots), at most
    `CURVE_POINTS + 1` points."""
    size = accumulator.mem_size
    points = torch.linspace(0, size, min(size, CURVE_POINTS) + 1).round().long()
    curve = {"x": (points.double() / size).tolist()}
    for key, counts in (("used", accumulator.used_counts), ("weight", accumulator.weight_sums),
                        ("top1", accumulator.top1_counts)):
        held = torch.cat([torch.zeros(1, dtype=torch.float64), counts.cpu().double().sort(descending=True).values.cumsum(0)])
        curve[key] = (held[points] / held[-1].clamp_min(1e-300)).tolist()
    return curve


def _write_layer(folder, model, tokenizer, name, memory, tracker, selections, summary, max_projected_slots, progress):
    accumulator = tracker.accumulators[name]
    metrics = accumulator.compute()
    size, chunk_size = accumulator.mem_size, summary["chunk_size"]
    ranked = _ranked_slots(accumulator)
    _, _, projection = value_projection(model, memory)

    per_token = selections.per_token()
    _write_data(folder, f"{name}/selections", {
        "top1": per_token["top1"].tolist(),
        "top1_weight": [round(w, 4) for w in per_token["top1_weight"].tolist()],
        "head_top1": per_token["head_top1"].tolist(),
        "head_top1_weight": [[round(w, 4) for w in head] for head in per_token["head_top1_weight"].tolist()],
    })

    # the slots whose values are projected: every slot, or the most used (ranked order, then the unused by number)
    if max_projected_slots is None or max_projected_slots >= size:
        projected = torch.arange(size)
    else:
        unused = (accumulator.used_counts.cpu() == 0).nonzero().squeeze(1)
        projected = torch.cat([torch.tensor(ranked["slot"], dtype=torch.long), unused])[:max_projected_slots].sort().values
    context_slots, positions, weights, top1 = selections.contexts()
    context_counts = torch.bincount(context_slots, minlength=size)
    context_starts = context_counts.cumsum(0) - context_counts
    chunks = []
    bar = _progress(progress, total=size, desc=f"{name}: contexts and values", unit="slot")
    for first in range(0, size, chunk_size):
        last = min(first + chunk_size, size)
        start, stop = int(context_starts[first]), int(context_starts[last - 1] + context_counts[last - 1])
        contexts = {}
        for slot, position, weight, is_top1 in zip(context_slots[start:stop].tolist(), positions[start:stop].tolist(),
                                                   weights[start:stop].tolist(), top1[start:stop].tolist()):
            contexts.setdefault(str(slot), []).append([position, float(f"{weight:.6g}"), int(is_top1)])
        promoted = {}
        here = projected[(projected >= first) & (projected < last)]
        for block in here.split(PROJECTION_BLOCK):  # (block, vocab) logits at a time: 125 MB for BERT's vocabulary
            logits, ids = project_values(model, memory, block).topk(min(summary["top_tokens"], _vocab_size(model)), dim=-1)
            for slot, row_ids, row_logits in zip(block.tolist(), ids.tolist(), logits.tolist()):
                tokens = tokenizer.convert_ids_to_tokens(row_ids)
                promoted[str(slot)] = [[token, round(logit, 4)] for token, logit in zip(tokens, row_logits)]
        if contexts or promoted:
            chunk = f"{name}/slots_{first // chunk_size:05d}"
            _write_data(folder, chunk, {"first": first, "contexts": contexts, "promoted": promoted})
            chunks.append(first // chunk_size)
        bar.update(last - first)
    bar.close()

    n_keys = getattr(memory, "n_keys", None) or math.isqrt(size)
    return {
        "name": name,
        "kind": "product_key",
        "unit": "slot",
        "path": next(path for path, module in model.named_modules() if module is memory),
        "size": size,
        "n_keys": n_keys,
        "heads": getattr(memory, "heads", None),
        "knn": getattr(memory, "knn", None),
        "metrics": metrics,
        "never_picked": int((accumulator.top1_counts == 0).sum()),
        "never_selected": int((accumulator.used_counts == 0).sum()),
        "ranked": ranked,
        "curve": _usage_curve(accumulator),
        "chunks": chunks,
        "projected_slots": int(projected.numel()),
        "projection": projection,
    }


def _vocab_size(model) -> int:
    return value_projection_embeddings(model)[0].shape[0]


def _page_html(title: str) -> str:
    import html

    from .explorer_page import PAGE

    return PAGE.replace("{{TITLE}}", html.escape(title))


__all__ = [
    "MemoryExplorerError",
    "SelectionRecorder",
    "SlotSelections",
    "build_memory_explorer",
    "explored_memories",
    "project_values",
    "read_explorer_data",
    "value_projection",
]
