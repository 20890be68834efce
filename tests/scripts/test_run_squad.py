"""run_scripts/run_squad.py and modeling_pkm_bert/training/squad.py: SQuAD reading and checks, post-processing, tiny end-to-end runs."""

import copy
import json
import os
import re
import sys

import numpy as np
import pytest
import torch
from helpers import REPO_ROOT, metrics_records, reset_accelerate_state, tiny_config, torchrun, usage_error
from datasets import Dataset
from safetensors.torch import load_file


sys.path.insert(0, str(REPO_ROOT / "run_scripts"))

import run_squad  # noqa: E402
from modeling_pkm_bert.training.squad import SquadFormatError, check_answers, postprocess_qa_predictions, read_squad_json  # noqa: E402

from modeling_pkm_bert import BertPkmForQuestionAnswering  # noqa: E402


def squad_file(path, articles, version="1.1"):
    path.write_text(json.dumps({"version": version, "data": articles}), encoding="utf-8")
    return str(path)


def article(title, *paragraphs):
    return {"title": title, "paragraphs": list(paragraphs)}


def qa(qid, question, *answers, impossible=None):
    entry = {"id": qid, "question": question, "answers": [{"text": t, "answer_start": s} for t, s in answers]}
    if impossible is not None:
        entry["is_impossible"] = impossible
    return entry


CONTEXT = "The Denver Broncos beat the Carolina Panthers 24-10 at Levi's Stadium in Santa Clara."


# ---- reading and checking the official json layout ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev_articles(shared_data):
    path = shared_data / "squad_v1.1" / "dev-v1.1.json"
    if not path.is_file():
        pytest.skip(f"SQuAD v1.1 dev not found at {path}")
    return json.loads(path.read_text(encoding="utf-8"))["data"]


def test_read_real_dev_articles(dev_articles, tmp_path):
    path = squad_file(tmp_path / "dev3.json", dev_articles[:3])
    examples = read_squad_json(path)
    assert len(examples) == 810 + 247 + 112  # Super_Bowl_50, Warsaw, Normans
    first = examples[0]
    assert first["title"] == "Super_Bowl_50" and first["id"] == dev_articles[0]["paragraphs"][0]["qas"][0]["id"]
    assert set(first) == {"id", "title", "context", "question", "answers"}
    assert len(first["answers"]["text"]) == len(first["answers"]["answer_start"]) == 3
    for example in examples:  # every dev answer is its context at answer_start
        assert check_answers(copy.deepcopy(example)) == example


def test_read_errors_name_the_place(tmp_path):
    with pytest.raises(SquadFormatError, match=r"official SQuAD layout"):
        read_squad_json(squad_file(tmp_path / "a.json", None))
    bad = tmp_path / "b.json"
    bad.write_text('[{"question": "?"}]')
    with pytest.raises(SquadFormatError, match="official SQuAD layout"):
        read_squad_json(str(bad))
    no_question = article("T", {"context": CONTEXT, "qas": [{"id": "q7", "answers": []}]})
    with pytest.raises(SquadFormatError, match=r"'T'.*id 'q7'.*missing \['question'\]"):
        read_squad_json(squad_file(tmp_path / "c.json", [no_question]))
    no_start = article("T", {"context": CONTEXT, "qas": [{"id": "q8", "question": "?", "answers": [{"text": "x"}]}]})
    with pytest.raises(SquadFormatError, match="'q8'.*answer_start"):
        read_squad_json(squad_file(tmp_path / "d.json", [no_start]))
    with pytest.raises(SquadFormatError, match="paragraphs"):
        read_squad_json(squad_file(tmp_path / "e.json", [{"title": "no paragraphs"}]))
    impossible = article("T", {"context": CONTEXT, "qas": [qa("q9", "?", ("Denver", 4), impossible=True)]})
    with pytest.raises(SquadFormatError, match="'q9' is_impossible but has answers"):
        read_squad_json(squad_file(tmp_path / "f.json", [impossible]))


