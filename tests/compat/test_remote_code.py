"""Saved folders are Hub repositories: they load through remote code in a process that cannot import the package."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import BertTokenizer
from transformers.pipelines import SUPPORTED_TASKS

from helpers import REPO_ROOT, bert_pkm_code_files, tiny_config, tiny_roberta_config
from modeling_pkm_bert import (
    AUTO_MAP,
    BertPkmForMaskedLM,
    BertPkmForQuestionAnswering,
    BertPkmForSequenceClassification,
    BertPkmForTokenClassification,
)


WORDS = "the a cat dog sat on mat is was good bad movie film great awful who where what paris london city lives in".split()


# not a tester's tokenizer: the pipelines' texts below are made of WORDS (then fillers word<i> up to 99 tokens)
def tiny_tokenizer(folder: Path) -> BertTokenizer:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    vocab += [f"word{i}" for i in range(99 - len(vocab))]
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    tokenizer.save_pretrained(folder)
    return tokenizer


# Runs in a fresh interpreter whose import of modeling_pkm_bert is made to fail: only the folder's code can be used.
REMOTE_SCRIPT = r"""
import json, sys
sys.modules["modeling_pkm_bert"] = None
try:
    import modeling_pkm_bert
    raise SystemExit("modeling_pkm_bert must not be importable here")
except ImportError:
    pass
import torch
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, \
    AutoModelForQuestionAnswering, AutoModelForTokenClassification, AutoTokenizer, pipeline
folders = json.loads(sys.argv[1])
inputs = torch.tensor(json.loads(sys.argv[2]))
mask = torch.tensor(json.loads(sys.argv[3]))
out = {}
config = AutoConfig.from_pretrained(folders["mlm"], trust_remote_code=True)
out["config_module"] = type(config).__module__
for name, auto in [("mlm", AutoModelForMaskedLM), ("cls", AutoModelForSequenceClassification),
                   ("qa", AutoModelForQuestionAnswering), ("tok", AutoModelForTokenClassification)]:
    model = auto.from_pretrained(folders[name], trust_remote_code=True).eval()
    out[name + "_module"] = type(model).__module__
    with torch.no_grad():
        result = model(inputs, attention_mask=mask)
    out[name] = (result.start_logits if name == "qa" else result.logits).tolist()
base = AutoModel.from_pretrained(folders["mlm"], trust_remote_code=True).eval()
with torch.no_grad():
    out["base"] = base(inputs, attention_mask=mask).last_hidden_state.tolist()
out["fill-mask"] = pipeline("fill-mask", model=folders["mlm"], trust_remote_code=True)("the cat [MASK] on the mat", top_k=3)
out["text-classification"] = pipeline("text-classification", model=folders["cls"], trust_remote_code=True)("a good movie")
out["token-classification"] = pipeline("token-classification", model=folders["tok"], trust_remote_code=True)("the cat sat")
from transformers.pipelines import SUPPORTED_TASKS
if "question-answering" in SUPPORTED_TASKS:  # removed from transformers' pipelines in later 5.x releases
    out["question-answering"] = pipeline("question-answering", model=folders["qa"], trust_remote_code=True)(
        question="where is the cat", context="the cat sat on the mat in paris")
