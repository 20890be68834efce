"""Publishing to the Hub: exactly which calls go out and which files would be uploaded (the Hub is not reachable)."""

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from transformers import BertConfig, BertForMaskedLM

from helpers import BertPkmModelTester, bert_pkm_code_files, load_script, tiny_config, usage_error
from modeling_pkm_bert import BertPkmForMaskedLM
from modeling_pkm_bert.hub import upload


HUB_FILES = {
    "README.md",
    "config.json",
    *bert_pkm_code_files(),
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


class FakeHfApi:
    """Records the calls; `upload_folder` lists the files as huggingface_hub's own filter would select them."""

    calls: list = []
    uploaded: list = []

    def __init__(self, token=None):
        FakeHfApi.calls.append(("HfApi", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        FakeHfApi.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"me/{repo_id}"})()

    def upload_folder(self, **kwargs):
        FakeHfApi.calls.append(("upload_folder", kwargs))
        folder = Path(kwargs["folder_path"])
        files = sorted(p.relative_to(folder).as_posix() for p in folder.glob("**/*") if p.is_file())
        ignore = list(kwargs.get("ignore_patterns") or []) + DEFAULT_IGNORE_PATTERNS
        allow = kwargs.get("allow_patterns")
        FakeHfApi.uploaded = list(filter_repo_objects(files, allow_patterns=allow, ignore_patterns=ignore))
        return "https://huggingface.co/fake/commit/0"


@pytest.fixture
def hub(monkeypatch):
    FakeHfApi.calls, FakeHfApi.uploaded = [], []
    monkeypatch.setattr(upload, "HfApi", FakeHfApi)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return FakeHfApi


@pytest.fixture
def trained_dir(tmp_path):
    """What a training script leaves: the model, tokenizer, results and accelerate checkpoints (pickles inside)."""
    folder = tmp_path / "run"
    BertPkmForMaskedLM(tiny_config()).save_pretrained(folder)
    BertPkmModelTester().get_placeholder_tokenizer().save_pretrained(folder)
    (folder / "all_results.json").write_text(json.dumps({"perplexity": 12.3}))
    for checkpoint in ("step_10", "epoch_0"):
        (folder / checkpoint).mkdir()
        for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
            (folder / checkpoint / name).write_bytes(b"x")
    (folder / "training_args.bin").write_bytes(b"x")
    return folder


def test_push_folder_to_hub_makes_exactly_two_calls(hub, trained_dir):
    (trained_dir / "README.md").write_text("---\nlicense: mit\n---\n# run\n")
    result = upload.push_folder_to_hub(trained_dir, "me/bert-pkm", private=True, token="hf_abc", commit_message="m")

    assert result == "https://huggingface.co/fake/commit/0"
    assert hub.calls == [
        ("HfApi", {"token": "hf_abc"}),
        ("create_repo", {"repo_id": "me/bert-pkm", "private": True, "exist_ok": True, "repo_type": "model"}),
        (
            "upload_folder",
            {
                "repo_id": "me/bert-pkm",
                "folder_path": str(trained_dir),
                "repo_type": "model",
                "commit_message": "m",
                "allow_patterns": upload.files_to_upload(trained_dir),  # the allow-list, name by name
            },
        ),
    ]
    # accelerate checkpoints and pickles stay local
    assert set(hub.uploaded) == HUB_FILES | {"all_results.json"}
    assert hub.uploaded == upload.files_to_upload(trained_dir)


def test_convert_cli_pushes_the_converted_folder(hub, tmp_path, capsys):
    source = tmp_path / "bert"
    BertForMaskedLM(
        BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37
        )
    ).save_pretrained(source)
    BertPkmModelTester().get_placeholder_tokenizer().save_pretrained(source)
    out = tmp_path / "bert-pkm"
    script = load_script("convert_to_pkm")
    script.main(
        ["--model_name_or_path", str(source), "--output_dir", str(out), "--pkm_layers", "1", "--pkm_n_keys", "8"]
        + ["--pkm_heads", "2", "--pkm_knn", "4", "--pkm_k_dim", "16", "--license", "apache-2.0"]
        + ["--push_to_hub", "--hub_model_id", "me/tiny-pkm", "--private"]
    )

    assert [name for name, _ in hub.calls] == ["HfApi", "create_repo", "upload_folder"]
    assert hub.calls[0][1] == {"token": None}  # token from HF_TOKEN or the cached login, inside huggingface_hub
    assert hub.calls[1][1] == {"repo_id": "me/tiny-pkm", "private": True, "exist_ok": True, "repo_type": "model"}
    upload = hub.calls[2][1]
    assert upload["repo_id"] == "me/tiny-pkm" and upload["folder_path"] == str(out)
    assert upload["commit_message"] == f"Convert {source} to BertPkmForMaskedLM"
    assert set(hub.uploaded) == HUB_FILES
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0" and card.data.base_model is None  # a local source is no Hub id
    assert 'from_pretrained("me/tiny-pkm", trust_remote_code=True)' in card.text


