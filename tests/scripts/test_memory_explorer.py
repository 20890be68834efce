"""The memory explorer: its numbers equal the memory report's and memory_usage's, its contexts and per-head picks equal
a direct computation, the value projection is the documented one, a headless Chromium can use the page (layer, slot,
search), and bad input gets a clear error."""

import collections
import json
import re

import pytest
import torch
from transformers import BertTokenizer

from browser import Browser, chromium_or_skip
from helpers import REPO_ROOT, BertPkmModelTester, load_script, tiny_config, usage_error
from modeling_pkm_bert import BertPkmForMaskedLM, BertPkmModel
from modeling_pkm_bert.analysis import explorer as explorer_module
from modeling_pkm_bert.analysis import report as report_module
from modeling_pkm_bert.analysis import write_memory_report
from modeling_pkm_bert.analysis.explorer import (
    MemoryExplorerError,
    SlotSelections,
    build_memory_explorer,
    project_ngram_buckets,
    project_values,
    read_explorer_data,
)
from modeling_pkm_bert.ngram_memory import NgramMemory
from modeling_pkm_bert.analysis.memory_usage import track_memory_usage


TEXT = (REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_validation.txt").read_text(encoding="utf-8")
LENGTH, SEQUENCES = 32, 10  # 320 tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    BertPkmModelTester().get_tokenizer("validation", 200).save_pretrained(folder)
    return BertTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[0, 2])).eval()


@pytest.fixture(scope="module")
def explorer(model, tokenizer, tmp_path_factory):
    """The explorer of the tiny model, every context kept (more than any slot gets), 4 data chunks per layer."""
    folder = tmp_path_factory.mktemp("explorer") / "explorer"
    summary = build_memory_explorer(model, tokenizer, folder, [TEXT], max_seq_length=LENGTH,
                                    max_tokens=LENGTH * SEQUENCES, contexts_per_slot=1000, chunk_size=16)  # fmt: skip
    return folder, summary


def tracker_of(model, tokenizer):
    """memory_usage's tracker over the explorer's sequences, run independently; and those sequences' token ids."""
    sequences = report_module.text_sequences(tokenizer, [TEXT], LENGTH, SEQUENCES)
    with track_memory_usage(model) as tracker, torch.no_grad():
        model(input_ids=torch.tensor([s["input_ids"] for s in sequences]))
    return tracker, [i for s in sequences for i in s["input_ids"]]


def layer_of(summary, name):
    return next(layer for layer in summary["layers"] if layer["name"] == name)


def all_contexts(folder, layer):
    contexts, promoted = {}, {}
    for chunk in layer["chunks"]:
        data = read_explorer_data(folder, f"{layer['name']}/slots_{chunk:05d}")
        contexts.update({int(k): v for k, v in data["contexts"].items()})
        promoted.update({int(k): v for k, v in data["promoted"].items()})
    return contexts, promoted


def test_numbers_equal_the_memory_report_and_memory_usage(model, tokenizer, explorer, tmp_path):
    folder, summary = explorer
    report = write_memory_report(model, tokenizer, tmp_path / "report", texts=[TEXT], max_seq_length=LENGTH,
                                 max_sequences=SEQUENCES)  # fmt: skip
    assert "run_scripts/memory_explorer.py" in (tmp_path / "report" / "memory_report.md").read_text()  # the link
    tracker, token_ids = tracker_of(model, tokenizer)
    assert json.loads((folder / "explorer.json").read_text()) == read_explorer_data(folder) == summary
    assert summary["tokens"] == LENGTH * SEQUENCES and [layer["name"] for layer in summary["layers"]] == ["layer_0", "layer_2"]
    assert read_explorer_data(folder, "tokens")["tokens"] == tokenizer.convert_ids_to_tokens(token_ids)
    for name, accumulator in tracker.accumulators.items():
        layer = layer_of(summary, name)
        assert layer["metrics"] == report["usage"][name] == tracker.results()[name]
        assert layer["never_picked"] == int((accumulator.top1_counts == 0).sum())
        assert layer["never_selected"] == int((accumulator.used_counts == 0).sum()) > 0 or name == "layer_0"
        ranked = layer["ranked"]
        slots = torch.tensor(ranked["slot"])
        # every selected slot once, by top-1 picks then weight, with memory_usage's counts
        assert sorted(ranked["slot"]) == accumulator.used_counts.nonzero().squeeze(1).tolist()
        assert ranked["top1"] == accumulator.top1_counts[slots].tolist() == sorted(ranked["top1"], reverse=True)
        assert ranked["weight"] == accumulator.weight_sums[slots].tolist()
        assert ranked["used"] == accumulator.used_counts[slots].tolist()
        for (top1, weight), (next_top1, next_weight) in zip(zip(ranked["top1"], ranked["weight"]),
                                                            zip(ranked["top1"][1:], ranked["weight"][1:])):  # fmt: skip
            assert top1 > next_top1 or weight >= next_weight
        # the usage curve ends at 100 % and the top-1 curve reaches it at the share of picked slots
        assert layer["curve"]["x"][0] == 0 and layer["curve"]["x"][-1] == 1 and layer["curve"]["top1"][-1] == 1


