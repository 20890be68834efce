"""The memory report: figures, numbers equal to memory_usage's, clear errors and no half-written report."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import BertTokenizer

from helpers import REPO_ROOT, BertPkmModelTester, load_script, reset_accelerate_state, tiny_config, usage_error
from modeling_pkm_bert import BertPkmForMaskedLM, BertPkmModel
from modeling_pkm_bert.analysis import MemoryReportError, MetricsLog, write_memory_report
from modeling_pkm_bert.training.glue_data import class_data_from_files
from modeling_pkm_bert.analysis import report as report_module
from modeling_pkm_bert.analysis.class_usage import PerClassMemoryUsage
from modeling_pkm_bert.analysis.memory_usage import track_memory_usage


DATA = REPO_ROOT / "run_scripts" / "data"
PNG = b"\x89PNG\r\n\x1a\n"
TEXT = (DATA / "pride_and_prejudice_validation.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    BertPkmModelTester().get_tokenizer("validation", 200).save_pretrained(folder)
    return BertTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[0, 2])).eval()


def sst2_file(path, rows=24):
    sentences = [s.strip() for s in re.split(r"[.;!?]", TEXT.replace("\n", " ")) if len(s.split()) > 3][:rows]
    path.write_text("sentence\tlabel\n" + "".join(f"{s} \t{i % 2}\n" for i, s in enumerate(sentences)))
    return path


def markdown_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The cells of the table under `heading`, by first cell."""
    section = text.split(heading, 1)[1]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "layer":
            rows[cells[0]] = cells[1:]
    return rows


def test_report_figures_and_numbers_equal_memory_usage(model, tokenizer, tmp_path):
    out = tmp_path / "report"
    report = write_memory_report(model, tokenizer, out, texts=[TEXT], max_seq_length=32, max_sequences=10)

    # the same sequences through memory_usage's tracker, independently
    sequences = report_module.text_sequences(tokenizer, [TEXT], 32, 10)
    with track_memory_usage(model) as tracker, torch.no_grad():
        model(input_ids=torch.tensor([s["input_ids"] for s in sequences]))
    expected = tracker.results()
    assert report["usage"] == expected
    assert json.loads((out / "memory_report.json").read_text())["usage"] == expected
    rows = markdown_rows((out / "memory_report.md").read_text(), "## Usage per memory layer")
    for layer, m in expected.items():
        assert rows[layer][:7] == [
            str(m["tokens"]), f"{100 * m['mu']:.2f}", f"{100 * m['top1_mu']:.2f}", f"{m['kl_u']:.4f}",
            f"{m['kl_w']:.4f}", f"{m['gini_u']:.4f}", f"{m['gini_w']:.4f}",
        ]
    assert m["tokens"] == 10 * 32
    text = (out / "memory_report.md").read_text()
    for name in ("layer_0_heatmap.png", "layer_0_usage_curve.png", "layer_2_heatmap.png", "layer_2_usage_curve.png"):
        assert (out / name).read_bytes()[:8] == PNG
        assert f"]({name})" in text
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out / "layer_2_heatmap.png").shape
    assert 200 < height < 1000 and 300 < width < 1500  # small figures


def test_per_class_usage_equals_glue_metrics(model, tokenizer, tmp_path):
    classes = class_data_from_files(tokenizer, str(sst2_file(tmp_path / "dev.tsv")), "sst2", max_seq_length=32)
    report = write_memory_report(model, tokenizer, tmp_path / "report", class_data=classes, batch_size=5)

    per_class = PerClassMemoryUsage(model, 2).attach()
    with torch.no_grad():
        for start in range(0, len(classes.dataset), 5):
            rows = classes.dataset[start : start + 5]
            batch = tokenizer.pad([{k: r[k] for k in ("input_ids", "token_type_ids", "attention_mask")} for r in rows],
                                  return_tensors="pt")
            per_class.set_batch(torch.tensor([r["labels"] for r in rows]), batch["attention_mask"])
            model(**batch)
    per_class.detach()
    expected = per_class.results(["negative", "positive"])
    assert report["class_usage"] == expected
    rows = markdown_rows((tmp_path / "report" / "memory_report.md").read_text(), "## Per-class usage")
    assert rows["layer_2"][2:4] == [f"{expected['layer_2']['top1_kl']:.4f}", f"{expected['layer_2']['top1_iou']:.4f}"]
    assert (tmp_path / "report" / "class_usage.png").read_bytes()[:8] == PNG


