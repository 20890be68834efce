"""Sparse memory finetuning: rankers against hand-computed examples, only the chosen value rows change (each value
optimizer, dense and sparse gradients, shared tables), background statistics (padding, merge, reload, errors), the
background blocks of a masked and of a causal LM, the transformers.Trainer callback, run_mlm.py (exact resume, 2
processes; run_clm.py's are in test_run_clm.py) and the benchmark's --quick mode."""

import contextlib
import math
import os

import pytest
import torch
from helpers import (
    REPO_ROOT,
    BertPkmModelTester,
    load_script,
    make_tiny_folder,
    reset_accelerate_state,
    tiny_config,
    torchrun,
    usage_error,
)

from modeling_pkm_bert import BertPkmForMaskedLM
from modeling_pkm_bert.methods.sparse_finetuning.arguments import STATISTICS_NAME
from modeling_pkm_bert.methods.optimizers import SparseRowAdam, pkm_value_parameters, set_sparse_values
from modeling_pkm_bert.methods.sparse_finetuning import (
    BackgroundStatistics,
    ReadCounter,
    SparseMemoryFinetuning,
    SparseMemoryFinetuningCallback,
    background_batches,
    choose_slots,
    compute_background_statistics,
    freeze_all_but_values,
    gradient_scores,
    kl_scores,
    rank_slots,
    row_gradient_norms,
    tfidf_scores,
    validate_top_t,
)


# ---- rankers ----


def test_tfidf_against_hand_computed_scores_ties_and_unread_slots():
    counts = torch.tensor([2, 0, 1, 1, 4])
    df = torch.tensor([0, 0, 3, 3, 9])
    n = 9
    scores = tfidf_scores(counts, df, n)
    expected = [2 / 8 * math.log(10 / 1), -math.inf, 1 / 8 * math.log(10 / 4), 1 / 8 * math.log(10 / 4), 0.0]
    assert scores.tolist() == pytest.approx(expected)
    # slot 4 is read most but in every background batch: idf 0; slots 2 and 3 tie: the lower index goes first
    assert choose_slots(scores, 2).tolist() == [0, 2]
    assert choose_slots(scores, 3).tolist() == [0, 2, 3]
    # t above the number of read slots: every read slot, never the unread slot 1 (even with score 0 for slot 4)
    assert choose_slots(scores, 5).tolist() == [0, 2, 3, 4]


def test_kl_against_hand_computed_scores():
    counts = torch.tensor([3, 1, 0, 0])
    background = torch.tensor([0, 5, 2, 1])
    scores = kl_scores(counts, background)
    q = [1 / 12, 6 / 12, 3 / 12, 2 / 12]
    p = [3 / 4, 1 / 4]
    assert scores.tolist()[:2] == pytest.approx([p[0] * math.log(p[0] / q[0]), p[1] * math.log(p[1] / q[1])])
    assert scores[2:].tolist() == [-math.inf, -math.inf]
    # a negative score (read less than in the background) is still eligible; unread slots never
    assert scores[1] < 0 and choose_slots(scores, 3).tolist() == [0, 1]
    statistics = BackgroundStatistics({"layer_0": 4})
    statistics.reads["layer_0"] = background
    assert rank_slots(counts, statistics, "layer_0", 1, "kl").tolist() == [0]


def test_gradient_ranker_against_hand_computed_norms():
    counts = torch.tensor([1, 0, 2, 5, 1])
    gradient = torch.tensor([4.0, 9.0, 1.0, 0.25, math.nan], dtype=torch.float64)
    scores = gradient_scores(counts, gradient)
    # slot 1 has the largest gradient but was not read (a shared table's other layer): never this layer's choice; a
    # non-finite norm ranks first (the step is skipped or diverges anyway), never dropped
    assert scores[1] == -math.inf and scores[4] == torch.finfo(torch.float64).max
    assert choose_slots(scores, 2).tolist() == [0, 4]
    assert rank_slots(counts, None, "layer_0", 3, "gradient", gradient).tolist() == [0, 2, 4]
    assert choose_slots(scores, 5).tolist() == [0, 2, 3, 4]
    with pytest.raises(ValueError, match="needs row_gradient"):
        rank_slots(counts, None, "layer_0", 3, "gradient")


def test_gradient_kl_ranker_is_kl_with_the_gradient_mass_in_place_of_reads():
    counts = torch.tensor([1, 1, 1, 0])
    gradient = torch.tensor([6.0, 3.0, 1.0, 50.0], dtype=torch.float64)  # slot 3 unread (another layer's rows)
    background = torch.tensor([99, 0, 0, 0])
    statistics = BackgroundStatistics({"layer_0": 4})
    statistics.reads["layer_0"] = background
    q = [100 / 103, 1 / 103, 1 / 103]
    p = [0.6, 0.3, 0.1]
    expected = [pi * math.log(pi / qi) for pi, qi in zip(p, q)]
    scores = kl_scores(torch.tensor([6.0, 3.0, 1.0, 0.0]), background)
    assert scores[:3].tolist() == pytest.approx(expected) and scores[3] == -math.inf
    # slot 0 has the largest gradient but the background reads it most: the gradient ranker takes it first, this one last
    assert rank_slots(counts, statistics, "layer_0", 1, "gradient", gradient).tolist() == [0]
    assert rank_slots(counts, statistics, "layer_0", 2, "gradient_kl", gradient).tolist() == [1, 2]
    # a read slot without gradient scores 0 (p log(p / q) -> 0): above slot 0's negative score, never dropped
    no_gradient = torch.tensor([6.0, 3.0, 0.0, 50.0], dtype=torch.float64)
    assert rank_slots(counts, statistics, "layer_0", 2, "gradient_kl", no_gradient).tolist() == [1, 2]
    assert rank_slots(counts, statistics, "layer_0", 4, "gradient_kl", no_gradient).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="the gradient_kl ranker needs background statistics"):
        SparseMemoryFinetuning(tiny_model(), None, top_t=4, ranker="gradient_kl")


def test_unread_ranker_takes_only_rows_no_background_document_read():
    counts = torch.tensor([2, 0, 1, 3, 4])
    df = torch.tensor([0, 0, 0, 1, 9])
    statistics = BackgroundStatistics({"layer_0": 5})
    statistics.document_frequency["layer_0"], statistics.num_batches = df, 36
    # TF-IDF over 36 documents ranks slot 3 (read once in the background) first: 3/10 log(37/2) > 2/10 log(37)
    assert rank_slots(counts, statistics, "layer_0", 1, "tfidf").tolist() == [3]
    # unread: the step's most read slots among those the background never read; slots 3 and 4 never, whatever t
    assert rank_slots(counts, statistics, "layer_0", 1, "unread").tolist() == [0]
    assert rank_slots(counts, statistics, "layer_0", 5, "unread").tolist() == [0, 2]
    # a step reading only background rows trains nothing
    assert rank_slots(torch.tensor([0, 0, 0, 3, 4]), statistics, "layer_0", 5, "unread").tolist() == []


