"""Model cards of BertPkm folders: the base model and license of the source, the parameter counts, the run's results
(curated numbers first), and the card's metadata block."""

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import ModelCard, ModelCardData, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open

from ..configuration_bert_pkm import AUTO_MAP, BertPkmConfig
from .card_command import DEFAULT_LICENSE, redact_command


if TYPE_CHECKING:
    from .conversion import ConversionReport


# the pkm_* and ngram_* fields of the config; the heads a conversion may add
PKM_FIELDS = [f.name for f in dataclasses.fields(BertPkmConfig) if f.name.startswith(("pkm_", "ngram_"))]
# fields a card never lists: digests of the weights, not a setting (config.json keeps them)
_UNLISTED_FIELDS = {"pkm_weights_checksum"}
# lm_head: RoBERTa's; head (the prediction head of every task) and decoder: ModernBERT's
HEAD_PREFIXES = ("cls.", "lm_head.", "classifier.", "qa_outputs.", "head.", "decoder.")


PIPELINE_TAGS = {
    "BertPkmModel": "feature-extraction",
    "BertPkmForMaskedLM": "fill-mask",
    "BertPkmForSequenceClassification": "text-classification",
    "BertPkmForTokenClassification": "token-classification",
    "BertPkmForQuestionAnswering": "question-answering",
    "BertPkmForCausalLM": "text-generation",
}


# RobertaPkm and ModernBertPkm classes have the pipeline task and Auto class of the BertPkm class of the same head
_OTHER_FAMILIES = ("RobertaPkm", "ModernBertPkm")
PIPELINE_TAGS.update({name.replace("BertPkm", f): tag for name, tag in PIPELINE_TAGS.items() for f in _OTHER_FAMILIES})
_AUTO_CLASS_OF = {target.split(".")[-1]: auto for auto, target in AUTO_MAP.items()}
_AUTO_CLASS_OF.update({name.replace("BertPkm", f): auto for name, auto in _AUTO_CLASS_OF.items() for f in _OTHER_FAMILIES})
# model_type -> (the family's tag, its name in prose)
_FAMILIES = {"roberta_pkm": ("roberta", "RoBERTa"), "modernbert_pkm": ("modernbert", "ModernBERT")}


_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


_HUB_LOOKUP_ERRORS = (EntryNotFoundError, HfHubHTTPError, HFValidationError, OSError)


def hub_file(repo_id: str, filename: str) -> Path | None:
    try:
        return Path(hf_hub_download(repo_id, filename))
    except _HUB_LOOKUP_ERRORS:
        return None


def source_license(source) -> str | None:
    """The license in the source's README YAML, else in its config.json, else None."""
    if not isinstance(source, (str, os.PathLike)):
        return getattr(getattr(source, "config", None), "license", None)
    local = Path(source).is_dir()
    readme = Path(source) / "README.md" if local else hub_file(str(source), "README.md")
    if readme is not None and readme.is_file():
        license = ModelCard.load(readme, ignore_metadata_errors=True).data.license
        if license:
            return license
    config = Path(source) / "config.json" if local else hub_file(str(source), "config.json")
    if config is not None and config.is_file():
        return json.loads(config.read_text(encoding="utf-8")).get("license")
    return None


def hub_id_or_none(name) -> str | None:
    """`name` if it can be a Hub model id (not a local path), else None."""
    if name is None or not isinstance(name, str) or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def folder_parameter_counts(folder: str | os.PathLike) -> dict[str, int]:
    """Parameter counts of a saved model from its safetensors headers: total, product-key memory values, other
    product-key memory parameters, n-gram memory tables, other n-gram memory parameters."""
    counts = {"total": 0, "memory_values": 0, "memory_other": 0, "ngram_tables": 0, "ngram_other": 0}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name.endswith(_BUFFER_SUFFIXES):
                    continue
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                counts["total"] += n
                if ".memory." in name:
                    counts["memory_values" if name.endswith("memory.values.weight") else "memory_other"] += n
                elif ".ngram." in name:
                    counts["ngram_tables" if name.endswith("ngram.tables.weight") else "ngram_other"] += n
    return counts


