"""TRIME's training objective with in-batch memory (Zhong, Lei & Chen 2022, "Training Language Models with Memory
Augmentation"), for causal and masked language models.

The probability of the target `w` of a scored position `t` is

    p(w | t) = [exp(E_w . h_t + b_w) + sum_{j in M(t), y_j = w} exp(sim(h_t, h_j))]
               / [sum_v exp(E_v . h_t + b_v) + sum_{j in M(t)} exp(sim(h_t, h_j))]

where `h` is the representation fed to the output layer (its input), `E`, `b` the output layer's weight and bias,
`y_j` the target of position `j`, and `M(t)` the memory of `t`: other scored positions of the same batch. Every memory
entry counts in the normaliser, whatever its target; only those whose target is `w` add to its numerator.

`sim(q, k) = q . k / sqrt(d)`, a dot product scaled by the square root of the hidden size `d`, as in the authors'
code (princeton-nlp/TRIME, `fairseq/criterions/trime_loss.py`: `torch.mm(reps, reps.T) / math.sqrt(reps.shape[-1])`);
`scale=` overrides the factor.

Memories (`memory=`):
- `"local"` (TRIME_local): the earlier scored positions of the same sequence (row);
- `"long"` (TRIME_long): every earlier scored position of the batch in row-major order, i.e. the local memory plus
  all positions of the previous rows, which must then be consecutive segments of one text;
- `"batch"` (masked LM, training only): every other scored position of the batch (a position never counts itself),
  credited to its target. Those targets are the hidden tokens of the masked positions: fine as a training signal, but
  at test time they are exactly what the model must predict, so a perplexity with this memory reads the answers;
- `"context"` (masked LM at test time): every visible position of the batch (not scored, not padding), credited to
  its own input token, so no label is read (`input_ids=` and `attention_mask=` are then needed).

With an empty memory the loss is the cross-entropy, exactly. The memory terms are computed in chunks of queries
(a `chunk_size x keys` similarity block at a time): no `(tokens x tokens x vocab)` tensor is ever built.
"""

import contextlib
import math

import torch

from ...utils.input_errors import InputError
from ...utils.memories import unwrap_model


MEMORY_KINDS = ("local", "long", "batch", "context")