def test_check_answers_and_fix(tmp_path):
    def example(text, start):
        return {"id": "q1", "context": CONTEXT, "answers": {"text": [text], "answer_start": [start]}}

    assert check_answers(example("Denver Broncos", 4)) == example("Denver Broncos", 4)
    message = r"'q1': answer 'Denver Broncos' is not in its context at answer_start=5 "
    message += r"\(the context holds 'enver Broncos ' there\); the text occurs at \[4\]"
    with pytest.raises(SquadFormatError, match=message):
        check_answers(example("Denver Broncos", 5))
    assert check_answers(example("Denver Broncos", 5), fix_answer_starts=True)["answers"]["answer_start"] == [4]
    # exact, case-sensitive substrings: "the" is at 24 and inside "Panthers" at 40 (not "The" at 0)
    assert check_answers(example("the", 60), fix_answer_starts=True)["answers"]["answer_start"] == [40]
    with pytest.raises(SquadFormatError, match="occurs nowhere"):
        check_answers(example("Kansas City", 4), fix_answer_starts=True)


# ---- post-processing, worked by hand --------------------------------------------------------------------------------


def hand_worked_case():
    """Two examples; tokens [CLS] question [SEP] context... [SEP], offsets None outside the context."""
    context_1 = "Denver Broncos beat Carolina"
    examples = Dataset.from_list(
        [{"id": "a", "context": context_1}, {"id": "b", "context": context_1}]
    )
    offsets_1 = [None, None, None, [0, 6], [7, 14], [15, 19], [20, 28], None]
    offsets_2 = [None, None, None, [15, 19], [20, 28], None, None, None]  # a second feature of example b
    features = Dataset.from_list(
        [
            {"example_id": "a", "offset_mapping": offsets_1},
            {"example_id": "b", "offset_mapping": offsets_1},
            {"example_id": "b", "offset_mapping": offsets_2},
        ]
    )
    start = np.array(
        [
            [0, 5, 0, 3, 1, 0, 2, 0],  # the question token (5) can never start an answer
            [8, 0, 0, 3, 1, 0, 2, 0],  # same spans, null score 8 + 1 = 9
            [7, 0, 0, 1, 9, 0, -100, -100],  # "Carolina": 9 + 9 = 18; null 7 + 0 = 7 (b's null: the lowest, 7)
        ],
        dtype=np.float64,
    )
    end = np.array(
        [
            [0, 0, 0, 0, 4, 0, 1, 0],
            [1, 0, 0, 0, 4, 0, 1, 0],
            [0, 0, 0, 0, 9, 0, -100, -100],
        ],
        dtype=np.float64,
    )
    return examples, features, (start, end)


def test_postprocess_by_hand(tmp_path):
    examples, features, logits = hand_worked_case()
    # a: best span (3, 4) = 3 + 4 = 7 "Denver Broncos"; b: its second feature's (4, 4) = 18 "Carolina"
    predictions, null_odds = postprocess_qa_predictions(
        examples, features, logits, output_dir=str(tmp_path), prefix="eval"
    )
    assert predictions == {"a": "Denver Broncos", "b": "Carolina"} and null_odds is None
    assert json.loads((tmp_path / "eval_predictions.json").read_text()) == predictions
    nbest = json.loads((tmp_path / "eval_nbest_predictions.json").read_text())
    assert nbest["a"][0] == {"start_logit": 3.0, "end_logit": 4.0, "score": 7.0, "text": "Denver Broncos",
                             "probability": pytest.approx(nbest["a"][0]["probability"])}
    assert sum(p["probability"] for p in nbest["a"]) == pytest.approx(1.0)
    # spans of one token only: a's best is (4, 4) = 1 + 4 = 5 "Broncos"
    short, _ = postprocess_qa_predictions(examples, features, logits, max_answer_length=1)
    assert short["a"] == "Broncos"
    # n_best 1: only the top start (index 1, the question) and top end (4) of a -> no valid span -> "empty"
    assert postprocess_qa_predictions(examples, features, logits, n_best_size=1)[0]["a"] == "empty"