def test_convert_cli_push_needs_the_flag(tmp_path):
    script = load_script("convert_to_pkm")
    with pytest.raises(SystemExit):
        script.parse_args(["--model_name_or_path", "x", "--output_dir", "y", "--hub_model_id", "me/x"])


def test_push_script_writes_a_card_and_uploads_the_model_only(hub, trained_dir, capsys):
    script = load_script("push_to_hub")
    script.main(["--model_dir", str(trained_dir), "--hub_model_id", "me/run", "--dry_run", "--license", "mit"])
    printed = capsys.readouterr().out
    assert hub.calls == []  # a dry run contacts nothing
    # README, all_results, config, weights, the two tokenizer files and the remote code
    assert f"Would upload {6 + len(bert_pkm_code_files())} files to me/run" in printed and "step_10" not in printed
    assert "README.md (a model card, written at upload)" in printed
    assert not (trained_dir / "README.md").exists()  # and writes nothing (test_security.py hashes the whole tree)
    script.main(["--model_dir", str(trained_dir), "--hub_model_id", "me/run", "--license", "mit"])
    card = ModelCard.load(trained_dir / "README.md")
    assert card.data.pipeline_tag == "fill-mask" and card.data.license == "mit" and "pkm" in card.data.tags
    assert f"| total | {BertPkmForMaskedLM(tiny_config()).num_parameters():,} |" in card.text

    hub.calls.clear()
    script.main(["--model_dir", str(trained_dir), "--hub_model_id", "me/run", "--hub_token", "hf_t"])
    assert hub.calls[0] == ("HfApi", {"token": "hf_t"})
    assert hub.calls[1] == (
        "create_repo",
        {"repo_id": "me/run", "private": False, "exist_ok": True, "repo_type": "model"},
    )
    assert set(hub.uploaded) == HUB_FILES | {"all_results.json"}


def test_push_script_refuses_an_incomplete_folder(hub, tmp_path, capsys):
    script = load_script("push_to_hub")
    plain = tmp_path / "plain"
    BertForMaskedLM(
        BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37
        )
    ).save_pretrained(plain)
    line = usage_error(capsys, lambda: script.main(["--model_dir", str(plain), "--hub_model_id", "me/x"]))
    assert re.search("model_type is 'bert'.*auto_map lacks", line)

    broken = tmp_path / "broken"
    BertPkmForMaskedLM(tiny_config()).save_pretrained(broken)
    (broken / "model.safetensors").unlink()
    (broken / "product_key_memory.py").unlink()
    line = usage_error(capsys, lambda: script.main(["--model_dir", str(broken), "--hub_model_id", "me/x"]))
    assert re.search("product_key_memory.py is missing.*no model.safetensors", line)
    assert hub.calls == []
