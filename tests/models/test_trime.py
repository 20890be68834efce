"""TRIME's in-batch memory loss (modeling_pkm_bert/methods/trime/objective.py): the formula and its gradient against a direct
loop, an empty memory == cross-entropy bit for bit, the memory rules (local / long / batch, never itself, unscored
positions never in it), chunking, the output layer of real models, and run_mlm.py --trime."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO_ROOT, BertPkmModelTester, load_script, reset_accelerate_state, tiny_config
from transformers import GPT2Config, GPT2LMHeadModel

from modeling_pkm_bert import BertPkmForCausalLM, BertPkmForMaskedLM
from modeling_pkm_bert.methods.trime import (
    causal_targets,
    check_trime_model,
    model_trime_losses,
    output_layer,
    trime_log_probs,
    trime_loss,
)


def allowed(memory, query, key):
    """The rule of the docstring, for (row, position) pairs."""
    return {"local": key[0] == query[0] and key[1] < query[1], "long": key < query, "batch": key != query}[memory]


def loop_trime_nll(hidden, targets, weight, bias, memory, ignore_index=-100):
    """The formula written out: p(w|t) = [exp(E_w.h_t + b_w) + sum_{j in M(t), y_j = w} exp(h_t.h_j / sqrt(d))] /
    sum over the vocabulary of the same numerators; the mean -log p(y_t|t) over scored positions."""
    batch, length, d = hidden.shape
    losses = []
    for r in range(batch):
        for t in range(length):
            if targets[r, t] == ignore_index:
                continue
            numerators = torch.exp(weight @ hidden[r, t] + bias)
            for r2 in range(batch):
                for j in range(length):
                    if targets[r2, j] != ignore_index and allowed(memory, (r, t), (r2, j)):
                        entry = torch.exp(hidden[r, t] @ hidden[r2, j] / math.sqrt(d))
                        numerators = numerators + F.one_hot(targets[r2, j], weight.shape[0]) * entry
            losses.append(-torch.log(numerators[targets[r, t]] / numerators.sum()))
    return torch.stack(losses).mean()


@pytest.fixture
def tiny_inputs():
    batch, length, d, vocab = 3, 5, 4, 7
    hidden = torch.randn(batch, length, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 3, (batch, length))  # 3 of 7 words: many memory entries share the target
    targets[0, 2] = targets[2, 0] = -100
    return hidden, targets, weight, bias


@pytest.mark.parametrize("memory", ["local", "long", "batch"])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_loss_and_gradient_match_the_formula(tiny_inputs, memory, chunk_size):
    hidden, targets, weight, bias = tiny_inputs
    expected = loop_trime_nll(hidden, targets, weight, bias, memory)
    expected_grads = torch.autograd.grad(expected, (hidden, weight, bias))
    for kwargs in (dict(output_layer=(weight, bias)), dict(logits=hidden @ weight.T + bias)):
        loss = trime_loss(hidden, targets, memory=memory, chunk_size=chunk_size, **kwargs)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        for grad, reference in zip(grads, expected_grads):
            torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)
    assert loss > F.cross_entropy((hidden @ weight.T + bias).flatten(0, 1), targets.flatten()) - 10  # finite, sane


def test_an_empty_memory_gives_cross_entropy_exactly():
    """local memory with one scored position per row, long/batch memory with one scored position in the batch: the
    loss, per position and reduced, is F.cross_entropy's bit for bit; its gradient is finite and CE's."""
    hidden = torch.randn(6, 4, 16, requires_grad=True)
    linear = torch.nn.Linear(16, 50)
    one_per_row = torch.full((6, 4), -100)
    one_per_row[torch.arange(6), torch.tensor([0, 3, 1, 2, 0, 3])] = torch.randint(0, 50, (6,))
    only_one = torch.full((6, 4), -100)
    only_one[4, 2] = 7
    for memory, targets in (("local", one_per_row), ("long", only_one), ("batch", only_one)):
        logits = linear(hidden)
        reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(6, 4)
        assert torch.equal(trime_loss(hidden, targets, logits=logits, memory=memory, reduction="none"), reference)
        for reduction in ("mean", "sum"):
            loss = trime_loss(hidden, targets, logits=logits, memory=memory, reduction=reduction)
            assert torch.equal(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction))
        loss = trime_loss(hidden, targets, logits=logits, memory=memory)
        grad = torch.autograd.grad(loss, hidden, retain_graph=True)[0]
        ce_grad = torch.autograd.grad(F.cross_entropy(logits.flatten(0, 1), targets.flatten()), hidden)[0]
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, ce_grad)
    # the first position of a causal "local" memory has an empty memory too
    full = torch.randint(0, 50, (6, 4))
    first = trime_loss(hidden, full, logits=logits, memory="local", reduction="none")[:, 0]
    assert torch.equal(first, F.cross_entropy(logits[:, 0], full[:, 0], reduction="none"))


def test_entries_with_other_targets_still_count_in_the_normaliser():
    """Two positions of one row, different targets: the second's memory holds the first, whose target differs, so
    p = exp(x_y) / (Z_vocab + exp(sim)): lower than the softmax, by exactly that normaliser."""
    hidden = torch.randn(1, 2, 8, dtype=torch.float64)
    weight, bias = torch.randn(11, 8, dtype=torch.float64), torch.randn(11, dtype=torch.float64)
    targets = torch.tensor([[3, 5]])
    logits = hidden[0, 1] @ weight.T + bias
    sim = hidden[0, 1] @ hidden[0, 0] / math.sqrt(8)
    expected = -(logits[5] - torch.log(torch.exp(logits).sum() + torch.exp(sim)))
    losses = trime_loss(hidden, targets, (weight, bias), memory="local", reduction="none")
    torch.testing.assert_close(losses[0, 1], expected, rtol=1e-13, atol=0)
    assert losses[0, 1] > F.cross_entropy(logits[None], targets[0, 1:])
    # the same entry with the same target raises the probability instead
    same = trime_loss(hidden, torch.tensor([[5, 5]]), (weight, bias), memory="local", reduction="none")[0, 1]
    expected = -torch.log((torch.exp(logits[5]) + torch.exp(sim)) / (torch.exp(logits).sum() + torch.exp(sim)))
    torch.testing.assert_close(same, expected)


@pytest.mark.parametrize("memory", ["local", "long", "batch"])
def test_which_positions_a_position_sees(memory):
    """The gradient of one position's loss reaches exactly the hidden states of its memory (and its own): local =
    earlier positions of its row, long = every earlier position of the batch, batch = every other scored position;
    unscored positions never."""
    hidden = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 8, dtype=torch.float64)
    targets = torch.randint(0, 5, (3, 4))
    targets[0, 1] = targets[2, 3] = -100
    query = (1, 2)
    loss = trime_loss(hidden, targets, (weight, None), memory=memory, reduction="none")[query]
    (grad,) = torch.autograd.grad(loss, hidden)
    reached = {(r, t) for r in range(3) for t in range(4) if grad[r, t].abs().sum() > 0}
    expected = {
        (r, t) for r in range(3) for t in range(4) if targets[r, t] != -100 and allowed(memory, query, (r, t))
    }
    assert reached == expected | {query}
    assert {"local": 2, "long": 5, "batch": 9}[memory] == len(expected)  # never itself


def test_chunks_change_nothing_and_hold_at_most_a_chunk_of_scores():
    """512 tokens, a vocabulary of 300, chunks of 64: the result matches the one-chunk computation, and no tensor
    autograd keeps is larger than a chunk of scores (64 x 512), let alone (tokens x tokens) or (tokens x tokens x
    vocab)."""
    hidden = torch.randn(8, 64, 32, requires_grad=True)
    layer = torch.nn.Linear(32, 300)
    targets = torch.randint(0, 300, (8, 64))
    targets[:, -1] = -100
    largest = []

    def pack(tensor):
        largest.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunked = trime_loss(hidden, targets, layer, memory="long", chunk_size=64)
    assert max(largest) <= 64 * 512
    one = trime_loss(hidden, targets, layer, memory="long", chunk_size=4096)
    torch.testing.assert_close(chunked, one)
    torch.testing.assert_close(
        torch.autograd.grad(chunked, hidden)[0], torch.autograd.grad(one, hidden)[0], rtol=1e-4, atol=1e-7
    )


def test_bad_arguments_are_clear_errors():
    hidden, targets = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"memory='global'; expected one of \('local', 'long', 'batch', 'context'\)"):
        trime_loss(hidden, targets, torch.nn.Linear(4, 5), memory="global")
    with pytest.raises(ValueError, match=r"hidden must be \(batch, seq, d\) and targets \(batch, seq\)"):
        trime_loss(hidden, targets[:, :2], torch.nn.Linear(4, 5))
    with pytest.raises(ValueError, match=r"vocabulary projection \(a weight of shape \(vocab, hidden\)\)"):
        trime_loss(hidden, targets, torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"does not take hidden states of size 4"):
        trime_loss(hidden, targets, torch.nn.Linear(6, 5))
    # no scored position: a zero loss that still reaches the hidden states (no NaN)
    loss = trime_loss(hidden.requires_grad_(), torch.full((2, 3), -100), torch.nn.Linear(4, 5))
    assert loss.item() == 0.0 and torch.equal(torch.autograd.grad(loss, hidden)[0], torch.zeros_like(hidden))


def test_bert_heads_h_is_the_decoder_input_and_ce_is_the_models_loss():
    """For BertPkm heads h is the input of cls.predictions.decoder (after the transform); with memory=None the loss is
    the model's own masked-LM loss bit for bit; the causal head's too (to rounding: its loss sums then divides)."""
    model = BertPkmForMaskedLM(tiny_config()).eval()
    input_ids = torch.randint(5, 99, (2, 10))
    labels = torch.full_like(input_ids, -100)
    labels[:, [1, 4, 7]] = input_ids[:, [1, 4, 7]]
    with torch.no_grad():
        ce, trime = model_trime_losses(model, {"input_ids": input_ids}, labels, "batch")
        reference = model(input_ids=input_ids, labels=labels).loss
        hidden = model.cls.predictions.transform(model.bert(input_ids).last_hidden_state)
        logits = model(input_ids=input_ids).logits
    assert torch.equal(ce, reference)
    assert output_layer(model) is model.cls.predictions.decoder
    torch.testing.assert_close(trime, trime_loss(hidden, labels, model.cls.predictions.decoder, memory="batch"))
    torch.testing.assert_close(trime, trime_loss(hidden, labels, logits=logits, memory="batch"))
    assert trime != ce

    causal = BertPkmForCausalLM(tiny_config(is_decoder=True)).eval()
    with torch.no_grad():
        ce, _ = model_trime_losses(causal, {"input_ids": input_ids}, causal_targets(input_ids), "local")
        torch.testing.assert_close(ce, causal(input_ids=input_ids, labels=input_ids).loss, rtol=1e-6, atol=1e-6)


def test_plain_causal_model_and_unreadable_output_layers():
    """GPT-2 (an lm_head without bias) works as is; a model without output embeddings, or one that transforms its
    logits after the output layer, is refused with a clear error."""
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    input_ids = torch.randint(0, 50, (2, 8))
    check_trime_model(gpt2)
    with torch.no_grad():
        ce, trime = model_trime_losses(gpt2, {"input_ids": input_ids}, causal_targets(input_ids), "long")
        torch.testing.assert_close(ce, gpt2(input_ids=input_ids, labels=input_ids).loss, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(trime)

    class NoHead(BertPkmForCausalLM):
        def get_output_embeddings(self):
            return None

    with pytest.raises(ValueError, match=r"NoHead has no output embeddings"):
        check_trime_model(NoHead(tiny_config(is_decoder=True)))

    class ScaledLogits(BertPkmForCausalLM):  # like a logit scale or soft-capping after the vocabulary projection
        def forward(self, *args, **kwargs):
            outputs = super().forward(*args, **kwargs)
            outputs.logits = outputs.logits * 0.5
            return outputs

    with pytest.raises(ValueError, match=r"logits of ScaledLogits are not its output layer's"):
        check_trime_model(ScaledLogits(tiny_config(is_decoder=True)))

    wrong = BertPkmForCausalLM(tiny_config(is_decoder=True))
    wrong.config.vocab_size = 120
    with pytest.raises(ValueError, match=r"has 99 rows, not the vocabulary's 120"):
        check_trime_model(wrong)


def test_log_probs_without_memory_are_the_log_softmax():
    hidden = torch.randn(2, 3, 4)
    layer = torch.nn.Linear(4, 9)
    targets = torch.randint(0, 9, (2, 3))
    scored, log_p, log_p_vocab = trime_log_probs(hidden, targets, layer, memory=None)
    assert torch.equal(log_p, log_p_vocab) and torch.equal(scored, torch.arange(6))
    expected = torch.log_softmax(layer(hidden), -1).gather(-1, targets[..., None]).flatten()
    torch.testing.assert_close(log_p, expected)


# ---- run_mlm.py --trime ----


@pytest.fixture
def tiny_mlm_folder(tmp_path_factory):
    """A tiny BertPkm config and word-level tokenizer in a folder of their own (a run's output may not lie in a folder
    it reads)."""
    folder = tmp_path_factory.mktemp("tiny_mlm")
    BertPkmModelTester(vocab_size=200).save_folder(folder)
    return folder


def test_run_mlm_trains_with_trime_and_reports_both_perplexities(tiny_mlm_folder, tmp_path):
    run_mlm = load_script("run_mlm")
    args = ["--config_name", str(tiny_mlm_folder), "--tokenizer_name", str(tiny_mlm_folder)]
    args += "--max_seq_length 32 --per_device_train_batch_size 4 --max_train_steps 2 --max_eval_samples 4".split()
    args += ["--seed", "1"]
    results = run_mlm.main([*args, "--trime", "--output_dir", str(tmp_path / "trime")])
    reset_accelerate_state()
    plain = run_mlm.main([*args, "--trime_eval", "context", "--output_dir", str(tmp_path / "plain")])
    for name in ("pride_and_prejudice", "moby_dick"):
        for run in (results, plain):
            assert run[f"eval_{name}_trime_perplexity"] == pytest.approx(math.exp(run[f"eval_{name}_trime_loss"]))
            assert run[f"eval_{name}_trime_perplexity"] != run[f"eval_{name}_perplexity"]
    # same seed, masks and batches: only the loss differs
    assert results["train_loss"] != plain["train_loss"]
    assert results["eval_moby_dick_perplexity"] != plain["eval_moby_dick_perplexity"]


# ---- masked LM at test time: the memory never holds a hidden label ----


def test_run_mlm_test_time_memory_never_reads_a_hidden_label():
    """The masked positions' labels are what the model must predict: run_mlm.py's test-time memory (the `--trime`
    default and any accepted `--trime_eval`) may not read them. Changing the label of another masked position (same
    inputs, same hidden states) must leave a position's TRIME score where it is."""
    run_mlm = load_script("run_mlm")
    torch.manual_seed(0)
    model = BertPkmForMaskedLM(tiny_config()).eval()
    input_ids = torch.randint(5, 99, (2, 12))
    labels = torch.full_like(input_ids, -100)
    labels[:, [1, 4, 7, 9]] = input_ids[:, [1, 4, 7, 9]]
    input_ids[:, [1, 4, 7, 9]] = 4  # [MASK]
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    data = str(REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_train.txt")
    base = ["--model_name_or_path", "m", "--train_file", data, "--output_dir", "o"]
    memories = set()
    for flags in (["--trime"], ["--trime_eval", "batch"], ["--trime_eval", "context"]):
        try:  # every test-time memory the script accepts
            memories.add(run_mlm.parse_args([*base, *flags]).trime_eval)
        except (SystemExit, ValueError):
            pass
    assert memories
    for memory in memories:
        with torch.no_grad():
            before = model_trime_losses(model, inputs, labels, memory, reduction="none")[1]
            changed = labels.clone()
            changed[0, 4] = changed[0, 1]  # another masked position now "answers" position (0, 1)
            after = model_trime_losses(model, inputs, changed, memory, reduction="none")[1]
        assert before[0, 1].item() == after[0, 1].item(), (memory, -before[0, 1].item(), -after[0, 1].item())
        assert torch.equal(before[1], after[1])


def test_run_mlm_refuses_the_batch_memory_at_test_time():
    run_mlm = load_script("run_mlm")
    data = str(REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_train.txt")
    base = ["--model_name_or_path", "m", "--train_file", data, "--output_dir", "o"]
    with pytest.raises(ValueError, match=r"--trime_eval batch .* labels .* hidden"):
        run_mlm.parse_args([*base, "--trime_eval", "batch"])
    args = run_mlm.parse_args([*base, "--trime"])
    assert (args.trime, args.trime_eval) == ("batch", "context")  # trains with the masked memory, tests with context


def test_context_memory_is_the_visible_positions_with_their_own_tokens():
    """memory="context": the entries are the unscored, unpadded positions of the batch, each credited to its own input
    token; the formula against a direct loop, and its gradient."""
    torch.manual_seed(0)
    batch, length, d, vocab = 2, 6, 4, 7
    hidden = torch.randn(batch, length, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64)
    bias = torch.randn(vocab, dtype=torch.float64)
    input_ids = torch.randint(0, 3, (batch, length))
    targets = torch.full_like(input_ids, -100)
    targets[:, [1, 4]] = torch.randint(0, 3, (batch, 2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -1] = 0  # padding is never an entry
    losses = []
    for r, t in targets.ne(-100).nonzero().tolist():
        numerators = torch.exp(weight @ hidden[r, t] + bias)
        for r2 in range(batch):
            for j in range(length):
                if targets[r2, j] == -100 and attention_mask[r2, j]:
                    entry = torch.exp(hidden[r, t] @ hidden[r2, j] / math.sqrt(d))
                    numerators = numerators + F.one_hot(input_ids[r2, j], vocab) * entry
        losses.append(-torch.log(numerators[targets[r, t]] / numerators.sum()))
    expected = torch.stack(losses).mean()
    for chunk_size in (1, 1024):
        loss = trime_loss(hidden, targets, (weight, bias), memory="context", input_ids=input_ids,
                          attention_mask=attention_mask, chunk_size=chunk_size)
        torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(expected, hidden)[0])
    with pytest.raises(ValueError, match=r"memory='context' needs the input_ids"):
        trime_loss(hidden, targets, (weight, bias), memory="context")