def test_postprocess_v2_by_hand(tmp_path):
    examples, features, logits = hand_worked_case()
    predictions, null_odds = postprocess_qa_predictions(
        examples, features, logits, version_2_with_negative=True, output_dir=str(tmp_path)
    )
    # a: null 0 + 0 = 0, best 7 -> diff -7 -> answer; b: null min(9, 7) = 7, best 18 -> diff -11 -> answer
    assert null_odds == {"a": -7.0, "b": -11.0}
    assert predictions == {"a": "Denver Broncos", "b": "Carolina"}
    assert json.loads((tmp_path / "null_odds.json").read_text()) == null_odds
    # lift a's null score to 9 (diff +2 > 0): no answer, unless the threshold allows 2
    start, end = (x.copy() for x in logits)
    start[0, 0], end[0, 0] = 8, 1
    assert postprocess_qa_predictions(examples, features, (start, end), version_2_with_negative=True)[0]["a"] == ""
    assert postprocess_qa_predictions(
        examples, features, (start, end), version_2_with_negative=True, null_score_diff_threshold=2.5
    )[0]["a"] == "Denver Broncos"


# ---- tiny end-to-end runs -------------------------------------------------------------------------------------------


def word_vocab(*json_paths) -> dict[str, int]:
    words = set()
    for path in json_paths:
        for example in read_squad_json(path):
            words.update(re.findall(r"\w+|[^\w\s]", (example["context"] + " " + example["question"]).lower()))
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    return {token: i for i, token in enumerate(tokens)}


@pytest.fixture(scope="module")
def squad_slice(tmp_path_factory, dev_articles):
    """Train/eval json files from the Normans article of SQuAD v1.1 dev, and a tiny BertPkm QA model (+ tokenizer)."""
    from transformers import BertTokenizer

    folder = tmp_path_factory.mktemp("squad")
    paragraphs = dev_articles[2]["paragraphs"]
    train = squad_file(folder / "train.json", [article("Normans", *paragraphs[:3])])
    evaluation = squad_file(folder / "eval.json", [article("Normans", *paragraphs[3:5])])
    vocab = word_vocab(train, evaluation)
    model_dir = folder / "tiny"
    config = tiny_config(
        vocab_size=len(vocab), max_position_embeddings=128, hidden_dropout_prob=0.1, pkm_value_dropout=0.1
    )
    torch.manual_seed(0)
    BertPkmForQuestionAnswering(config).save_pretrained(model_dir)
    BertTokenizer(vocab=vocab).save_pretrained(model_dir)
    return {"folder": folder, "train": train, "eval": evaluation, "model": str(model_dir)}


def tiny_args(data, output_dir, *extra):
    return [
        "--model_name_or_path", data["model"], "--train_file", data["train"], "--validation_file", data["eval"],
        "--output_dir", str(output_dir), "--max_seq_length", "64", "--doc_stride", "16",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--seed", "3", *extra,
    ]  # fmt: skip


