"""GLUE metrics on hand-worked examples, the GLUE TSV readers on the real files, and the per-class memory usage."""

import math

import pytest
import torch
from helpers import tiny_config

from modeling_pkm_bert import BertPkmForSequenceClassification
from modeling_pkm_bert.training.glue_data import GLUE_TASKS, get_glue_task, load_glue_tsv, read_glue_tsv
from modeling_pkm_bert.analysis.class_usage import PerClassMemoryUsage, class_usage_divergence
from modeling_pkm_bert.training.glue_metrics import (
    accuracy,
    classification_metrics,
    f1,
    glue_compute_metrics,
    matthews_correlation,
    pearson,
    spearman,
)
from modeling_pkm_bert.analysis.memory_usage import MemoryUsageAccumulator, track_memory_usage


# predictions / references: TP at 0 and 3, FP at 2, FN at 4, TN at 1
PREDICTIONS = [1, 0, 1, 1, 0]
REFERENCES = [1, 0, 0, 1, 1]


def test_accuracy_f1_matthews_by_hand():
    assert accuracy(PREDICTIONS, REFERENCES) == pytest.approx(3 / 5)
    # P = TP / (TP + FP) = 2/3, R = TP / (TP + FN) = 2/3, F1 = 2PR / (P + R) = 2/3
    assert f1(PREDICTIONS, REFERENCES) == pytest.approx(2 / 3)
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6
    assert matthews_correlation(PREDICTIONS, REFERENCES) == pytest.approx(1 / 6)
    # degenerate cases: no positive anywhere, a single predicted class
    assert f1([0, 0], [0, 0]) == 0.0
    assert matthews_correlation([1, 1, 1], [1, 0, 1]) == 0.0