def card_base_model(model_name_or_path, base_model: str | None = None) -> str | None:
    """The Hub id a model card names as `base_model`: `base_model` (a flag), else `model_name_or_path` when it is a
    Hub id, else the `base_model` of a local source folder's own card (a converted or trained folder); never a local
    path."""
    if base_model is not None:
        if hub_id_or_none(base_model) is None:
            raise ValueError(f"base_model {base_model!r} is not a Hub model id (e.g. google-bert/bert-base-uncased)")
        return base_model
    if not isinstance(model_name_or_path, (str, os.PathLike)):
        return None
    hub_id = hub_id_or_none(str(model_name_or_path))
    if hub_id is not None:
        return hub_id
    readme = Path(model_name_or_path) / "README.md"
    if readme.is_file():
        found = ModelCard.load(readme, ignore_metadata_errors=True).data.base_model
        found = found[0] if isinstance(found, list) and len(found) == 1 else found
        return hub_id_or_none(found) if isinstance(found, str) else None
    return None


def card_license(model_name_or_path, license: str | None = None) -> str:
    """The license a model card declares: `license` (a flag), else the source's (its card or config), else
    `apache-2.0`, the license of BERT's and MiniLM's weights and of this code."""
    return license or source_license(model_name_or_path) or DEFAULT_LICENSE


def _shown_name(name: str) -> str:
    """A source or data set as a card names it: a Hub id as is, a local path by its last component only."""
    return name if hub_id_or_none(name) is not None else (Path(str(name)).name or "<path>")


# curated results of a card: (label, all_results.json key pattern), in this order; the rest stays in all_results.json
_TASK_METRICS = {
    "accuracy": "accuracy",
    "f1": "F1",
    "exact_match": "exact match",
    "exact": "exact match",
    "matthews_correlation": "Matthews correlation",
    "pearson": "Pearson",
    "spearmanr": "Spearman",
    "HasAns_f1": "F1, answerable",
    "NoAns_f1": "F1, unanswerable",
}


_MEMORY_METRICS = {"mu": ("MU %", 100, 2), "top1_mu": ("top-1 MU %", 100, 3), "kl_u": ("KL_u", 1, 3), "kl_w": ("KL_w", 1, 3)}


_BEFORE_PREFIXES = ("initial_", "pretrained_")


def _number(value: float) -> str:
    return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4f}"