def test_end_to_end_and_exact_resume(squad_slice, tmp_path, monkeypatch):
    # 10 questions -> 44 features of 64 tokens -> 11 batches an epoch -> 6 optimizer steps (accumulation 2, the
    # last step of an epoch on 1 batch)
    common = ["--num_train_epochs", "2", "--gradient_accumulation_steps", "2"]
    pushed = []
    monkeypatch.setattr("modeling_pkm_bert.hub.upload.push_folder_to_hub", lambda *a, **k: pushed.append((a, k)))
    results = run_squad.main(
        tiny_args(squad_slice, tmp_path / "a", *common, "--checkpointing_steps", "3", "--push_to_hub",
                  "--hub_model_id", "someone/tiny-squad")  # fmt: skip
    )
    out = tmp_path / "a"
    assert (results["train_samples"], results["train_features"]) == (10, 44)
    assert results["step"] == 12 and results["epoch"] == 2
    for name in ("config.json", "model.safetensors", "modeling_bert_pkm.py", "tokenizer.json", "all_results.json",
                 "eval_predictions.json", "eval_nbest_predictions.json"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in out.glob("step_*")) == ["step_12", "step_3", "step_6", "step_9"]
    assert not list(out.glob("*.tmp"))
    predictions = json.loads((out / "eval_predictions.json").read_text())
    assert list(predictions) == [e["id"] for e in read_squad_json(squad_slice["eval"])]
    assert all(isinstance(text, str) for text in predictions.values())
    saved = json.loads((out / "all_results.json").read_text())
    assert saved["eval_samples"] == 4 and 0 <= saved["eval_exact_match"] <= saved["eval_f1"] <= 100
    assert saved["eval_memory/layer_1/tokens"] > 0 and 0 < saved["eval_memory/layer_1/mu"] <= 1
    assert {"train_loss", "train_runtime", "eval_runtime"} <= set(saved)
    # pushed once, with a model card carrying the results and the command
    (folder, repo_id), kwargs = pushed[0]
    assert len(pushed) == 1 and (folder, repo_id) == (str(out), "someone/tiny-squad")
    card = (out / "README.md").read_text()
    f1 = f"{saved['eval_f1']:,.2f}" if saved["eval_f1"] >= 100 else f"{saved['eval_f1']:.4f}"
    assert f"| F1 (`eval_f1`) | {f1} |" in card and "python run_scripts/run_squad.py --model_name_or_path" in card

    # resume mid-epoch 0 (step 3: 6 batches skipped) and mid-epoch 1 (step 9: 3 steps into it, 6 batches skipped)
    final = load_file(out / "model.safetensors")
    for checkpoint in ("step_3", "step_9"):
        resumed_dir = tmp_path / f"from_{checkpoint}"
        run_squad.main(tiny_args(squad_slice, resumed_dir, *common, "--resume_from_checkpoint", str(out / checkpoint)))
        resumed = load_file(resumed_dir / "model.safetensors")
        assert all(torch.equal(final[k], resumed[k]) for k in final), checkpoint
        assert json.loads((resumed_dir / "eval_predictions.json").read_text()) == predictions


def test_eval_steps_and_staleness(squad_slice, tmp_path):
    """--eval_steps evaluates during training (SQuAD scores in metrics.jsonl; none at epoch ends without it), and
    --track_staleness writes the per-slot staleness beside the model."""
    out = tmp_path / "out"
    results = run_squad.main(tiny_args(squad_slice, out, "--max_train_steps", "4", "--eval_steps", "2",
                                       "--track_staleness"))  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval_f1" in r]
    assert [r["step"] for r in evaluations] == [2, 4] and evaluations[-1]["eval_f1"] == results["eval_f1"]
    assert all({"eval_exact_match", "train_loss"} <= set(r) for r in evaluations)
    assert (out / "staleness.safetensors").is_file() and any(k.startswith("staleness/") for k in results)


def test_resume_at_a_step_evaluation_logs_as_the_uninterrupted_run(squad_slice, tmp_path):
    """--eval_steps 2 and --checkpointing_steps 2 meet at step 2: resumed from step_2, the run logs the uninterrupted
    run's records (the training loss of the step-4 evaluation averages steps 3 and 4 alone) and ends with its weights."""
    options = ("--max_train_steps", "4", "--eval_steps", "2", "--checkpointing_steps", "2")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_squad.main(tiny_args(squad_slice, full, *options))
    assert [r["step"] for r in metrics_records(full) if "eval_f1" in r] == [2, 4]
    reset_accelerate_state()
    run_squad.main(tiny_args(squad_slice, resumed, *options, "--resume_from_checkpoint", str(full / "step_2")))
    assert metrics_records(resumed) == metrics_records(full, after=2)
    reference, weights = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(reference[name], weights[name]) for name in reference)


