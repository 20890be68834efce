"""SQuAD evaluation, exactly as the official v1.1 and v2.0 scripts compute it (no Hub download needed).

`squad_v1_scores` reproduces `evaluate-v1.1.py` (Rajpurkar et al. 2016): answers are normalised (lower case, no
punctuation, no articles, single spaces); EM and token-level F1 take the maximum over the ground truths and are
averaged over *all* questions x 100 (a question without a prediction scores 0).

`squad_v2_scores` reproduces `evaluate-v2.0.py`: the empty string is the prediction "no answer", the only correct
answer of an unanswerable question; F1 of an empty answer against anything is 1 if both are empty, else 0; averages
are over the predicted questions, with `HasAns_*`/`NoAns_*` breakdowns and, given no-answer probabilities, the
`best_*` threshold search of the official script.

Both take `predictions` as `{question id: answer text}` and `references` as a list of
`{"id": ..., "answers": {"text": [...], ...}}` (the flat Hugging Face `squad` layout) or
`{"id": ..., "answers": [{"text": ...}, ...]}` (the official nested layout); `squad_references` turns an official json
file's `data` into that list.
"""

import collections
import re
import string
import warnings


__all__ = [
    "exact_match_score",
    "f1_score",
    "normalize_answer",
    "squad_references",
    "squad_scores",
    "squad_v1_scores",
    "squad_v2_scores",
]


