"""What run_mlm.py masks: random tokens (BERT), whole words, and given character spans (salient-span masking, REALM:
the standard way to teach a masked LM facts, e.g. the value of "Ada was born in [MASK]" in every exposure).

One rule covers the three. Every token carries a *unit code*: 1 starts a unit of random masking (a token, or with
whole-word masking a word), 2 starts a given span, 0 continues the unit before it. Each unit start is drawn once,
a random unit with `mlm_probability` and a span with `span_mask_probability`; a drawn unit masks all its tokens.
Special tokens and padding are never drawn. The drawn tokens become [MASK], a random token or stay, with
`mask_replace_prob` / `random_replace_prob` (BERT's 80% / 10% / 10% by default).

With every token a unit of its own (no spans, no whole words) the draws are exactly those of transformers'
`DataCollatorForLanguageModeling.torch_mask_tokens`: the same seed masks the same positions with the same tokens.

Data with spans: a JSON-lines file whose rows hold the text and its spans as [start, end) character offsets,
`{"text": "Ada was born in Paris.", "spans": [[16, 21]]}` (`--span_column spans`)."""

from collections.abc import Sequence

import torch

from ..utils.input_errors import InputError


CONTINUE, UNIT, SPAN = 0, 1, 2  # the unit codes


def unit_codes(
    offsets: Sequence[tuple[int, int]],
    word_ids: Sequence[int | None] | None = None,
    spans: Sequence[Sequence[int]] = (),
) -> list[int]:
    """The unit code of every token of one tokenized text, from its character `offsets` (a fast tokenizer's
    `offset_mapping`), its `word_ids` (whole-word masking; None: every token its own unit) and the text's `spans`
    ([start, end) character offsets). A token belongs to a span when its characters overlap it; a special token
    ((0, 0) offsets or no word id) starts a unit of its own."""
    span_of = []  # the index of the span each token overlaps, or -1
    for start, end in offsets:
        hit = -1
        if end > start:
            for index, (span_start, span_end) in enumerate(spans):
                if start < span_end and end > span_start:
                    hit = index
                    break
        span_of.append(hit)
    codes = []
    for i, ((start, end), span) in enumerate(zip(offsets, span_of)):
        if span >= 0:
            codes.append(SPAN if i == 0 or span_of[i - 1] != span else CONTINUE)
        elif word_ids is None or word_ids[i] is None or end <= start or i == 0:
            codes.append(UNIT)
        else:
            same_word = word_ids[i] == word_ids[i - 1] and span_of[i - 1] < 0
            codes.append(CONTINUE if same_word else UNIT)
    return codes


def check_spans(spans, text: str, where: str) -> list[tuple[int, int]]:
    """A row's spans as (start, end) pairs, or an InputError naming `where` and the problem."""
    if spans is None:
        return []
    if not isinstance(spans, (list, tuple)):
        raise InputError(f"{where}: spans must be a list of [start, end] character offsets, got {spans!r}")
    pairs = []
    for span in spans:
        if (
            not isinstance(span, (list, tuple))
            or len(span) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in span)
        ):
            raise InputError(f"{where}: a span must be [start, end] (two integers), got {span!r}")
        start, end = span
        if not 0 <= start < end <= len(text):
            raise InputError(f"{where}: span {list(span)} is not within the text's {len(text)} characters")
        pairs.append((start, end))
    return pairs


def cut_unit_codes(codes: list[int], block_size: int) -> list[list[int]]:
    """Concatenated unit codes cut into blocks of `block_size` (the remainder dropped, as `group_texts` does): a
    block that begins inside a unit begins it anew, with the code of the unit it cuts."""
    blocks, unit = [], UNIT
    for begin in range(0, len(codes) - block_size + 1, block_size):
        block = codes[begin : begin + block_size]
        if block[0] == CONTINUE:
            block = [unit, *block[1:]]
        unit = next((code for code in reversed(block) if code != CONTINUE), unit)
        blocks.append(block)
    return blocks


def mask_tokens(
    input_ids: torch.Tensor,
    special_tokens_mask: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    generator: torch.Generator,
    mlm_probability: float = 0.15,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
    units: torch.Tensor | None = None,
    span_mask_probability: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input_ids, labels with -100 at every unmasked position) of a batch (batch, seq), drawn from
    `generator`; `units` (batch, seq) holds the unit codes (None: every token a unit of random masking)."""
    input_ids, labels = input_ids.clone(), input_ids.clone()
    never = special_tokens_mask.bool()
    if units is None:
        units = torch.full_like(input_ids, UNIT)
    units = units.to(input_ids.device)
    starts = (units != CONTINUE) | never
    starts[:, 0] = True  # a leading continuation (a unit cut by truncation) starts its own unit
    probability = torch.where(units == SPAN, span_mask_probability, mlm_probability).float()
    probability = probability.masked_fill(never | ~starts, 0.0)
    drawn = torch.bernoulli(probability, generator=generator).bool()
    # every token takes the draw of its unit's start, the last start at or before it
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    unit_start = torch.where(starts, positions, 0).cummax(dim=1).values
    masked = drawn.gather(1, unit_start) & ~never
    labels[~masked] = -100
    replaced = torch.bernoulli(torch.full(labels.shape, mask_replace_prob), generator=generator).bool() & masked
    input_ids[replaced] = mask_token_id
    if mask_replace_prob == 1 or random_replace_prob == 0:
        return input_ids, labels
    scaled = random_replace_prob / (1 - mask_replace_prob)
    randomized = torch.bernoulli(torch.full(labels.shape, scaled), generator=generator).bool() & masked & ~replaced
    random_words = torch.randint(vocab_size, labels.shape, dtype=torch.long, generator=generator)
    input_ids[randomized] = random_words[randomized]
    return input_ids, labels


class PaddingWithUnits:
    """A padding collator (`DataCollatorWithPadding`) that also pads the examples' `mask_units` (when they have them)
    to the batch's length: padding is a special token, never masked."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features: list[dict]) -> dict:
        if not features or "mask_units" not in features[0]:
            return self.collator(features)
        units = [feature["mask_units"] for feature in features]
        batch = self.collator([{k: v for k, v in feature.items() if k != "mask_units"} for feature in features])
        length = batch["input_ids"].shape[1]
        batch["mask_units"] = torch.tensor([list(row) + [UNIT] * (length - len(row)) for row in units])
        return batch


__all__ = ["CONTINUE", "SPAN", "UNIT", "PaddingWithUnits", "check_spans", "cut_unit_codes", "mask_tokens", "unit_codes"]