@pytest.mark.parametrize("optimizer_name,sparse", [("sgd", False), ("adam", False), ("sparse_row_adam", True)])
def test_unread_ranker_leaves_the_background_outputs_bit_identical(optimizer_name, sparse):
    """The unread ranker writes only rows no background document reads, so the model's outputs on the background are
    exactly what they were, however far the new data moved the values."""
    model = tiny_model(pkm_layers=[0, 2], pkm_n_keys=16)  # 256 slots: room the background does not read
    background = batches(2, seed=2)
    statistics = compute_background_statistics(model, background)
    model.eval()
    with torch.no_grad():
        before = [model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in background]
    freeze_all_but_values(model)
    set_sparse_values(model, sparse)
    optimizer = value_optimizer(optimizer_name, model)
    smf = SparseMemoryFinetuning(model, statistics, top_t=50, ranker="unread").attach(optimizer)
    tables = {layer: memory.values.weight.detach().clone() for layer, memory in smf.memories.items()}
    model.train()
    for batch in batches(4, seed=3):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for layer, rows in smf.chosen.items():
            assert (statistics.document_frequency[layer][rows] == 0).all()
    for layer, memory in smf.memories.items():
        changed = (memory.values.weight != tables[layer]).any(1)
        assert changed.any() and (statistics.document_frequency[layer][changed] == 0).all(), layer
    model.eval()
    with torch.no_grad():
        after = [model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in background]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_unread_ranker_on_background_text_alone_changes_nothing():
    model = tiny_model(pkm_layers=[0, 2])
    data = batches(2, seed=4)
    statistics = compute_background_statistics(model, data)  # every row the training batches read, the background read
    freeze_all_but_values(model)
    optimizer = value_optimizer("sgd", model)
    smf = SparseMemoryFinetuning(model, statistics, top_t=50, ranker="unread").attach(optimizer)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    for batch in data:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(rows.numel() == 0 for rows in smf.chosen.values()) and smf.steps == 2
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items() if not name.endswith("num_batches_tracked"))


def test_row_gradient_norms_of_dense_and_sparse_gradients_agree():
    norms = {}
    for sparse in (False, True):
        model = tiny_model(pkm_layers=[0, 2])
        freeze_all_but_values(model)
        set_sparse_values(model, sparse)
        model.eval()
        model(**batches(1, seed=3, pad=2)[0]).loss.backward()
        weight = model.bert.encoder.layer[2].memory.values.weight
        assert weight.grad.is_sparse == sparse
        norms[sparse] = row_gradient_norms(weight)
        if not sparse:
            assert torch.allclose(norms[sparse], weight.grad.double().pow(2).sum(1))
    assert norms[False].dtype == torch.float64 and (norms[False] > 0).any()
    assert torch.allclose(norms[False], norms[True], rtol=1e-6, atol=1e-15)
    assert torch.equal(row_gradient_norms(torch.nn.Parameter(torch.ones(3, 2))), torch.zeros(3, dtype=torch.float64))


def test_ties_are_broken_by_the_lower_slot_index():
    scores = torch.tensor([1.0, 2.0, 2.0, 1.0, 2.0], dtype=torch.float64)
    assert choose_slots(scores, 2).tolist() == [1, 2]
    assert choose_slots(scores, 4).tolist() == [0, 1, 2, 4]


# ---- background statistics ----


def tiny_model(**overrides):
    return BertPkmModelTester().get_model(BertPkmForMaskedLM, seed=0, **overrides)


