"""Model cards written by conversion and training are Hub-ready: license, base_model (a Hub id, never a local path),
library_name, tags, a curated results table, and a "Produced by" command without secrets or this machine's paths."""

import json
import os
import re

import pytest
from helpers import BertPkmModelTester, load_script, placeholder_vocab, tiny_config
from huggingface_hub import ModelCard
from transformers import BertConfig, BertForMaskedLM, BertTokenizer

from modeling_pkm_bert import BertPkmForMaskedLM
from modeling_pkm_bert.hub.card_command import card_command, redact_command
from modeling_pkm_bert.hub.model_card import card_base_model, card_license, curated_results
from modeling_pkm_bert.training import write_results_model_card


SECRET = "hf_SeCrEtToKeN123"
RESULTS = {
    "initial_eval_books_perplexity": 30500.0,
    "eval_books_perplexity": 97.31,
    "perplexity": 97.31,
    "eval_accuracy": 0.9123,
    "eval_f1": 0.88,
    "eval_runtime": 3.21,
    "train_runtime": 812.4,
    "train_steps_per_second": 0.31,
    "initial_eval_memory/layer_1/mu": 0.448,
    "eval_memory/layer_1/mu": 0.691,
    "eval_memory/layer_1/top1_mu": 0.016,
    "eval_memory/layer_1/kl_u": 1.09,
    "eval_memory/layer_1/gini_w": 0.5,
    "eval_memory/layer_1/tokens": 6848,
}


def machine_paths(text: str, *roots) -> list[str]:
    """Absolute paths of this machine found in `text`."""
    found = [str(root) for root in roots if str(root) in text]
    return found + re.findall(r"(?<![\w.])/(?:work|root|home|tmp|usr)/\S*", text)