def test_contexts_and_picks_equal_a_direct_computation(model, tokenizer, explorer):
    """Per slot, the kept contexts (all of them here) add up to memory_usage's counts; per token, the top-1 slot and
    each head's best slot are those of the memory's own search on the layer's input."""
    folder, summary = explorer
    tracker, token_ids = tracker_of(model, tokenizer)
    inputs = {}
    hooks = [model.bert.encoder.layer[i].memory.register_forward_hook(
        lambda module, args, output, i=i: inputs.__setitem__(i, args[0])) for i in (0, 2)]  # fmt: skip
    with torch.no_grad():
        model(input_ids=torch.tensor(token_ids).view(SEQUENCES, LENGTH))
    for hook in hooks:
        hook.remove()
    for index in (0, 2):
        name, memory = f"layer_{index}", model.bert.encoder.layer[index].memory
        accumulator, layer = tracker.accumulators[name], layer_of(summary, f"layer_{index}")
        contexts, promoted = all_contexts(folder, layer)
        for slot in range(accumulator.mem_size):
            kept = contexts.get(slot, [])
            assert len(kept) == accumulator.used_counts[slot]
            assert sum(top1 for _, _, top1 in kept) == accumulator.top1_counts[slot]
            assert sum(w for _, w, _ in kept) == pytest.approx(float(accumulator.weight_sums[slot]), rel=1e-5)
            assert [w for _, w, _ in kept] == sorted((w for _, w, _ in kept), reverse=True)
        assert len(promoted) == accumulator.mem_size

        selections = read_explorer_data(folder, f"{name}/selections")
        picks = torch.tensor(selections["top1"])
        assert torch.equal(torch.bincount(picks, minlength=accumulator.mem_size), accumulator.top1_counts)
        with torch.no_grad():
            queries = memory.query_batchnorm(memory.query_proj(inputs[index].reshape(-1, 32)))
            scores, indices = memory.search(queries.view(-1, memory.heads, memory.k_dim))
        best = indices.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)  # (tokens, heads)
        assert selections["head_top1"] == best.T.tolist()
        weights = scores.softmax(-1).max(-1).values.T
        assert torch.allclose(torch.tensor(selections["head_top1_weight"]), weights, atol=1e-4)
        # a token's context is its position: the token stream holds the token that selected the slot
        slot, kept = next(iter(contexts.items()))
        assert all(slot in indices[position].flatten().tolist() for position, _, _ in kept)