def batches(count, seed=1, batch=3, length=10, pad=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(5, 99, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        if pad:
            mask[:, -pad:] = 0
            ids[:, -pad:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids})
    return out


def test_statistics_count_reads_without_padding_and_reload_exactly(tmp_path):
    model = tiny_model()
    config = model.config
    statistics = compute_background_statistics(model, batches(4, pad=3))
    reads = statistics.reads["layer_1"]
    assert statistics.num_batches == 4 and reads.shape == (64,)
    # padding excluded: 4 batches x 3 sequences x 7 real tokens x heads x knn reads
    assert reads.sum() == 4 * 3 * 7 * config.pkm_heads * config.pkm_knn
    df = statistics.document_frequency["layer_1"]
    assert df.max() <= 4 and torch.equal(df > 0, reads > 0)
    assert model.training  # the mode is restored
    path = statistics.save(tmp_path)
    assert os.path.basename(path) == STATISTICS_NAME
    assert BackgroundStatistics.load(tmp_path) == statistics
    # the padded positions change nothing: same counts as the unpadded 7-token batches
    short = [{k: v[:, :7] for k, v in b.items()} for b in batches(4, pad=3)]
    assert compute_background_statistics(model, short) == statistics


def test_statistics_merge_equals_one_pass_over_all_batches():
    model = tiny_model()
    data = batches(5)
    whole = compute_background_statistics(model, data)
    merged = compute_background_statistics(model, data[0::2]).merge(compute_background_statistics(model, data[1::2]))
    assert merged == whole and merged.num_batches == 5


class _DigitTokenizer:
    """Each word is its own id; the special tokens given (None: the tokenizer has none, as GPT-2 has no [CLS])."""

    def __init__(self, cls_token_id=None, sep_token_id=None, eos_token_id=None):
        self.cls_token_id, self.sep_token_id, self.eos_token_id = cls_token_id, sep_token_id, eos_token_id

    def __call__(self, texts, add_special_tokens=True):
        assert not add_special_tokens
        return {"input_ids": [[int(word) for word in text.split()] for text in texts]}


def test_background_blocks_are_cut_as_the_script_cuts_its_training_text():
    """A masked LM's blocks lie between [CLS] and [SEP] (run_mlm.py); a causal LM's have no special token, each text
    followed by the end-of-text token, else [SEP] (run_clm.py)."""
    texts = ["1 2 3", "4 5"]
    mlm = background_batches(_DigitTokenizer(cls_token_id=7, sep_token_id=9), texts, 4, batch_size=2)
    assert [b["input_ids"].tolist() for b in mlm] == [[[7, 1, 2, 9], [7, 3, 4, 9]]]
    gpt = background_batches(_DigitTokenizer(eos_token_id=0), texts, 3, batch_size=1, causal=True)
    assert [b["input_ids"].tolist() for b in gpt] == [[[1, 2, 3]], [[0, 4, 5]]]  # the last partial block dropped
    bert = background_batches(_DigitTokenizer(cls_token_id=7, sep_token_id=9), texts, 3, batch_size=2, causal=True)
    assert [b["input_ids"].tolist() for b in bert] == [[[1, 2, 3], [9, 4, 5]]]
    assert all(torch.equal(b["attention_mask"], torch.ones_like(b["input_ids"])) for b in gpt + bert)


def test_bad_statistics_and_arguments_are_clear_errors(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="max_batches=0 must be >= 1"):
        compute_background_statistics(model, batches(2), max_batches=0)
    with pytest.raises(ValueError, match="the background set is empty"):
        compute_background_statistics(model, [])
    other = compute_background_statistics(tiny_model(pkm_n_keys=6), batches(1))
    with pytest.raises(ValueError, match=r"'layer_1': 36.*'layer_1': 64"):
        SparseMemoryFinetuning(model, other, top_t=4)
    empty = BackgroundStatistics.for_model(model)
    empty.save(tmp_path / "empty.safetensors")
    with pytest.raises(ValueError, match="counts no background batch"):
        BackgroundStatistics.load(tmp_path / "empty.safetensors")
    statistics = compute_background_statistics(model, batches(1))
    for bad in (0, -1, 65, 2.5):
        with pytest.raises(ValueError, match=r"top_t=.* must be an integer in \[1, 64\]"):
            SparseMemoryFinetuning(model, statistics, top_t=bad)
    with pytest.raises(ValueError, match="ranker"):
        SparseMemoryFinetuning(model, statistics, top_t=4, ranker="bm25")
    with pytest.raises(ValueError, match="the kl ranker needs background statistics"):
        SparseMemoryFinetuning(model, None, top_t=4, ranker="kl")
    with pytest.raises(ValueError, match=r"top_t=65 must be an integer in \[1, 64\]"):
        SparseMemoryFinetuning(model, None, top_t=65, ranker="gradient")
    with pytest.raises(ValueError, match="does not exist"):
        BackgroundStatistics.load(tmp_path / "missing.safetensors")


# ---- the update ----


def value_optimizer(name, model):
    values = pkm_value_parameters(model)
    if name == "sgd":
        return torch.optim.SGD(values, lr=1.0)
    if name == "adam":
        return torch.optim.Adam(values, lr=1e-2)
    return SparseRowAdam(values, lr=1e-2)


@pytest.mark.parametrize(
    "optimizer_name,sparse,ranker",
    [
        ("sgd", False, "tfidf"),
        ("sgd", False, "kl"),
        ("sgd", True, "tfidf"),
        ("adam", False, "kl"),  # momentum would move rows chosen earlier: they are put back
        ("sparse_row_adam", False, "tfidf"),
        ("sparse_row_adam", True, "kl"),
        ("sgd", False, "gradient"),
        ("adam", False, "gradient"),
        ("sparse_row_adam", True, "gradient"),
        ("sgd", True, "gradient_kl"),
    ],
)
def test_only_chosen_rows_change_and_nothing_else_when_frozen(optimizer_name, sparse, ranker):
    model = tiny_model(pkm_layers=[0, 2])
    statistics = compute_background_statistics(model, batches(6, seed=2)) if ranker != "gradient" else None
    freeze_all_but_values(model)
    set_sparse_values(model, sparse)
    optimizer = value_optimizer(optimizer_name, model)
    smf = SparseMemoryFinetuning(model, statistics, top_t=5, ranker=ranker).attach(optimizer)
    model.train()
    for batch in batches(4, seed=3, pad=2):
        before = {name: p.detach().clone() for name, p in model.state_dict().items()}
        with ReadCounter(model, training_only=True) as counter:
            model(**batch).loss.backward()
        gradients = {layer: row_gradient_norms(memory.values.weight) for layer, memory in smf.memories.items()}
        optimizer.step()
        optimizer.zero_grad()
        after = model.state_dict()
        for layer, memory in smf.memories.items():
            expected = rank_slots(counter.counts[layer], statistics, layer, 5, ranker, gradients[layer])
            assert torch.equal(smf.chosen[layer], expected) and expected.numel() == 5
            if ranker == "gradient":  # the 5 read rows of largest gradient: none left out has a larger one
                left_out = torch.ones_like(gradients[layer], dtype=torch.bool)
                left_out[expected] = False
                assert gradients[layer][expected].min() >= gradients[layer][left_out].max()
            name = next(n for n, p in model.state_dict(keep_vars=True).items() if p is memory.values.weight)
            changed = (after[name] != before[name]).any(1).nonzero().squeeze(1)
            assert set(changed.tolist()) <= set(expected.tolist()) and changed.numel() > 0, layer
        weights = {n for n, p in model.state_dict(keep_vars=True).items() if any(p is v for v in pkm_value_parameters(model))}
        # num_batches_tracked counts forwards; with momentum 0 it weighs nothing: the running statistics stay fixed
        moved = [n for n in after if n not in weights and not torch.equal(after[n], before[n])]
        assert [n for n in moved if not n.endswith("num_batches_tracked")] == []
    assert smf.steps == 4


def test_shared_table_takes_the_union_of_its_layers_choices():
    model = tiny_model(pkm_layers=[0, 2])
    memories = list(model.modules())
    first, second = [m for m in memories if type(m).__name__ == "ProductKeyMemory"]
    second.values = first.values  # one value table read by two layers (pkm_shared_values)
    statistics = compute_background_statistics(model, batches(4))
    freeze_all_but_values(model)
    optimizer = torch.optim.Adam(pkm_value_parameters(model), lr=1e-2)
    assert len(pkm_value_parameters(model)) == 1
    smf = SparseMemoryFinetuning(model, statistics, top_t=3).attach(optimizer)
    before = first.values.weight.detach().clone()
    model.train()
    model(**batches(1, seed=5)[0]).loss.backward()
    optimizer.step()
    union = set(smf.chosen["layer_0"].tolist()) | set(smf.chosen["layer_2"].tolist())
    assert len(smf.chosen["layer_0"]) == len(smf.chosen["layer_2"]) == 3
    changed = set((first.values.weight != before).any(1).nonzero().squeeze(1).tolist())
    assert changed and changed <= union


def test_train_rest_keeps_other_parameters_learning():
    model = tiny_model()
    statistics = compute_background_statistics(model, batches(3))
    values = pkm_value_parameters(model)
    rest = [p for p in model.parameters() if all(p is not v for v in values)]
    optimizer = torch.optim.SGD(values, lr=1.0)
    main = torch.optim.SGD(rest, lr=0.1)
    smf = SparseMemoryFinetuning(model, statistics, top_t=2).attach(optimizer)
    before = [p.detach().clone() for p in rest]
    model.train()
    model(**batches(1, seed=4)[0]).loss.backward()
    optimizer.step()
    main.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, rest))
    assert smf.chosen["layer_1"].numel() == 2