# a plain BERT folder (a conversion's source), not a BertPkm one: no tester builds it
def tiny_bert_folder(folder, **config):
    BertTokenizer(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"])}).save_pretrained(folder)
    BertForMaskedLM(
        BertConfig(vocab_size=7, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, **config)
    ).save_pretrained(folder)
    return folder


def test_card_command_drops_secrets_and_machine_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "out"
    argv = [
        "--model_name_or_path", "/opt/models/bert-local",
        "--train_file", str(tmp_path / "data" / "train.txt"),
        "--validation_files", "wt2=/srv/data/wiki.test.raw", "books=books.txt",
        "--output_dir", str(out),
        "--resume_from_checkpoint", str(out / "step_4"),
        "--hub_token", SECRET, f"--hub_token={SECRET}", "--wandb_api_secret", SECRET, "--db_password", SECRET,
        "--seed", "3",
    ]  # fmt: skip
    command = card_command("/somewhere/run_scripts/run_mlm.py", argv, output_dir=out)
    assert command == (
        "python run_scripts/run_mlm.py --model_name_or_path bert-local --train_file data/train.txt "
        "--validation_files wt2=wiki.test.raw books=books.txt --output_dir out --resume_from_checkpoint out/step_4 "
        "--seed 3"
    )
    # a local copy of a Hub model is named by the Hub id that --base_model gives
    shown = card_command("run_mlm.py", ["--model_name_or_path", "/opt/minilm", "--base_model", "org/model"])
    assert shown == "python run_scripts/run_mlm.py --model_name_or_path org/model --base_model org/model"
    # text commands (older cards, other callers) are cleaned the same way
    text = f"HF_TOKEN={SECRET} /usr/bin/python3 /work/x/run_scripts/run_glue.py --hub_token {SECRET} --output_dir /x/y"
    assert redact_command(text) == "python3 run_scripts/run_glue.py --output_dir y"
    assert card_command("x.py", ["--tokenizer_name", "tok", "--max_tokens", "5"]).endswith("--tokenizer_name tok --max_tokens 5")


def test_curated_results_keep_the_headline_numbers():
    lines = curated_results(RESULTS)
    text = "\n".join(lines)
    assert lines[0] == "| | before training | after training |"
    assert "| perplexity, books (`eval_books_perplexity`) | 30,500.00 | 97.3100 |" in lines
    assert "| accuracy (`eval_accuracy`) | - | 0.9123 |" in lines and "(`eval_f1`)" in text
    assert "| layer_1 MU % | 44.80 | 69.10 |" in lines and "| layer_1 top-1 MU % | - | 1.600 |" in lines
    for left_out in ("runtime", "steps_per_second", "gini", "tokens", "(`perplexity`)"):
        assert left_out not in text  # in all_results.json only
    assert curated_results({"eval_runtime": 1.0}) == []


def test_base_model_and_license_resolution(tmp_path):
    assert card_base_model("google-bert/bert-base-uncased") == "google-bert/bert-base-uncased"
    local = tiny_bert_folder(tmp_path / "bert")
    assert card_base_model(str(local)) is None  # a local folder is never named
    assert card_base_model(str(local), "org/bert") == "org/bert"
    (local / "README.md").write_text("---\nbase_model: org/origin\nlicense: mit\n---\n# x\n")
    assert card_base_model(str(local)) == "org/origin"  # e.g. a converted folder trained further
    with pytest.raises(ValueError, match="not a Hub model id"):
        card_base_model(str(local), str(local))
    assert card_license(str(local)) == "mit" and card_license(str(local), "cc-by-4.0") == "cc-by-4.0"
    assert card_license(str(tmp_path / "nothing")) == "apache-2.0"


def test_conversion_card_from_a_local_folder(tmp_path, monkeypatch):
    """convert_to_pkm.py on a local folder: base_model from --base_model, the source's license, the command relative
    and without the token or the folder's absolute path."""
    convert = load_script("convert_to_pkm")
    source = tiny_bert_folder(tmp_path / "src")
    (source / "README.md").write_text("---\nlicense: mit\n---\n# source\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "converted"
    args = ["--model_name_or_path", str(source), "--output_dir", str(out), "--pkm_layers", "1", "--pkm_n_keys", "4"]
    args += ["--pkm_knn", "2", "--pkm_heads", "1", "--pkm_k_dim", "8"]
    convert.main([*args, "--base_model", "org/tiny-bert"])
    card = ModelCard.load(out / "README.md")
    assert (card.data.license, card.data.base_model, card.data.library_name) == ("mit", "org/tiny-bert", "transformers")
    assert {"pkm", "bert_pkm", "custom_code"} <= set(card.data.tags)
    assert "python run_scripts/convert_to_pkm.py --model_name_or_path org/tiny-bert --output_dir converted" in card.text
    assert not machine_paths(card.text, tmp_path)

    # without --base_model a local source is named by its folder name only, and no base_model is claimed
    convert.main([*args, "--overwrite_output_dir"])
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None and "Converted from `src`" in card.text
    assert not machine_paths(card.text, tmp_path)


@pytest.mark.parametrize("pkm", [True, False], ids=["bertpkm", "plain-bert-baseline"])
def test_results_card_is_hub_ready_and_curated(tmp_path, monkeypatch, pkm):
    folder = tmp_path / "out"
    if pkm:
        BertPkmForMaskedLM(tiny_config()).save_pretrained(folder)
    else:
        tiny_bert_folder(folder)
    monkeypatch.chdir(tmp_path)
    command = card_command(
        "run_glue.py", ["--model_name_or_path", str(tmp_path / "model"), "--hub_token", SECRET, "--output_dir", str(folder)], folder
    )
    text = write_results_model_card(
        str(folder),
        RESULTS,
        repo_id="me/run",
        base_model=str(tmp_path),  # a local path: never named as base_model
        dataset=str(tmp_path / "data" / "train.tsv"),
        task="text-classification",
        command=command + f" --hub_token {SECRET}",  # a caller that forgot to clean it
    )
    card = ModelCard.load(folder / "README.md")
    assert card.text.strip() and text == (folder / "README.md").read_text()
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert card.data.base_model is None and card.data.tags
    assert "## Fine-tuning results" in card.text and "| accuracy (`eval_accuracy`) | - | 0.9123 |" in card.text
    assert f"All {len(RESULTS)} numbers of the run" in card.text and "`all_results.json`" in card.text
    assert "train_runtime" not in card.text and "data: `train.tsv`" in card.text
    assert "python run_scripts/run_glue.py --model_name_or_path model --output_dir out" in card.text
    assert SECRET not in text and not machine_paths(text, tmp_path)

    write_results_model_card(str(folder), RESULTS, base_model="org/base", license="mit")
    card = ModelCard.load(folder / "README.md")
    assert (card.data.base_model, card.data.license) == ("org/base", "mit")


def test_run_mlm_card_after_a_real_run(tmp_path, monkeypatch):
    """run_mlm.py writes the card after every run: the token given on the command line never reaches it."""
    run_mlm = load_script("run_mlm")
    folder = tmp_path / "tiny"
    words = placeholder_vocab()
    BertPkmModelTester().get_placeholder_tokenizer().save_pretrained(folder)
    tiny_config().save_pretrained(folder)
    (tmp_path / "train.txt").write_text(" ".join(words[5:]) + "\n" + " ".join(reversed(words[5:])) + "\n")
    monkeypatch.chdir(tmp_path)
    argv = f"--config_name {folder} --tokenizer_name {folder} --output_dir {tmp_path / 'out'} --max_seq_length 16"
    argv += f" --train_file {tmp_path / 'train.txt'} --validation_files held_out={tmp_path / 'train.txt'}"
    argv += " --per_device_train_batch_size 2 --max_train_steps 1 --max_eval_samples 2 --seed 0"
    monkeypatch.setattr("modeling_pkm_bert.hub.upload.push_folder_to_hub", lambda *a, **k: None)
    results = run_mlm.main([*argv.split(), "--push_to_hub", "--hub_token", SECRET])  # a token needs --push_to_hub
    card = (tmp_path / "out" / "README.md").read_text()
    assert SECRET not in card and not machine_paths(card, tmp_path)
    assert "python run_scripts/run_mlm.py --config_name tiny --tokenizer_name tiny --output_dir out" in card
    assert "--train_file train.txt --validation_files held_out=train.txt" in card and "data: `train.txt`" in card
    assert "license: apache-2.0" in card and "(`eval_held_out_perplexity`)" in card
    saved = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert saved.keys() == results.keys() and "total_runtime" in saved and "total_runtime" not in card
    assert os.path.isfile(tmp_path / "out" / "config.json")
    # a product-key model without n-gram layers: its memory settings, one line for the n-gram memory it lacks
    assert "| `pkm_n_keys` | `8` |" in card and "Hashed n-gram memory: none." in card
    assert "ngram_" not in card and "null" not in settings_section(card)


def settings_section(card: str) -> str:
    return card.split("## Memory settings", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("pkm_layers, ngram_layers", [([1], []), ([], [0, 2]), ([1], [0]), ([], [])])
def test_card_lists_the_memories_the_model_uses(tmp_path, pkm_layers, ngram_layers):
    """The card's memory settings hold the fields of each memory kind the model has, and none that is None (a
    checksum not taken, a scale not set); a kind it lacks is one line, not its defaults."""
    from modeling_pkm_bert.hub.model_card import write_model_card

    folder = tmp_path / "out"
    model = BertPkmForMaskedLM(tiny_config(pkm_layers=pkm_layers, ngram_layers=ngram_layers))
    model.save_pretrained(folder)
    card = str(write_model_card(folder))
    settings = settings_section(card)
    # the parameters of a kind's memories in its own rows, not in "the rest of the model"
    rest = sum(p.numel() for n, p in model.named_parameters() if ".memory." not in n and ".ngram." not in n)
    assert f"| rest of the model | {rest:,} |" in card
    assert ("| memory values |" in card) == bool(pkm_layers) and ("| n-gram memory tables |" in card) == bool(ngram_layers)
    assert "null" not in settings and "pkm_weights_checksum" not in settings and "pkm_memory_scale" not in settings
    if pkm_layers:
        assert f"| `pkm_layers` | `{pkm_layers}` |" in settings and "| memory slots per layer | 64 |" in settings
        assert "Product-key memory: none." not in settings and f"product key memory (PKM, Lample et al. 2019) at layers {pkm_layers}" in card
    else:
        assert "Product-key memory: none." in settings and "pkm_" not in settings and "slots" not in settings
        assert "product key memory (PKM" not in card and "product-key-memory" not in card
    if ngram_layers:
        assert f"| `ngram_layers` | `{ngram_layers}` |" in settings and "| `ngram_orders` | `[2, 3]` |" in settings
        assert "Hashed n-gram memory: none." not in settings and f"n-gram memories at layers {ngram_layers}" in card
    else:
        assert "Hashed n-gram memory: none." in settings and "ngram_" not in settings
