"""Writes tiny BertPkm and RobertaPkm folders of every head (plain and with the Memory+ options; a causal LM) with the
installed package and transformers, and `expected.json` with their outputs on fixed inputs, greedy generations and
fill-mask answers: `python write_folders.py OUT_DIR [NAME ...]` (default: all of FOLDERS). `check_folders.py` loads them
elsewhere through remote code.

A release's fixture (`tests/fixtures/bert_pkm_<version>`, what every later release must still load; never rewritten)
is written with `--fixture`: the same folders, with the code files, equal in every folder, kept once in OUT_DIR/code/
(`helpers.release_folders` puts them back at test time). `tests/fixtures/bert_pkm_0.2.0` holds what
`write_folders.py OUT mlm causal_memory_plus` wrote, `tests/fixtures/bert_pkm_0.3.0` what `write_folders.py OUT mlm
causal_memory_plus mlm_ngram causal_ngram roberta_mlm` wrote, `tests/fixtures/bert_pkm_0.4.0` what `write_folders.py OUT
mlm causal_memory_plus mlm_ngram causal_ngram mlm_ngram_int8 roberta_mlm` wrote, `tests/fixtures/modernbert_pkm_0.5.0`
(the release that introduces ModernBertPkm) what `write_folders.py OUT modernbert_mlm modernbert_cls_memory_plus
modernbert_tok_replace modernbert_choice modernbert_mlm_int8` wrote, `tests/fixtures/bert_pkm_0.6.0` what
`write_folders.py OUT mlm_ngram_int8 roberta_mlm modernbert_mlm_int8` wrote (a folder of each family: a release's
fixture holds every shipped file, tests/compat/test_release.py); a new release's:
`python tests/compat/write_folders.py --fixture tests/fixtures/bert_pkm_<version> NAME ...`."""

import json
import sys
from pathlib import Path

import torch
import transformers

from inputs import fixed_inputs, forward_kwargs
from modeling_pkm_bert import (
    BertPkmConfig,
    BertPkmForCausalLM,
    BertPkmForMaskedLM,
    BertPkmForMultipleChoice,
    BertPkmForQuestionAnswering,
    BertPkmForSequenceClassification,
    BertPkmForTokenClassification,
    BertPkmModel,
    ModernBertPkmConfig,
    ModernBertPkmForMaskedLM,
    ModernBertPkmForMultipleChoice,
    ModernBertPkmForSequenceClassification,
    ModernBertPkmForTokenClassification,
    ModernBertPkmModel,
    RobertaPkmConfig,
    RobertaPkmForCausalLM,
    RobertaPkmForMaskedLM,
    RobertaPkmForSequenceClassification,
    quantize_memory_values,
)


VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a cat dog sat on mat is was in paris".split()
VOCAB += [f"word{i}" for i in range(64 - len(VOCAB))]
MEMORY_PLUS = dict(
    pkm_shared_values=True, pkm_output_gate="swilu", pkm_qk_norm=True, pkm_score_activation="relu", pkm_memory_scale=0.5
)
FOLDERS = {  # name: (class, config overrides)
    "model": (BertPkmModel, {}),
    "mlm": (BertPkmForMaskedLM, {}),
    "mlm_replace": (BertPkmForMaskedLM, {"pkm_mode": "replace"}),
    "mlm_memory_plus": (BertPkmForMaskedLM, MEMORY_PLUS),
    "cls": (BertPkmForSequenceClassification, {"num_labels": 3}),
    "cls_memory_plus": (BertPkmForSequenceClassification, {"num_labels": 3, **MEMORY_PLUS}),
    "qa": (BertPkmForQuestionAnswering, {}),
    "tok": (BertPkmForTokenClassification, {"num_labels": 4}),
    "choice": (BertPkmForMultipleChoice, {}),
    "causal": (BertPkmForCausalLM, {"is_decoder": True}),
    "causal_memory_plus": (BertPkmForCausalLM, {"is_decoder": True, **MEMORY_PLUS}),
    # hashed n-gram memories (issue 35), beside product keys; their value projections made non-zero below
    "mlm_ngram": (BertPkmForMaskedLM, {"ngram_layers": [1], "ngram_table_size": 101, "ngram_dim": 4}),
    "causal_ngram": (BertPkmForCausalLM, {"is_decoder": True, "ngram_layers": [0, 1], "ngram_table_size": 101, "ngram_dim": 4}),
    # int8 serving tables of both memory kinds (release 0.4.0), packed by quantize_memory_values before saving
    "mlm_ngram_int8": (BertPkmForMaskedLM, {"ngram_layers": [1], "ngram_table_size": 101, "ngram_dim": 4}),
    # the RoBERTa family (issue 36): its own embeddings and heads around the same layers
    "roberta_mlm": (RobertaPkmForMaskedLM, {}),
    "roberta_cls_memory_plus": (RobertaPkmForSequenceClassification, {"num_labels": 3, **MEMORY_PLUS}),
    "roberta_causal": (RobertaPkmForCausalLM, {"is_decoder": True}),
    # the ModernBERT family (issue 48): pre-norm layers, rotary positions, a local layer (window 4 < 9 tokens)
    "modernbert_model": (ModernBertPkmModel, {}),
    "modernbert_mlm": (ModernBertPkmForMaskedLM, {"ngram_layers": [1], "ngram_table_size": 101, "ngram_dim": 4}),
    "modernbert_cls_memory_plus": (ModernBertPkmForSequenceClassification, {"num_labels": 3, **MEMORY_PLUS}),
    "modernbert_tok_replace": (ModernBertPkmForTokenClassification, {"num_labels": 4, "pkm_mode": "replace"}),
    "modernbert_choice": (ModernBertPkmForMultipleChoice, {"classifier_pooling": "mean"}),
    "modernbert_mlm_int8": (ModernBertPkmForMaskedLM, {"ngram_layers": [1], "ngram_table_size": 101, "ngram_dim": 4}),
}


