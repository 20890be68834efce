"""Seeing the memory: the memory report (usage heat maps, sorted usage curves, staleness, per-class usage, training
curves), the memory explorer (a static page: what each slot holds) and the metrics log the training scripts write.

Not imported by the remote-code files. Submodules: `report` (the report), `explorer` (the explorer page; its HTML, CSS and JavaScript are
package data in `explorer_page/`), `arguments` (the report's flags), `metrics_log`,
`memory_usage` (MU, KL_u, KL_w per memory layer), `class_usage` (per-class usage, Figure 4), `staleness` (Figure 2),
`knowledge` (a synthetic knowledge base and the recall of its facts in bits: the knowledge benchmarks and the demo).
Names resolve on first use; matplotlib (Agg) is imported only when a figure is drawn.

    from modeling_pkm_bert.analysis import write_memory_report
    write_memory_report(model, tokenizer, "report", texts=["Some held-out text ..."])
"""

from ..utils.lazy_imports import lazy_exports


__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".arguments": ("add_memory_report_arguments",),
        ".explorer": ("MemoryExplorerError", "build_memory_explorer", "read_explorer_data"),
        ".metrics_log": ("METRICS_LOG_NAME", "MetricsLog", "read_metrics_log"),
        ".report": (
            "ClassData",
            "MemoryReportError",
            "check_run_dir",
            "read_texts",
            "write_memory_report",
            "write_run_memory_report",
        ),
    },
)
