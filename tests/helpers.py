"""What many test files share (test modules import it, `from helpers import ...`; tests/conftest.py does not): the
repository's paths, tiny configs, loading a script or benchmark as a module, launching one under torchrun, resetting
accelerate's process-wide state (tests/conftest.py resets it after every test; call `reset_accelerate_state` between
two runs inside one test), the usage-error form every script gives bad input (`usage_error`), and the release
fixtures' folders assembled from their parts (`release_folders`)."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling_pkm_bert import BertPkmConfig


REPO_ROOT = Path(__file__).resolve().parents[1]
# enough of a failed or hung launch's output to name the cause, short enough to read in pytest's report
OUTPUT_TAIL = 3000


def bert_pkm_code_files() -> list[str]:
    """The remote-code files a saved BertPkm folder holds: the shipped files its classes import (the RobertaPkm files
    travel with RobertaPkm models only, the ModernBertPkm files with ModernBertPkm ones)."""
    from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES

    return [name for name in REMOTE_CODE_FILES if "roberta" not in name and "modernbert" not in name]


def load_script(name: str, folder: str | Path = "run_scripts"):
    """`folder/name.py` (relative to the repository, or absolute) executed as a fresh module named `name`: the scripts
    and benchmarks are not a package. The module is in `sys.modules` while it executes, as under a real import."""
    path = REPO_ROOT / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    return module


def torchrun(script, args=(), processes: int = 2, timeout: float = 300, env: dict | None = None):
    """`python -m torch.distributed.run --standalone --nproc_per_node processes script *args` on CPU (gloo, one thread a
    process), offline, with the repository importable; returns the finished `subprocess.CompletedProcess` (text).
    A non-zero exit fails the test with the output's tail; so does a hang: after `timeout` seconds the launcher and its
    workers are stopped (none outlives the test) and the test fails with what they wrote."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command += [str(script), *map(str, args)]
    launch_env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    launch_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    launch_env.update(env or {})
    process = subprocess.Popen(
        command, env=launch_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(process)
        pytest.fail(f"{Path(script).name} on {processes} processes did not finish in {timeout} s (a hang?); the output's "
                    f"tail:\n{_tail(stdout, stderr)}")  # fmt: skip
    if process.returncode != 0:
        pytest.fail(f"{Path(script).name} on {processes} processes exited with {process.returncode}; the output's tail:\n"
                    f"{_tail(stdout, stderr)}")  # fmt: skip
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _stop(process: subprocess.Popen, grace: float = 30) -> tuple[str, str]:
    """Stop a hung torchrun and its workers; what they wrote. SIGTERM first: torchrun then stops its workers, which it
    starts in sessions of their own; SIGKILL to the launcher's group if that takes longer than `grace` seconds."""
    process.terminate()
    try:
        return process.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
    try:
        return process.communicate(timeout=grace)
    except subprocess.TimeoutExpired:  # a worker that outlived its launcher still holds the pipes
        return "", "(no output: a worker outlived the launcher and holds its pipes)"


def _tail(stdout: str, stderr: str) -> str:
    return f"--- stdout\n{stdout[-OUTPUT_TAIL:]}\n--- stderr\n{stderr[-OUTPUT_TAIL:]}"


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons (AcceleratorState, PartialState, GradientState), so that the next
    Accelerator (a script's next `main`) starts as in a fresh process. Nothing to do where accelerate was never used."""
    if "accelerate.state" not in sys.modules:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def metrics_records(output_dir, after: int = 0) -> list[dict]:
    """The records of a run's metrics.jsonl past step `after`, without their wall-clock times (what a resumed run from
    step_<after> must log as the uninterrupted run did)."""
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    records = [{key: value for key, value in json.loads(line).items() if key != "time"} for line in lines]
    return [record for record in records if record["step"] > after]


def usage_error(capsys, call) -> str:
    """`call()` (a script's `main(argv)` or `parse_args(argv)`) ends as argparse's usage error: exit status 2, a
    `usage:` line and one `<script>: error: ...` line on stderr, no traceback. Returns that error line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as raised:
        call()
    err = capsys.readouterr().err
    assert raised.value.code == 2, err
    assert "Traceback" not in err and any(line.startswith("usage: ") for line in err.splitlines()), err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


def lookup_plans() -> dict:
    """Every plan of a memory lookup a CPU can run, by name (`product_key_memory_ops.Plan`): tests run each and compare
    it with the reference."""
    from modeling_pkm_bert.product_key_memory_ops import REFERENCE, Plan

    return {
        "reference": REFERENCE,
        "cpu": Plan("native", "selected", "csr"),  # what a CPU training step runs
        "cpu_torch_selection": Plan("torch", "selected", "csr"),
        "custom_op": Plan("torch", "torch", "op"),  # what a compiled step runs, here eagerly
    }


# ---- the tiny models: one tester per family, in the manner of transformers' `BertModelTester` ----

# the embedded training and validation texts of run_scripts/data, whose words make the word-level tokenizers
EMBEDDED_TEXT = REPO_ROOT / "run_scripts" / "data"
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def embedded_text_vocab(split: str = "train", size: int = 200) -> list[str]:
    """BERT's 5 special tokens and the `size - 5` commonest words and punctuation marks of the embedded
    pride_and_prejudice_<split>.txt, lowercased (ties in the order the text first uses them)."""
    import collections
    import re

    text = (EMBEDDED_TEXT / f"pride_and_prejudice_{split}.txt").read_text(encoding="utf-8").lower()
    words = collections.Counter(re.findall(r"\w+|[^\w\s]", text))
    return BERT_SPECIAL_TOKENS + [w for w, _ in words.most_common(size - len(BERT_SPECIAL_TOKENS))]


def placeholder_vocab(size: int = 99) -> list[str]:
    """BERT's 5 special tokens and the placeholder words w0, w1, ..., `size` tokens in all (a vocabulary that stands for
    no text: for folders whose tokenizer is saved, not used)."""
    return BERT_SPECIAL_TOKENS + [f"w{i}" for i in range(size - len(BERT_SPECIAL_TOKENS))]


class FamilyModelTester:
    """What the family testers share; each defines `get_config(**overrides)` and `get_tokenizer(...)`."""

    def get_model(self, model_class, seed: int | None = None, **overrides) -> torch.nn.Module:
        """A random `model_class` (a class, or the name of one in modeling_pkm_bert) of `get_config(**overrides)`
        (`is_decoder=True` unless overridden where the class is a causal LM), in training mode as built; with `seed`,
        torch is seeded with it first."""
        if isinstance(model_class, str):
            import modeling_pkm_bert

            model_class = getattr(modeling_pkm_bert, model_class)
        if model_class.__name__.endswith("ForCausalLM"):
            overrides = {"is_decoder": True, **overrides}
        if seed is not None:
            torch.manual_seed(seed)
        return model_class(self.get_config(**overrides))

    def save_tokenizer(self, folder, *args, **kwargs):
        """`get_tokenizer(*args, **kwargs)` saved in `folder`; returns the tokenizer."""
        tokenizer = self.get_tokenizer(*args, **kwargs)
        tokenizer.save_pretrained(folder)
        return tokenizer

    def _save_folder(self, folder, tokenizer, model_class, seed, overrides) -> str:
        tokenizer.save_pretrained(folder)
        if model_class is None:
            self.get_config(**overrides).save_pretrained(folder)
        else:
            self.get_model(model_class, seed, **overrides).save_pretrained(folder)
        return str(folder)


class BertPkmModelTester(FamilyModelTester):
    """The tiny BertPkm models of the suite: `get_config(**overrides)` (3 layers, hidden 32, a memory of 8**2 slots at
    layer 1, dropout off), `get_model(model_class, seed=None, **overrides)` (a random model of that config),
    `get_tokenizer(split)` (a word-level BertTokenizer of the embedded text, as many tokens as the config's vocabulary),
    `get_placeholder_tokenizer(vocab_folder=None)` (one of `placeholder_vocab`), `save_tokenizer(folder, ...)` and
    `save_folder(folder, model_class=None, split="train", seed=None)` (the tokenizer and the config alone or a random
    model of `model_class`, in one folder). `BertPkmModelTester(**overrides)` changes the defaults of all of them."""

    config_class = BertPkmConfig
    defaults = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pkm_layers=[1],
        pkm_n_keys=8,
        pkm_heads=2,
        pkm_knn=4,
        pkm_k_dim=16,
    )

    def __init__(self, **overrides):
        self.config_kwargs = {**self.defaults, **overrides}

    def get_config(self, **overrides):
        return self.config_class(**{**self.config_kwargs, **overrides})

    def get_tokenizer(self, split: str = "train", vocab_size: int | None = None):
        """A lowercasing word-level BertTokenizer of `embedded_text_vocab(split, vocab_size)` (default: the config's
        vocabulary size)."""
        from transformers import BertTokenizer

        vocab = embedded_text_vocab(split, vocab_size or self.config_kwargs["vocab_size"])
        return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)

    def get_placeholder_tokenizer(self, vocab_folder=None):
        """A BertTokenizer of `placeholder_vocab` (as many tokens as the config's vocabulary); with `vocab_folder`, read
        from the vocab.txt it writes there (the same tokenizer, saved alike)."""
        from transformers import BertTokenizer

        vocab = placeholder_vocab(self.config_kwargs["vocab_size"])
        if vocab_folder is None:
            return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
        vocab_file = Path(vocab_folder) / "vocab.txt"
        vocab_file.write_text("\n".join(vocab) + "\n")
        return BertTokenizer(vocab=str(vocab_file))

    def save_folder(self, folder, model_class=None, split: str = "train", seed: int | None = None, **overrides) -> str:
        """The tokenizer and the config (`overrides` on the tester's), or a random `model_class` of that config (seeded
        with `seed`, else the caller seeds torch), saved in `folder`; returns the folder as a string."""
        tokenizer = self.get_tokenizer(split, overrides.get("vocab_size"))  # default: the tester's vocabulary size
        return self._save_folder(folder, tokenizer, model_class, seed, overrides)


class RobertaPkmModelTester(BertPkmModelTester):
    """BertPkmModelTester's sizes as a RobertaPkm config (RoBERTa's special ids: <s> 0, <pad> 1, </s> 2; one token
    type; positions from pad_token_id + 1 = 2, so 64 tokens fit) and a byte-level BPE tokenizer."""

    defaults = {**BertPkmModelTester.defaults, "max_position_embeddings": 66}
    SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]  # RoBERTa's ids 0-3; <mask> is the last id
    WORDS = ["Ġthe", "Ġcat", "Ġsat", "Ġon", "Ġmat", "Ġa", "Ġgood", "Ġmovie"]

    @property
    def config_class(self):
        from modeling_pkm_bert import RobertaPkmConfig

        return RobertaPkmConfig

    def get_tokenizer(self, *_):
        """A byte-level BPE tokenizer (RoBERTa's kind): the 4 special tokens, the 256 byte symbols, `WORDS` merged left
        to right (Ġ t -> Ġt, Ġt h -> Ġth, ...) and <mask>; the same whatever the config's vocabulary size."""
        from tokenizers.pre_tokenizers import ByteLevel
        from transformers import RobertaTokenizer

        alphabet = sorted(ByteLevel.alphabet())
        merges, vocab_words = [], []
        for word in self.WORDS:
            for end in range(2, len(word) + 1):
                merged = word[:end]
                if merged not in vocab_words:
                    merges.append((word[: end - 1], word[end - 1]))
                    vocab_words.append(merged)
        vocab = {token: i for i, token in enumerate(self.SPECIAL + alphabet + vocab_words + ["<mask>"])}
        return RobertaTokenizer(vocab=vocab, merges=merges)


class ModernBertPkmModelTester(FamilyModelTester):
    """The tiny ModernBertPkm models: a ModernBERT body (`base`: 3 layers, global, local, local; a window of 4 tokens
    that 12-token sequences exceed; two rotary thetas; pad 0, [CLS] 1, [SEP] 2) and a memory of 8**2 slots at layer 1
    (`memory`). `get_config(**overrides)` is their ModernBertPkmConfig, `get_model(model_class, seed=None, **overrides)`
    a random model of it, `get_source_config(**overrides)` transformers' ModernBertConfig of the body, `get_tokenizer()`
    a word-level tokenizer of `WORDS` with BERT-style special tokens ([CLS] x [SEP], as ModernBERT's),
    `save_tokenizer(folder)` and `save_folder(folder, model_class=None, seed=None)` the tokenizer and the config (or a
    random model of `model_class`). `ModernBertPkmModelTester(**overrides)` changes the defaults (pkm_* and ngram_*
    fields go to `memory`, the others to `base`)."""

    base_defaults = dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2,
    )  # fmt: skip
    memory_defaults = dict(pkm_layers=[1], pkm_n_keys=8, pkm_heads=2, pkm_knn=4, pkm_k_dim=16)
    SPECIAL = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]  # ids 0-4, as the base's pad/cls/sep ids
    WORDS = "the a cat dog sat on mat is was good bad movie film great awful who where what in paris and".split()

    def __init__(self, **overrides):
        memory = {k: v for k, v in overrides.items() if k.startswith(("pkm_", "ngram_"))}
        self.base = {**self.base_defaults, **{k: v for k, v in overrides.items() if k not in memory}}
        self.memory = {**self.memory_defaults, **memory}

    def get_config(self, **overrides):
        from modeling_pkm_bert import ModernBertPkmConfig

        return ModernBertPkmConfig(**{**self.base, **self.memory, **overrides})

    def get_source_config(self, **overrides):
        from transformers import ModernBertConfig

        return ModernBertConfig(**{**self.base, **overrides})

    def get_tokenizer(self):
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {token: i for i, token in enumerate(self.SPECIAL + self.WORDS)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
            unk_token="[UNK]", model_max_length=64, model_input_names=["input_ids", "attention_mask"],
        )  # fmt: skip

    def save_folder(self, folder, model_class=None, seed: int | None = None, **overrides) -> str:
        return self._save_folder(folder, self.get_tokenizer(), model_class, seed, overrides)


def family_tester(model_class) -> FamilyModelTester:
    """The tester of `model_class`'s family (a class or a class name): RobertaPkm*, ModernBertPkm* or BertPkm*."""
    name = model_class if isinstance(model_class, str) else model_class.__name__
    if name.startswith("RobertaPkm"):
        return RobertaPkmModelTester()
    return ModernBertPkmModelTester() if name.startswith("ModernBertPkm") else BertPkmModelTester()


def tiny_config(**overrides) -> BertPkmConfig:
    """`BertPkmModelTester().get_config(**overrides)`: a BertPkm config small enough for unit tests (3 layers, hidden
    32, a memory of 8**2 slots at layer 1)."""
    return BertPkmModelTester().get_config(**overrides)


def tiny_roberta_config(**overrides):
    """`RobertaPkmModelTester().get_config(**overrides)`: `tiny_config`'s sizes as a RobertaPkm config."""
    return RobertaPkmModelTester().get_config(**overrides)


def remote_code_model(folder, auto_class: str = "AutoModelForMaskedLM"):
    """The model of `folder` built from the folder's own code (the Hub cache module), as `trust_remote_code=True`
    loads it where the package is not registered with the Auto classes (another test may have registered it)."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model_class = get_class_from_dynamic_module(config.auto_map[auto_class], folder)
    model = model_class.from_pretrained(folder)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    return model


def batch(batch_size=3, seq_len=9, vocab=99, pad_from=(None, 6, 4)):
    """(input_ids, attention_mask) of random tokens, row `i` padded (id 0, mask 0) from position `pad_from[i]` (None: no
    padding)."""
    input_ids = torch.randint(1, vocab, (batch_size, seq_len))
    attention_mask = torch.ones_like(input_ids)
    for row, start in enumerate(pad_from[:batch_size]):
        if start is not None:
            input_ids[row, start:] = 0
            attention_mask[row, start:] = 0
    return input_ids, attention_mask


def make_tiny_folder(folder, model_class=None, seed: int | None = None) -> str:
    """For run_mlm.py and run_clm.py: a tiny BertPkm config (memory at layer 1, dropout on: a resume must restore the
    RNG), or a random `model_class` of it (seeded with `seed`), and a word-level tokenizer of 200 tokens made from the
    embedded training text, saved in `folder`."""
    return BertPkmModelTester(vocab_size=200, hidden_dropout_prob=0.1).save_folder(folder, model_class, seed=seed)


def mlm_args(tiny, output_dir, options=""):
    """run_mlm.py's arguments for a run of the tiny folder of `make_tiny_folder` (`options`: more flags, one string)."""
    return [
        *("--config_name", tiny, "--tokenizer_name", tiny, "--output_dir", str(output_dir)),
        *"--max_seq_length 32 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --seed 3".split(),
        *options.split(),
    ]


# ---- the release fixtures: tests/fixtures/<family>_<version>/ ----

FIXTURES = REPO_ROOT / "tests" / "fixtures"
# each release's code files are kept once, in code/; each saved folder keeps its own files (config, weights, tokenizer)
FIXTURE_CODE = "code"


def fixture_code_files(release: Path, folder: str) -> list[Path]:
    """The code files that release fixture `release`'s saved folder `folder` held as the release wrote it: every file
    of the release's code/, a family's own (`configuration_<type>.py`, `modeling_<type>.py`) only in a folder of that
    model type, BertPkm's in every folder (the other families build on them), as `save_pretrained` writes them."""
    model_type = json.loads((release / folder / "config.json").read_text(encoding="utf-8"))["model_type"]
    code = sorted((release / FIXTURE_CODE).glob("*.py"))
    families = {path.stem.removeprefix("configuration_") for path in code if path.name.startswith("configuration_")}

    def family(path: Path) -> str | None:  # a file shared by every family (e.g. modeling_pkm_utils.py) has none
        prefix = next((p for p in ("configuration_", "modeling_") if path.name.startswith(p)), None)
        name = path.stem.removeprefix(prefix) if prefix else None
        return name if name in families else None

    return [path for path in code if family(path) in (None, "bert_pkm", model_type)]


def release_folders(version: str, into: str | Path) -> Path:
    """tests/fixtures/<family>_<version> (bert_pkm_<version>, modernbert_pkm_<version>, ...) assembled as the release
    wrote it, in `into`: its expected.json and each saved folder, that is the folder's own files with the release's code
    files beside them. Returns the assembled folder (the layout `write_folders.py` writes and `check_folders.py` reads)."""
    found = [path for path in FIXTURES.glob(f"*_{version}") if path.is_dir()]
    if len(found) != 1:
        raise FileNotFoundError(f"no release fixture of {version} (or more than one) in {FIXTURES}")
    release = found[0]
    return assemble_fixture(release, Path(into) / release.name)


def assemble_fixture(release: Path, out: Path) -> Path:
    """The folders of fixture `release` (code/, expected.json and each folder's own files) assembled in `out`."""
    out.mkdir(parents=True)
    shutil.copy2(release / "expected.json", out / "expected.json")
    for folder in sorted(path for path in release.iterdir() if path.is_dir() and path.name != FIXTURE_CODE):
        shutil.copytree(folder, out / folder.name)
        for path in fixture_code_files(release, folder.name):
            shutil.copy2(path, out / folder.name / path.name)
    return out
