"""Bad flags and bad data files of the training scripts (issue 13): each is a clear error before any work, naming the
flag or file, the value seen and what is allowed. Parsing errors exit with argparse's status 2 and the message on
stderr; what needs the model (`--freeze_memory` without memories) raises ValueError before training."""

import json

import pytest
from conftest import tiny_config
from helpers import load_script


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


def test_freeze_memory_on_a_model_without_memory(tmp_path):
    """--freeze_memory would silently train everything on a plain BERT: ValueError before any step."""
    from transformers import BertConfig, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(tmp_path / "bert")
    BertConfig(vocab_size=31, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
               max_position_embeddings=64).save_pretrained(tmp_path / "bert")  # fmt: skip
    args = ["--config_name", str(tmp_path / "bert"), "--tokenizer_name", str(tmp_path / "bert"), "--freeze_memory"]
    args += ["--output_dir", str(tmp_path / "out"), "--max_seq_length", "16", "--max_train_steps", "1"]
    with pytest.raises(ValueError, match=r"--freeze_memory: the model \(BertForMaskedLM\) has no product key memory"):
        run_mlm.main(args)
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
    from modeling_pkm_bert import BertPkmForMaskedLM

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    BertPkmForMaskedLM(tiny_config()).save_pretrained(tmp_path / "pkm")
    argv = ["--model_name_or_path", source.format(d=tmp_path), "--output_dir", str(tmp_path / "out")]
    if stage == "parse":
        with pytest.raises(SystemExit) as raised:
            convert_to_pkm.parse_args(argv)
        assert raised.value.code == 2
        assert message.format(d=tmp_path) in " ".join(capsys.readouterr().err.split())
    else:
        with pytest.raises(ValueError) as raised:
            convert_to_pkm.main(argv)
        assert message in str(raised.value)
    assert not (tmp_path / "out").exists()