@pytest.mark.parametrize("ranker", ["tfidf", "gradient"])
def test_trainer_callback_changes_only_chosen_rows(tmp_path, ranker):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_model()
    statistics = compute_background_statistics(model, batches(4)) if ranker == "tfidf" else None
    freeze_all_but_values(model)
    data = batches(4, seed=7, batch=1)
    dataset = Dataset.from_list([{k: v[0].tolist() for k, v in b.items()} for b in data])
    callback = SparseMemoryFinetuningCallback(statistics, top_t=3, ranker=ranker)
    table = model.bert.encoder.layer[1].memory.values.weight
    before, state = table.detach().clone(), {n: p.detach().clone() for n, p in model.state_dict().items()}
    chosen = []
    original = SparseMemoryFinetuning.after_step

    def record(self):
        chosen.append(set(self.chosen["layer_1"].tolist()))
        original(self)

    SparseMemoryFinetuning.after_step = record
    try:
        arguments = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
            report_to=[], save_strategy="no", use_cpu=True, logging_strategy="no",
        )
        Trainer(model=model, args=arguments, train_dataset=dataset, callbacks=[callback]).train()
    finally:
        SparseMemoryFinetuning.after_step = original
    assert len(chosen) == 2 and all(len(c) == 3 for c in chosen)
    changed = set((table != before).any(1).nonzero().squeeze(1).tolist())
    assert changed and changed <= chosen[0] | chosen[1]
    after = model.state_dict()
    moved = [n for n in after if not torch.equal(after[n], state[n]) and "memory.values" not in n]
    assert [n for n in moved if not n.endswith("num_batches_tracked")] == []


# ---- run_mlm.py: exact resume, two processes, errors ----

SCRIPTS = REPO_ROOT / "run_scripts"
BACKGROUND = SCRIPTS / "data" / "pride_and_prejudice_validation.txt"


@pytest.fixture(scope="module")
def run_mlm():
    return load_script("run_mlm")