def test_kept_contexts_are_the_heaviest_whatever_the_pruning(monkeypatch):
    """SlotSelections prunes its candidates as it goes: the result is the heaviest `contexts_per_slot` per slot (ties:
    the earlier token), as one sort over everything gives."""
    torch.manual_seed(1)
    tokens, heads, knn, size, keep = 300, 2, 3, 10, 4
    indices = torch.randint(0, size, (tokens, heads, knn))
    weights = torch.rand(tokens, heads, knn).round(decimals=1)  # ties and zeros
    monkeypatch.setattr(explorer_module, "PRUNE_AT", 50)
    selections = SlotSelections(size, heads, keep)
    for start in range(0, tokens, 32):
        selections.update(indices[start : start + 32].flatten(1), weights[start : start + 32].flatten(1))
    slots, positions, kept_weights, _ = selections.contexts()

    totals = weights.double().flatten(1).sum(1)
    expected = []
    for slot in range(size):
        per_token = ((indices == slot) * weights.double()).flatten(1).sum(1) / totals.clamp_min(1e-300)
        candidates = [(-float(w), position) for position, w in enumerate(per_token) if w > 0]
        expected += [(slot, position, -w) for w, position in sorted(candidates)[:keep]]
    got = list(zip(slots.tolist(), positions.tolist(), kept_weights.tolist()))
    assert [(s, p) for s, p, _ in got] == [(s, p) for s, p, _ in expected]
    assert [w for _, _, w in got] == pytest.approx([w for _, _, w in expected])


@pytest.mark.parametrize("mode, scale", [("resm", None), ("replace", -0.5)])
def test_value_projection_is_the_documented_one(mode, scale, tokenizer, tmp_path):
    """logits = E @ (gamma * (s v - mean(s v))): E the MLM decoder, gamma the LayerNorm closing the memory's layer, s
    the memory scale; and the page's promoted tokens are its top tokens."""
    torch.manual_seed(2)
    config = tiny_config(vocab_size=200, pkm_layers=[1], pkm_mode=mode, pkm_memory_scale=scale, tie_word_embeddings=False)
    model = BertPkmForMaskedLM(config).eval()
    layer = model.bert.encoder.layer[1]
    with torch.no_grad():  # gains far from 1, so that leaving gamma out would change the ranking
        layer.output.LayerNorm.weight.uniform_(-2, 2)
        model.cls.predictions.decoder.weight.normal_()
    decoder, gamma = model.cls.predictions.decoder.weight, layer.output.LayerNorm.weight
    memory = layer.memory
    slots = torch.tensor([0, 5, 63])
    rows = memory.values.weight[slots] * (1 if scale is None else scale)
    expected = (rows - rows.mean(-1, keepdim=True)) * gamma @ decoder.T
    assert torch.allclose(project_values(model, memory, slots), expected, atol=1e-5)
    assert not torch.equal(decoder, model.bert.embeddings.word_embeddings.weight)  # E is the decoder, not the input

    summary = build_memory_explorer(model, tokenizer, tmp_path / "explorer", [TEXT], max_seq_length=LENGTH,
                                    max_tokens=LENGTH * 2, top_tokens=5)  # fmt: skip
    layer_summary = layer_of(summary, "layer_1")
    assert layer_summary["projection"]["gamma"] == "bert.encoder.layer.1.output.LayerNorm.weight"
    _, promoted = all_contexts(tmp_path / "explorer", layer_summary)
    for slot, row in zip(slots.tolist(), expected):
        logits, ids = row.topk(5)
        assert [token for token, _ in promoted[slot]] == tokenizer.convert_ids_to_tokens(ids.tolist())
        assert [logit for _, logit in promoted[slot]] == pytest.approx(logits.tolist(), abs=1e-3)

    # a model without an LM head reads the word embeddings (tied to the decoder in BERT)
    base = BertPkmModel(config).eval()
    row = base.encoder.layer[1].memory.values.weight[:1] * (1 if scale is None else scale)
    gamma = base.encoder.layer[1].output.LayerNorm.weight
    expected = (row - row.mean(-1, keepdim=True)) * gamma @ base.embeddings.word_embeddings.weight.T
    assert torch.allclose(project_values(base, base.encoder.layer[1].memory, torch.tensor([0])), expected, atol=1e-5)


def test_most_used_slots_only_are_projected_on_request(model, tokenizer, tmp_path):
    summary = build_memory_explorer(model, tokenizer, tmp_path / "explorer", [TEXT], max_seq_length=LENGTH,
                                    max_tokens=LENGTH * SEQUENCES, max_projected_slots=5)  # fmt: skip
    for layer in summary["layers"]:
        _, promoted = all_contexts(tmp_path / "explorer", layer)
        assert layer["projected_slots"] == 5 and sorted(promoted) == sorted(layer["ranked"]["slot"][:5])


