"""Question answering for `run_squad.py`: reading SQuAD json, checking answers, tokenizing into features, and
post-processing start/end logits into answer texts (the official example's `utils_qa.py`, moved into the package)."""

import collections
import json
import logging
import os

import numpy as np

from ..utils.input_errors import InputError


logger = logging.getLogger(__name__)

QUESTION_FIELDS = ("id", "question", "answers")


class SquadFormatError(InputError):
    """A SQuAD file or dataset that does not have the layout or the answers it should."""


def read_squad_json(path: str) -> list[dict]:
    """Flattens a SQuAD json file in the official nested layout (v1.1 or v2.0) into one example per question.

    Args:
        path: A json file `{"version": ..., "data": [{"title", "paragraphs": [{"context", "qas": [{"id", "question",
            "answers": [{"text", "answer_start"}], "is_impossible"?}]}]}]}`.

    Returns:
        Examples `{"id", "title", "context", "question", "answers": {"text": [...], "answer_start": [...]}}`, the
        flat layout of the Hugging Face `squad`/`squad_v2` datasets. An unanswerable question (v2) has empty lists.

    Raises:
        SquadFormatError: naming the file and the article/paragraph/question where a field is missing or malformed.
    """
    with open(path, encoding="utf-8") as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as error:
            raise SquadFormatError(f"{path}: not valid json ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise SquadFormatError(
            f'{path}: expected the official SQuAD layout {{"version": ..., "data": [articles]}}; got '
            f"{type(document).__name__} with keys {sorted(document)[:5] if isinstance(document, dict) else '-'}"
        )

    examples = []
    for a, article in enumerate(document["data"]):
        where = f"{path}: data[{a}]"
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise SquadFormatError(f"{where}: an article needs a 'paragraphs' list")
        title = article.get("title", "")
        for p, paragraph in enumerate(article["paragraphs"]):
            where = f"{path}: data[{a}] ({title!r}) paragraphs[{p}]"
            if not isinstance(paragraph.get("context"), str) or not isinstance(paragraph.get("qas"), list):
                raise SquadFormatError(f"{where}: a paragraph needs a 'context' string and a 'qas' list")
            for q, qa in enumerate(paragraph["qas"]):
                missing = [field for field in QUESTION_FIELDS if field not in qa]
                if missing:
                    raise SquadFormatError(f"{where} qas[{q}] (id {qa.get('id', '?')!r}): missing {missing}")
                answers = qa["answers"]
                if qa.get("is_impossible") and answers:
                    raise SquadFormatError(f"{path}: question {qa['id']!r} is_impossible but has answers")
                if not isinstance(answers, list) or any(
                    not isinstance(answer, dict) or "text" not in answer or "answer_start" not in answer
                    for answer in answers
                ):
                    raise SquadFormatError(
                        f"{path}: question {qa['id']!r}: 'answers' must be a list of {{'text', 'answer_start'}}"
                    )
                examples.append(
                    {
                        "id": str(qa["id"]),
                        "title": title,
                        "context": paragraph["context"],
                        "question": qa["question"],
                        "answers": {
                            "text": [answer["text"] for answer in answers],
                            "answer_start": [_answer_start(answer["answer_start"], path, qa) for answer in answers],
                        },
                    }
                )
    return examples


def _answer_start(value, path: str, qa: dict) -> int:
    # an int, or a string of one (as int() reads it): anything else is an error naming the field, not int()'s
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SquadFormatError(
            f"{path}: question {qa['id']!r}: answer_start must be a character offset (an integer >= 0), got {value!r}"
        )
    return value


def squad_features():
    """The `datasets.Features` of flattened SQuAD examples (kept explicit: all-unanswerable slices infer no type)."""
    from datasets import Features, List, Value

    return Features(
        {
            "id": Value("string"),
            "title": Value("string"),
            "context": Value("string"),
            "question": Value("string"),
            "answers": {"text": List(Value("string")), "answer_start": List(Value("int32"))},
        }
    )


