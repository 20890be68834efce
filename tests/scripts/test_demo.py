"""The demo's knowledge stage: its data (a fact a line, each value a span) and its run_mlm.py command (value masking)."""

import json
import sys

from helpers import load_script


def test_the_demo_teaches_its_facts_with_value_masking(tmp_path, monkeypatch):
    script = load_script("demo")
    monkeypatch.setattr(sys, "argv", ["demo.py", "--output_dir", str(tmp_path / "out"), "--knowledge_people", "3",
                                      "--knowledge_memory_learning_rate", "3e-3"])  # fmt: skip
    args = script.parse_args()
    kb = script.write_knowledge_data(args, tmp_path / "data")
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 5 * 8  # 8 sentences a person and attribute
    values = {person[a] for person in kb["people"] for a in kb["attributes"]}
    for row in rows:
        ((start, end),) = row["spans"]
        assert row["text"][start:end] in values and row["text"].endswith(".")
    command = script.knowledge_command(args, "MODEL", tmp_path / "data", tmp_path / "run", pkm=True)
    after = lambda flag: command[command.index(flag) + 1]  # noqa: E731
    assert after("--train_file").endswith("train.jsonl") and after("--span_column") == "spans"
    assert after("--mask_replace_prob") == "1" and after("--memory_learning_rate") == "0.003"
    plain = script.knowledge_command(args, "MODEL", tmp_path / "data", tmp_path / "run", pkm=False)
    assert "--memory_learning_rate" not in plain and "--pkm_layers" not in plain and after("--span_column") == "spans"