print("RESULT" + json.dumps(out, default=float))
"""


def test_saved_folders_load_as_remote_code_offline_with_identical_outputs(tmp_path):
    input_ids = torch.tensor([[2, 7, 8, 9, 3, 0], [2, 10, 11, 12, 13, 3]])
    attention_mask = (input_ids != 0).long()
    folders, expected = {}, {}
    for name, model_class in [
        ("mlm", BertPkmForMaskedLM),
        ("cls", BertPkmForSequenceClassification),
        ("qa", BertPkmForQuestionAnswering),
        ("tok", BertPkmForTokenClassification),
    ]:
        folder = tmp_path / name
        # an n-gram memory (issue 35) beside the product keys, contributing (its value projection starts at zero)
        config = tiny_config(pkm_layers=[0, 2], num_labels=2, ngram_layers=[1], ngram_table_size=211, ngram_dim=4)
        model = model_class(config).eval()
        with torch.no_grad():
            model.base_model.encoder.layer[1].ngram.value.weight.normal_()
        model.save_pretrained(folder)
        tiny_tokenizer(folder)
        folders[name] = str(folder)
        with torch.no_grad():
            result = model(input_ids, attention_mask=attention_mask)
        expected[name] = result.start_logits if name == "qa" else result.logits
        if name == "mlm":
            with torch.no_grad():
                expected["base"] = model.bert(input_ids, attention_mask=attention_mask).last_hidden_state
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP
        for code in bert_pkm_code_files():
            assert (folder / code).is_file(), code

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    completed = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, json.dumps(folders), json.dumps(input_ids.tolist()), json.dumps(attention_mask.tolist())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.split("RESULT", 1)[1])
    for name in ("mlm", "cls", "qa", "tok", "base"):
        assert torch.allclose(torch.tensor(out[name]), expected[name], atol=1e-6), name
    # the classes came from the copied files, not from this repository
    for key in ("config_module", "mlm_module", "cls_module"):
        assert out[key].startswith("transformers_modules."), out[key]
    assert len(out["fill-mask"]) == 3 and all("[MASK]" not in r["sequence"] for r in out["fill-mask"])
    assert out["text-classification"][0]["label"] in ("LABEL_0", "LABEL_1")
    assert isinstance(out["token-classification"], list)
    if "question-answering" in SUPPORTED_TASKS:
        assert out["question-answering"]["answer"] in "the cat sat on the mat in paris"


# Loads saved folders with every default (online, Hub kernels as transformers sets them) in a process whose sockets
# refuse to connect and record each try; a fetch made first shows that the guard catches one.
NO_NETWORK_SCRIPT = r"""
import json, socket, sys, urllib.request
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args)[:200])
    raise OSError("network access refused by the test")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse
try:
    urllib.request.urlopen("https://huggingface.co", timeout=5)
except OSError:
    pass
out = {"guard": len(attempts), "folders": {}}
attempts.clear()
sys.modules["modeling_pkm_bert"] = None
import torch, transformers
from transformers import AutoModelForMaskedLM
for folder in sys.argv[1:]:
    model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        model(torch.tensor([[2, 7, 8, 3]]))
    out["folders"][folder] = {"module": type(model).__module__, "use_kernels": getattr(model, "use_kernels", None)}