def causal_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The next-token target of every position of a causal LM: `labels` shifted left by one, the last position of each
    row ignored (what `ForCausalLMLoss` does inside the model)."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def _read_output_layer(output_layer):
    """(weight (vocab, d), bias (vocab,) or None) of an nn.Linear-like module or a (weight, bias) pair."""
    if isinstance(output_layer, (tuple, list)):
        weight, bias = output_layer
    else:
        weight, bias = getattr(output_layer, "weight", None), getattr(output_layer, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"TRIME needs the output layer's vocabulary projection (a weight of shape (vocab, hidden)); got "
            f"{type(output_layer).__name__} with weight {None if weight is None else tuple(weight.shape)}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        raise ValueError(f"output bias of shape {tuple(bias.shape)} does not match the weight {tuple(weight.shape)}")
    return weight, bias


def trime_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    output_layer=None,
    *,
    logits: torch.Tensor | None = None,
    memory: str = "local",
    scale: float | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    reduction: str = "mean",
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """TRIME's negative log-likelihood of `targets` (see the module docstring).

    Args:
        hidden: (batch, seq, d) the representation fed to the output layer (for BERT heads: after the transform).
        targets: (batch, seq) the target of each position (a causal LM: `causal_targets(labels)`), `ignore_index`
            where a position is not scored; unscored positions are never memory entries either.
        output_layer: the vocabulary projection, an nn.Linear-like module (`weight` (vocab, d), optional `bias`) or a
            `(weight, bias)` pair; not needed when `logits` are given.
        logits: (batch, seq, vocab) the output layer's logits `hidden @ weight.T + bias`, when already computed (the
            model's forward): they are reused instead of computed again.
        memory: "local", "long", "batch" or "context" (see the module docstring).
        scale: the factor of the similarity, default 1 / sqrt(d).
        chunk_size: queries per block of the memory computation.
        reduction: "mean" over scored positions, "sum", or "none" (a (batch, seq) tensor, 0 at unscored positions).
        input_ids, attention_mask: (batch, seq), for `memory="context"`: the token each visible position is credited
            to, and which positions are padding (never entries; default: none is).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; expected 'mean', 'sum' or 'none'")
    scored, log_p, _ = trime_log_probs(
        hidden, targets, output_layer, logits=logits, memory=memory, scale=scale, ignore_index=ignore_index,
        chunk_size=chunk_size, input_ids=input_ids, attention_mask=attention_mask,
    )
    return _reduce(log_p, scored, hidden, targets, reduction)


def _reduce(log_p, scored, hidden, targets, reduction):
    """-log_p reduced like cross_entropy: nll_loss's own kernel, in position order (an empty memory then gives
    F.cross_entropy bit for bit); "none": a (batch, seq) tensor with 0 at unscored positions."""
    if reduction == "none":
        per_position = log_p.new_zeros(targets.numel())
        return per_position.index_put((scored,), -log_p).view(targets.shape)
    if not scored.numel():  # no scored position: 0, still connected to `hidden` (a DDP backward all-reduces as usual)
        return hidden.sum().to(log_p.dtype) * 0.0
    return torch.nn.functional.nll_loss(log_p[:, None], scored.new_zeros(scored.numel()), reduction=reduction)


def trime_log_probs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    output_layer=None,
    *,
    logits: torch.Tensor | None = None,
    memory: str | None = "local",
    scale: float | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat indices of the scored positions, TRIME log p of their targets, log p of the vocabulary alone, i.e. the
    model's ordinary log-softmax), in row-major order. `memory=None` skips the memory (the first two are then equal).
    Arguments as `trime_loss`."""
    if memory is not None and memory not in MEMORY_KINDS:
        raise ValueError(f"memory={memory!r}; expected one of {MEMORY_KINDS}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be (batch, seq, d) and targets (batch, seq); got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if memory == "context" and (input_ids is None or input_ids.shape != targets.shape):
        raise ValueError(
            f"memory='context' needs the input_ids of shape {tuple(targets.shape)} (the token each visible position "
            f"is credited to); got {None if input_ids is None else tuple(input_ids.shape)}"
        )
    batch, length, d = hidden.shape
    if logits is None:
        if output_layer is None:
            raise ValueError("give the output layer (or its (weight, bias)) or the logits")
        weight, bias = _read_output_layer(output_layer)
        if weight.shape[1] != d:
            raise ValueError(f"output weight {tuple(weight.shape)} does not take hidden states of size {d}")
    elif logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # at least fp32 (bf16/fp16 activations are upcast)

    flat_targets = targets.reshape(-1)
    scored = (flat_targets != ignore_index).nonzero().squeeze(1)  # flat positions, increasing
    n = scored.numel()
    if not n:
        empty = hidden.new_zeros(0, dtype=dtype)
        return scored, empty, empty
    queries = hidden.reshape(-1, d)[scored]
    y = flat_targets[scored]
    if memory == "context":  # the entries: the visible positions, credited to their own input token
        visible = flat_targets == ignore_index
        if attention_mask is not None:
            visible &= attention_mask.reshape(-1) != 0
        visible = visible.nonzero().squeeze(1)
        keys, key_targets = hidden.reshape(-1, d)[visible] * scale, input_ids.reshape(-1)[visible]
    else:  # the entries: every scored position, in row-major order, credited to its target
        keys, key_targets = queries * scale, y
    rows = torch.div(scored, length, rounding_mode="floor")
    # for "local", the first key of each query's row (the keys of one row are contiguous)
    row_start = torch.searchsorted(rows, rows) if memory == "local" else None
    flat_logits = logits.reshape(-1, logits.shape[-1]) if logits is not None else None
    log_ps, log_p_vocabs = [], []
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        q = queries[start:stop]
        target = y[start:stop, None]
        if flat_logits is None:
            vocab_logits = q @ weight.T if bias is None else torch.addmm(bias, q, weight.T)
            target_logit = vocab_logits.gather(1, target).squeeze(1)
            # the vocabulary part as cross_entropy computes it (an empty memory then gives CE exactly)
            log_p_vocab = torch.log_softmax(vocab_logits.to(dtype), dim=-1).gather(1, target).squeeze(1)
        else:
            span_start, span_stop = int(scored[start]), int(scored[stop - 1]) + 1
            if span_stop - span_start <= 2 * (stop - start):
                # mostly scored rows (a causal LM): a view of the logits' span, no copy of (rows x vocab) floats
                rows_in_span = scored[start:stop] - span_start
                span_targets = flat_targets.new_zeros(span_stop - span_start, 1).index_put_((rows_in_span,), target)
                span = flat_logits[span_start:span_stop]
                target_logit = span.gather(1, span_targets).squeeze(1)[rows_in_span]
                log_p_vocab = torch.log_softmax(span.to(dtype), dim=-1).gather(1, span_targets).squeeze(1)
                log_p_vocab = log_p_vocab[rows_in_span]
            else:  # sparse rows (masked positions): copy just those
                vocab_logits = flat_logits[scored[start:stop]]
                target_logit = vocab_logits.gather(1, target).squeeze(1)
                log_p_vocab = torch.log_softmax(vocab_logits.to(dtype), dim=-1).gather(1, target).squeeze(1)
        log_p_vocabs.append(log_p_vocab)
        if memory is None:
            log_ps.append(log_p_vocab)
            continue

        # the keys any query of this chunk may see: a contiguous range of the entries
        first = 0 if memory != "local" else int(row_start[start])
        last = keys.shape[0] if memory in ("batch", "context") else stop
        index = torch.arange(start, stop, device=hidden.device)[:, None]
        key_index = torch.arange(first, last, device=hidden.device)[None, :]
        if memory == "context":  # entries and queries are disjoint positions
            allowed = torch.ones(stop - start, last - first, dtype=torch.bool, device=hidden.device)
        elif memory == "batch":
            allowed = key_index != index
        else:
            allowed = key_index < index
            if memory == "local":
                allowed &= rows[first:last][None, :] == rows[start:stop, None]
        if allowed.numel() == 0:
            log_ps.append(log_p_vocab)
            continue
        log_z_vocab = target_logit.to(dtype) - log_p_vocab
        sims = (q @ keys[first:last].T).to(dtype)
        log_z_memory = torch.logsumexp(sims.masked_fill(~allowed, -math.inf), dim=-1)
        positive = allowed & (key_targets[first:last][None, :] == target)
        log_positive = torch.logsumexp(sims.masked_fill(~positive, -math.inf), dim=-1)
        # log p = log(exp(x_y) + S_pos) - log(Z_vocab + S_memory), written relative to Z_vocab so that an empty
        # memory (S = 0, log S = -inf) leaves log_p_vocab untouched: logaddexp(a, -inf) == a, softplus(-inf) == 0
        log_ps.append(
            torch.logaddexp(log_p_vocab, log_positive - log_z_vocab)
            - torch.nn.functional.softplus(log_z_memory - log_z_vocab)
        )
    return scored, torch.cat(log_ps), torch.cat(log_p_vocabs)


# ---- models: the output layer and its input ----


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The model's vocabulary projection (`get_output_embeddings()`, e.g. `cls.predictions.decoder` of BERT heads, the
    `lm_head` of GPT-2), checked to be readable: a clear ValueError otherwise."""
    model = unwrap_model(model)
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    if layer is None:
        raise InputError(
            f"--trime: {type(model).__name__} has no output embeddings (get_output_embeddings() is None): TRIME needs "
            "the vocabulary projection of an LM head to score the vocabulary and the memory together"
        )
    _read_output_layer(layer)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is not None and layer.weight.shape[0] != vocab_size:
        raise InputError(
            f"--trime: the output layer of {type(model).__name__} has {layer.weight.shape[0]} rows, not the "
            f"vocabulary's {vocab_size}: it is not a vocabulary projection TRIME can read"
        )
    return layer


@contextlib.contextmanager
def capture_output_layer(model: torch.nn.Module):
    """Within the block, every forward of the model's output layer stores its input (`h`) and output (the logits
    before any post-processing) in the yielded dict under "hidden" and "logits"."""
    captured = {}

    def hook(module, inputs, output):
        captured["hidden"], captured["logits"] = inputs[0], output

    handle = output_layer(model).register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def check_logits_match(model_logits: torch.Tensor, captured: dict, model_name: str) -> None:
    """A clear error when the model post-processes its output layer's logits (soft-capping, scaling): TRIME's
    vocabulary scores would then not be the model's."""
    if captured.get("logits") is model_logits:
        return
    if captured.get("logits") is None or not torch.allclose(
        model_logits.float(), captured["logits"].float(), rtol=1e-4, atol=1e-4
    ):
        raise InputError(
            f"--trime: the logits of {model_name} are not its output layer's (the model transforms them after the "
            "vocabulary projection); TRIME needs a plain linear output layer"
        )