def test_run_directory_gives_staleness_and_training_curves(model, tokenizer, tmp_path):
    run = tmp_path / "run"
    log = MetricsLog(str(run))
    for step in range(1, 11):
        log.log({"loss": 5.0 - 0.1 * step}, step=step)
        if step % 5 == 0:
            log.log({"eval_pride_perplexity": 100.0 / step, "eval_moby_perplexity": float("inf")}, step=step)
    last = {"layer_0": torch.tensor([-1] * 10 + [3] * 20 + [10] * 34), "layer_2": torch.where(torch.arange(64) < 6, -1, torch.arange(64) % 10 + 1)}
    save_file(last, str(run / "staleness.safetensors"), metadata={"step": "10", "never": "-1"})
    report = write_memory_report(model, tokenizer, tmp_path / "report", texts=[TEXT], run_dir=str(run),
                                 max_seq_length=32, max_sequences=4)
    histogram = report["staleness"]["histogram"]
    assert histogram["layer_0"] == {"never": 10, "1-2": 0, "3-4": 20, "5-6": 0, "7-8": 0, "9-10": 34}
    assert sum(histogram["layer_2"].values()) == 64 and histogram["layer_2"]["never"] == 6
    text = (tmp_path / "report" / "memory_report.md").read_text()
    assert "| layer_0 | 10 | 0 | 20 | 0 | 0 | 34 |" in text
    for name in ("staleness.png", "training_curves.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == PNG


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("case", ["no memory", "run dir without logs", "text too short", "no labels", "one class"])
def test_bad_input_is_a_clear_error_and_writes_nothing(case, model, tokenizer, tmp_path):
    out = tmp_path / "report"
    kwargs = {"texts": [TEXT], "max_seq_length": 32}
    target = model
    if case == "no memory":
        target, message = BertPkmModel(tiny_config(vocab_size=200, pkm_layers=[])), "no product key memory"
    elif case == "run dir without logs":
        (tmp_path / "run").mkdir()
        kwargs["run_dir"], message = str(tmp_path / "run"), "neither a metrics log"
    elif case == "text too short":
        kwargs["texts"], message = ["it is a truth universally acknowledged"], "too short for one sequence of 32"
    else:
        rows = "sentence\nsome words here\n" if case == "no labels" else "sentence,label\nsome words,1\nmore words,1\n"
        (tmp_path / "plain.csv").write_text(rows)
        message = "no 'label' column" if case == "no labels" else "at least two classes"
        with pytest.raises(MemoryReportError, match=message):
            class_data_from_files(tokenizer, str(tmp_path / "plain.csv"))
        return
    with pytest.raises(MemoryReportError, match=message):
        write_memory_report(target, tokenizer, out, **kwargs)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_a_failure_midway_leaves_the_previous_report(model, tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "report"
    write_memory_report(model, tokenizer, out, texts=[TEXT], max_seq_length=32, max_sequences=4)
    before = sorted(p.name for p in out.iterdir())

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report_module, "plot_usage_curve", broken)  # after the first heat map was written
    with pytest.raises(RuntimeError, match="disk full"):
        write_memory_report(model, tokenizer, out, texts=[TEXT], max_seq_length=32, max_sequences=4)
    assert sorted(p.name for p in out.iterdir()) == before
    assert _leftovers(tmp_path) == []


def test_cli_on_a_saved_folder_and_its_errors(model, tokenizer, tmp_path, capsys):
    cli = load_script("memory_report")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    dev = sst2_file(tmp_path / "dev.tsv")
    out = tmp_path / "report"
    cli.main(["--model_name_or_path", str(folder), "--task_name", "sst2", "--train_file", str(dev),
              "--max_seq_length", "32", "--max_sequences", "4", "--output_dir", str(out)])
    text = (out / "memory_report.md").read_text()
    assert "## Usage per memory layer" in text and "## Per-class usage" in text

    plain = tmp_path / "plain"
    BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[])).save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    line = usage_error(capsys, lambda: cli.main(["--model_name_or_path", str(plain), "--output_dir", str(tmp_path / "none")]))
    assert "no product key memory" in line
    (tmp_path / "empty_run").mkdir()
    line = usage_error(capsys, lambda: cli.main(["--model_name_or_path", str(folder), "--run_dir", str(tmp_path / "empty_run"),
                                                 "--output_dir", str(tmp_path / "none")]))  # fmt: skip
    assert "metrics.jsonl" in line
    assert not (tmp_path / "none").exists()


