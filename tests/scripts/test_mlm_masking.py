"""What run_mlm.py masks (`training.masking`): random tokens exactly as transformers' collator draws them, whole
words whole, given spans (salient-span / value masking) in every exposure, and a span cut by a block begun anew."""

import pytest
import torch
from transformers import BertTokenizerFast, DataCollatorForLanguageModeling

from modeling_pkm_bert.training.masking import CONTINUE, SPAN, UNIT, cut_unit_codes, mask_tokens, unit_codes
from modeling_pkm_bert.utils.input_errors import InputError


WORDS = "[PAD] [UNK] [CLS] [SEP] [MASK] ada love ##lace was born in london maida vale . the ##s".split()


@pytest.fixture(scope="module")
def tokenizer():
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)})


def encode(tokenizer, texts):
    return tokenizer(texts, return_offsets_mapping=True, return_special_tokens_mask=True, padding=True)


def draw(tokenizer, encoding, units, seed, **options):
    return mask_tokens(
        torch.as_tensor(encoding["input_ids"]),
        torch.as_tensor(encoding["special_tokens_mask"]),
        units=None if units is None else torch.tensor(units),
        mask_token_id=tokenizer.mask_token_id,
        vocab_size=len(tokenizer),
        generator=torch.Generator().manual_seed(seed),
        **options,
    )


def test_random_masking_draws_what_the_official_collator_draws(tokenizer):
    ids = torch.randint(5, len(WORDS), (6, 40), generator=torch.Generator().manual_seed(0))
    special = torch.zeros_like(ids)
    special[:, 0] = special[:, -3:] = 1
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    for seed in range(20):
        collator.generator = torch.Generator().manual_seed(seed)
        expected = collator.torch_mask_tokens(ids.clone(), special.clone())
        got = draw(tokenizer, {"input_ids": ids, "special_tokens_mask": special}, None, seed, mlm_probability=0.3)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), seed


def test_unit_codes_of_words_and_spans(tokenizer):
    text = "Ada Lovelace was born in Maida Vale."
    encoding = tokenizer(text, return_offsets_mapping=True)
    tokens = tokenizer.convert_ids_to_tokens(encoding["input_ids"])
    assert tokens == ["[CLS]", "ada", "love", "##lace", "was", "born", "in", "maida", "vale", ".", "[SEP]"]
    assert unit_codes(encoding["offset_mapping"]) == [UNIT] * 11
    assert unit_codes(encoding["offset_mapping"], encoding.word_ids()) == [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    spans = [(25, 35)]  # "Maida Vale": two words, one span
    assert unit_codes(encoding["offset_mapping"], encoding.word_ids(), spans) == [1, 1, 1, 0, 1, 1, 1, 2, 0, 1, 1]
    # a span that ends inside a word takes the word's tokens it overlaps; the rest of the word starts a unit
    assert unit_codes(encoding["offset_mapping"], encoding.word_ids(), [(4, 7)]) == [1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1]


def test_whole_words_are_masked_whole(tokenizer):
    texts = ["Ada Lovelace was born in London."] * 64
    encoding = encode(tokenizer, texts)
    units = [unit_codes(o, encoding.word_ids(i)) for i, o in enumerate(encoding["offset_mapping"])]
    lovelace = [2, 3]  # love ##lace
    masked_words = 0
    for seed in range(10):
        _, labels = draw(tokenizer, encoding, units, seed, mlm_probability=0.4)
        picked = labels != -100
        assert torch.equal(picked[:, lovelace[0]], picked[:, lovelace[1]]), seed
        assert not picked[:, 0].any() and not picked[:, -1].any()  # [CLS], [SEP]
        masked_words += picked[:, 1:8].sum().item() - picked[:, lovelace[1]].sum().item()
    assert 0.3 < masked_words / (10 * 64 * 6) < 0.5  # six words a text, each drawn with 0.4


def test_spans_are_masked_in_every_exposure_and_nothing_else(tokenizer):
    texts = ["Ada Lovelace was born in London.", "the ada was born in Maida Vale."]
    spans = [[(25, 31)], [(20, 30)]]
    encoding = encode(tokenizer, texts)
    units = [unit_codes(o, encoding.word_ids(i), spans[i]) for i, o in enumerate(encoding["offset_mapping"])]
    values = [["london"], ["maida", "vale"]]
    for seed in range(20):
        input_ids, labels = draw(tokenizer, encoding, units, seed, mlm_probability=0.0, mask_replace_prob=1.0)
        for row in range(2):
            assert tokenizer.convert_ids_to_tokens(labels[row][labels[row] != -100]) == values[row]
            assert (input_ids[row] == tokenizer.mask_token_id).sum() == len(values[row])
    # a span drawn with probability 0.5 is masked whole or not at all, in about half of the draws
    whole = 0
    for seed in range(200):
        _, labels = draw(tokenizer, encoding, units, seed, mlm_probability=0.0, span_mask_probability=0.5)
        picked = (labels[1] != -100).sum().item()
        assert picked in (0, 2)
        whole += picked == 2
    assert 70 < whole < 130


def test_a_block_that_cuts_a_unit_begins_it_anew():
    codes = [UNIT, CONTINUE, SPAN, CONTINUE, CONTINUE, UNIT, CONTINUE, CONTINUE, UNIT]
    assert cut_unit_codes(codes, 3) == [[UNIT, CONTINUE, SPAN], [SPAN, CONTINUE, UNIT], [UNIT, CONTINUE, UNIT]]
    assert cut_unit_codes(codes, 4) == [[UNIT, CONTINUE, SPAN, CONTINUE], [SPAN, UNIT, CONTINUE, CONTINUE]]


@pytest.mark.parametrize(
    "spans, message",
    [
        ([[5, 50]], r"span \[5, 50\] is not within the text's 32 characters"),
        ([[3, 3]], r"span \[3, 3\] is not within"),
        ([[1, "2"]], r"a span must be \[start, end\]"),
        ("25-31", r"spans must be a list"),
    ],
)
def test_bad_spans_are_one_line_errors(spans, message):
    from modeling_pkm_bert.training.masking import check_spans

    with pytest.raises(InputError, match=message):
        check_spans(spans, "Ada Lovelace was born in London.", "row 1")