_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower text and remove punctuation, articles and extra white space (official, both versions)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    """v1.1 `exact_match_score`: equality after normalisation."""
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(prediction: str, ground_truth: str) -> float:
    """v1.1 `f1_score`: harmonic mean of token precision and recall, tokens counted with multiplicity.

    As in the official v1.1 script, no overlap gives 0 even when both sides normalise to nothing."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def _v2_exact(gold: str, prediction: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(prediction))


def _v2_f1(gold: str, prediction: str) -> float:
    gold_tokens = normalize_answer(gold).split() if gold else []
    prediction_tokens = normalize_answer(prediction).split() if prediction else []
    if not gold_tokens or not prediction_tokens:
        # if either is no-answer, F1 is 1 if they agree, 0 otherwise
        return int(gold_tokens == prediction_tokens)
    common = collections.Counter(gold_tokens) & collections.Counter(prediction_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def _answer_texts(reference: dict) -> list[str]:
    answers = reference["answers"]
    if isinstance(answers, dict):  # flat layout: {"text": [...], "answer_start": [...]}
        return list(answers["text"])
    return [answer["text"] for answer in answers]  # nested layout: [{"text", "answer_start"}, ...]


def squad_references(data: list[dict]) -> list[dict]:
    """`[{"id", "answers": [texts]}]` from the `data` list of an official SQuAD json (v1.1 or v2.0)."""
    return [
        {"id": qa["id"], "answers": {"text": [answer["text"] for answer in qa["answers"]]}}
        for article in data
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]


def _check_references(references: list[dict]) -> None:
    ids = [reference["id"] for reference in references]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"question ids must be unique in the references; repeated: {duplicates}")


def squad_v1_scores(predictions: dict[str, str], references: list[dict]) -> dict[str, float]:
    """Official SQuAD v1.1 evaluation: `{"exact_match": ..., "f1": ...}` in percent over all references."""
    _check_references(references)
    exact_match = f1 = 0.0
    missing = []
    for reference in references:
        if reference["id"] not in predictions:
            missing.append(reference["id"])
            continue
        ground_truths = _answer_texts(reference)
        if not ground_truths:
            raise ValueError(
                f"question {reference['id']!r} has no answer: SQuAD v1.1 needs at least one "
                "(use the v2 evaluation for unanswerable questions)"
            )
        prediction = predictions[reference["id"]]
        exact_match += max(exact_match_score(prediction, truth) for truth in ground_truths)
        f1 += max(f1_score(prediction, truth) for truth in ground_truths)
    if missing:
        warnings.warn(f"{len(missing)} unanswered question(s) score 0, e.g. {missing[:3]}", stacklevel=2)
    total = len(references)
    if total == 0:
        raise ValueError("no references to evaluate")
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def _mean_scores(exact: dict, f1: dict, qids) -> dict:
    total = len(qids)
    return {
        "exact": 100.0 * sum(exact[q] for q in qids) / total,
        "f1": 100.0 * sum(f1[q] for q in qids) / total,
        "total": total,
    }


def _best_threshold(predictions, scores, na_probs, has_answer) -> tuple[float, float]:
    """The official `find_best_thresh`: the score if every question above a no-answer probability predicted "" ."""
    current = best = sum(1 for q in has_answer if not has_answer[q])
    best_threshold = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            current += scores[qid]
        elif predictions[qid]:
            current -= 1
        if current > best:
            best, best_threshold = current, na_probs[qid]
    return 100.0 * best / len(scores), best_threshold


def squad_v2_scores(
    predictions: dict[str, str],
    references: list[dict],
    na_probs: dict[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float]:
    """Official SQuAD v2.0 evaluation (`evaluate-v2.0.py`), keys named as there.

    Args:
        predictions: question id -> answer text, `""` meaning "no answer".
        references: questions; unanswerable ones have no answers.
        na_probs: optional question id -> no-answer score (higher = more likely unanswerable); a question whose score
            exceeds `na_prob_thresh` counts as predicted unanswerable, and `best_exact`/`best_f1` (with their
            thresholds) are added. Without it every score is 0 (the official default).
    """
    _check_references(references)
    has_answer, exact, f1 = {}, {}, {}
    missing = []
    for reference in references:
        qid = reference["id"]
        gold = [text for text in _answer_texts(reference) if normalize_answer(text)]
        has_answer[qid] = bool(_answer_texts(reference))
        if not gold:
            gold = [""]  # the only correct answer of an unanswerable question
        if qid not in predictions:
            missing.append(qid)
            continue
        exact[qid] = max(_v2_exact(g, predictions[qid]) for g in gold)
        f1[qid] = max(_v2_f1(g, predictions[qid]) for g in gold)
    if missing:
        warnings.warn(f"missing prediction for {len(missing)} question(s), e.g. {missing[:3]}", stacklevel=2)
    if not exact:
        raise ValueError("no predicted question to evaluate")
    probabilities = na_probs if na_probs is not None else {qid: 0.0 for qid in has_answer}

    def thresholded(scores):
        return {
            qid: float(not has_answer[qid]) if probabilities[qid] > na_prob_thresh else score
            for qid, score in scores.items()
        }

    exact_thresh, f1_thresh = thresholded(exact), thresholded(f1)
    results = _mean_scores(exact_thresh, f1_thresh, list(exact_thresh))
    for prefix, qids in (
        ("HasAns", [q for q in has_answer if has_answer[q]]),
        ("NoAns", [q for q in has_answer if not has_answer[q]]),
    ):
        qids = [q for q in qids if q in exact]  # (the official script fails with a KeyError on a missing one)
        if qids:
            results.update({f"{prefix}_{k}": v for k, v in _mean_scores(exact_thresh, f1_thresh, qids).items()})
    if na_probs is not None:
        results["best_exact"], results["best_exact_thresh"] = _best_threshold(predictions, exact, na_probs, has_answer)
        results["best_f1"], results["best_f1_thresh"] = _best_threshold(predictions, f1, na_probs, has_answer)
    return results


def squad_scores(
    predictions: dict[str, str],
    references: list[dict],
    version_2_with_negative: bool = False,
    na_probs: dict[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float]:
    """`squad_v2_scores` if `version_2_with_negative`, else `squad_v1_scores`."""
    if version_2_with_negative:
        return squad_v2_scores(predictions, references, na_probs=na_probs, na_prob_thresh=na_prob_thresh)
    return squad_v1_scores(predictions, references)
