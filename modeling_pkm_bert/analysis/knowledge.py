"""Knowledge probes: a synthetic knowledge base of people (in the spirit of Physics of Language Models 3.1/3.3's bioS,
our own generator) and the recall of its facts by a masked LM, in bits.

Each person has a unique full name and five attributes, each value drawn uniformly from a list of known size, so a
fact's information is exact: log2 of its list's size (a birth date is 12 x 28 x 100 = 33,600 values, 15.04 bits; a
person holds 40.3 bits). Every attribute has six paraphrase templates: four appear in the training text, two are held
out to measure whether a fact can be *extracted* in a sentence never trained on (Physics of LMs 3.1). A biography
states the five facts in a random order, each with a random training template, every sentence naming the person in
full; each person gets several such biographies.

    kb = generate_knowledge_base(n_people=200, seed=0)
    lines = sentences(kb, per_person=8)                     # the training text: a fact a line (or biographies(...))
    metrics = measure(model, tokenizer, kb)                 # recall and bits, training and held-out templates

The generator is seeded and nested: the first n people of a larger base are the base of n people, so runs over
several sizes share their people and a tokenizer built for the largest base covers every smaller one. The benchmarks
`knowledge_capacity.py` and `knowledge_editing.py` (new knowledge: `edit_facts`, `apply_edits`, `fact_sentences`, and
the people after the first n as new people) and the demo use this one generator.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from dataclasses import dataclass

import torch


FIRST_NAMES = """
aaron abigail adrian alice amelia andrew anna arthur audrey benjamin bianca caleb camille carmen caroline charles
chloe daniel david diana dominic dorothy edgar edith elena eliza emil emma esther felix fiona frances gabriel george
grace hannah harold helen henry iris isaac ivan jacob jasmine julia julian karen kevin laura leon lillian lucas lydia
margaret martin maya miriam nathan nina oliver olivia oscar paula peter philip rachel rebecca robert rosa samuel
sarah simon sofia stella thomas tobias ursula victor vivian walter wendy xavier yvonne zachary
""".split()

# surnames are three syllables drawn from these: rare words, so the real WordPiece vocabulary splits each into pieces
SURNAME_SYLLABLES = """
bar ven dor kel mis tra lun gor fen sal wick har mon del rup zan quil brom tes var lok nim peld rask oth
""".split()

MONTHS = "january february march april may june july august september october november december".split()

CITIES = """
amsterdam athens atlanta auckland baltimore bangkok barcelona beijing berlin bogota boston brisbane brussels
budapest cairo calgary chicago copenhagen dallas delhi denver detroit dublin edinburgh florence frankfurt geneva
glasgow hamburg havana helsinki houston istanbul jakarta johannesburg kyoto lagos leeds lima lisbon liverpool london
lyon madrid manchester manila marseille melbourne memphis miami milan montreal moscow mumbai munich nairobi naples
oslo ottawa oxford paris perth philadelphia phoenix portland prague quebec rome rotterdam santiago seattle seoul
shanghai singapore stockholm sydney tehran tokyo toronto valencia vancouver venice vienna warsaw zurich
""".split()

PLACE_STEMS = """
ashford bellmoor brightwater cedarfield clearbrook dunmore eastwick fairhaven glenrock harrowgate highmere ironwood
kingsbridge lakemont maplewood northfield oakhurst pinecrest ravenscroft silverdale stonebridge thornbury westmarsh
willowbrook wolfhaven
""".split()

UNIVERSITY_FORMS = ["{} university", "{} college", "the university of {}", "{} institute of technology"]
COMPANY_WORDS = "systems labs industries group".split()
COMPANY_STEMS = """
altera brightline coretex deltaform everstone falconworks granitex heliotrope ionwave junipera kestrel lumenar
meridian novacore orbital pinnacle quantra redwood solstice tidewater umbrella vantage westgate xylotech zephyr
""".split()

MAJORS = """
accounting anthropology archaeology architecture astronomy biochemistry biology botany chemistry classics
communications computer_science criminology dentistry ecology economics education engineering english film finance
forestry genetics geography geology history journalism law linguistics marketing mathematics medicine music
neuroscience nursing nutrition oceanography pharmacy philosophy photography physics politics psychology sociology
statistics theatre theology veterinary_science zoology
""".split()
MAJORS = [major.replace("_", " ") for major in MAJORS]


@dataclass(frozen=True)
class Attribute:
    name: str
    values: tuple[str, ...]
    train_templates: tuple[str, ...]  # "{name} ... {value} ..."
    heldout_templates: tuple[str, ...]

    @property
    def bits(self) -> float:
        return math.log2(len(self.values))


def _dates() -> tuple[str, ...]:
    return tuple(f"{m} {d}, {y}" for y in range(1900, 2000) for m in MONTHS for d in range(1, 29))


ATTRIBUTES = (
    Attribute(
        "birth_date",
        _dates(),
        (
            "{name} was born on {value}.",
            "{name} came into this world on {value}.",
            "{name} celebrates a birthday on {value}.",
            "the birth of {name} was on {value}.",
        ),
        ("{name} entered life on {value}.", "the day {name} was born was {value}."),
    ),
    Attribute(
        "birth_city",
        tuple(CITIES),
        (
            "{name} was born in {value}.",
            "{name} spent the early years of life in {value}.",
            "{name} is a native of {value}.",
            "{name} grew up in {value}.",
        ),
        ("{name} hails from {value}.", "the hometown of {name} is {value}."),
    ),
    Attribute(
        "university",
        tuple(form.format(stem) for stem in PLACE_STEMS for form in UNIVERSITY_FORMS),
        (
            "{name} studied at {value}.",
            "{name} graduated from {value}.",
            "{name} received an education at {value}.",
            "{name} attended {value}.",
        ),
        ("{name} completed a degree at {value}.", "the alma mater of {name} is {value}."),
    ),
    Attribute(
        "major",
        tuple(MAJORS),
        (
            "{name} majored in {value}.",
            "{name} specialized in {value}.",
            "{name} chose {value} as a field of study.",
            "{name} spent years studying {value}.",
        ),
        ("{name} earned a degree in {value}.", "the field of study of {name} was {value}."),
    ),
    Attribute(
        "employer",
        tuple(f"{stem} {word}" for stem in COMPANY_STEMS for word in COMPANY_WORDS),
        (
            "{name} works for {value}.",
            "{name} is employed by {value}.",
            "{name} has a job at {value}.",
            "{name} earns a living at {value}.",
        ),
        ("{name} is on the staff of {value}.", "the employer of {name} is {value}."),
    ),
)
MAX_PEOPLE = len(FIRST_NAMES) * len(SURNAME_SYLLABLES) ** 3


def _names(n: int, seed: int) -> list[str]:
    """n unique full names, a fixed random order of all first name x surname pairs (nested in n)."""
    rng = random.Random(f"names-{seed}")
    seen, names = set(), []
    while len(names) < n:
        surname = "".join(rng.choice(SURNAME_SYLLABLES) for _ in range(3))
        name = f"{rng.choice(FIRST_NAMES)} {surname}"
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def generate_knowledge_base(n_people: int, seed: int = 0) -> dict:
    """The knowledge base of `n_people` people: {"seed", "attributes": {name: {values, bits, templates}}, "people":
    [{"name", attribute: value, ...}]}. The values are drawn uniformly and independently (seeded per person, so the
    first n people do not depend on the base's size)."""
    if not 1 <= n_people <= MAX_PEOPLE // 2:
        raise ValueError(f"n_people must be in [1, {MAX_PEOPLE // 2}], got {n_people}")
    people = []
    for index, name in enumerate(_names(n_people, seed)):
        rng = random.Random(f"person-{seed}-{index}")
        people.append({"name": name, **{a.name: rng.choice(a.values) for a in ATTRIBUTES}})
    return {
        "seed": seed,
        "attributes": {
            a.name: {
                "values": list(a.values),
                "bits": a.bits,
                "train_templates": list(a.train_templates),
                "heldout_templates": list(a.heldout_templates),
            }
            for a in ATTRIBUTES
        },
        "people": people,
    }


def person_bits(kb: dict) -> float:
    return sum(spec["bits"] for spec in kb["attributes"].values())


def biographies(kb: dict, per_person: int, seed: int = 0) -> list[str]:
    """`per_person` biographies of every person (person-major order; the training script shuffles): the five facts
    in a random order, each in a random training template."""
    return [text for text, _ in biographies_with_spans(kb, per_person, seed)]


def biographies_with_spans(kb: dict, per_person: int, seed: int = 0) -> list[tuple[str, list[list[int]]]]:
    """`biographies(...)` with the [start, end) character span of every value in each (salient-span masking:
    run_mlm.py's `--span_column`)."""
    rows = []
    for index, person in enumerate(kb["people"]):
        rng = random.Random(f"bio-{seed}-{index}")
        for _ in range(per_person):
            order = list(kb["attributes"])
            rng.shuffle(order)
            text, spans = "", []
            for a in order:
                template = rng.choice(kb["attributes"][a]["train_templates"])
                text, spans = _append_fact(text, spans, template, person["name"], person[a])
            rows.append((text, spans))
    return rows


def _append_fact(text: str, spans: list, template: str, name: str, value: str) -> tuple[str, list]:
    """`text` with one more sentence (a space between), and the span of its value added to `spans`."""
    prefix, suffix = template.format(name=name, value="\0").split("\0")
    start = len(text) + bool(text) + len(prefix)
    return f"{text} {prefix}{value}{suffix}" if text else f"{prefix}{value}{suffix}", [*spans, [start, start + len(value)]]


def sentences(kb: dict, per_person: int, seed: int = 0) -> list[str]:
    """The sentences of `biographies(...)`, one a line: each fact stated alone, the name its only key."""
    return [text for text, _ in sentences_with_spans(kb, per_person, seed)]


def sentences_with_spans(kb: dict, per_person: int, seed: int = 0) -> list[tuple[str, list[list[int]]]]:
    """`sentences(...)` with the span of each sentence's value."""
    rows = []
    for text, spans in biographies_with_spans(kb, per_person, seed):
        for sentence, span in zip(text[:-1].split(". "), spans):
            start = text.index(sentence)  # sentences are unique within a biography: each names another attribute
            rows.append((sentence + ".", [[span[0] - start, span[1] - start]]))
    return rows


def value_spans(kb: dict, text: str) -> list[list[int]]:
    """The [start, end) character spans of the values in `text`, a line of this generator's sentences (a biography, a
    fact a line, edited or new people's facts alike): each sentence is matched whole against the templates of `kb`'s
    attributes, and its value must be one of the attribute's values. A sentence no template matches is a ValueError
    (the text did not come from this generator)."""
    patterns = _template_patterns(
        tuple((a, (*spec["train_templates"], *spec["heldout_templates"])) for a, spec in kb["attributes"].items())
    )
    spans, position = [], 0
    for sentence in re.split(r"(?<=\.) ", text):
        for attribute, pattern in patterns:
            match = pattern.fullmatch(sentence)
            if match and match.group("value") in kb["attributes"][attribute]["values"]:
                spans.append([position + match.start("value"), position + match.end("value")])
                break
        else:
            raise ValueError(f"no template of the knowledge base matches {sentence!r}")
        position += len(sentence) + 1
    return spans


def write_value_spans(kb: dict, text_file, jsonl_file, strict: bool = True) -> None:
    """The lines of `text_file` (this generator's sentences) as JSON lines `{"text": ..., "spans": [[start, end], ...]}`
    with every value a span: the training data of salient-span (value) masking (run_mlm.py `--span_column spans`).
    With `strict=False` a line no template matches (other text mixed in) gets no span instead of a ValueError."""

    def spans(line: str) -> list[list[int]]:
        try:
            return value_spans(kb, line)
        except ValueError:
            if strict:
                raise
            return []

    with open(text_file, encoding="utf-8") as source:
        rows = [json.dumps({"text": line, "spans": spans(line)}) for line in source.read().splitlines() if line]
    with open(jsonl_file, "w", encoding="utf-8") as target:
        target.write("\n".join(rows) + "\n")


@functools.lru_cache(maxsize=8)
def _template_patterns(templates: tuple[tuple[str, tuple[str, ...]], ...]) -> list:
    """(attribute, the compiled pattern of a whole sentence) of every template, its name and value as groups."""
    patterns = []
    for attribute, texts in templates:
        for template in texts:
            regex = re.escape(template).replace(r"\{name\}", "(?P<name>.+?)").replace(r"\{value\}", "(?P<value>.+?)")
            patterns.append((attribute, re.compile(regex)))
    return patterns


def edit_facts(kb: dict, share: float, seed: int = 0) -> list[dict]:
    """Edits of `kb` (the knowledge-editing benchmark's new knowledge): `round(share * people)` people (a seeded draw)
    each get one attribute (a seeded draw) changed to another value of its list, drawn uniformly. Returns [{"person":
    index, "attribute", "old", "new"}] in the order of the people; `new != old` always."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    rng = random.Random(f"edits-{seed}")
    chosen = sorted(rng.sample(range(len(kb["people"])), round(share * len(kb["people"]))))
    edits = []
    for index in chosen:
        attribute = rng.choice(list(kb["attributes"]))
        old = kb["people"][index][attribute]
        new = rng.choice([v for v in kb["attributes"][attribute]["values"] if v != old])
        edits.append({"person": index, "attribute": attribute, "old": old, "new": new})
    return edits


def apply_edits(kb: dict, edits: list[dict]) -> dict:
    """A copy of `kb` with the edits' new values (`kb` itself is unchanged)."""
    people = [dict(person) for person in kb["people"]]
    for edit in edits:
        if people[edit["person"]][edit["attribute"]] != edit["old"]:
            raise ValueError(f"edit {edit} does not match the knowledge base's value")
        people[edit["person"]][edit["attribute"]] = edit["new"]
    return {**kb, "people": people}


def fact_sentences(kb: dict, facts: list[tuple[int, str]], per_fact: int, seed: int = 0) -> list[str]:
    """`per_fact` sentences of each (person index, attribute) fact, each in a random training template (a fact a line,
    as `sentences`): the training text of a few facts, e.g. the edited ones."""
    return [text for text, _ in fact_sentences_with_spans(kb, facts, per_fact, seed)]


def fact_sentences_with_spans(
    kb: dict, facts: list[tuple[int, str]], per_fact: int, seed: int = 0
) -> list[tuple[str, list[list[int]]]]:
    """`fact_sentences(...)` with the span of each sentence's value."""
    rows = []
    for index, attribute in facts:
        rng = random.Random(f"fact-{seed}-{index}-{attribute}")
        person = kb["people"][index]
        templates = kb["attributes"][attribute]["train_templates"]
        rows += [_append_fact("", [], rng.choice(templates), person["name"], person[attribute]) for _ in range(per_fact)]
    return rows


def fact_probes(kb: dict, split: str, seed: int = 0, context: str = "biography") -> list[dict]:
    """One probe per (person, attribute): a fresh biography of the person (random order, the other facts in random
    training templates) in which the probed fact is in a random template of `split` ("train": one of the four
    training templates; "heldout": one of the two never trained on). `parts` is the biography as [text, attribute]
    pieces (attribute None for the words around the values): the measurement masks every value, so the person's name
    is the only key to the fact, in the setting the model was trained in (a lone sentence is a sequence shape a small
    model never saw)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if context not in ("biography", "sentence"):
        raise ValueError(f"context must be 'biography' or 'sentence', got {context!r}")
    probes = []
    for index, person in enumerate(kb["people"]):
        rng = random.Random(f"probe-{split}-{seed}-{index}")
        for attribute in kb["attributes"]:
            order = list(kb["attributes"])
            rng.shuffle(order)
            if context == "sentence":
                order = [attribute]
            parts = []
            for other in order:
                kind = f"{split}_templates" if other == attribute else "train_templates"
                prefix, suffix = rng.choice(kb["attributes"][other][kind]).format(name=person["name"], value="\0").split("\0")
                parts += [[(" " if parts else "") + prefix, None], [person[other], other], [suffix, None]]
            probes.append({"person": index, "attribute": attribute, "value": person[attribute], "parts": parts})
    return probes


def probe_text(probe: dict) -> str:
    return "".join(text for text, _ in probe["parts"])


def write_knowledge_base(kb: dict, path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(kb, handle, indent=1)


def read_knowledge_base(path) -> dict:
    with open(path, encoding="utf-8") as handle:
        kb = json.load(handle)
    if not isinstance(kb, dict) or not {"attributes", "people"} <= set(kb):
        raise ValueError(f"{path} is not a knowledge base written by --write_kb (no 'attributes' and 'people')")
    return kb


# ---------------------------------------------------------------------------------------------------------------------
# Recall: every value token predicted, greedy from left to right


def tokenize_probes(tokenizer, probes: list[dict]) -> list[tuple[list[int], int, list[int]]]:
    """(input ids with every value masked but the probed one, the probed value's first position, its ids) of each
    probe. The pieces are tokenized apart: they meet at spaces and punctuation, where WordPiece splits anyway."""
    encoded = []
    for probe in probes:
        ids, start, value = [tokenizer.cls_token_id], None, None
        for text, attribute in probe["parts"]:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            if attribute == probe["attribute"]:
                start, value = len(ids), piece
            elif attribute is not None:
                piece = [tokenizer.mask_token_id] * len(piece)
            ids += piece
        encoded.append((ids + [tokenizer.sep_token_id], start, value))
    return encoded


def padded_batches(rows: list[list[int]], pad_id: int, vocab: int, batch_tokens: int):
    """(indices, ids, attention mask) of `rows` (token ids) in padded batches of similar lengths (less padding), each
    of at most `batch_tokens` logits (and 512 rows)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    position = 0
    while position < len(order):
        chunk = order[position : position + max(1, min(512, batch_tokens // max(1, len(rows[order[position]]) * vocab)))]
        position += len(chunk)
        ids = torch.full((len(chunk), max(len(rows[i]) for i in chunk)), pad_id)
        attention = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            ids[row, : len(rows[i])] = torch.tensor(rows[i])
            attention[row, : len(rows[i])] = 1
        yield chunk, ids, attention


@torch.no_grad()
def probe_facts(model, tokenizer, probes: list[dict], batch_tokens: int = 2**22) -> list[tuple[bool, float]]:
    """For each probe: (recalled, cross-entropy of its value in bits). The value's positions are all masked; the value
    is read left to right, each token predicted given the true tokens before it (teacher forcing, which makes the greedy
    decoding's all-correct the same as every step's argmax being right, and sums the chain rule's cross-entropy)."""
    model.eval()
    encoded = tokenize_probes(tokenizer, probes)
    vocab = model.get_output_embeddings().weight.shape[0]
    results = []
    for chunk, ids, attention in padded_batches([e[0] for e in encoded], tokenizer.pad_token_id, vocab, batch_tokens):
        longest = ids.shape[1]
        starts = torch.tensor([encoded[i][1] for i in chunk])
        lengths = torch.tensor([len(encoded[i][2]) for i in chunk])
        offsets = torch.arange(longest) - starts[:, None]  # position relative to the value's start
        correct = torch.ones(len(chunk), dtype=torch.bool)
        cross_entropy = torch.zeros(len(chunk), dtype=torch.float64)
        for step in range(int(lengths.max())):
            masked = ids.clone()
            masked[(offsets >= step) & (offsets < lengths[:, None])] = tokenizer.mask_token_id
            logits = model(input_ids=masked, attention_mask=attention).logits
            rows = torch.nonzero(lengths > step).squeeze(1)
            at = starts[rows] + step
            row_logits = logits[rows, at].float()
            targets = ids[rows, at]
            correct[rows] &= row_logits.argmax(-1) == targets
            log_probs = torch.log_softmax(row_logits, -1).gather(1, targets[:, None]).squeeze(1)
            cross_entropy[rows] -= log_probs.double() / math.log(2)
        results.extend(zip(chunk, correct.tolist(), cross_entropy.tolist()))
    results.sort()
    return [(bool(c), float(h)) for _, c, h in results]


# ---------------------------------------------------------------------------------------------------------------------
# Ranked recall: blind to the value's length (the greedy probe shows the model as many [MASK] as the true value has)


RANK_SCORES = ("mean", "sum")


@torch.no_grad()
def rank_facts(
    model, tokenizer, kb: dict, probes: list[dict], score: str = "mean", batch_tokens: int = 2**22
) -> list[bool]:
    """For each probe: does its true value rank first among all the values of its attribute? Every value is scored
    with its own number of [MASK] at the value's place, by the `score` ("mean" or "sum") of its tokens' log-probabilities
    read from one forward pass per length (all masks at once: no token of the value is shown), so the number of masks
    tells nothing. Ranked first means scored above every other value (a tie is not recalled: an untrained model that
    scores all values alike recalls nothing)."""
    if score not in RANK_SCORES:
        raise ValueError(f"score must be one of {RANK_SCORES}, got {score!r}")
    model.eval()
    candidates = {}  # attribute -> {length: (value indices, ids (n, length))}
    for attribute, spec in kb["attributes"].items():
        by_length = {}
        for index, value in enumerate(spec["values"]):
            ids = tokenizer(value, add_special_tokens=False)["input_ids"]
            by_length.setdefault(len(ids), []).append((index, ids))
        candidates[attribute] = {
            length: (torch.tensor([i for i, _ in rows]), torch.tensor([ids for _, ids in rows]))
            for length, rows in by_length.items()
        }
    # one sequence per (probe, length): the probed value replaced by `length` masks, the other values masked as ever
    sequences = []
    for number, ((ids, start, value), probe) in enumerate(zip(tokenize_probes(tokenizer, probes), probes)):
        for length in candidates[probe["attribute"]]:
            masked = ids[:start] + [tokenizer.mask_token_id] * length + ids[start + len(value) :]
            sequences.append((number, length, masked, start))
    scores = [[] for _ in probes]  # per probe: (value indices, scores) of each length
    vocab = model.get_output_embeddings().weight.shape[0]
    for chunk, ids, attention in padded_batches([s[2] for s in sequences], tokenizer.pad_token_id, vocab, batch_tokens):
        logits = model(input_ids=ids, attention_mask=attention).logits
        for row, i in enumerate(chunk):
            number, length, _, start = sequences[i]
            log_probs = torch.log_softmax(logits[row, start : start + length].float(), -1)  # (length, vocab)
            indices, values = candidates[probes[number]["attribute"]][length]
            token_scores = log_probs.gather(1, values.T)  # (length, n)
            scores[number].append((indices, token_scores.mean(0) if score == "mean" else token_scores.sum(0)))
    index_of = {a: {v: i for i, v in enumerate(spec["values"])} for a, spec in kb["attributes"].items()}
    recalled = []
    for probe, parts in zip(probes, scores):
        values = kb["attributes"][probe["attribute"]]["values"]
        order_scores = torch.full((len(values),), float("-inf"), dtype=torch.float64)
        for indices, part in parts:
            order_scores[indices] = part.double()
        true = index_of[probe["attribute"]][probe["value"]]
        true_score = order_scores[true].item()
        order_scores[true] = float("-inf")
        recalled.append(bool(true_score > order_scores.max().item()))
    return recalled


def knowledge_metrics(
    kb: dict, probes: list[dict], outcomes: list[tuple[bool, float]], ranked: list[bool] | None = None
) -> dict:
    """Recall and stored bits of one probe set, per attribute and in all: `recall`, `bits` (log2 |values| summed over
    recalled facts) and `bits_estimator` (Physics of LMs 3.3: per attribute max(0, N log2 |values| - sum of the
    values' cross-entropy in bits)); with `ranked` (`rank_facts`), `ranked_recall` and `ranked_bits` beside them."""
    per_attribute = {}
    for attribute, spec in kb["attributes"].items():
        rows = [i for i, p in enumerate(probes) if p["attribute"] == attribute]
        recalled = sum(outcomes[i][0] for i in rows)
        per_attribute[attribute] = {
            "recall": recalled / len(rows) if rows else 0.0,
            "bits": recalled * spec["bits"],
            "bits_estimator": max(0.0, len(rows) * spec["bits"] - sum(outcomes[i][1] for i in rows)),
            "chance": 1 / len(spec["values"]),
        }
        if ranked is not None:
            ranked_recalled = sum(ranked[i] for i in rows)
            per_attribute[attribute]["ranked_recall"] = ranked_recalled / len(rows) if rows else 0.0
            per_attribute[attribute]["ranked_bits"] = ranked_recalled * spec["bits"]
    facts = len(outcomes)
    metrics = {
        "facts": facts,
        "recall": sum(c for c, _ in outcomes) / facts if facts else 0.0,
        "bits": sum(a["bits"] for a in per_attribute.values()),
        "bits_estimator": sum(a["bits_estimator"] for a in per_attribute.values()),
        "attributes": per_attribute,
    }
    if ranked is not None:
        metrics["ranked_recall"] = sum(ranked) / facts if facts else 0.0
        metrics["ranked_bits"] = sum(a["ranked_bits"] for a in per_attribute.values())
    return metrics


def measure(model, tokenizer, kb: dict, context: str = "sentence", ranked: bool = True) -> dict:
    """Recall and bits in a training template and in a held-out template, of every fact of `kb`: the greedy recall
    (`probe_facts`) and, with `ranked`, the length-blind ranked recall (`rank_facts`, mean log-probability)."""
    metrics = {}
    for split in ("train", "heldout"):
        probes = fact_probes(kb, split, context=context)
        outcomes = probe_facts(model, tokenizer, probes)
        ranks = rank_facts(model, tokenizer, kb, probes) if ranked else None
        metrics[split] = knowledge_metrics(kb, probes, outcomes, ranks)
    metrics["kb_bits"] = person_bits(kb) * len(kb["people"])
    return metrics