def test_plain_bert_converted_on_load_and_frozen_memory(squad_slice, tmp_path):
    from transformers import BertConfig, BertModel

    # a plain BERT encoder with the tiny tokenizer's vocabulary, converted on load (+Init) by the --pkm_* flags
    plain = tmp_path / "plain"
    vocab_size = json.loads(open(os.path.join(squad_slice["model"], "config.json")).read())["vocab_size"]
    bert = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=128)  # fmt: skip
    BertModel(bert).save_pretrained(plain)
    pkm = ["--pkm_layers", "1", "--pkm_n_keys", "4", "--pkm_heads", "1", "--pkm_knn", "2", "--pkm_k_dim", "8"]
    weights = {}
    for steps in ("1", "3"):
        args = tiny_args(squad_slice, tmp_path / steps, "--max_train_steps", steps, "--freeze_memory", *pkm,
                         "--tokenizer_name", squad_slice["model"])  # fmt: skip
        args[args.index("--model_name_or_path") + 1] = str(plain)
        results = run_squad.main(args)
        assert "eval_memory/layer_1/mu" in results
        weights[steps] = load_file(tmp_path / steps / "model.safetensors")
    saved = json.loads((tmp_path / "3" / "config.json").read_text())
    assert saved["model_type"] == "bert_pkm" and saved["pkm_layers"] == [1] and saved["pkm_n_keys"] == 4
    # the same seeded +Init, then 1 or 3 steps: the frozen memory is the same, the rest has moved on
    memory = [k for k in weights["3"] if ".memory." in k and "running" not in k and "num_batches" not in k]
    assert memory and all(torch.equal(weights["1"][k], weights["3"][k]) for k in memory)
    assert not torch.equal(weights["1"]["qa_outputs.weight"], weights["3"]["qa_outputs.weight"])


@pytest.mark.filterwarnings("ignore:`log_with=all` was passed but no supported trackers")
def test_version_2_with_unanswerable_questions(squad_slice, tmp_path, capsys):
    paragraph = {
        "context": CONTEXT,
        "qas": [
            qa("v1", "Who won?", ("Denver Broncos", 4), ("The Denver Broncos", 0)),
            qa("v2", "Who lost in Dallas?", impossible=True),
            qa("v3", "Where?", ("Levi's Stadium", 55)),
        ],
    }
    data = squad_file(tmp_path / "v2.json", [article("SB", paragraph)], version="v2.0")
    args = tiny_args({**squad_slice, "train": data, "eval": data}, tmp_path / "out", "--max_train_steps", "1",
                     "--with_tracking", "--version_2_with_negative")  # fmt: skip
    results = run_squad.main(args)
    assert {"eval_exact", "eval_f1", "eval_HasAns_exact", "eval_NoAns_exact", "eval_best_f1"} <= set(results)
    assert results["eval_HasAns_total"] == 2 and results["eval_NoAns_total"] == 1
    odds = json.loads((tmp_path / "out" / "eval_null_odds.json").read_text())
    predictions = json.loads((tmp_path / "out" / "eval_predictions.json").read_text())
    assert set(odds) == set(predictions) == {"v1", "v2", "v3"}
    assert all((predictions[q] == "") == (odds[q] > 0.0) for q in odds)  # null_score_diff_threshold 0

    # the same file as SQuAD v1.1: a question without answer is an error naming it
    line = usage_error(capsys, lambda: run_squad.main(args[:-1]))
    assert re.search(r"1 question\(s\) without an answer \(e.g. \['v2'\]\).*--version_2_with_negative", line)


