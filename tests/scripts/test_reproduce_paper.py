"""The reproduction study's whole pipeline (stage 0, Table 2 rows, fine-tuning, ablation, report) on a tiny BERT."""

import re
from pathlib import Path

import pytest
from transformers import BertConfig, BertForMaskedLM

from helpers import REPO_ROOT, BertPkmModelTester, load_script


DATA = REPO_ROOT / "run_scripts" / "data"


def tiny_bert(folder: Path) -> None:
    """A 6-layer BERT masked LM (memories go to layers 2 and 4) with a word-level tokenizer of the embedded text."""
    BertPkmModelTester().get_tokenizer("train", 200).save_pretrained(folder)
    config = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=130)
    BertForMaskedLM(config).save_pretrained(folder)


def tiny_glue(data: Path) -> None:
    """SST-2 and CoLA files in GLUE's layout, made of sentences of the embedded text (labels alternate)."""
    sentences = [s.strip().replace("\t", " ") for s in re.split(r"[.!?]", (DATA / "moby_dick_validation.txt").read_text())]
    sentences = [s.replace("\n", " ") for s in sentences if len(s.split()) > 3][:40]
    for split in ("train", "dev"):
        sst = data / "glue" / "SST-2"
        sst.mkdir(parents=True, exist_ok=True)
        (sst / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{s} \t{i % 2}\n" for i, s in enumerate(sentences)))
        cola = data / "glue" / "CoLA"
        cola.mkdir(parents=True, exist_ok=True)
        (cola / f"{split}.tsv").write_text("".join(f"src\t{i % 2}\t\t{s}\n" for i, s in enumerate(sentences)))
    wiki = data / "wikitext-2-raw"
    wiki.mkdir(parents=True)
    (wiki / "wiki.test.raw").write_text((DATA / "pride_and_prejudice_validation.txt").read_text())


@pytest.mark.slow  # end to end: the reproduction pipeline (45 s on 2 cores)
def test_tiny_study_runs_every_stage_and_writes_the_report(tmp_path):
    model, data = tmp_path / "tiny", tmp_path / "data"
    tiny_bert(model)
    tiny_glue(data)
    report = tmp_path / "out" / "REPRODUCTION.md"
    study = load_script("runner", folder="benchmarks/studies/reproduce_paper")
    argv = ["--budget", "tiny", "--model", str(model), "--data_dir", str(data), "--work_dir", str(tmp_path / "runs"),
            "--report", str(report), "--in_process", "--tasks", "sst2"]
    study.main(argv)
    text = report.read_text()
    for heading in ("Table 2", "Figure 3", "Figure 2", "Tables 4 and 5", "Table 6", "Figure 4", "claims"):
        assert heading in text
    for claim in ("+Init helps", "ResM beats PKM", "ResM' vs ResM", "Staleness", "Memory usage", "Fixing the memory hurts"):
        assert f"**{claim}**" in text
    figures = sorted(p.name for p in (tmp_path / "out" / "reproduction").iterdir() if p.name != ".reproduce_paper")
    assert {"figure2_staleness.png", "figure3_training_curves.png", "figure4_sst2_class_usage.png"} <= set(figures)
    for name in figures:
        assert (tmp_path / "out" / "reproduction" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"reproduction/{name}" in text

    # resume: every run exists, so a second call trains nothing and rewrites the same tables
    runs = tmp_path / "runs"
    stamps = {p: p.stat().st_mtime for p in runs.glob("*/*/all_results.json")}
    assert len(stamps) == 4 + 4 + 1  # Table 2 rows, SST-2 on each row, the fixed-memory ablation of PKM
    study.main([*argv, "--note", "beside the test suite"])
    assert {p: p.stat().st_mtime for p in runs.glob("*/*/all_results.json")} == stamps
    again = report.read_text()
    assert again.split("## Table 2")[1] == text.split("## Table 2")[1]
    assert "CPU only; beside the test suite)" in again and "--note" not in again and "CPU only)" in text