def curated_results(results: dict) -> list[str]:
    """The results table of a model card: perplexities, task metrics (accuracy, F1, exact match, ...) and the memory
    usage of each memory layer, before training (`initial_*`, `pretrained_*`) and after, as markdown lines."""
    rows = {}  # key after training -> [label, before, after]

    def add(key, label, before_keys, scale=1.0, digits=None):
        def shown(k):
            value = results.get(k)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return None
            return f"{value * scale:.{digits}f}" if digits is not None else _number(value)

        before = next((v for v in map(shown, before_keys) if v is not None), None)
        rows[key] = [label, before, shown(key)]

    for key in results:
        if key.startswith(_BEFORE_PREFIXES):
            continue
        match = re.fullmatch(r"(?:eval_)?(?:(.+)_)?perplexity", key)
        if match and not match.group(1) and any(re.fullmatch(r"eval_.+_perplexity", k) for k in results):
            continue  # the first evaluation set's, shown under its name
        if match:
            name = f"perplexity, {match.group(1)}" if match.group(1) else "perplexity"
            add(key, f"{name} (`{key}`)", [p + key for p in _BEFORE_PREFIXES])
            continue
        match = re.fullmatch(r"eval_(" + "|".join(_TASK_METRICS) + r")(_[a-z0-9]+)?", key)
        if match:
            add(key, f"{_TASK_METRICS[match.group(1)]}{match.group(2) or ''} (`{key}`)", [])
            continue
        match = re.fullmatch(r"eval_memory/([^/]+)/(" + "|".join(_MEMORY_METRICS) + ")", key)
        if match:
            label, scale, digits = _MEMORY_METRICS[match.group(2)]
            tail = key[len("eval_") :]
            add(key, f"{match.group(1)} {label}", ["initial_" + key, "pretrained_" + tail], scale, digits)
    if not rows:
        return []
    with_before = any(before is not None for _, before, _ in rows.values())
    lines = ["| | before training | after training |", "|---|---:|---:|"] if with_before else ["| | |", "|---|---:|"]
    for label, before, after in rows.values():
        cells = [label, before or "-", after or "-"] if with_before else [label, after or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def results_section(
    results: dict,
    title: str = "Results",
    *,
    command: str | None = None,
    output_dir: str | os.PathLike | None = None,
    dataset: str | None = None,
    task: str | None = None,
) -> list[str]:
    """A card's results: what was trained on, the curated table, where the rest is, the command ("Produced by")."""
    lines = [f"## {title}", ""]
    if dataset or task:
        lines += [f"Task: {task or '-'}; data: `{_shown_name(dataset) if dataset else '-'}`.", ""]
    table = curated_results(results)
    numeric = [k for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    lines += table + ([""] if table else [])
    lines.append(
        f"All {len(numeric)} numbers of the run (every memory statistic, sample counts, runtimes on the machine that"
        " trained it) are in `all_results.json`."
    )
    if command:
        lines += ["", "Produced by:", "", "```bash", redact_command(command, output_dir), "```"]
    return lines


def card_metadata(base_model, license, tags, pipeline_tag=None) -> str:
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        base_model=hub_id_or_none(base_model),
        license=license or DEFAULT_LICENSE,
    )
    return f"---\n{data.to_yaml()}\n---\n\n"


def memory_settings(config: dict, prefix: str, kind: str, extra_rows: list[str] = ()) -> list[str]:
    """A card's settings of one memory kind (the config fields starting with `prefix`, each set one, and
    `extra_rows`), as markdown lines; a kind the model does not use (no `<prefix>layers`) is one line saying so."""
    if not config.get(f"{prefix}layers"):
        return [f"{kind}: none.", ""]
    rows = [
        f"| `{field}` | `{json.dumps(config[field])}` |"
        for field in PKM_FIELDS
        if field.startswith(prefix) and field not in _UNLISTED_FIELDS and config.get(field) is not None
    ]
    return [f"{kind}:", "", "| setting | value |", "|---|---|", *rows, *extra_rows, ""]


def write_model_card(
    folder: str | os.PathLike,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    report: "ConversionReport | None" = None,
    model_name: str | None = None,
    results: dict | None = None,
    results_title: str = "Results",
    command: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
) -> ModelCard:
    """Write `README.md` for a saved BertPkm folder: YAML metadata (`library_name`, `license`, `base_model` when it
    is a Hub id, tags), usage, memory settings, parameter counts and, given `results`, their curated table and the
    `command` that produced the folder, without secrets or this machine's paths."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    architecture = (config.get("architectures") or ["BertPkmModel"])[0]
    auto_class = _AUTO_CLASS_OF.get(architecture, "AutoModel")
    base_model = hub_id_or_none(base_model)
    family, family_name = _FAMILIES.get(config.get("model_type"), ("bert", "BERT"))
    pkm_layers, ngram_layers = config.get("pkm_layers") or [], config.get("ngram_layers") or []
    tags = ["pkm", family, f"{family}_pkm", "custom_code"]  # the model type's tags; those of the memories it has:
    tags[1:1] = ["product-key-memory"] if pkm_layers else []
    tags[-1:-1] = ([f"pkm-{config['pkm_mode']}"] if pkm_layers else []) + (["ngram-memory"] if ngram_layers else [])
    if report is not None and report.source_architecture.startswith(("DistilBert", "XLMRoberta")):
        tags.insert(3, "distilbert" if report.source_architecture.startswith("DistilBert") else "xlm-roberta")
    metadata = card_metadata(base_model, license, tags, PIPELINE_TAGS.get(architecture))
    counts = folder_parameter_counts(folder)
    name = model_name or repo_id or folder.name
    load_from = repo_id or "path/to/this/folder"
    source = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else f"a {family.upper()} checkpoint"
    if report is not None and not base_model:
        source = f"`{_shown_name(report.source)}`"
    mode = {"resm": "beside the feed-forward network (ResM)", "replace": "instead of the feed-forward network"}
    memories = []
    if pkm_layers:
        memories.append(
            f"product key memory (PKM, Lample et al. 2019) at layers {pkm_layers}, {mode[config['pkm_mode']]}, as in"
            " Kim & Jung 2020 (*Large Product Key Memory for Pretrained Language Models*)"
        )
    if ngram_layers:
        memories.append(f"hashed n-gram memories at layers {ngram_layers}")
    described = " and ".join(memories) if memories else "no memory layer (the architecture of a plain model)"
    lines = [
        f"# {name}",
        "",
        f"{family_name} with {described}. Architecture: `{architecture}`.",
    ]
    if report is not None:
        lines += [
            "",
            f"Converted from {source} ({report.source_architecture}): {report.carried_parameters:,} parameters"
            f" carried over, {report.new_parameters:,} new (the memories"
            + (", the head" if any(n.startswith(HEAD_PREFIXES) for n in report.new) else "")
            + f"), {report.dropped_parameters:,} dropped. "
            + (
                "Its memory values are zero and sit beside the FFN, so it computes exactly what the source"
                " computes until trained"
                if config["pkm_mode"] == "resm" and config["pkm_value_init"] == "zeros"
                else "Its memories are freshly initialised, so its outputs differ from the source's until trained"
            )
            + " (e.g. with masked language modeling).",
        ]
    elif base_model:
        lines += ["", f"Trained from {source}."]
    if results is not None:
        lines += ["", *results_section(results, results_title, command=command, output_dir=folder, dataset=dataset, task=task)]
    elif command:
        lines += ["", "Produced by:", "", "```bash", redact_command(command, folder), "```"]
    lines += [
        "",
        "## Usage",
        "",
        "The model code ships with the checkpoint (`trust_remote_code=True`); it needs `transformers>=5.4,<6`.",
        "",
        "```python",
        f"from transformers import AutoTokenizer, {auto_class}",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{load_from}", trust_remote_code=True)  # reads the config',
        f'model = {auto_class}.from_pretrained("{load_from}", trust_remote_code=True)',
        'outputs = model(**tokenizer("Product keys make a large memory cheap to read.", return_tensors="pt"))',
        "```",
        "",
        "## Memory settings",
        "",
        *memory_settings(config, "pkm_", "Product-key memory", [f"| memory slots per layer | {config['pkm_n_keys'] ** 2:,} |"]),
        *memory_settings(config, "ngram_", "Hashed n-gram memory"),
        "## Parameters",
        "",
        "| | parameters |",
        "|---|---:|",
        f"| total | {counts['total']:,} |",
        *(
            [
                f"| memory values | {counts['memory_values']:,} |",
                f"| other memory parameters (keys, query network) | {counts['memory_other']:,} |",
            ]
            if pkm_layers
            else []
        ),
        *(
            [
                f"| n-gram memory tables | {counts['ngram_tables']:,} |",
                f"| other n-gram memory parameters (convolution, projections, norms) | {counts['ngram_other']:,} |",
            ]
            if ngram_layers
            else []
        ),
        f"| rest of the model | {counts['total'] - sum(v for k, v in counts.items() if k != 'total'):,} |",
        "",
        "Memory values are best trained in their own optimizer group (Adam, constant learning rate 1e-3, no weight"
        " decay), as in XLM and the paper.",
        "",
    ]
    card = ModelCard(metadata + "\n".join(lines))
    card.save(folder / "README.md")
    return card
