"""Bad flags and bad data files of the training scripts (issue 13): each is a clear error before any work, naming the
flag or file, the value seen and what is allowed. Every script turns its configuration and input errors into
argparse's form, `usage: ...` and `<script>: error: ...` on stderr with exit status 2, never a traceback (issue 44):
the flag checks, the config the flags ask for (built from the model's config alone, before any weight loads), and
what only the loaded model or data shows (a folder without memories, a sequence longer than the model's positions,
`--freeze_memory` without memories). The scripts' default sequence lengths fit the model they read."""

import json
import sys

import pytest
import torch
from helpers import REPO_ROOT, BertPkmModelTester, load_script, reset_accelerate_state, tiny_config, usage_error


run_mlm, run_glue, run_squad = load_script("run_mlm"), load_script("run_glue"), load_script("run_squad")


@pytest.fixture
def files(tmp_path):
    """Bad (and good) data files, by name."""
    (tmp_path / "good.txt").write_text("some text\nmore text\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\nna\xefve\n".encode("latin-1"))
    (tmp_path / "latin1.csv").write_bytes("text\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "latin1.tsv").write_bytes("sentence\tlabel\ncaf\xe9\t1\n".encode("latin-1"))
    (tmp_path / "ragged.csv").write_text("text,label\nhello,1\nhello, world,0\n")
    (tmp_path / "broken.json").write_text('[{"text": "a"}, {"text": "b"')
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n')
    (tmp_path / "scalar.json").write_text("42")
    (tmp_path / "squad_broken.json").write_text('{"version": "1.1", "data": [{"title": "x", "paragraphs": [}]}')
    (tmp_path / "truncated_utf8.txt").write_bytes("ok\n\u00e9".encode()[:-1])
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path


MLM_BASE = "--model_name_or_path some-model"
GLUE_BASE = "--model_name_or_path some-model --task_name sst2"
SQUAD_BASE = "--model_name_or_path some-model --validation_file {d}/good_squad.json"

# (id, script, flags, what the error message must say)
CASES = [
    ("grad-accum-0", "mlm", "--gradient_accumulation_steps 0", "--gradient_accumulation_steps must be >= 1"),
    ("max-steps-negative", "mlm", "--max_train_steps -5", "--max_train_steps must be >= 0"),
    ("epochs-negative", "mlm", "--num_train_epochs -1", "--num_train_epochs must be >= 0"),
    ("split-150", "mlm", "--validation_split_percentage 150", "--validation_split_percentage must be in 1..99"),
    ("split-0", "mlm", "--validation_split_percentage 0", "--validation_split_percentage must be in 1..99"),
    ("batchnorm-yes", "mlm", "--pkm_query_batchnorm yes", "--pkm_query_batchnorm: expected true or false, got 'yes'"),
    ("lr-negative", "mlm", "--learning_rate -0.001", "--learning_rate must be a finite number > 0"),
    ("lr-zero", "mlm", "--learning_rate 0", "--learning_rate must be a finite number > 0"),
    ("lr-nan", "mlm", "--learning_rate nan", "--learning_rate must be a finite number > 0, got nan"),
    ("memory-lr-negative", "mlm", "--memory_learning_rate -1", "--memory_learning_rate must be a finite number >= 0"),
    ("weight-decay-inf", "mlm", "--weight_decay inf", "--weight_decay must be a finite number >= 0, got inf"),
    ("train-batch-0", "mlm", "--per_device_train_batch_size 0", "--per_device_train_batch_size must be >= 1"),
    ("eval-batch-0", "mlm", "--per_device_eval_batch_size 0", "--per_device_eval_batch_size must be >= 1"),
    ("checkpointing-0", "mlm", "--checkpointing_steps 0", "--checkpointing_steps must be a positive integer or 'epoch'"),
    ("checkpointing-garbage", "mlm", "--checkpointing_steps soon", "--checkpointing_steps must be a positive integer"),
    ("checkpointing-negative", "mlm", "--checkpointing_steps -3", "--checkpointing_steps must be a positive integer"),
    ("seed-negative", "mlm", "--seed -1", "--seed must be in [0, 2**32 - 1]"),
    ("seed-too-large", "mlm", "--seed 4294967296", "--seed must be in [0, 2**32 - 1]"),
    ("seq-length-0", "mlm", "--max_seq_length 0", "--max_seq_length must be >= 1"),
    ("warmup-negative", "mlm", "--num_warmup_steps -3", "--num_warmup_steps must be >= 0"),
    ("train-samples-0", "mlm", "--max_train_samples 0", "--max_train_samples must be >= 1"),
    ("eval-steps-0", "mlm", "--eval_steps 0", "--eval_steps must be >= 1"),
    ("staleness-bins-0", "mlm", "--staleness_bins 0", "--staleness_bins must be >= 1"),
    ("workers-0", "mlm", "--preprocessing_num_workers 0", "--preprocessing_num_workers must be >= 1"),
    ("resume-missing", "mlm", "--resume_from_checkpoint {d}/nowhere/step_3", "--resume_from_checkpoint"),
    ("output-under-file", "mlm", "--output_dir {d}/a_file/out", "cannot be created: {d}/a_file is not a folder"),
    ("output-is-file", "mlm", "--output_dir {d}/a_file", "--output_dir '{d}/a_file': exists and is not a folder"),
    ("json-malformed", "mlm", "--train_file {d}/broken.json", "broken.json' is not valid JSON: Expecting"),
    ("jsonl-bad-line", "mlm", "--train_file {d}/broken.jsonl", "broken.jsonl' is neither a JSON document nor JSON lines: line 2"),
    ("json-scalar", "mlm", "--train_file {d}/scalar.json", "scalar.json' is a JSON int, expected records"),
    ("txt-latin1", "mlm", "--train_file {d}/latin1.txt", "latin1.txt' is not UTF-8 text: byte 3 (line 1)"),
    ("txt-truncated-utf8", "mlm", "--train_file {d}/truncated_utf8.txt", "ends inside a multi-byte character"),
    ("csv-latin1-validation", "mlm", "--train_file {d}/good.txt --validation_files {d}/latin1.csv", "--validation_files latin1 '{d}/latin1.csv' is not UTF-8"),
    ("csv-ragged", "mlm", "--train_file {d}/ragged.csv", "ragged.csv' line 3 has 3 fields, the header 2"),
    ("memory-optimizer-unknown", "mlm", "--memory_optimizer lion", "--memory_optimizer: invalid choice: 'lion'"),
    ("glue-grad-accum-0", "glue", "--gradient_accumulation_steps 0", "--gradient_accumulation_steps must be >= 1"),
    ("glue-warmup-ratio", "glue", "--warmup_ratio 1.5", "--warmup_ratio must be in [0, 1], got 1.5"),
    ("glue-tsv-latin1", "glue", "--train_file {d}/latin1.tsv", "--train_file '{d}/latin1.tsv' is not UTF-8 text"),
    ("glue-batchnorm-maybe", "glue", "--pkm_query_batchnorm maybe", "--pkm_query_batchnorm: expected true or false"),
    ("squad-json-malformed", "squad", "--train_file {d}/squad_broken.json", "squad_broken.json' is not valid JSON"),
    ("squad-n-best-0", "squad", "--n_best_size 0", "--n_best_size must be >= 1"),
    ("squad-epochs-negative", "squad", "--num_train_epochs -2", "--num_train_epochs must be >= 0"),
]


def base_args(script, folder):
    good_squad = folder / "good_squad.json"
    if not good_squad.exists():
        good_squad.write_text(json.dumps({"version": "1.1", "data": []}))
    base = {"mlm": MLM_BASE, "glue": GLUE_BASE, "squad": SQUAD_BASE}[script]
    return base.format(d=folder).split()


@pytest.mark.parametrize("script, flags, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_flag_or_file_is_a_clear_error_before_any_work(files, capsys, script, flags, message):
    module = {"mlm": run_mlm, "glue": run_glue, "squad": run_squad}[script]
    with pytest.raises(SystemExit) as raised:
        module.parse_args(base_args(script, files) + flags.format(d=files).split())
    assert raised.value.code == 2  # argparse's usage error
    assert message.format(d=files) in capsys.readouterr().err
    assert not (files / "out").exists()  # nothing was created


def test_cases_are_distinct():
    assert len({case[0] for case in CASES}) == len(CASES) >= 28
    assert len({(case[1], case[2]) for case in CASES}) == len(CASES)


def test_good_files_pass_the_content_checks(files):
    from modeling_pkm_bert.training import check_data_file_contents

    (files / "good.csv").write_text('text,label\n"hello, world",1\n')
    (files / "good.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n')
    (files / "good.json").write_text('[{"text": "a"}, {"text": "b"}]')
    (files / "utf8.txt").write_text("caf\u00e9 \u00fcber \u6f22\u5b57\n" * 100000, encoding="utf-8")  # > 1 MiB chunks
    for name in ("good.txt", "good.csv", "good.jsonl", "good.json", "good_squad.json", "utf8.txt"):
        base_args("squad", files)
        assert check_data_file_contents(str(files / name)) is None, name


def test_a_non_utf8_byte_far_into_a_file_is_located(files):
    from modeling_pkm_bert.training import check_data_file_contents

    path = files / "late.txt"
    path.write_bytes(b"line\n" * 300000 + b"bad \xff byte\n")  # past the first 1 MiB chunk
    assert check_data_file_contents(str(path)) == "is not UTF-8 text: byte 1500004 (line 300001) is b'\\xff'"


def test_freeze_memory_on_a_model_without_memory(tmp_path, capsys):
    """--freeze_memory would silently train everything on a plain BERT: a usage error before any step."""
    from transformers import BertConfig, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(tmp_path / "bert")
    BertConfig(vocab_size=31, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
               max_position_embeddings=64).save_pretrained(tmp_path / "bert")  # fmt: skip
    args = ["--config_name", str(tmp_path / "bert"), "--tokenizer_name", str(tmp_path / "bert"), "--freeze_memory"]
    args += ["--output_dir", str(tmp_path / "out"), "--max_seq_length", "16", "--max_train_steps", "1"]
    line = usage_error(capsys, lambda: run_mlm.main(args))
    assert "--freeze_memory: the model (BertForMaskedLM) has no product key memory" in line
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_freeze_memory_on_a_pkm_model_still_works(tmp_path):
    from modeling_pkm_bert import BertPkmForMaskedLM
    from modeling_pkm_bert.methods.optimizers import freeze_memory
    from modeling_pkm_bert.training import check_freeze_memory

    model = BertPkmForMaskedLM(tiny_config())
    check_freeze_memory(model)
    assert freeze_memory(model) > 0


def test_a_squad_answer_start_that_is_not_an_integer_names_the_file_question_and_field(tmp_path):
    qas = [{"id": "q1", "question": "Who won?", "answers": [{"text": "Denver", "answer_start": "ten"}]}]
    data = {"version": "1.1", "data": [{"title": "T", "paragraphs": [{"context": "Denver won.", "qas": qas}]}]}
    (tmp_path / "squad.json").write_text(json.dumps(data))
    args = run_squad.parse_args(["--model_name_or_path", "some-model", "--validation_file", str(tmp_path / "squad.json")])
    with pytest.raises(ValueError, match=r"squad\.json: question 'q1': answer_start must be a character offset"
                       r" \(an integer >= 0\), got 'ten'"):  # fmt: skip
        run_squad.load_raw_datasets(args)


convert_to_pkm = load_script("convert_to_pkm")


@pytest.mark.parametrize(
    "source, stage, message",
    [
        ("{d}/no/such/folder", "parse", "--model_name_or_path '{d}/no/such/folder': no such folder, and not a Hub model id"),
        ("{d}/pkm", "parse", "--model_name_or_path '{d}/pkm' is already a BertPkm model (model_type 'bert_pkm')"),
        # the cache is read when the conversion starts, not by the flag parser
        ("someone/no-such-model", "main", "'someone/no-such-model': no such folder, and as a Hub model id not in the "
         "local cache, the only place HF_HUB_OFFLINE=1 reads"),  # fmt: skip
    ],
    ids=["missing-folder", "already-converted", "hub-id-offline"],
)
def test_convert_to_pkm_of_a_missing_or_converted_source_names_it(tmp_path, capsys, monkeypatch, source, stage, message):
    """Each a usage error: while the flags are parsed, or (a Hub id, read from the cache) when the conversion starts."""
    from modeling_pkm_bert import BertPkmForMaskedLM

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    BertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path / "pkm")
    argv = ["--model_name_or_path", source.format(d=tmp_path), "--output_dir", str(tmp_path / "out")]
    line = usage_error(capsys, lambda: (convert_to_pkm.parse_args if stage == "parse" else convert_to_pkm.main)(argv))
    assert message.format(d=tmp_path) in line
    assert not (tmp_path / "out").exists()


# ---- every script: configuration and input errors in argparse's form (issue 44) ----


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny model folders with 64 positions and their inputs: `pkm` (memories at layers 0 and 2), `nomem` (a BertPkm
    without memories), `bert` (a plain BERT), `notok` (a BertPkm without a tokenizer), text and data files."""
    import shutil

    from transformers import BertConfig, BertForMaskedLM

    from modeling_pkm_bert import BertPkmForMaskedLM

    root = tmp_path_factory.mktemp("folders")
    text = (REPO_ROOT / "run_scripts" / "data" / "pride_and_prejudice_validation.txt").read_text(encoding="utf-8")
    tokenizer = BertPkmModelTester().get_tokenizer("validation", 200)
    torch.manual_seed(0)
    BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[0, 2])).save_pretrained(root / "pkm")
    BertPkmForMaskedLM(tiny_config(vocab_size=200, pkm_layers=[])).save_pretrained(root / "nomem")
    BertForMaskedLM(BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=37, max_position_embeddings=64)).save_pretrained(root / "bert")  # fmt: skip
    for name in ("pkm", "nomem", "bert"):
        tokenizer.save_pretrained(root / name)
    shutil.copytree(root / "pkm", root / "notok", ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "special*"))
    shutil.copytree(root / "pkm", root / "wrongtype")  # a config field of the wrong type (issue 60)
    config = json.loads((root / "wrongtype" / "config.json").read_text())
    (root / "wrongtype" / "config.json").write_text(json.dumps({**config, "pkm_knn": "4"}))
    (root / "text.txt").write_text(text, encoding="utf-8")
    (root / "textdir").mkdir()  # a local dataset folder: its one split is `train`
    (root / "textdir" / "train.txt").write_text(text, encoding="utf-8")
    words = text.split()  # sentences of 100 words: longer than the model's 64 positions
    rows = "".join(f"{' '.join(words[i * 100:(i + 1) * 100])}\t{i % 2}\n" for i in range(16))
    (root / "sst2.tsv").write_text("sentence\tlabel\n" + rows)
    context = " ".join(text.split()[:200])
    qas = [{"id": f"q{i}", "question": "who spoke?", "answers": [{"text": context.split()[i], "answer_start":
            len(" ".join(context.split()[:i])) + (1 if i else 0)}]} for i in range(4)]  # fmt: skip
    squad = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}
    (root / "squad.json").write_text(json.dumps(squad))
    (root / "empty_run").mkdir()
    return root


SCRIPT_CASES = [
    # (id, script, argv, what the error line says); {d}: the folders, {o}: a fresh output folder
    ("convert-knn-above-n-keys", "convert_to_pkm", "--model_name_or_path {d}/bert --output_dir {o} --pkm_n_keys 16",
     "pkm_knn=32: must be in [1, pkm_n_keys=16]"),
    ("convert-layer-out-of-range", "convert_to_pkm", "--model_name_or_path {d}/bert --output_dir {o} --pkm_layers 7",
     "pkm_layers=[7] does not fit"),
    ("convert-push-flags", "convert_to_pkm", "--model_name_or_path {d}/bert --output_dir {o} --private",
     "--hub_model_id, --private and --hub_token need --push_to_hub"),
    ("convert-output-under-a-file", "convert_to_pkm", "--model_name_or_path {d}/bert --output_dir {d}/text.txt/out",
     "--output_dir '{d}/text.txt/out' lies under '{d}/text.txt', which is a file"),
    ("explorer-output-under-a-file", "memory_explorer", "--model_name_or_path {d}/pkm --output_dir {d}/text.txt/out",
     "--output_dir '{d}/text.txt/out' lies under '{d}/text.txt', which is a file"),
    ("explorer-unknown-split", "memory_explorer", "--model_name_or_path {d}/pkm --dataset_name {d}/textdir --output_dir {o}",
     "--dataset_split 'validation' is not a split of {d}/textdir (its splits: train): give --dataset_split train"),
    ("convert-missing-folder", "convert_to_pkm", "--model_name_or_path {d}/nowhere --output_dir {o}", "no such folder"),
    ("explorer-no-memory", "memory_explorer", "--model_name_or_path {d}/nomem --output_dir {o}",
     "has no memory layer (product key or hashed n-gram)"),
    ("explorer-layer-without-memory", "memory_explorer", "--model_name_or_path {d}/pkm --output_dir {o} --layers 1",
     "layer 1 has no memory"),
    ("explorer-too-long", "memory_explorer", "--model_name_or_path {d}/pkm --output_dir {o} --max_seq_length 100",
     "max_seq_length 100 is longer than the model's 64 positions"),
    ("explorer-missing-folder", "memory_explorer", "--model_name_or_path {d}/nowhere --output_dir {o}",
     "--model_name_or_path '{d}/nowhere': no such folder"),
    ("explorer-no-tokenizer", "memory_explorer", "--model_name_or_path {d}/notok --output_dir {o}",
     "--model_name_or_path '{d}/notok' holds no tokenizer"),
    ("explorer-missing-text", "memory_explorer", "--model_name_or_path {d}/pkm --output_dir {o} --text_file {d}/no.txt",
     "--text_file '{d}/no.txt' does not exist"),
    ("explorer-text-and-dataset", "memory_explorer",
     "--model_name_or_path {d}/pkm --output_dir {o} --text_file {d}/text.txt --dataset_name x", "not both"),
    ("explorer-missing-dataset", "memory_explorer", "--model_name_or_path {d}/pkm --output_dir {o} --dataset_name "
     "{d}/no_dataset", "--dataset_name '{d}/no_dataset'"),
    ("report-no-memory", "memory_report", "--model_name_or_path {d}/nomem --output_dir {o}", "no product key memory"),
    ("report-too-long", "memory_report", "--model_name_or_path {d}/pkm --output_dir {o} --max_seq_length 100",
     "max_seq_length 100 is longer than the model's 64 positions"),
    ("report-task-without-file", "memory_report", "--model_name_or_path {d}/pkm --output_dir {o} --task_name sst2",
     "--task_name needs --train_file"),
    ("report-run-without-logs", "memory_report", "--model_name_or_path {d}/pkm --output_dir {o} --run_dir {d}/empty_run",
     "metrics.jsonl"),
    ("report-missing-folder", "memory_report", "--model_name_or_path {d}/nowhere --output_dir {o}", "no such folder"),
    ("push-plain-bert", "push_to_hub", "--model_dir {d}/bert --hub_model_id me/x --dry_run",
     "is not a complete BertPkm Hub folder: model_type is 'bert'"),
    ("push-refresh-plain-bert", "push_to_hub", "--model_dir {d}/bert --refresh_code",
     "holds a 'bert' model, not a BertPkm one"),
    ("push-no-config", "push_to_hub", "--model_dir {d}/empty_run --hub_model_id me/x", "has no config.json"),
    ("push-quantized-dir-in-use", "push_to_hub", "--model_dir {d}/pkm --hub_model_id me/x --quantize_values 8 "
     "--quantized_dir {d}/bert --dry_run", "exists and is not empty"),
    ("mlm-knn-above-n-keys", "run_mlm", "--model_name_or_path {d}/bert --pkm_layers 1 --pkm_n_keys 16 --output_dir {o}",
     "pkm_knn=32: must be in [1, pkm_n_keys=16]"),
    ("mlm-runtime-knn", "run_mlm", "--model_name_or_path {d}/pkm --pkm_knn 100 --output_dir {o}",
     "pkm_knn=100: must be in [1, pkm_n_keys=8]"),
    ("mlm-structural-change", "run_mlm", "--model_name_or_path {d}/pkm --pkm_n_keys 16 --output_dir {o}",
     "is already a PKM model (bert_pkm); its ['pkm_n_keys'] cannot change"),
    ("mlm-token-without-push", "run_mlm", "--model_name_or_path {d}/pkm --hub_token MySecret_12345 --output_dir {o}",
     "--hub_token and --hub_private_repo need --push_to_hub (given: --hub_token)"),
    ("mlm-abbreviated-token", "run_mlm", "--model_name_or_path {d}/pkm --hub_tok MySecret_12345 --push_to_hub "
     "--output_dir {o}", "unrecognized arguments: --hub_tok MySecret_12345"),
    ("convert-abbreviated-flag", "convert_to_pkm", "--model_name_or_path {d}/bert --output_dir {o} --pkm_lay 1",
     "unrecognized arguments: --pkm_lay 1"),
    ("mlm-config-field-type", "run_mlm", "--model_name_or_path {d}/wrongtype --output_dir {o}",
     "--model_name_or_path '{d}/wrongtype': config.json: Field 'pkm_knn' expected int, got str (value: '4')"),
    ("report-config-field-type", "memory_report", "--model_name_or_path {d}/wrongtype --output_dir {o}",
     "--model_name_or_path '{d}/wrongtype': config.json: Field 'pkm_knn' expected int, got str (value: '4')"),
    ("mlm-missing-folder", "run_mlm", "--model_name_or_path {d}/nowhere --output_dir {o}",
     "--model_name_or_path '{d}/nowhere': no such folder"),
    ("clm-config-overrides", "run_clm", "--config_name {d}/bert --tokenizer_name {d}/bert --config_overrides "
     "hidden_sizes=4 --output_dir {o}", "--config_overrides 'hidden_sizes=4'"),
    ("mlm-too-long", "run_mlm", "--model_name_or_path {d}/pkm --train_file {d}/text.txt --max_seq_length 100 "
     "--max_train_steps 1 --output_dir {o}", "--max_seq_length 100 is longer than the model can take (64)"),
    ("mlm-no-tokenizer", "run_mlm", "--model_name_or_path {d}/notok --train_file {d}/text.txt --max_train_steps 1 "
     "--output_dir {o}", "holds no tokenizer"),
    ("clm-knn-above-n-keys", "run_clm", "--model_name_or_path {d}/bert --pkm_layers 1 --pkm_n_keys 16 --output_dir {o}",
     "pkm_knn=32: must be in [1, pkm_n_keys=16]"),
    ("clm-block-too-long", "run_clm", "--model_name_or_path {d}/pkm --train_file {d}/text.txt --block_size 100 "
     "--max_train_steps 1 --output_dir {o}", "--block_size 100 is longer than the model's 64 positions"),
    ("glue-knn-above-n-keys", "run_glue", "--model_name_or_path {d}/bert --task_name sst2 --pkm_layers 1 --pkm_n_keys 16"
     " --output_dir {o}", "pkm_knn=32: must be in [1, pkm_n_keys=16]"),
    ("glue-too-long", "run_glue", "--model_name_or_path {d}/pkm --task_name sst2 --train_file {d}/sst2.tsv "
     "--validation_file {d}/sst2.tsv --max_length 100 --max_train_steps 1 --output_dir {o}",
     "--max_length 100 is longer than the model's 64 positions"),
    ("squad-knn-above-n-keys", "run_squad", "--model_name_or_path {d}/bert --validation_file {d}/squad.json --pkm_layers 1"
     " --pkm_n_keys 16 --output_dir {o}", "pkm_knn=32: must be in [1, pkm_n_keys=16]"),
    ("squad-too-long", "run_squad", "--model_name_or_path {d}/pkm --validation_file {d}/squad.json --max_seq_length 100"
     " --output_dir {o}", "--max_seq_length 100 is longer than the model's 64 positions"),
    ("sweep-no-command", "seed_sweep", "--seeds 1 --output_dir {o}", "no command after `--`"),
    ("sweep-repeated-seed", "seed_sweep", f"--seeds 1 1 --output_dir {{o}} -- {sys.executable} -c pass",
     "--seeds repeats a seed"),
]


@pytest.mark.parametrize("script, argv, message", [case[1:] for case in SCRIPT_CASES], ids=[c[0] for c in SCRIPT_CASES])
def test_every_script_gives_input_errors_as_usage_errors(folders, tmp_path, capsys, script, argv, message):
    module = load_script(script)
    argv = argv.format(d=folders, o=tmp_path / "out").split()
    try:
        line = usage_error(capsys, lambda: module.main(argv))
    finally:
        reset_accelerate_state()
    assert message.format(d=folders) in line, line
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_script_cases_cover_every_script():
    scripts = {path.stem for path in (REPO_ROOT / "run_scripts").glob("*.py")}
    assert scripts - {case[1] for case in SCRIPT_CASES} == {"demo"}  # demo: tests/scripts/test_output_folders.py
    assert len({case[0] for case in SCRIPT_CASES}) == len(SCRIPT_CASES)


# ---- default sequence lengths fit the model they read (issue 44) ----


def test_explorer_and_report_defaults_fit_a_model_of_64_positions(folders, tmp_path):
    """The reproduction of the issue: memory_explorer.py's default 128 tokens on a model with
    max_position_embeddings=64 ended in the model's input check; now the default is the model's 64."""
    explorer = load_script("memory_explorer").main(["--model_name_or_path", str(folders / "pkm"), "--output_dir",
                                                     str(tmp_path / "explorer"), "--max_tokens", "128"])  # fmt: skip
    assert explorer["sequence_length"] == 64
    report = load_script("memory_report").main(["--model_name_or_path", str(folders / "pkm"), "--output_dir",
                                                 str(tmp_path / "report"), "--max_sequences", "2"])  # fmt: skip
    assert "sequences of 64 tokens" in (tmp_path / "report" / "memory_report.md").read_text() and report


def test_roberta_positions_are_counted_without_the_padding_offset():
    from modeling_pkm_bert.utils.positions import fitting_length, sequence_length
    from helpers import tiny_roberta_config

    config = tiny_roberta_config()  # max_position_embeddings=66, pad_token_id=1: 64 tokens
    assert fitting_length(config, 128) == 64 and fitting_length(tiny_config(), 128) == 64
    assert fitting_length(tiny_config(max_position_embeddings=512), 128) == 128
    with pytest.raises(ValueError, match="--max_seq_length 65 is longer than the model's 64 positions"):
        sequence_length(config, 65, 128)


@pytest.mark.parametrize("script", ["run_glue", "run_squad"])
def test_fine_tuning_defaults_fit_a_model_of_64_positions(script, folders, tmp_path):
    """run_glue.py's 128 and run_squad.py's 384 tokens by default, capped at the model's 64 positions (with a
    document stride that fits them)."""
    data = {"run_glue": ["--task_name", "sst2", "--train_file", str(folders / "sst2.tsv"), "--validation_file",
                         str(folders / "sst2.tsv")],
            "run_squad": ["--train_file", str(folders / "squad.json"), "--validation_file", str(folders / "squad.json")]}
    argv = ["--model_name_or_path", str(folders / "pkm"), *data[script], "--max_train_steps", "1",
            "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "out"), "--seed", "1"]  # fmt: skip
    try:
        results = load_script(script).main(argv)
    finally:
        reset_accelerate_state()
    assert results is not None and (tmp_path / "out" / "model.safetensors").is_file()