# ---- hashed n-gram memories ----


@pytest.fixture(scope="module")
def ngram_model():
    """Memories of both kinds: n-gram memories at layers 0 and 2 (their convolution and value projection set to random
    values: they start at zero), a product key memory at layer 2."""
    torch.manual_seed(3)
    model = BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[2], ngram_layers=[0, 2], ngram_table_size=53,
                                           ngram_dim=4))  # fmt: skip
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, NgramMemory):
                for parameter in (module.conv.weight, module.value.weight, module.value.bias):
                    parameter.normal_(std=0.3)
    return model.eval()


@pytest.fixture(scope="module")
def ngram_explorer(ngram_model, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ngram") / "explorer"
    summary = build_memory_explorer(ngram_model, tokenizer, folder, [TEXT], max_seq_length=LENGTH, max_tokens=LENGTH * 4,
                                    contexts_per_slot=1000, chunk_size=64)  # fmt: skip
    return folder, summary


def test_ngram_buckets_gates_and_collisions_equal_a_direct_computation(ngram_model, tokenizer, ngram_explorer):
    """Per position and table the bucket is the memory's own hash (`bucket_indices`) of the sequence with its edges;
    the gate is the factor of the memory's output over its value projection; per bucket the reads, the summed gate, the
    contexts (all kept here) with the n-gram's span, and the collisions add up."""
    folder, summary = ngram_explorer
    assert [layer["name"] for layer in summary["layers"]] == ["layer_0_ngram", "layer_2", "layer_2_ngram"]
    sequences = report_module.text_sequences(tokenizer, [TEXT], LENGTH, 4)
    ids = torch.tensor([s["input_ids"] for s in sequences])
    captured = {}
    hooks = []
    for index in (0, 2):
        memory = ngram_model.bert.encoder.layer[index].ngram
        hooks.append(memory.register_forward_hook(lambda m, args, out, i=index: captured.__setitem__(("out", i), out)))
        hooks.append(memory.value.register_forward_hook(lambda m, args, out, i=index: captured.__setitem__(("v", i), out)))
    with torch.no_grad():
        ngram_model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    tokens = read_explorer_data(folder, "tokens")["tokens"]
    for index in (0, 2):
        memory, name = ngram_model.bert.encoder.layer[index].ngram, f"layer_{index}_ngram"
        layer = layer_of(summary, name)
        edges = torch.full((ids.shape[0], memory.context_left), -1), torch.full((ids.shape[0], memory.context_right), -1)
        buckets = memory.bucket_indices(torch.cat([edges[0], ids, edges[1]], dim=1))
        buckets = buckets[:, memory.conv_left : memory.conv_left + LENGTH].reshape(-1, memory.num_tables)
        output, value = captured[("out", index)], captured[("v", index)]
        gate = ((output * value).sum(-1) / (value * value).sum(-1)).flatten()
        selections = read_explorer_data(folder, f"{name}/selections")
        assert "top1" not in selections and selections["head_top1"] == buckets.T.tolist()
        assert torch.allclose(torch.tensor(selections["head_top1_weight"][0]), gate, atol=1e-4)

        reads = torch.bincount(buckets.flatten(), minlength=layer["size"])
        ranked = layer["ranked"]
        assert sorted(ranked["slot"]) == reads.nonzero().squeeze(1).tolist() and layer["size"] == memory.tables.num_embeddings
        assert ranked["used"] == reads[ranked["slot"]].tolist() == sorted(ranked["used"], reverse=True)
        gate_sums = torch.zeros(layer["size"], dtype=torch.float64).index_add_(
            0, buckets.flatten(), gate.double().repeat_interleave(memory.num_tables))
        assert ranked["weight"] == pytest.approx(gate_sums[ranked["slot"]].tolist(), rel=1e-5)
        assert layer["metrics"]["mu"] == (reads > 0).double().mean().item() and layer["never_selected"] == int((reads == 0).sum())
        assert layer["metrics"]["tokens"] == LENGTH * 4 and layer["never_picked"] is None

        contexts, _ = all_contexts(folder, layer)
        collisions = {}
        for chunk in layer["chunks"]:
            collisions.update(read_explorer_data(folder, f"{name}/slots_{chunk:05d}")["collisions"])
        for bucket in ranked["slot"]:
            kept = contexts[bucket]
            table = next(t for t, info in enumerate(layer["tables"]) if info["offset"] <= bucket < info["offset"] + info["size"])
            order, ending = layer["tables"][table]["order"], layer["tables"][table]["side"] == "ending"
            assert len(kept) == reads[bucket] and all(buckets[p, table] == bucket for p, _, _, _, _ in kept)
            for position, weight, _, first, last in kept:
                start = position - position % LENGTH
                assert (first, last) == ((max(start, position - order + 1), position) if ending else
                                         (position, min(start + LENGTH - 1, position + order - 1)))  # fmt: skip
            grams = collisions[str(bucket)]
            assert sum(count for _, count in grams["ngrams"]) == reads[bucket] or grams["distinct"] > len(grams["ngrams"])
            # each n-gram read here, as text (a cut one ends in the boundary mark), is among its collisions
            if grams["distinct"] <= len(grams["ngrams"]):
                texts = {text for text, _ in grams["ngrams"]}
                for position, _, _, first, last in kept:
                    missing = order - (last - first + 1)
                    text = " ".join(tokens[first : last + 1]).replace(" ##", "")
                    text = " ".join(["\u2205"] * missing + [text]) if ending and missing else text
                    text = " ".join([text] + ["\u2205"] * missing) if not ending and missing else text
                    assert text in texts


def test_ngram_projection_is_the_documented_one(ngram_model):
    """E @ (gamma * (d - mean(d))), d = W_v[:, table] @ row: the row through its table's columns of the value
    projection, the gain of the attention block's LayerNorm the memory adds to, the output embedding."""
    layer = ngram_model.bert.encoder.layer[2]
    memory = layer.ngram
    buckets = torch.tensor([0, memory.offsets[3] + 7, memory.tables.num_embeddings - 1])
    expected = []
    for bucket in buckets.tolist():
        table = max(t for t, offset in enumerate(memory.offsets) if offset <= bucket)
        d = memory.value.weight[:, table * memory.dim : (table + 1) * memory.dim] @ memory.tables.weight[bucket]
        d = (d - d.mean()) * layer.attention.output.LayerNorm.weight
        expected.append(ngram_model.cls.predictions.decoder.weight @ d)
    assert torch.allclose(project_ngram_buckets(ngram_model, memory, buckets), torch.stack(expected), atol=1e-5)


def test_packed_n_gram_tables_are_explored_as_their_fp32_rows(ngram_model):
    """int8 serving tables (quantize_memory_values): the recorder sees the same buckets, the projection reads the
    dequantised rows."""
    import copy

    from modeling_pkm_bert import quantize_memory_values
    from modeling_pkm_bert.analysis.explorer import NgramRecorder

    quantized = copy.deepcopy(ngram_model).eval()
    quantize_memory_values(quantized, bits=8)
    memory, packed = ngram_model.bert.encoder.layer[2].ngram, quantized.bert.encoder.layer[2].ngram
    buckets = torch.tensor([0, memory.offsets[3] + 7, memory.tables.num_embeddings - 1])
    expected = project_ngram_buckets(ngram_model, memory, buckets)
    assert ((project_ngram_buckets(quantized, packed, buckets) - expected).norm() / expected.norm()) < 0.02
    ids = torch.randint(5, ngram_model.config.vocab_size, (2, 12))
    reads = []
    for model, layer in ((ngram_model.eval(), memory), (quantized, packed)):
        with NgramRecorder({"layer_2_ngram": layer}, 4) as recorder, torch.no_grad():
            model(ids)
        reads.append(recorder.reads["layer_2_ngram"])
    assert reads[0].sum() == 2 * 12 * memory.num_tables and torch.equal(reads[0], reads[1])


def test_a_browser_shows_a_bucket_with_its_collisions(ngram_explorer):
    chromium_or_skip()
    folder, summary = ngram_explorer
    layer = layer_of(summary, "layer_2_ngram")
    bucket = layer["ranked"]["slot"][0]
    data = read_explorer_data(folder, f"layer_2_ngram/slots_{bucket // 64:05d}")
    tokens = read_explorer_data(folder, "tokens")["tokens"]
    with Browser() as browser:
        browser.open((folder / "index.html").as_uri())
        page_ready(browser)
        browser.evaluate("document.getElementById('layer-layer_2_ngram').click()")
        page_ready(browser)
        assert browser.evaluate("document.querySelector('#layer-view h2').textContent").startswith(
            f"layer_2_ngram: {layer['size']} buckets, hashed n-gram memory, 16 tables")
        assert browser.evaluate("document.querySelector('#metrics [data-metric=mu] td').textContent") == (
            f"{100 * layer['metrics']['mu']:.2f} %")
        assert browser.evaluate("document.querySelectorAll('#metrics [data-metric=top1_mu]').length") == 0
        browser.evaluate(f"document.querySelector('#slot-table tr[data-slot=\"{bucket}\"]').click()")
        page_ready(browser)
        shown = browser.evaluate("Array.from(document.querySelectorAll('#collisions [data-ngram]')).map(s => [s.dataset.ngram,"
                                 " +s.dataset.count])")  # fmt: skip
        assert shown == data["collisions"][str(bucket)]["ngrams"]
        marks = browser.evaluate("Array.from(document.querySelectorAll('#contexts mark')).map(m => m.textContent)")
        assert marks == [" ".join(tokens[first : last + 1]) for _, _, _, first, last in data["contexts"][str(bucket)]]
        browser.evaluate("document.getElementById('search').value = 'elizabeth'; document.getElementById('search-button').click()")
        page_ready(browser)
        assert browser.evaluate("document.querySelectorAll('.search-layer[data-layer=layer_2_ngram] [data-head]').length") == 16
        assert browser.evaluate("document.querySelector('.search-layer[data-layer=layer_2_ngram] [data-head=\"0\"] td')"
                                ".textContent") == "table 0: 2-gram ending here, hash 0"  # fmt: skip


# ---- the page in a real browser ----


def page_ready(browser):
    return browser.wait_for(
        "document.body.getAttribute('data-ready') === (location.hash || '#') && document.body.getAttribute('data-ready')",
        "the page to draw its view",
    )


def test_a_browser_selects_a_layer_opens_a_slot_and_searches(explorer, tokenizer, tmp_path):
    """Chromium opens index.html from disk; clicks the second layer, a slot of the ranked table, and searches a word;
    the test reads what the page shows and compares it with the data. A screenshot of each view is saved (the docs'
    are made the same way: docs/memory_explorer.md)."""
    chromium_or_skip()
    folder, summary = explorer
    tokens = read_explorer_data(folder, "tokens")["tokens"]
    with Browser() as browser:
        browser.open((folder / "index.html").as_uri())
        page_ready(browser)
        assert browser.evaluate("document.querySelector('#layer-view h2').textContent").startswith("layer_0: 64 slots")

        # select a layer: its metrics and its ranked slots
        browser.evaluate("document.getElementById('layer-layer_2').click()")
        assert page_ready(browser) == "#layer=layer_2"
        layer = layer_of(summary, "layer_2")
        m = layer["metrics"]
        shown = dict(browser.evaluate(
            "Array.from(document.querySelectorAll('#metrics tr')).map(r => [r.dataset.metric, r.cells[1].textContent])"
        ))  # fmt: skip
        assert shown["tokens"] == str(m["tokens"])
        assert shown["mu"] == f"{100 * m['mu']:.2f} %" and shown["top1_mu"] == f"{100 * m['top1_mu']:.2f} %"
        assert shown["kl_u"] == f"{m['kl_u']:.4f}" and shown["gini_w"] == f"{m['gini_w']:.4f}"
        assert shown["never_picked"].startswith(f"{layer['never_picked']} (")
        rows = browser.evaluate(
            "Array.from(document.querySelectorAll('#slot-table tr[data-slot]')).map(r => [+r.dataset.slot,"
            " +r.querySelector('[data-field=top1]').textContent, +r.querySelector('[data-field=weight]').textContent])"
        )
        ranked = layer["ranked"]
        assert [r[0] for r in rows] == ranked["slot"][:50] and [r[1] for r in rows] == ranked["top1"][:50]
        assert [r[2] for r in rows] == pytest.approx(ranked["weight"][:50], abs=5e-4)
        browser.screenshot(tmp_path / "explorer_layer.png")

        # sort by summed weight
        browser.evaluate("document.getElementById('sort-weight').click()")
        assert page_ready(browser) == "#layer=layer_2&sort=weight"
        heaviest = max(zip(ranked["weight"], ranked["slot"]))[1]
        assert browser.evaluate("+document.querySelector('#slot-table tr[data-slot]').dataset.slot") == heaviest
        browser.evaluate("document.getElementById('sort-top1').click()")
        page_ready(browser)

        # page through the slots
        browser.evaluate("document.getElementById('next-page').click()")
        page_ready(browser)
        assert browser.evaluate("+document.querySelector('#slot-table tr[data-slot]').dataset.slot") == ranked["slot"][50]

        # open a slot: its contexts (heaviest first, with the token highlighted) and its promoted tokens
        slot = ranked["slot"][52]
        browser.evaluate(f"document.querySelector('#slot-table tr[data-slot=\"{slot}\"]').click()")
        assert page_ready(browser) == f"#layer=layer_2&sort=top1&page=1&slot={slot}"
        contexts, promoted = all_contexts(folder, layer)
        shown = browser.evaluate(
            "Array.from(document.querySelectorAll('#contexts li')).map(li => [+li.dataset.position, +li.dataset.weight,"
            " li.querySelector('mark').textContent, !!li.querySelector('.top1')])"
        )
        assert shown == [[p, w, tokens[p].removeprefix("##"), bool(t)] for p, w, t in contexts[slot]]
        assert browser.evaluate("document.getElementById('slot-title').textContent") == f"layer_2, slot {slot} ({slot // 8}, {slot % 8})"
        assert browser.evaluate("Array.from(document.querySelectorAll('#promoted [data-token]')).map(s => s.dataset.token)") == [
            token for token, _ in promoted[slot]
        ]
        browser.screenshot(tmp_path / "explorer_slot.png")

        # search a word: the slots its occurrences select, per layer (top-1) and per head
        word = "elizabeth"
        browser.evaluate(f"document.getElementById('search').value = '{word}'; document.getElementById('search-button').click()")
        page_ready(browser)
        positions = [p for p, token in enumerate(tokens) if token == word]
        assert browser.evaluate("document.getElementById('search-title').textContent").endswith(f": {len(positions)} token occurrences")
        for name in ("layer_0", "layer_2"):
            selections = read_explorer_data(folder, f"{name}/selections")
            for head, picks in [("top1", selections["top1"]), *[(str(h), p) for h, p in enumerate(selections["head_top1"])]]:
                expected = collections.Counter(picks[p] for p in positions)
                expected = sorted(expected.items(), key=lambda item: (-item[1], item[0]))
                shown = browser.evaluate(
                    f"Array.from(document.querySelectorAll('.search-layer[data-layer={name}] [data-head=\"{head}\"] a'))"
                    ".map(a => [+a.dataset.slot, +a.dataset.count])"
                )
                assert shown == [list(pair) for pair in expected[: len(shown)]] and len(shown) >= min(len(expected), 8)
        browser.screenshot(tmp_path / "explorer_search.png")

        # a search result opens its slot in its layer
        browser.evaluate("document.querySelector('.search-layer[data-layer=layer_0] [data-head=top1] a').click()")
        assert re.fullmatch(r"#layer=layer_0&sort=top1&slot=\d+&q=elizabeth", page_ready(browser))

        # a layer that does not exist is named, and the first layer shown
        browser.evaluate("location.hash = 'layer=layer_9'")
        page_ready(browser)
        assert "no memory layer layer_9 (the layers: layer_0, layer_2)" in browser.evaluate("document.getElementById('error').textContent")
    for view in ("layer", "slot", "search"):
        assert (tmp_path / f"explorer_{view}.png").read_bytes().startswith(b"\x89PNG")


# ---- the script and bad input ----


def test_script_writes_the_page(model, tokenizer, tmp_path):
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)
    script = load_script("memory_explorer")
    summary = script.main(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out"), "--text_file",
                           str(text), "--max_seq_length", str(LENGTH), "--max_tokens", "96", "--layers", "2"])  # fmt: skip
    assert [layer["name"] for layer in summary["layers"]] == ["layer_2"] and summary["tokens"] == 96
    assert (tmp_path / "out" / "index.html").read_text().startswith("<!DOCTYPE html>")
    assert "Memory explorer of model" in (tmp_path / "out" / "index.html").read_text()
    for name in ("explorer.css", "explorer.js"):  # the page's own files, beside it (it loads them by these names)
        assert f'"{name}"' in (tmp_path / "out" / "index.html").read_text()
        assert (tmp_path / "out" / name).read_text().strip()