def check_answers(example: dict, fix_answer_starts: bool = False) -> dict:
    """Checks that every answer of an example is its context at `answer_start`; returns the (fixed) example.

    With `fix_answer_starts`, an answer whose text occurs elsewhere in the context is moved to the occurrence nearest
    to the given `answer_start`; an answer text absent from the context is always an error.

    Raises:
        SquadFormatError: naming the question id, the answer and what the context holds at that offset.
    """
    context, answers = example["context"], example["answers"]
    if len(answers["text"]) != len(answers["answer_start"]):
        raise SquadFormatError(
            f"question {example['id']!r}: {len(answers['text'])} answer texts but "
            f"{len(answers['answer_start'])} answer_start values"
        )
    starts = list(answers["answer_start"])
    for i, (text, start) in enumerate(zip(answers["text"], starts)):
        if context[start : start + len(text)] == text:
            continue
        occurrences = list(_find_all(context, text)) if text else []
        if fix_answer_starts and occurrences:
            starts[i] = min(occurrences, key=lambda position: abs(position - start))
            logger.warning(f"question {example['id']!r}: answer {text!r} moved from {start} to {starts[i]}")
            continue
        found = (
            f"the text occurs at {occurrences[:5]} (--fix_answer_starts moves it to the nearest)"
            if occurrences
            else "the text occurs nowhere in the context"
        )
        raise SquadFormatError(
            f"question {example['id']!r}: answer {text!r} is not in its context at answer_start={start} "
            f"(the context holds {context[start : start + len(text)]!r} there); {found}"
        )
    if starts != list(answers["answer_start"]):
        example["answers"] = {"text": list(answers["text"]), "answer_start": starts}
    return example


def _find_all(text: str, sub: str):
    position = text.find(sub)
    while position != -1:
        yield position
        position = text.find(sub, position + 1)