def run_script(module, argv):
    """One run of a script; the next one (often in the same test) starts with a fresh accelerate state."""
    try:
        return module.main(argv)
    finally:
        reset_accelerate_state()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny BertPkm masked LM (dropout on) with a word-level tokenizer of the embedded text, saved in one folder."""
    folder = tmp_path_factory.mktemp("smf_tiny")
    make_tiny_folder(folder, BertPkmForMaskedLM, seed=0)
    return folder


def smf_args(checkpoint, output_dir, options=""):
    return [
        *("--model_name_or_path", str(checkpoint), "--output_dir", str(output_dir)),
        *"--max_seq_length 32 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --seed 3".split(),
        *"--max_train_samples 12 --max_eval_samples 8 --gradient_accumulation_steps 2 --max_train_steps 6".split(),
        *f"--sparse_memory_finetuning --smf_background_file {BACKGROUND} --smf_background_batches 5".split(),
        *"--smf_top_t 6 --memory_optimizer sgd --memory_learning_rate 1.0".split(),
        *options.split(),
    ]


def test_run_mlm_trains_only_value_rows_and_resumes_exactly(run_mlm, tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    straight = tmp_path / "straight"
    run_script(run_mlm, smf_args(tiny_checkpoint, straight, "--checkpointing_steps 3"))
    initial, trained = load_file(tiny_checkpoint / "model.safetensors"), load_file(straight / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["bert.encoder.layer.1.memory.values.weight"]
    rows = (trained[moved[0]] != initial[moved[0]]).any(1).sum()
    assert 0 < rows <= 6 * 6  # at most t rows a step
    statistics = BackgroundStatistics.load(straight / STATISTICS_NAME)
    assert statistics.num_batches == 5
    # the background's blocks of 32 tokens, 8 a document (4 sequences x 2 accumulated), read by the frozen model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    texts = [line for line in BACKGROUND.read_text(encoding="utf-8").splitlines() if line.strip()]
    blocks = background_batches(tokenizer, texts, 32, 8, 5)
    assert statistics == compute_background_statistics(BertPkmForMaskedLM.from_pretrained(tiny_checkpoint), blocks)
    assert BackgroundStatistics.load(straight / "step_3" / STATISTICS_NAME) == statistics
    # the resumed run takes the statistics from the checkpoint and ends with the weights of the straight run
    resumed = tmp_path / "resumed"
    run_script(run_mlm, smf_args(tiny_checkpoint, resumed, f"--resume_from_checkpoint {straight / 'step_3'}"))
    expected, got = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert [n for n in expected if not torch.equal(expected[n], got[n])] == []


def test_run_mlm_resume_checks_the_smf_settings(run_mlm, tiny_checkpoint, tmp_path, capsys):
    """Issue 60: a resume with another ranker, top_t or background file would mix two runs (the statistics come from
    the checkpoint: the new file was ignored), and one without --sparse_memory_finetuning ended in torch's
    "different number of parameter groups" traceback: each is the settings refusal, the last even with
    --allow_inexact_resume."""
    straight = tmp_path / "straight"
    run_script(run_mlm, smf_args(tiny_checkpoint, straight, "--max_train_steps 1 --checkpointing_steps 1"))
    other = tmp_path / "other_background.txt"
    other.write_text(BACKGROUND.read_text(encoding="utf-8") + "one more line of background\n", encoding="utf-8")
    resume = f"--max_train_steps 1 --resume_from_checkpoint {straight / 'step_1'}"  # the checkpoint's settings
    plain = [word for word in smf_args(tiny_checkpoint, tmp_path / "r") if word != "--sparse_memory_finetuning"]
    for flag in ("--smf_background_file", "--smf_background_batches", "--smf_top_t"):
        del plain[plain.index(flag) : plain.index(flag) + 2]
    for options, message in [
        ("--smf_ranker kl", "smf_ranker: checkpoint 'tfidf', now 'kl'"),
        ("--smf_top_t 5", "smf_top_t: checkpoint 6, now 5"),
        (f"--smf_background_file {other}", "smf_background_file: checkpoint {'bytes': "),
    ]:
        argv = smf_args(tiny_checkpoint, tmp_path / "r", f"{resume} {options}")
        line = usage_error(capsys, lambda: run_script(run_mlm, argv))
        assert "was saved by a run with other settings" in line and message in line, line
    for extra in ([], ["--allow_inexact_resume"]):
        argv = [*plain, *resume.split(), *extra]
        line = usage_error(capsys, lambda: run_script(run_mlm, argv))
        assert "sparse_memory_finetuning: checkpoint True, now None" in line, line
    assert "its state needs it" in line
    assert not (tmp_path / "r" / "model.safetensors").exists()


def test_run_mlm_unread_ranker_moves_only_rows_the_background_never_read(run_mlm, tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file

    roomy = tmp_path / "roomy"  # the tiny checkpoint with 32^2 slots: room a background of 1 document does not read
    shutil.copytree(tiny_checkpoint, roomy)
    torch.manual_seed(0)
    BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_n_keys=32)).save_pretrained(roomy)
    run_script(run_mlm, smf_args(roomy, tmp_path / "out", "--smf_ranker unread --smf_background_batches 1"))
    initial, trained = load_file(roomy / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["bert.encoder.layer.1.memory.values.weight"]
    rows = (trained[moved[0]] != initial[moved[0]]).any(1)
    unread = BackgroundStatistics.load(tmp_path / "out" / STATISTICS_NAME).document_frequency["layer_1"] == 0
    assert 0 < rows.sum() <= 6 * 6 and unread[rows].all() and not unread.all()


def test_run_mlm_gradient_ranker_needs_no_background_and_resumes_exactly(run_mlm, tiny_checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file

    def gradient_args(output_dir, options=""):
        argv = smf_args(tiny_checkpoint, output_dir, f"--smf_ranker gradient {options}")
        at = argv.index("--smf_background_file")
        return argv[:at] + argv[at + 2 :]

    straight = tmp_path / "straight"
    run_script(run_mlm, gradient_args(straight, "--checkpointing_steps 3"))
    initial, trained = load_file(tiny_checkpoint / "model.safetensors"), load_file(straight / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["bert.encoder.layer.1.memory.values.weight"]
    assert 0 < (trained[moved[0]] != initial[moved[0]]).any(1).sum() <= 6 * 6
    assert not (straight / STATISTICS_NAME).exists() and not (straight / "step_3" / STATISTICS_NAME).exists()
    resumed = tmp_path / "resumed"
    run_script(run_mlm, gradient_args(resumed, f"--resume_from_checkpoint {straight / 'step_3'}"))
    got = load_file(resumed / "model.safetensors")
    assert [n for n in trained if not torch.equal(trained[n], got[n])] == []
    # a background is not read by this ranker: giving one is a mistake, said in one line
    line = usage_error(capsys, lambda: run_script(run_mlm, smf_args(tiny_checkpoint, tmp_path / "c", "--smf_ranker gradient")))
    assert "--smf_ranker gradient ranks each step's value gradient and reads no background" in line
    assert not (tmp_path / "c" / "model.safetensors").exists()


@pytest.mark.multiprocess
def test_run_mlm_two_processes_merge_the_statistics_exactly(run_mlm, tiny_checkpoint, tmp_path):
    """A background document is one optimizer step's batch: 2 processes x 4 sequences and 1 process x 4 sequences x
    accumulation 2 count the same documents as 1 process with the merged batch of 8."""
    merged, accumulated = tmp_path / "merged", tmp_path / "accumulated"
    run_script(run_mlm, smf_args(tiny_checkpoint, merged, "--max_train_steps 1 --per_device_train_batch_size 8 "
                                 "--gradient_accumulation_steps 1"))
    run_script(run_mlm, smf_args(tiny_checkpoint, accumulated, "--max_train_steps 1"))
    options = "--max_train_steps 2 --memory_optimizer sparse_row_adam --memory_learning_rate 0.01"
    options += " --gradient_accumulation_steps 1"
    done = torchrun(SCRIPTS / "run_mlm.py", smf_args(tiny_checkpoint, tmp_path / "ddp", options))
    assert "MULTI_CPU" in done.stderr and "sparse gradients" in done.stderr
    expected = BackgroundStatistics.load(merged / STATISTICS_NAME)
    assert expected.num_batches == 5
    assert BackgroundStatistics.load(accumulated / STATISTICS_NAME) == expected
    assert BackgroundStatistics.load(tmp_path / "ddp" / STATISTICS_NAME) == expected


@pytest.mark.multiprocess
def test_run_mlm_gradient_ranker_on_two_processes_and_an_odd_example_count(tiny_checkpoint, tmp_path):
    """2 gloo processes, 13 examples (the last batch uneven), sparse value gradients: no hang, no background read or
    written, and only the value rows of the memory change, at most t a step."""
    from safetensors.torch import load_file

    argv = smf_args(tiny_checkpoint, tmp_path / "ddp", "--smf_ranker gradient --max_train_samples 13 --max_train_steps 4 "
                    "--per_device_train_batch_size 2 --gradient_accumulation_steps 1 --memory_optimizer sparse_row_adam "
                    "--memory_learning_rate 0.01")  # fmt: skip
    at = argv.index("--smf_background_file")
    done = torchrun(SCRIPTS / "run_mlm.py", argv[:at] + argv[at + 2 :])
    assert "MULTI_CPU" in done.stderr and "sparse gradients" in done.stderr
    initial, trained = load_file(tiny_checkpoint / "model.safetensors"), load_file(tmp_path / "ddp" / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
    assert moved == ["bert.encoder.layer.1.memory.values.weight"]
    assert 0 < (trained[moved[0]] != initial[moved[0]]).any(1).sum() <= 6 * 4
    assert not (tmp_path / "ddp" / STATISTICS_NAME).exists()


@pytest.mark.parametrize(
    "options,message",
    [
        ("--smf_top_t 0", "--smf_top_t 0 must be >= 1"),
        ("--smf_top_t 65", r"top_t=65 must be an integer in \[1, 64\]"),
        ("--smf_background_batches 0", "--smf_background_batches 0 must be >= 1"),
        ("--freeze_memory", "cannot be combined with --freeze_memory"),
    ],
)
def test_run_mlm_bad_smf_options_fail_before_training(run_mlm, tiny_checkpoint, tmp_path, capsys, options, message):
    with pytest.raises((SystemExit, ValueError)) as error:
        run_script(run_mlm, smf_args(tiny_checkpoint, tmp_path / "out", options))
    text = str(error.value) + capsys.readouterr().err
    assert re_search(message, text)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_run_mlm_empty_background_and_foreign_statistics_are_refused(run_mlm, tiny_checkpoint, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    line = usage_error(capsys, lambda: run_script(run_mlm, smf_args(tiny_checkpoint, tmp_path / "a",
                                                                    f"--smf_background_file {empty}")))  # fmt: skip
    assert "yields no block of 32 tokens" in line
    foreign = compute_background_statistics(tiny_model(pkm_n_keys=6), batches(1)).save(tmp_path / "other.safetensors")
    line = usage_error(capsys, lambda: run_script(run_mlm, smf_args(tiny_checkpoint, tmp_path / "b",
                                                                    f"--smf_background_file {foreign}")))  # fmt: skip
    assert "other.safetensors are for memory layers {'layer_1': 36}" in line


def re_search(pattern, text):
    import re

    return re.search(pattern, text) is not None


# ---- run_glue.py and run_squad.py ----


def test_run_glue_and_run_squad_train_only_value_rows(tiny_checkpoint, tmp_path, shared_data, monkeypatch):
    """A BertPkm checkpoint with its task head: with SMF only the memory value rows change, and the statistics are
    written beside the trained model."""
    import json as json_module

    from safetensors.torch import load_file
    from transformers import BertTokenizer

    from modeling_pkm_bert import BertPkmForQuestionAnswering, BertPkmForSequenceClassification

    tokenizer = BertTokenizer.from_pretrained(tiny_checkpoint)
    smf = f"--sparse_memory_finetuning --smf_background_file {BACKGROUND} --smf_background_batches 3 --smf_top_t 4"
    smf += " --memory_optimizer sgd --memory_learning_rate 1.0 --max_train_steps 2 --seed 1"
    rows = (shared_data / "glue" / "SST-2" / "train.tsv").read_text().splitlines(keepends=True)[:17]
    (tmp_path / "sst2.tsv").write_text("".join(rows))
    squad = json_module.loads((shared_data / "squad_v1.1" / "dev-v1.1.json").read_text())
    squad["data"] = [dict(squad["data"][0], paragraphs=squad["data"][0]["paragraphs"][:1])]
    (tmp_path / "squad.json").write_text(json_module.dumps(squad))
    cases = {
        "run_glue": (
            BertPkmForSequenceClassification,
            f"--task_name sst2 --train_file {tmp_path / 'sst2.tsv'} --validation_file {tmp_path / 'sst2.tsv'} "
            "--max_length 32 --per_device_train_batch_size 8",
        ),
        "run_squad": (
            BertPkmForQuestionAnswering,
            f"--train_file {tmp_path / 'squad.json'} --validation_file {tmp_path / 'squad.json'} --max_seq_length 64 "
            "--doc_stride 16 --per_device_train_batch_size 4 --max_train_samples 8 --max_eval_samples 4",
        ),
    }
    for script, (model_class, options) in cases.items():
        start = tmp_path / f"{script}_start"
        torch.manual_seed(0)
        model_class(tiny_config(vocab_size=200, num_labels=2)).save_pretrained(start)
        tokenizer.save_pretrained(start)
        module = load_script(script)
        out = tmp_path / script
        run_script(module, ["--model_name_or_path", str(start), "--output_dir", str(out), *options.split(), *smf.split()])
        initial, trained = load_file(start / "model.safetensors"), load_file(out / "model.safetensors")
        moved = [n for n in trained if not torch.equal(trained[n], initial[n]) and not n.endswith("num_batches_tracked")]
        assert moved == ["bert.encoder.layer.1.memory.values.weight"], script
        assert BackgroundStatistics.load(out / STATISTICS_NAME).num_batches == 3


# ---- the benchmark ----


def test_continual_learning_benchmark_quick(tmp_path):
    import json as json_module

    module = load_script("runner", folder="benchmarks/studies/continual_learning")
    results = module.main(["--quick", "--output_dir", str(tmp_path)])
    methods = ["full", "lora", "smf_tfidf_t4", "smf_tfidf_t16", "smf_kl_t4", "smf_kl_t16"]
    assert list(results["curves"]) == methods
    report = (tmp_path / "CONTINUAL_LEARNING_QUICK.md").read_text()
    assert all(f"| {method} |" in report for method in methods)
    assert (tmp_path / "continual_learning_quick.png").stat().st_size > 0
    assert json_module.loads((tmp_path / "continual_learning_quick.json").read_text())["target_new_loss"] == results["target_new_loss"]
    # the target is the lowest loss every method that learned reached: those have a matched point, the others none
    assert "full" in results["learned"]
    for method in methods:
        reached = min(p["new_loss"] for p in results["curves"][method]) <= results["target_new_loss"]
        assert reached == (results["matched"][method]["heldout_ppl"] is not None)
        assert reached or method not in results["learned"]
    # SMF learned something of the new text
    assert results["curves"]["smf_kl_t16"][-1]["new_loss"] < results["base"]["new_loss"]


def test_adam_momentum_would_move_unchosen_rows_without_the_restore():
    """Why rows are put back for Adam: a row chosen at step 1 but not at step 2 still moves at step 2 (momentum)."""
    moved_outside = {}
    for restore in (False, True):
        model = tiny_model()
        statistics = compute_background_statistics(model, batches(4))
        freeze_all_but_values(model)
        optimizer = torch.optim.Adam(pkm_value_parameters(model), lr=1e-2)
        smf = SparseMemoryFinetuning(model, statistics, top_t=3).attach(optimizer, restore_unchosen=restore)
        table = model.bert.encoder.layer[1].memory.values.weight
        model.train()
        outside = 0
        for batch in batches(3, seed=11):
            before = table.detach().clone()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            changed = set((table != before).any(1).nonzero().squeeze(1).tolist())
            outside += len(changed - set(smf.chosen["layer_1"].tolist()))
        moved_outside[restore] = outside
    assert moved_outside[False] > 0 and moved_outside[True] == 0


def test_benchmark_matched_learning_arithmetic_and_merge():
    bench = load_script("runner", folder="benchmarks/studies/continual_learning")
    base = {"new_loss": 5.0, "heldout_ppl": 100.0}
    fast = [{"step": 0, **base}, {"step": 10, "new_loss": 3.0, "heldout_ppl": 140.0}]
    slow = [{"step": 0, **base}, {"step": 10, "new_loss": 4.5, "heldout_ppl": 101.0}, {"step": 20, "new_loss": 4.0, "heldout_ppl": 102.0}]
    result = bench.matched_learning({"fast": fast, "slow": slow})
    # the target is the lowest loss both reached (4.0): fast crosses it half-way to step 10
    assert result["target_new_loss"] == 4.0
    assert result["matched"]["fast"] == {"step": 5.0, "heldout_ppl": 120.0}
    assert result["matched"]["slow"] == {"step": 20.0, "heldout_ppl": 102.0}
    run = {"base": base, "curves": {"fast": fast}, "times_s": {"fast": 1.0}, "argv": [], "args": {}}
    merged = bench.merge_runs([run, dict(run, curves={"slow": slow}, times_s={"slow": 2.0}, argv=["--methods", "slow"])])
    assert list(merged["curves"]) == ["fast", "slow"] and merged["target_new_loss"] == 4.0
    # a method that barely learned (a fall under 20 % of the largest) neither sets the target nor gets a matched point
    flat = [{"step": 0, **base}, {"step": 10, "new_loss": 4.9, "heldout_ppl": 100.0}]
    result = bench.matched_learning({"fast": fast, "slow": slow, "flat": flat})
    assert result["learned"] == ["fast", "slow"] and result["target_new_loss"] == 4.0
    assert result["matched"]["flat"] == {"step": None, "heldout_ppl": None}
    with pytest.raises(ValueError, match="same healed model"):
        bench.merge_runs([run, dict(run, base={"new_loss": 5.1, "heldout_ppl": 100.0})])


# ---- issue 25: non-finite gradients, mask before clip, eval-mode reads, one document unit, skipped steps ----


def unread_rows(table):
    """Rows a step did not read have an exactly zero gradient, and are never chosen."""
    return table.grad.abs().sum(1) == 0


@pytest.mark.parametrize("optimizer_name", ["sgd", "sparse_row_adam", "adam"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_unchosen_rows_stay_bit_identical_whatever_their_gradient(optimizer_name, bad):
    model = tiny_model()
    statistics = compute_background_statistics(model, batches(3))
    freeze_all_but_values(model)
    optimizer = value_optimizer(optimizer_name, model)
    smf = SparseMemoryFinetuning(model, statistics, top_t=3).attach(optimizer)
    table = model.bert.encoder.layer[1].memory.values.weight
    before = table.detach().clone()
    model(**batches(1, seed=4)[0]).loss.backward()
    with torch.no_grad():
        table.grad[unread_rows(table)] = bad  # e.g. an overflow in rows the step does not train
    optimizer.step()
    unchosen = torch.ones(table.shape[0], dtype=torch.bool)
    unchosen[smf.chosen["layer_1"]] = False
    assert torch.isfinite(table).all(), f"{int((~torch.isfinite(table)).any(1).sum())} rows became non-finite"
    assert torch.equal(table[unchosen], before[unchosen])


def _chosen_update(step, big, ranker="tfidf"):
    """The update of the chosen rows after one SMF step of `step(model, smf, optimizer)`, with `big` added to the
    gradient of every row the step did not read (never a chosen row, for the gradient ranker too)."""
    model = tiny_model()
    statistics = compute_background_statistics(model, batches(3)) if ranker != "gradient" else None
    freeze_all_but_values(model)
    table = model.bert.encoder.layer[1].memory.values.weight
    table.register_hook(lambda grad: grad + big * (grad.abs().sum(1, keepdim=True) == 0))
    optimizer = torch.optim.SGD([table], lr=1.0)
    smf = SparseMemoryFinetuning(model, statistics, top_t=3, ranker=ranker).attach(optimizer)
    before = table.detach().clone()
    step(model, smf, optimizer)
    chosen = smf.chosen["layer_1"]
    return chosen, (table.detach() - before)[chosen]


def test_scripts_mask_before_clipping_the_memory_gradient():
    """run_mlm/run_glue's step: `clip_memory_gradients(..., smf)` (--memory_max_grad_norm) then the optimizer step; the
    chosen rows' update does not depend on the unchosen rows' gradient."""
    from accelerate import Accelerator

    from modeling_pkm_bert.methods.optimizers.scripts import clip_memory_gradients

    accelerator = Accelerator(cpu=True)

    def step(model, smf, optimizer):
        model(**batches(1, seed=4)[0]).loss.backward()
        clip_memory_gradients(accelerator, model, optimizer, 1e-3, smf)
        optimizer.step()

    chosen, update = _chosen_update(step, 0.0)
    chosen_big, update_big = _chosen_update(step, 1e3)
    assert torch.equal(chosen, chosen_big)
    torch.testing.assert_close(update_big, update, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ranker", ["tfidf", "gradient"])
@pytest.mark.parametrize("fp16", [False, True])
def test_trainer_callback_masks_before_clipping(tmp_path, simulate_fp16, fp16, ranker):
    """Also under fp16 loss scaling (simulated: an injected GradScaler), where Trainer has unscaled the gradients for
    its gradient-norm log before the callback clips: unscaled once, the same update. The gradient ranker ranks the
    scaled gradient: the same rows as without the scaler."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    data = batches(2, seed=7, batch=1)
    dataset = Dataset.from_list([{k: v[0].tolist() for k, v in b.items()} for b in data])
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, max_grad_norm=1e-3, report_to=[],
        save_strategy="no", use_cpu=True, logging_strategy="no",
    )

    def step(model, smf, optimizer):
        smf.detach()  # the callback makes its own
        callback = SparseMemoryFinetuningCallback(smf.statistics, top_t=3, ranker=smf.ranker)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        trainer = Trainer(
            model=model, args=arguments, train_dataset=dataset, callbacks=[callback], optimizers=(optimizer, scheduler)
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with simulate_fp16(trainer.accelerator, scaler) if fp16 else contextlib.nullcontext():
            trainer.train()
        smf.chosen = callback.smf.chosen
        assert arguments.max_grad_norm == 1e-3  # given back

    chosen, update = _chosen_update(step, 0.0, ranker)
    chosen_big, update_big = _chosen_update(step, 1e3, ranker)
    assert torch.equal(chosen, chosen_big)
    torch.testing.assert_close(update_big, update, rtol=1e-6, atol=0)
    if fp16:  # the scaler-free run's update
        fp16 = False
        plain_chosen, plain_update = _chosen_update(step, 0.0, ranker)
        assert torch.equal(chosen, plain_chosen)
        torch.testing.assert_close(update, plain_update, rtol=1e-5, atol=0)


def eval_mode_reads(model, batch):
    with torch.no_grad(), ReadCounter(model) as counter:
        was_training = model.training
        model.eval()
        model(**{k: v for k, v in batch.items() if k != "labels"})
        model.train(was_training)
    return counter.counts


def test_ranked_reads_are_the_eval_mode_reads_of_the_background():
    """The frozen model's training forwards read as the background pass does (running BatchNorm statistics, no dropout),
    so a step ranks the slots inference reads."""
    model = tiny_model(hidden_dropout_prob=0.3, pkm_query_dropout=0.2, pkm_input_dropout=0.2)
    statistics = compute_background_statistics(model, batches(4))
    freeze_all_but_values(model)
    optimizer = torch.optim.SGD(pkm_value_parameters(model), lr=1.0)
    smf = SparseMemoryFinetuning(model, statistics, top_t=16).attach(optimizer)
    batch = batches(1, seed=4, batch=4)[0]
    expected = rank_slots(eval_mode_reads(model, batch)["layer_1"], statistics, "layer_1", 16)
    model.train()
    model(**batch).loss.backward()
    optimizer.step()
    overlap = len(set(smf.chosen["layer_1"].tolist()) & set(expected.tolist())) / 16
    assert overlap == 1.0, overlap
    assert model.training and all(m.training for m in model.modules())  # the mode is given back


def test_a_step_with_accumulation_ranks_the_reads_of_the_merged_batch():
    """Two micro-batches of one step rank as one forward of both (the document is the step's batch)."""
    model = tiny_model()
    statistics = compute_background_statistics(model, batches(4))
    freeze_all_but_values(model)
    optimizer = torch.optim.SGD(pkm_value_parameters(model), lr=1.0)
    smf = SparseMemoryFinetuning(model, statistics, top_t=6).attach(optimizer)
    merged = batches(1, seed=4, batch=6)[0]
    model.train()
    for half in (slice(0, 3), slice(3, 6)):
        model(**{k: v[half] for k, v in merged.items()}).loss.backward()
    optimizer.step()
    expected = rank_slots(eval_mode_reads(model, merged)["layer_1"], statistics, "layer_1", 6)
    assert torch.equal(smf.chosen["layer_1"], expected)
    # the background side: a document counted in micro-batches equals one forward of it
    documents = batches(3, seed=5, batch=6)
    assert compute_background_statistics(model, documents, micro_batch_size=4) == compute_background_statistics(
        model, documents
    )


def test_a_skipped_step_does_not_rank_two_steps_reads():
    """fp16 loss scaling skips a step whose gradient holds an inf: the next step ranks its own reads only."""
    model = tiny_model()
    statistics = compute_background_statistics(model, batches(4))
    freeze_all_but_values(model)
    table = model.bert.encoder.layer[1].memory.values.weight
    optimizer = torch.optim.SGD([table], lr=1.0)
    smf = SparseMemoryFinetuning(model, statistics, top_t=3).attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    first, second = batches(2, seed=4, batch=4)
    model.train()
    scaler.scale(model(**first).loss).backward()
    smf.mask_gradients()
    with torch.no_grad():
        table.grad[smf.chosen["layer_1"][0], 0] = math.inf  # an overflow in a row the step trains: skipped
    scaler.step(optimizer)
    scaler.update()
    assert smf.steps == 0 and scaler.get_scale() < 2.0**4
    optimizer.zero_grad()
    scaler.scale(model(**second).loss).backward()
    smf.mask_gradients()
    scaler.step(optimizer)
    assert smf.steps == 1
    expected = rank_slots(eval_mode_reads(model, second)["layer_1"], statistics, "layer_1", 3)
    assert torch.equal(smf.chosen["layer_1"], expected)


# ---- hashed n-gram memories ----


def tiny_ngram_model(**overrides):
    """Product keys at layer 0 and an n-gram memory at layer 1, its value projection and convolution non-zero (as in
    a trained model: at initialisation they are zero, so the tables would get no gradient)."""
    model = tiny_model(pkm_layers=[0], ngram_layers=[1], ngram_table_size=97, ngram_dim=8, **overrides)
    memory = model.bert.encoder.layer[1].ngram
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        memory.value.weight.copy_(torch.randn(memory.value.weight.shape, generator=generator) * 0.1)
        memory.conv.weight.copy_(torch.randn(memory.conv.weight.shape, generator=generator) * 0.1)
    return model


def ngram_reads(memory, batch):
    """The rows an n-gram memory looks up for a batch, computed from its hash alone (padding enters as -1)."""
    ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -1)
    rows = memory.bucket_indices(memory.context_tokens(ids))
    return torch.bincount(rows.reshape(-1), minlength=memory.tables.weight.shape[0])