def test_script_reads_a_dataset(model, tokenizer, tmp_path, capsys):
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "data"
    data.mkdir()
    paragraphs = [p for p in TEXT.split("\n") if p.strip()]
    (data / "validation.jsonl").write_text("".join(json.dumps({"content": p}) + "\n" for p in paragraphs))
    script = load_script("memory_explorer")
    args = ["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out"), "--dataset_name", str(data),
            "--max_seq_length", str(LENGTH), "--max_tokens", "64"]  # fmt: skip
    line = usage_error(capsys, lambda: script.main(args))
    assert re.search(r"--text_column 'text' is not a column of .* \(columns: \['content'\]\)", line)
    summary = script.main([*args, "--text_column", "content"])
    sequences = report_module.text_sequences(tokenizer, paragraphs, LENGTH, 2)
    tokens = read_explorer_data(tmp_path / "out", "tokens")["tokens"]
    assert summary["tokens"] == 64 and tokens == tokenizer.convert_ids_to_tokens([i for s in sequences for i in s["input_ids"]])


def test_bad_input_is_named(model, tokenizer, tmp_path, capsys):
    with pytest.raises(MemoryExplorerError, match="layer 5 has no memory: the model's memory layers are layer_0, layer_2"):
        build_memory_explorer(model, tokenizer, tmp_path / "a", [TEXT], layers=[5])
    with pytest.raises(MemoryExplorerError, match="the texts are empty"):
        build_memory_explorer(model, tokenizer, tmp_path / "b", ["", "  \n"])
    with pytest.raises(MemoryExplorerError, match="too short for one sequence"):
        build_memory_explorer(model, tokenizer, tmp_path / "c", ["a few words"])
    with pytest.raises(MemoryExplorerError, match="max_tokens=10 is less than one sequence of 64 tokens"):  # positions
        build_memory_explorer(model, tokenizer, tmp_path / "d", [TEXT], max_tokens=10)
    plain = BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[]))
    with pytest.raises(MemoryExplorerError, match=r"has no memory layer \(product key or hashed n-gram\)"):
        build_memory_explorer(plain, tokenizer, tmp_path / "e", [TEXT])
    assert not any(tmp_path.iterdir())  # nothing half-written

    script = load_script("memory_explorer")
    folder = tmp_path / "plain"
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    line = usage_error(capsys, lambda: script.main(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out")]))
    assert "has no memory layer (product key or hashed n-gram)" in line
    folder = tmp_path / "pkm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    line = usage_error(capsys, lambda: script.main(["--model_name_or_path", str(folder), "--output_dir",
                                                    str(tmp_path / "out"), "--layers", "7"]))  # fmt: skip
    assert "layer 7 has no memory" in line
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    line = usage_error(capsys, lambda: script.main(["--model_name_or_path", str(folder), "--output_dir",
                                                    str(tmp_path / "out"), "--text_file", str(empty)]))  # fmt: skip
    assert "the texts are empty" in line
    line = usage_error(capsys, lambda: script.parse_args(["--model_name_or_path", str(folder), "--output_dir", "x",
                                                          "--text_file", "missing.txt"]))  # fmt: skip
    assert "--text_file 'missing.txt' does not exist" in line
    assert not (tmp_path / "out").exists()