out.update(attempts=attempts, transformers=transformers.__version__)
print("RESULT" + json.dumps(out))
"""


def test_loading_with_the_defaults_never_reaches_the_network(tmp_path):
    """transformers >= 5.25 kernelizes every load by default (Hub kernels for BERT's activations on GPUs, fetched from
    the Hub): on CPU, with HF_HUB_OFFLINE unset, a folder of each family loads and runs without opening a connection."""
    from modeling_pkm_bert import ModernBertPkmConfig, ModernBertPkmForMaskedLM, RobertaPkmForMaskedLM

    modernbert = ModernBertPkmConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=37, pkm_layers=[1], pkm_n_keys=8, pkm_heads=2, pkm_knn=4,
                                     pkm_k_dim=16, pad_token_id=0, bos_token_id=2, cls_token_id=2, eos_token_id=3,
                                     sep_token_id=3, local_attention=4)  # fmt: skip
    models = {"mlm": BertPkmForMaskedLM(tiny_config()), "roberta_mlm": RobertaPkmForMaskedLM(tiny_roberta_config()),
              "modernbert_mlm": ModernBertPkmForMaskedLM(modernbert)}  # fmt: skip
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "USE_HUB_KERNELS"))}
    env.pop("PYTHONPATH", None)
    env.update(HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    completed = subprocess.run([sys.executable, "-c", NO_NETWORK_SCRIPT, *(str(tmp_path / name) for name in models)],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.split("RESULT", 1)[1])
    assert out["guard"] and out["attempts"] == [], out
    assert all(folder["module"].startswith("transformers_modules.") for folder in out["folders"].values()), out
    if tuple(int(part) for part in out["transformers"].split(".")[:2]) >= (5, 25):
        assert all(folder["use_kernels"] for folder in out["folders"].values()), out  # the defaults did kernelize


def test_question_answering_pipeline_where_transformers_has_it(tmp_path):
    if "question-answering" not in SUPPORTED_TASKS:
        pytest.skip(
            f"transformers {transformers.__version__} removed the question-answering pipeline; "
            "extractive QA is covered by the remote-code logits test above and by run_squad"
        )
    model = BertPkmForQuestionAnswering(tiny_config()).eval()
    answer = transformers.pipeline("question-answering", model=model, tokenizer=tiny_tokenizer(tmp_path))(
        question="where is the cat", context="the cat sat on the mat in paris"
    )
    assert answer["answer"] in "the cat sat on the mat in paris"


# transformers' stable public surface: what the remote-code files may import from it (its internals change between
# minor releases: 5.24 renamed past_key_values in every BERT block); GradientCheckpointingLayer is top-level from 5.4
STABLE_TRANSFORMERS = {
    "transformers": {
        "AttentionInterface", "BertConfig", "Cache", "DynamicCache", "EncoderDecoderCache", "GenerationMixin",
        "GradientCheckpointingLayer", "ModernBertConfig", "PreTrainedModel", "initialization",
    },
    "transformers.activations": {"ACT2FN"},
    "transformers.modeling_outputs": None,  # any output class
    "transformers.utils": {"logging"},
}


def private_torch_uses(source: str) -> list[str]:
    """The private names a file reaches through torch's modules: `torch._C`, `torch.ops.aten._embedding_bag_backward`,
    `nn.modules.module._global_forward_hooks`, `F._x` (a name starting with "_", dunders aside, anywhere on a chain rooted
    at `torch`, `nn` or `F`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in ("torch", "nn", "F"):
                names = [base.id, *reversed(chain)]
                if any(n.startswith("_") and not n.startswith("__") for n in names[1:]):
                    found.append(".".join(names))
    return found


def test_private_torch_uses_are_found():
    source = "import torch\nx = torch._C._storage_Use_Count(t)\ny = torch.ops.aten._embedding_bag_backward\nz = torch.nn.functional.relu"
    assert set(private_torch_uses(source)) == {"torch._C._storage_Use_Count", "torch._C", "torch.ops.aten._embedding_bag_backward"}


def test_remote_code_files_use_no_private_torch_internals():
    """A Hub folder written today must load under a later torch: the shipped files call torch's public API only."""
    from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES

    for name in REMOTE_CODE_FILES:
        assert private_torch_uses((REPO_ROOT / "modeling_pkm_bert" / name).read_text()) == [], name


def test_remote_code_files_import_only_allowed_modules():
    from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES

    allowed = {"torch", "transformers", "huggingface_hub", "__future__", "dataclasses", "typing", "math", "collections", "functools", "itertools", "warnings", "hashlib", "weakref", "contextlib"}
    forbidden_calls = {"open", "exec", "eval", "compile", "__import__"}
    for name in REMOTE_CODE_FILES:
        tree = ast.parse((REPO_ROOT / "modeling_pkm_bert" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
                assert all(alias.name in ("transformers",) or not alias.name.startswith("transformers.") for alias in node.names), name
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: only `from .module import Name`, of another remote-code file
                    assert node.module, f"{name}: use `from .module import Name`, never `from . import x`"
                    assert f"{node.module}.py" in REMOTE_CODE_FILES, f"{name} imports .{node.module}, not a remote-code file"
                    continue
                roots = {node.module.split(".")[0]}
                if roots == {"transformers"}:
                    assert node.module in STABLE_TRANSFORMERS, f"{name} imports transformers internals: {node.module}"
                    names = STABLE_TRANSFORMERS[node.module]
                    imported = {alias.name for alias in node.names}
                    assert names is None or imported <= names, f"{name} imports {imported - names} from {node.module}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in forbidden_calls, f"{name} calls {node.func.id}"
                continue
            else:
                continue
            assert roots <= allowed, f"{name} imports {roots - allowed}"


def relative_imports(name: str) -> set[str]:
    tree = ast.parse((REPO_ROOT / "modeling_pkm_bert" / name).read_text())
    return {f"{node.module}.py" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}


def test_each_remote_code_file_imports_directly_every_file_it_needs():
    """transformers before 5.24 copies only the direct relative imports of the file it loads (configuration or
    modeling) into its module cache: a file needed through another one is missing there (FileNotFoundError)."""
    from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES

    for name in REMOTE_CODE_FILES:
        direct = relative_imports(name)
        for needed in direct:
            assert relative_imports(needed) <= direct | {name}, f"{name} needs {relative_imports(needed) - direct} through {needed}"