def test_ngram_memory_tables_are_counted_as_its_looked_up_rows():
    model = tiny_ngram_model()
    data = batches(3, pad=2)
    statistics = compute_background_statistics(model, data)
    assert set(statistics.mem_sizes) == {"layer_0", "ngram_layer_1"}
    memory = model.bert.encoder.layer[1].ngram
    per_document = [ngram_reads(memory, batch) for batch in data]
    assert torch.equal(statistics.reads["ngram_layer_1"], sum(per_document))
    assert torch.equal(statistics.document_frequency["ngram_layer_1"], sum((r > 0).long() for r in per_document))
    # the product key memory's counts are those of the model without the n-gram memory
    assert statistics.reads["layer_0"].sum() == 3 * 3 * 8 * model.config.pkm_heads * model.config.pkm_knn


@pytest.mark.parametrize("optimizer_name,ranker", [("sgd", "tfidf"), ("sparse_row_adam", "kl"), ("adam", "tfidf")])
def test_ngram_memory_only_chosen_table_rows_change(optimizer_name, ranker):
    model = tiny_ngram_model()
    statistics = compute_background_statistics(model, batches(4, seed=2))
    trainable = freeze_all_but_values(model)
    memory = model.bert.encoder.layer[1].ngram
    assert trainable == memory.tables.weight.numel() + model.bert.encoder.layer[0].memory.values.weight.numel()
    optimizer = value_optimizer(optimizer_name, model)
    smf = SparseMemoryFinetuning(model, statistics, top_t=7, ranker=ranker).attach(optimizer)
    model.train()
    for batch in batches(3, seed=3, pad=2):
        before = {name: p.detach().clone() for name, p in model.state_dict().items()}
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = model.state_dict()
        expected = rank_slots(ngram_reads(memory, batch), statistics, "ngram_layer_1", 7, ranker)
        assert torch.equal(smf.chosen["ngram_layer_1"], expected)
        name = "bert.encoder.layer.1.ngram.tables.weight"
        changed = (after[name] != before[name]).any(1).nonzero().squeeze(1)
        assert changed.numel() > 0 and set(changed.tolist()) <= set(expected.tolist())
        moved = {n for n in after if not torch.equal(after[n], before[n]) and not n.endswith("num_batches_tracked")}
        assert moved <= {name, "bert.encoder.layer.0.memory.values.weight"}
    with pytest.raises(ValueError, match=r"top_t=.* must be an integer in \[1, 64\]"):
        SparseMemoryFinetuning(model, statistics, top_t=65)  # the smallest memory: layer 0's 64 slots