QUANTIZED = {"mlm_ngram_int8": 8, "modernbert_mlm_int8": 8}  # folders saved with packed tables (bits)
# ModernBERT's own fields: the special ids of VOCAB ([PAD] 0, [CLS] 2, [SEP] 3), a 4-token local window
MODERNBERT_FIELDS = dict(
    pad_token_id=0, bos_token_id=2, cls_token_id=2, eos_token_id=3, sep_token_id=3, local_attention=4
)


def tiny_config(config_class=BertPkmConfig, **overrides) -> BertPkmConfig:
    fields = dict(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pkm_layers=[0, 2], pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=16,
    )  # fmt: skip
    return config_class(**{**fields, **overrides})


def outputs_of(model, name: str) -> list:
    with torch.no_grad():
        return model(**fixed_inputs(name, model.config.vocab_size), **forward_kwargs(name))[0].tolist()


def main(out_dir: str, names: list[str]):
    out = Path(out_dir)
    tokenizer = transformers.BertTokenizer(vocab={token: i for i, token in enumerate(VOCAB)})
    expected = {"transformers": transformers.__version__, "folders": {}}
    for index, (name, (model_class, overrides)) in enumerate(FOLDERS.items()):
        if names and name not in names:
            continue
        torch.manual_seed(index)
        config_class = RobertaPkmConfig if model_class.__name__.startswith("Roberta") else BertPkmConfig
        if model_class.__name__.startswith("ModernBert"):
            config_class, overrides = ModernBertPkmConfig, {**MODERNBERT_FIELDS, **overrides}
        model = model_class(tiny_config(config_class, **overrides)).train()
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__ == "NgramMemory":  # starts function-preserving: make it contribute
                    module.value.weight.normal_()
        with torch.no_grad():  # moves the query BatchNorm statistics, which must travel with the folder
            model(**fixed_inputs(name, model.config.vocab_size))
        model.eval()
        if name in QUANTIZED:
            quantize_memory_values(model, bits=QUANTIZED[name])
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        record = {"class": model_class.__name__, "outputs": outputs_of(model, name)}
        if "causal" in name:
            prompt = fixed_inputs(name, model.config.vocab_size)["input_ids"][:1, :4]
            record["generated"] = model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
        expected["folders"][name] = record
    (out / "expected.json").write_text(json.dumps(expected))


CODE = "code"  # a fixture's one copy of the release's code files (helpers.FIXTURE_CODE)


def keep_code_once(out: Path):
    """The fixture layout: every folder's code files moved into `out`/code/, one copy of each (they must be equal)."""
    (out / CODE).mkdir()
    for path in sorted(out.glob("*/*.py")):
        if path.parent.name == CODE:
            continue
        kept = out / CODE / path.name
        if not kept.exists():
            path.rename(kept)
        elif kept.read_bytes() == path.read_bytes():
            path.unlink()
        else:
            raise SystemExit(f"{path} differs from the copy in {kept.parent}: a release ships one code")


if __name__ == "__main__":
    args = sys.argv[1:]
    fixture = "--fixture" in args
    args = [arg for arg in args if arg != "--fixture"]
    if not args:
        raise SystemExit("usage: write_folders.py [--fixture] OUT_DIR [NAME ...]")
    unknown = set(args[1:]) - set(FOLDERS)
    if unknown:
        raise SystemExit(f"unknown folder names {sorted(unknown)}; known: {list(FOLDERS)}")
    if fixture and Path(args[0]).exists() and any(Path(args[0]).iterdir()):
        raise SystemExit(f"{args[0]} is not empty: a release fixture is written once, into a new folder")
    main(args[0], args[1:])
    if fixture:
        keep_code_once(Path(args[0]))