def test_pearson_spearman_by_hand():
    # x - mean = (-1.5, -0.5, 0.5, 1.5), y - mean = (-1.5, 0.5, -0.5, 1.5): sum of products 4, sums of squares 5 and 5
    assert pearson([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(4 / 5)
    # ranks with a tie: x -> (1, 2.5, 2.5, 4), y -> (1, 2, 3, 4); centred (-1.5, 0, 0, 1.5) and (-1.5, -.5, .5, 1.5):
    # 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    assert spearman([1.0, 2.0, 2.0, 3.0], [10.0, 20.0, 30.0, 40.0]) == pytest.approx(3 / math.sqrt(10))
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_glue_compute_metrics_names_per_task():
    assert glue_compute_metrics("cola", PREDICTIONS, REFERENCES) == pytest.approx({"matthews_correlation": 1 / 6})
    assert glue_compute_metrics("mrpc", PREDICTIONS, REFERENCES) == pytest.approx({"accuracy": 0.6, "f1": 2 / 3})
    assert glue_compute_metrics("qqp", PREDICTIONS, REFERENCES) == pytest.approx({"accuracy": 0.6, "f1": 2 / 3})
    for task in ("sst2", "mnli", "qnli", "rte", "wnli"):
        assert glue_compute_metrics(task, PREDICTIONS, REFERENCES) == pytest.approx({"accuracy": 0.6})
    assert glue_compute_metrics("stsb", [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(
        {"pearson": 0.8, "spearmanr": 0.8}
    )
    assert classification_metrics(PREDICTIONS, REFERENCES) == pytest.approx({"accuracy": 0.6, "f1": 2 / 3})
    assert classification_metrics([0, 2], [0, 1]) == {"accuracy": 0.5}
    with pytest.raises(ValueError, match="unknown GLUE task 'sst-2'"):
        glue_compute_metrics("sst-2", PREDICTIONS, REFERENCES)
    with pytest.raises(ValueError, match="4 predictions for 5 references"):
        accuracy(PREDICTIONS[:4], REFERENCES)


def test_every_glue_task_is_described():
    assert sorted(GLUE_TASKS) == ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli"]
    assert get_glue_task("stsb").is_regression and get_glue_task("stsb").num_labels == 1
    assert get_glue_task("mnli").num_labels == 3
    assert get_glue_task("mnli").validation_splits == ("validation_matched", "validation_mismatched")


# ---- GLUE's TSV files ----

REAL_FILES = {
    # task: (folder, rows of dev.tsv, rows of train.tsv, class counts of dev.tsv)
    "cola": ("CoLA", 1043, 8551, {1: 721, 0: 322}),
    "sst2": ("SST-2", 872, 67349, {1: 444, 0: 428}),
    "mrpc": ("MRPC", 408, 3668, {1: 279, 0: 129}),
    "rte": ("RTE", 277, 2490, {0: 146, 1: 131}),  # 0 = entailment (146), 1 = not_entailment (131)
}


@pytest.mark.parametrize("task", sorted(REAL_FILES))
def test_read_real_glue_tsv(shared_data, task):
    folder, dev_rows, train_rows, counts = REAL_FILES[task]
    dev = read_glue_tsv(shared_data / "glue" / folder / "dev.tsv", task)
    assert len(dev["label"]) == dev_rows
    assert {label: dev["label"].count(label) for label in counts} == counts
    assert dev["idx"] == list(range(dev_rows))
    assert len(read_glue_tsv(shared_data / "glue" / folder / "train.tsv", task)["label"]) == train_rows


def test_real_glue_tsv_rows(shared_data):
    glue = shared_data / "glue"
    # CoLA has no header: the first line is an example
    cola = load_glue_tsv(glue / "CoLA" / "dev.tsv", "cola")
    assert cola[0] == {"sentence": "The sailors rode the breeze clear of the rocks.", "label": 1, "idx": 0}
    assert cola.features["label"].names == ["unacceptable", "acceptable"]
    # MRPC: the byte-order mark does not hide the Quality column; quotes are text (QUOTE_NONE)
    mrpc = load_glue_tsv(glue / "MRPC" / "dev.tsv", "mrpc")
    assert mrpc[0]["label"] == 1
    assert mrpc[0]["sentence2"] == '" The foodservice pie business does not fit our long-term growth strategy .'
    # SST-2 keeps the sentence as written (trailing space included)
    sst2 = load_glue_tsv(glue / "SST-2" / "dev.tsv", "sst2")
    assert sst2[1] == {"sentence": "unflinchingly bleak and desperate ", "label": 0, "idx": 1}
    # RTE's string labels become the Hub's ids
    rte = load_glue_tsv(glue / "RTE" / "dev.tsv", "rte")
    assert rte[0]["sentence2"] == "Christopher Reeve had an accident." and rte[0]["label"] == 1  # not_entailment
    assert rte.features["label"].names == ["entailment", "not_entailment"]


def test_glue_tsv_errors(shared_data, tmp_path):
    with pytest.raises(ValueError, match=r"does not have the GLUE rte layout: header \['sentence', 'label'\]"):
        read_glue_tsv(shared_data / "glue" / "SST-2" / "dev.tsv", "rte")
    with pytest.raises(ValueError, match="holds no cola rows"):  # a 2-column file read as CoLA's 4 columns
        read_glue_tsv(shared_data / "glue" / "SST-2" / "dev.tsv", "cola")
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\ngood film\t1\nbad film\tneutral\n")
    with pytest.raises(ValueError, match=r"bad.tsv:3: label 'neutral' is not a sst2 label"):
        read_glue_tsv(bad, "sst2")
    with pytest.raises(ValueError, match="unknown GLUE task"):
        read_glue_tsv(bad, "sst")


def test_stsb_and_mnli_layouts(tmp_path):
    stsb = tmp_path / "stsb.tsv"
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    stsb.write_text(
        f"{header}\n0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA man plays.\tA man is playing.\t4.750\n"
    )
    assert read_glue_tsv(stsb, "stsb") == {
        "sentence1": ["A man plays."],
        "sentence2": ["A man is playing."],
        "label": [4.75],
        "idx": [0],
    }
    mnli = tmp_path / "dev_matched.tsv"
    columns = (
        "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse sentence2_parse"
    )
    mnli.write_text(
        "\t".join(columns.split() + ["sentence1", "sentence2", "label1", "label2", "gold_label"])
        + "\n"
        + "\t".join(["0", "1", "1n", "slate", "(", "(", "(", "(", "P.", "H.", "neutral", "neutral", "neutral"])
        + "\n0\ttoo short\n"
    )
    assert read_glue_tsv(mnli, "mnli") == {"premise": ["P."], "hypothesis": ["H."], "label": [1], "idx": [0]}


# ---- per-class memory usage (Figure 4) ----


def accumulator(indices, mem_size=4):
    acc = MemoryUsageAccumulator(mem_size)
    acc.update(torch.tensor(indices), torch.ones(len(indices), len(indices[0])))
    return acc


def test_class_usage_divergence_by_hand():
    # one slot per token: class 1 picks slots 0, 0, 1 (t' = 2, 1, 0, 0); class 0 picks 1, 2 (t' = 0, 1, 1, 0)
    result = class_usage_divergence(accumulator([[0], [0], [1]]), accumulator([[1], [2]]))
    # distributions (2/3, 1/3, 0, 0) and (0, 1/2, 1/2, 0): sum of minima 1/3, of maxima 2/3 + 1/2 + 1/2 = 5/3
    assert result["top1_iou"] == pytest.approx(1 / 5)
    assert result["top1_set_iou"] == pytest.approx(1 / 3)  # {0, 1} vs {1, 2}
    # smoothed with 1/N = 1/4 pseudo-count per slot: P1 = (2.25, 1.25, .25, .25) / 4, P0 = (.25, 1.25, 1.25, .25) / 3
    p1 = [2.25 / 4, 1.25 / 4, 0.25 / 4, 0.25 / 4]
    p0 = [0.25 / 3, 1.25 / 3, 1.25 / 3, 0.25 / 3]
    expected_kl = 0.5625 * math.log(6.75) + 0.3125 * math.log(0.75) + 0.0625 * math.log(0.15) + 0.0625 * math.log(0.75)
    assert sum(a * math.log(a / b) for a, b in zip(p1, p0)) == pytest.approx(expected_kl)
    assert result["top1_kl"] == pytest.approx(expected_kl)
    assert result["weight_kl"] == pytest.approx(expected_kl)  # one slot of weight 1 per token: w' = t'
    assert (result["tokens_1"], result["tokens_0"]) == (3, 2)
    same = class_usage_divergence(accumulator([[0], [1]]), accumulator([[1], [0]]))
    assert same["top1_iou"] == 1.0 and same["top1_kl"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="both classes need evaluation examples"):
        class_usage_divergence(accumulator([[0]]), MemoryUsageAccumulator(4))


def test_per_class_usage_routes_tokens_by_label():
    """Per-class counts from one padded, mixed batch equal the counts of each class's examples run alone."""
    model = BertPkmForSequenceClassification(tiny_config()).eval()  # eval: BatchNorm uses running statistics
    input_ids = torch.randint(5, 99, (4, 7))
    attention_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 5 + [0] * 2, [1] * 2 + [0] * 5])
    labels = torch.tensor([1, 0, 1, 0])
    with PerClassMemoryUsage(model, num_labels=2) as usage, torch.no_grad():
        usage.set_batch(labels, attention_mask)
        model(input_ids=input_ids, attention_mask=attention_mask)
    for label in (0, 1):
        rows = labels == label
        with track_memory_usage(model) as tracker, torch.no_grad():
            model(input_ids=input_ids[rows], attention_mask=attention_mask[rows])
        alone, routed = tracker.accumulators["layer_1"], usage.accumulators["layer_1"][label]
        assert int(routed.tokens) == int(attention_mask[rows].sum())
        assert torch.equal(routed.top1_counts, alone.top1_counts)
        assert torch.equal(routed.used_counts, alone.used_counts)
        assert torch.allclose(routed.weight_sums, alone.weight_sums)
    results = usage.results(["negative", "positive"])["layer_1"]
    assert {"top1_iou", "top1_kl", "mu_negative", "top1_mu_positive"} <= set(results)
    with PerClassMemoryUsage(model, num_labels=2), pytest.raises(RuntimeError, match="set_batch"):
        model(input_ids=input_ids)