@torch.no_grad()
def check_trime_model(model: torch.nn.Module) -> None:
    """Before training: a clear ValueError when TRIME cannot read the model's output layer (none, not a vocabulary
    projection, or logits transformed after it), checked on one short forward in eval mode (no random draw)."""
    layer = output_layer(model)
    was_training = model.training
    model.eval()
    try:
        tokens = torch.arange(2, device=layer.weight.device)[None] % layer.weight.shape[0]
        with capture_output_layer(model) as captured:
            logits = model(input_ids=tokens).logits
        check_logits_match(logits, captured, type(unwrap_model(model)).__name__)
    finally:
        model.train(was_training)


def model_trime_losses(model, inputs: dict, targets: torch.Tensor, memory: str | None, reduction="mean", **kwargs):
    """One forward of `model` on `inputs` (no labels): (cross-entropy, TRIME loss with `memory`), both reduced
    (`reduction=`) over the scored positions of `targets`, which are aligned with the model's positions
    (`causal_targets(labels)` for a causal LM). The forward's logits are reused; the cross-entropy is the
    vocabulary part of the same computation (F.cross_entropy's value). `memory=None`: the TRIME loss is the CE."""
    with capture_output_layer(model) as captured:
        outputs = model(**inputs)
    check_logits_match(outputs.logits, captured, type(unwrap_model(model)).__name__)
    if memory == "context":  # the visible tokens the entries are credited to
        kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs.get("attention_mask"), **kwargs}
    scored, log_p, log_p_vocab = trime_log_probs(
        captured["hidden"], targets, logits=outputs.logits, memory=memory, **kwargs
    )
    ce = _reduce(log_p_vocab, scored, captured["hidden"], targets, reduction)
    return ce, (_reduce(log_p, scored, captured["hidden"], targets, reduction) if memory is not None else ce)


__all__ = [
    "MEMORY_KINDS",
    "capture_output_layer",
    "causal_targets",
    "check_logits_match",
    "check_trime_model",
    "model_trime_losses",
    "output_layer",
    "trime_log_probs",
    "trime_loss",
]
