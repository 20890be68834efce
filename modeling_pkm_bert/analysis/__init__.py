"""Seeing the memory: the memory report (usage heat maps, sorted usage curves, staleness, per-class usage, training
curves) and the metrics log the training scripts write for it.

Not imported by the remote-code files. Submodules: `report` (the report), `metrics_log`, `memory_usage` (MU, KL_u,
KL_w per memory layer), `class_usage` (per-class usage, Figure 4), `staleness` (Figure 2). Names resolve on first use. matplotlib (Agg) is imported only when a figure is drawn.

    from modeling_pkm_bert.analysis import write_memory_report
    write_memory_report(model, tokenizer, "report", texts=["Some held-out text ..."])
"""

import importlib


_NAMES = {
    "metrics_log": ("METRICS_LOG_NAME", "MetricsLog", "read_metrics_log"),
    "report": (
        "ClassData",
        "MemoryReportError",
        "add_memory_report_arguments",
        "check_run_dir",
        "class_data_from_files",
        "read_texts",
        "write_memory_report",
        "write_run_memory_report",
    ),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


__all__ = sorted(_MODULE_OF)