def postprocess_qa_predictions(
    examples,
    features,
    predictions: tuple[np.ndarray, np.ndarray],
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
    output_dir: str | None = None,
    prefix: str | None = None,
) -> tuple[dict[str, str], dict[str, float] | None]:
    """Turns the start/end logits of the features into an answer text per example (the method of the official
    the official example's `utils_qa.py`: the `n_best_size` best start and end logits of each feature, spans in the context of at most
    `max_answer_length` tokens, score = start logit + end logit, best over all features of the example).

    Args:
        examples: The raw examples (`id`, `context`).
        features: The evaluation features, with `example_id` and `offset_mapping` (None outside the context).
        predictions: `(start_logits, end_logits)`, each of shape `(len(features), sequence_length)`.
        version_2_with_negative: Whether "no answer" (`""`) may be predicted.
        n_best_size: How many start and end logits (and answers, in the n-best file) to consider.
        max_answer_length: The longest answer, in tokens.
        null_score_diff_threshold: v2: predict `""` when the null score minus the best span's score exceeds it.
        output_dir: Where to write `predictions.json` (id -> text), `nbest_predictions.json` and, for v2,
            `null_odds.json` (id -> null score minus best span score), each prefixed with `{prefix}_` if given.

    Returns:
        `(predictions, null_odds)`: question id -> answer text; for v2 question id -> score difference, else None.
    """
    if len(predictions) != 2:
        raise ValueError("`predictions` should be a tuple with two elements (start_logits, end_logits).")
    all_start_logits, all_end_logits = predictions
    if len(all_start_logits) != len(features):
        raise ValueError(f"Got {len(all_start_logits)} predictions and {len(features)} features.")

    # Map each example to its features.
    example_id_to_index = {k: i for i, k in enumerate(examples["id"])}
    features_per_example = collections.defaultdict(list)
    for i, example_id in enumerate(features["example_id"]):
        features_per_example[example_id_to_index[example_id]].append(i)
    offset_mappings = features["offset_mapping"]

    all_predictions = collections.OrderedDict()
    all_nbest_json = collections.OrderedDict()
    scores_diff_json = collections.OrderedDict() if version_2_with_negative else None

    for example_index, example in enumerate(examples):
        min_null_prediction = None
        prelim_predictions = []
        context = example["context"]

        for feature_index in features_per_example[example_index]:
            start_logits = all_start_logits[feature_index]
            end_logits = all_end_logits[feature_index]
            offset_mapping = offset_mappings[feature_index]

            # The null answer of the example is the one with the lowest score over its features (CLS at index 0).
            feature_null_score = start_logits[0] + end_logits[0]
            if min_null_prediction is None or min_null_prediction["score"] > feature_null_score:
                min_null_prediction = {
                    "offsets": (0, 0),
                    "score": feature_null_score,
                    "start_logit": start_logits[0],
                    "end_logit": end_logits[0],
                }

            start_indexes = np.argsort(start_logits)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -n_best_size - 1 : -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    # Skip spans outside the context (question, special tokens, padding) or of a bad length.
                    if (
                        start_index >= len(offset_mapping)
                        or end_index >= len(offset_mapping)
                        or offset_mapping[start_index] is None
                        or len(offset_mapping[start_index]) < 2
                        or offset_mapping[end_index] is None
                        or len(offset_mapping[end_index]) < 2
                    ):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > max_answer_length:
                        continue
                    prelim_predictions.append(
                        {
                            "offsets": (offset_mapping[start_index][0], offset_mapping[end_index][1]),
                            "score": start_logits[start_index] + end_logits[end_index],
                            "start_logit": start_logits[start_index],
                            "end_logit": end_logits[end_index],
                        }
                    )

        if version_2_with_negative and min_null_prediction is not None:
            prelim_predictions.append(min_null_prediction)
            null_score = min_null_prediction["score"]

        # Only keep the n_best_size best predictions; v2 always keeps the null one.
        predictions_n_best = sorted(prelim_predictions, key=lambda x: x["score"], reverse=True)[:n_best_size]
        if (
            version_2_with_negative
            and min_null_prediction is not None
            and not any(p["offsets"] == (0, 0) for p in predictions_n_best)
        ):
            predictions_n_best.append(min_null_prediction)

        for prediction in predictions_n_best:
            start, end = prediction.pop("offsets")
            prediction["text"] = context[start:end]

        # A fake prediction when there is no valid span at all, to avoid failing.
        if len(predictions_n_best) == 0 or (len(predictions_n_best) == 1 and predictions_n_best[0]["text"] == ""):
            predictions_n_best.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})

        # Softmax over the n-best scores, for the n-best file.
        scores = np.array([p["score"] for p in predictions_n_best], dtype=np.float64)
        exp_scores = np.exp(scores - np.max(scores))
        probabilities = exp_scores / exp_scores.sum()
        for probability, prediction in zip(probabilities, predictions_n_best):
            prediction["probability"] = probability

        if not version_2_with_negative:
            all_predictions[example["id"]] = predictions_n_best[0]["text"]
        else:
            # The best non-null prediction, then the null one if its score is higher by more than the threshold.
            best_non_null = next((p for p in predictions_n_best if p["text"] != ""), predictions_n_best[0])
            score_diff = null_score - best_non_null["start_logit"] - best_non_null["end_logit"]
            scores_diff_json[example["id"]] = float(score_diff)
            all_predictions[example["id"]] = "" if score_diff > null_score_diff_threshold else best_non_null["text"]

        all_nbest_json[example["id"]] = [
            {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in p.items()}
            for p in predictions_n_best
        ]

    if output_dir is not None:
        if not os.path.isdir(output_dir):
            raise OSError(f"{output_dir} is not a directory.")
        files = {"predictions.json": all_predictions, "nbest_predictions.json": all_nbest_json}
        if version_2_with_negative:
            files["null_odds.json"] = scores_diff_json
        for base, content in files.items():
            path = os.path.join(output_dir, base if prefix is None else f"{prefix}_{base}")
            logger.info(f"Saving {base[:-5].replace('_', ' ')} to {path}.")
            with open(path, "w", encoding="utf-8") as writer:
                writer.write(json.dumps(content, indent=4, ensure_ascii=False) + "\n")

    return dict(all_predictions), (dict(scores_diff_json) if version_2_with_negative else None)