def test_a_model_without_any_memory_is_refused():
    model = tiny_model(pkm_layers=[])
    with pytest.raises(ValueError, match="no memory layer"):
        validate_top_t(4, model)


def test_run_mlm_trains_only_the_ngram_tables_rows_of_an_ngram_model(run_mlm, tiny_checkpoint, tmp_path):
    """A model whose only memory is an n-gram memory: --sparse_memory_finetuning trains its table rows and nothing else."""
    from safetensors.torch import load_file

    folder = tmp_path / "ngram_model"
    folder.mkdir()
    for name in os.listdir(tiny_checkpoint):
        if "tok" in name or name.startswith(("vocab", "special")):
            (folder / name).write_bytes((tiny_checkpoint / name).read_bytes())
    torch.manual_seed(0)
    model = BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[], ngram_layers=[1], ngram_table_size=97, ngram_dim=8))
    memory = model.bert.encoder.layer[1].ngram
    with torch.no_grad():
        memory.value.weight.normal_(std=0.1)
    model.save_pretrained(folder)
    output = tmp_path / "trained"
    run_script(run_mlm, smf_args(folder, output))
    initial, trained = load_file(folder / "model.safetensors"), load_file(output / "model.safetensors")
    moved = [n for n in trained if not torch.equal(trained[n], initial[n])]
    assert moved == ["bert.encoder.layer.1.ngram.tables.weight"]
    rows = (trained[moved[0]] != initial[moved[0]]).any(1).sum()
    assert 0 < rows <= 6 * 6  # at most t rows a step
    assert set(BackgroundStatistics.load(output / STATISTICS_NAME).mem_sizes) == {"ngram_layer_1"}
