"""The layer has one switch, its plan: no class attribute or module flag of the layer's files chooses a path, the
plan's table in product_key_memory_ops.py's docstring names every implementation the plan can choose, and no shipped
file reaches into torch's or transformers' private internals."""

import re
import tokenize

from helpers import REPO_ROOT
from modeling_pkm_bert import product_key_memory_ops
from modeling_pkm_bert.configuration_bert_pkm import REMOTE_CODE_FILES
from modeling_pkm_bert.product_key_memory import ProductKeyMemory, ProductKeyValues
from modeling_pkm_bert.product_key_memory_ops import Plan


def test_no_attribute_or_flag_chooses_a_path():
    attributes = [
        f"{cls.__name__}.{name}"
        for cls in (ProductKeyMemory, ProductKeyValues)
        for name, value in vars(cls).items()
        if not name.startswith("_") and isinstance(value, (bool, tuple))
    ]
    assert not attributes, attributes
    flags = [name for name, value in vars(product_key_memory_ops).items() if name.isupper() and isinstance(value, (bool, int))]
    assert flags == ["OPS_VERSION"], flags  # (names the custom ops: not a switch)


def test_the_plan_table_names_every_implementation():
    listing = product_key_memory_ops.__doc__
    for field in ("selection", "search_backward", "value_read"):
        assert field in Plan.__dataclass_fields__
        choices = re.findall(r'"(\w+)"', _comment(field).split("#", 1)[1])
        assert choices and choices[0] == "torch", field
        for choice in choices[1:]:
            assert f"`{choice}`" in listing, f"{field} {choice!r} is missing from the plan's table"
    assert all(len(line) <= 120 for line in listing.splitlines())


def _comment(field: str) -> str:
    """The comment of a Plan field in the source: its choices."""
    source = (REPO_ROOT / "modeling_pkm_bert" / "product_key_memory_ops.py").read_text(encoding="utf-8")
    return re.search(rf"^    {field}: str = .*$", source, re.MULTILINE).group(0)


# torch's and transformers' private internals (each a way for a saved folder to break under a later release)
PRIVATE = [
    r"torch\._C\b", r"torch\._softmax_backward_data", r"torch\.ops\.aten\._", r"torch\._dynamo", r"torch\._inductor",
    r"torch\.utils\._", r"nn\.modules\.module\._global", r"_current_graph_task_id", r"_will_engine_execute_node",
    r"_storage_Use_Count", r"\._cdata\b", r"nn\.modules\.batchnorm\._BatchNorm", r"transformers\.models\.",
    r"transformers\.utils\._", r"\bfrom torch\._", r"\bimport torch\._",
]


def code_lines(path) -> dict[int, str]:
    """The code of a Python file by line, strings and comments left out (docstrings name what they were copied from)."""
    lines: dict[int, str] = {}
    with open(path, encoding="utf-8") as handle:
        for token in tokenize.generate_tokens(handle.readline):
            if token.type not in (tokenize.STRING, tokenize.COMMENT) and token.string.strip():
                lines[token.start[0]] = lines.get(token.start[0], "") + token.string
    return lines


def test_no_shipped_file_uses_private_torch_or_transformers_internals():
    found = []
    for name in REMOTE_CODE_FILES:
        for number, line in code_lines(REPO_ROOT / "modeling_pkm_bert" / name).items():
            code = line.replace("from", "from ").replace("import", "import ")
            found += [f"{name}:{number}: {line}" for pattern in PRIVATE if re.search(pattern, code)]
    assert not found, found


def test_the_private_internals_check_finds_them():
    """The check above reads code: it finds each kind of private use in a line of code, not in a comment or string."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sample.py"
        path.write_text('x = torch._C._current_graph_task_id()\n# torch._C in a comment\ny = "torch._C in a string"\n')
        lines = code_lines(path)
    assert [n for n, line in lines.items() if any(re.search(p, line) for p in PRIVATE)] == [1]
