"""The official SQuAD v1.1 / v2.0 evaluation on examples worked out by hand."""

import json

import pytest

from modeling_pkm_bert.training.squad_metrics import (
    exact_match_score,
    f1_score,
    normalize_answer,
    squad_references,
    squad_scores,
    squad_v1_scores,
    squad_v2_scores,
)


@pytest.mark.parametrize(
    "text, normalized",
    [
        ("The  Quick, brown fox!", "quick brown fox"),  # lower, punctuation, article, spaces
        ("A man's hat", "mans hat"),  # the apostrophe is punctuation: removed, not a space
        ("theater and an apple", "theater and apple"),  # articles only as whole words
        ("1,000.5 km", "10005 km"),  # punctuation inside numbers goes too
        ("\u201cDenver\u201d", "\u201cdenver\u201d"),  # string.punctuation is ASCII: curly quotes stay
        ("  the\tend\n", "end"),
        ("", ""),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_match_and_f1_by_hand():
    # articles vanish: both sides are "cat sat on mat"
    assert exact_match_score("the cat sat on the mat", "a cat sat on mat")
    assert f1_score("the cat sat on the mat", "a cat sat on mat") == 1.0
    # 1 common token of 2 predicted, 1 gold: P = 1/2, R = 1, F1 = 2 * 1/2 * 1 / (3/2) = 2/3
    assert not exact_match_score("Denver Broncos", "Broncos")
    assert f1_score("Denver Broncos", "Broncos") == pytest.approx(2 / 3)
    # multiplicity: pred [b, b, c] ("a" is an article), gold [b, b, b, d]: 2 common; P = 2/3, R = 1/2, F1 = 4/7
    assert f1_score("a b b c", "b b b d") == pytest.approx(4 / 7)
    # no common token
    assert f1_score("Santa Clara", "Levi's Stadium") == 0
    # v1.1 quirk kept: two answers that normalise to nothing are an exact match but F1 0
    assert exact_match_score("the", "a")
    assert f1_score("the", "a") == 0


def test_squad_v1_by_hand():
    references = [
        {"id": "q1", "answers": {"text": ["Denver Broncos", "Broncos"], "answer_start": [0, 7]}},
        {"id": "q2", "answers": {"text": ["Broncos"], "answer_start": [7]}},
        {"id": "q3", "answers": [{"text": "Santa Clara", "answer_start": 3}]},  # nested layout also accepted
    ]
    predictions = {"q1": "broncos.", "q2": "Denver Broncos"}  # q3 unanswered: counts 0
    with pytest.warns(UserWarning, match="1 unanswered"):
        scores = squad_v1_scores(predictions, references)
    # EM: q1 1 (max over the answers), q2 0, q3 0 -> 100/3; F1: 1 + 2/3 + 0 -> 100 * (5/3) / 3
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(500 / 9)
    assert squad_scores(predictions | {"q3": "santa clara"}, references) == pytest.approx(
        {"exact_match": 200 / 3, "f1": 800 / 9}
    )


def test_squad_v1_rejects_bad_references():
    with pytest.raises(ValueError, match="repeated"):
        squad_v1_scores({"a": "x"}, [{"id": "a", "answers": {"text": ["x"]}}] * 2)
    with pytest.raises(ValueError, match="no answer"):
        squad_v1_scores({"a": "x"}, [{"id": "a", "answers": {"text": []}}])


V2_REFERENCES = [
    {"id": "q1", "answers": {"text": ["Broncos", "Denver Broncos"]}},
    {"id": "q2", "answers": {"text": ["Santa Clara"]}},
    {"id": "q3", "answers": {"text": []}},  # unanswerable
    {"id": "q4", "answers": {"text": []}},  # unanswerable
    {"id": "q5", "answers": {"text": ["Carolina Panthers"]}},
]
V2_PREDICTIONS = {"q1": "Denver Broncos", "q2": "", "q3": "", "q4": "Levi's Stadium", "q5": "the Panthers"}


def test_squad_v2_by_hand():
    # exact: q1 1, q2 0, q3 1 ("" is the answer), q4 0, q5 0 -> 40
    # f1: q1 1, q2 0 (empty vs answer), q3 1 (both empty), q4 0, q5 [panthers] vs [carolina, panthers] = 2/3
    scores = squad_v2_scores(V2_PREDICTIONS, V2_REFERENCES)
    assert scores == pytest.approx(
        {
            "exact": 40.0,
            "f1": 100 * (8 / 3) / 5,
            "total": 5,
            "HasAns_exact": 100 / 3,
            "HasAns_f1": 100 * (5 / 3) / 3,
            "HasAns_total": 3,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2,
        }
    )
    # v1.1 F1 of two empty answers is 0, v2 gives 1
    assert squad_v2_scores({"q": "the"}, [{"id": "q", "answers": {"text": []}}])["f1"] == 100.0


def test_squad_v2_no_answer_probabilities_by_hand():
    na_probs = {"q1": -2.0, "q2": 3.0, "q3": 5.0, "q4": 0.5, "q5": 1.5}
    scores = squad_v2_scores(V2_PREDICTIONS, V2_REFERENCES, na_probs=na_probs, na_prob_thresh=1.0)
    # above 1.0 (q2, q3, q5) counts as "no answer": q2 0, q3 1, q5 0; q1 1, q4 0 stay -> exact = f1 = 40
    assert scores["exact"] == pytest.approx(40.0) and scores["f1"] == pytest.approx(40.0)
    # threshold search in order q1 (-2), q4, q5, q2, q3 from 2 (all "no answer" = both unanswerables right):
    # q1 +1 -> 3 (best, at -2); q4 answered though unanswerable -1 -> 2; q5 +0 (exact) / +2/3 (f1); q2, q3 +0
    assert scores["best_exact"] == pytest.approx(60.0) and scores["best_exact_thresh"] == -2.0
    assert scores["best_f1"] == pytest.approx(60.0) and scores["best_f1_thresh"] == -2.0


def test_squad_references_from_official_json(shared_data):
    path = shared_data / "squad_v1.1" / "dev-v1.1.json"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    data = json.loads(path.read_text(encoding="utf-8"))["data"][:2]
    references = squad_references(data)
    assert len(references) == 810 + 247  # Super_Bowl_50, Warsaw
    # predicting the first gold answer scores 100 / 100
    predictions = {r["id"]: r["answers"]["text"][0] for r in references}
    assert squad_v1_scores(predictions, references) == {"exact_match": 100.0, "f1": 100.0}