def test_scripts_write_metrics_log_and_memory_report(tokenizer, tmp_path):
    """run_glue.py and run_squad.py with --memory_report: metrics.jsonl, and the report of the final model with the
    per-class usage (GLUE) and the training curves."""
    folder = tmp_path / "model"
    from modeling_pkm_bert import BertPkmForQuestionAnswering, BertPkmForSequenceClassification

    BertPkmForSequenceClassification(tiny_config(vocab_size=200, num_labels=2)).save_pretrained(folder / "glue")
    BertPkmForQuestionAnswering(tiny_config(vocab_size=200)).save_pretrained(folder / "squad")
    for name in ("glue", "squad"):
        tokenizer.save_pretrained(folder / name)
    dev = sst2_file(tmp_path / "dev.tsv")
    load_script("run_glue").main([
        "--model_name_or_path", str(folder / "glue"), "--task_name", "sst2", "--train_file", str(dev),
        "--validation_file", str(dev), "--max_train_steps", "3", "--per_device_train_batch_size", "8",
        "--max_length", "32", "--output_dir", str(tmp_path / "glue"), "--memory_report", "--seed", "1",
    ])  # fmt: skip
    reset_accelerate_state()  # run_squad's Accelerator below starts afresh
    records = [json.loads(line) for line in (tmp_path / "glue" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3] and "eval_accuracy" in records[-1]
    text = (tmp_path / "glue" / "memory_report" / "memory_report.md").read_text()
    assert "## Per-class usage" in text and "training_curves.png" in text

    context = " ".join(TEXT.split()[:60])
    answer = TEXT.split()[10]
    qas = [{"id": str(i), "question": f"what is word {i}", "answers": [{"text": answer, "answer_start": context.index(answer)}]}
           for i in range(4)]
    squad = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    load_script("run_squad").main([
        "--model_name_or_path", str(folder / "squad"), "--train_file", str(tmp_path / "squad.json"),
        "--validation_file", str(tmp_path / "squad.json"), "--max_seq_length", "64", "--doc_stride", "16",
        "--max_train_steps", "2", "--output_dir", str(tmp_path / "squad"), "--memory_report", "--seed", "1",
    ])  # fmt: skip
    assert (tmp_path / "squad" / "metrics.jsonl").is_file()
    report = json.loads((tmp_path / "squad" / "memory_report" / "memory_report.json").read_text())
    assert report["usage"]["layer_1"]["tokens"] > 0


def test_report_of_n_gram_memories_counts_buckets_collisions_and_gates(tokenizer, tmp_path):
    """Issue 35: bucket usage, collisions and the gate of each n-gram memory, with a figure; an n-gram-only model too."""
    from modeling_pkm_bert.analysis.ngram_usage import NgramUsageTracker

    torch.manual_seed(0)
    config = tiny_config(vocab_size=200, pkm_layers=[], ngram_layers=[0, 2], ngram_table_size=53, ngram_heads=2, ngram_dim=4)
    model = BertPkmForMaskedLM(config).eval()
    report = write_memory_report(model, tokenizer, tmp_path / "report", texts=[TEXT], max_seq_length=32, max_sequences=6)
    usage = report["ngram_usage"]
    assert sorted(usage) == ["layer_0", "layer_2"] and report["usage"] == {}
    layer = usage["layer_0"]
    memory = model.bert.encoder.layer[0].ngram
    assert layer["tokens"] == 6 * 32 and layer["rows"] == sum(memory.primes)
    # recount: the rows read by the real tokens' own n-grams
    ids = torch.tensor([row["input_ids"] for row in report_module.text_sequences(tokenizer, [TEXT], 32, 6)])
    rows = memory.bucket_indices(memory.context_tokens(ids))[:, memory.conv_left : memory.conv_left + 32]
    assert layer["bucket_usage"] == pytest.approx(rows.unique().numel() / sum(memory.primes))
    # 8 tables of <= 53 rows for ~190 tokens: collisions are certain, every head colliding is rarer
    assert all(0 < layer["collision_any_head"][k] <= 1 for k in layer["collision_any_head"])
    assert all(layer["collision_every_head"][k] <= layer["collision_any_head"][k] for k in layer["collision_any_head"])
    assert sum(layer["gate_histogram"]) == layer["tokens"] and 0 < layer["gate_mean"] < 1
    text = (tmp_path / "report" / "memory_report.md").read_text()
    assert "## n-gram memories" in text and "layer_0_ngram.png" in text
    assert (tmp_path / "report" / "layer_0_ngram.png").read_bytes()[:8] == PNG
    assert set(NgramUsageTracker(model).memories) == {"layer_0", "layer_2"}