def test_bad_input_errors(squad_slice, tmp_path, capsys):
    wrong_start = article("SB", {"context": CONTEXT, "qas": [qa("w1", "Who won?", ("Denver Broncos", 9))]})
    data = squad_file(tmp_path / "wrong.json", [wrong_start])
    args = tiny_args({**squad_slice, "train": data}, tmp_path / "out", "--max_train_steps", "1")
    assert "'w1': answer 'Denver Broncos' is not in its context at " in usage_error(capsys, lambda: run_squad.main(args))
    run_squad.main([*args, "--fix_answer_starts"])  # found at 4: moved, the run goes through

    absent = article("SB", {"context": CONTEXT, "qas": [qa("w2", "Who won?", ("Kansas City", 4))]})
    args = tiny_args({**squad_slice, "eval": squad_file(tmp_path / "absent.json", [absent])}, tmp_path / "o2",
                     "--max_train_steps", "1", "--fix_answer_starts")  # fmt: skip
    assert re.search("'w2'.*occurs nowhere", usage_error(capsys, lambda: run_squad.main(args)))

    # a checkpoint whose head is not a 2-logit span head
    three = tmp_path / "three_labels"
    BertPkmForQuestionAnswering(tiny_config(vocab_size=50, num_labels=3)).save_pretrained(three)
    args = tiny_args(squad_slice, tmp_path / "o3", "--max_train_steps", "1", "--tokenizer_name", squad_slice["model"])
    args[args.index("--model_name_or_path") + 1] = str(three)
    assert "head of 3 labels; extractive QA needs 2" in usage_error(capsys, lambda: run_squad.main(args))

    for bad, message in (
        (["--doc_stride", "64"], "must be smaller than --max_seq_length"),
        (["--train_file", str(tmp_path / "missing.json")], "does not exist"),
        (["--train_file", str(tmp_path / "train.csv")], "must be a .json file"),
        (["--checkpointing_steps", "sometimes"], "integer or 'epoch'"),
    ):
        with pytest.raises(SystemExit):
            run_squad.parse_args(tiny_args(squad_slice, tmp_path / "o4", *bad))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="torchrun needs a POSIX system")
@pytest.mark.multiprocess
def test_two_processes_match_one(squad_slice, tmp_path):
    """2 CPU processes (gloo) train and evaluate; evaluating their model in 1 process gives the same predictions."""
    two = tmp_path / "two"
    options = ("--max_train_steps", "2", "--per_device_eval_batch_size", "3")
    completed = torchrun(REPO_ROOT / "run_scripts" / "run_squad.py", tiny_args(squad_slice, two, *options), timeout=240)
    assert "Num processes: 2" in completed.stderr
    two_predictions = json.loads((two / "eval_predictions.json").read_text())

    one = tmp_path / "one"
    args = tiny_args(squad_slice, one)
    args[args.index("--model_name_or_path") + 1] = str(two)
    args.remove("--train_file")
    args.remove(squad_slice["train"])
    results = run_squad.main(args)  # evaluation only: no training data
    assert "train_loss" not in results
    assert json.loads((one / "eval_predictions.json").read_text()) == two_predictions
    two_results = json.loads((two / "all_results.json").read_text())
    assert results["eval_f1"] == two_results["eval_f1"]
    # every feature's memory lookups counted once (no repeated features from evening out the last batch); the
    # usage statistics agree up to the few near-tie lookups that other batch paddings round differently
    assert results["eval_memory/layer_1/tokens"] == two_results["eval_memory/layer_1/tokens"] == 1182
    memory = [k for k in two_results if k.startswith("eval_memory/")]
    assert all(results[k] == pytest.approx(two_results[k], rel=0.02) for k in memory)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="torchrun needs a POSIX system")
@pytest.mark.multiprocess
def test_two_processes_with_memory_parallel_match_one(squad_slice, tmp_path):
    """FSDP2 with the value tables sharded column-wise (--memory_parallel) on 2 CPU processes: trains, and its
    consolidated folder evaluated in 1 process gives the same predictions."""
    two = tmp_path / "two"
    options = ("--max_train_steps", "2", "--per_device_eval_batch_size", "4", "--memory_parallel")
    completed = torchrun(REPO_ROOT / "run_scripts" / "run_squad.py", tiny_args(squad_slice, two, *options), timeout=240)
    assert "Num processes: 2" in completed.stderr
    two_results = json.loads((two / "all_results.json").read_text())
    one = tmp_path / "one"
    args = tiny_args(squad_slice, one)
    args[args.index("--model_name_or_path") + 1] = str(two)
    args.remove("--train_file")
    args.remove(squad_slice["train"])
    results = run_squad.main(args)  # the consolidated folder, evaluated in one process
    assert json.loads((one / "eval_predictions.json").read_text()) == json.loads((two / "eval_predictions.json").read_text())
    assert results["eval_f1"] == two_results["eval_f1"]
