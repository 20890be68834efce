"""Seeing the memory: the memory report (usage heat maps, sorted usage curves, staleness, per-class usage, training
curves) and the metrics log the training scripts write for it.

Not imported by the remote-code files. matplotlib (Agg) is imported only when a figure is drawn.

    from modeling_pkm_bert.analysis import write_memory_report
    write_memory_report(model, tokenizer, "report", texts=["Some held-out text ..."])
"""

from .metrics_log import METRICS_LOG_NAME, MetricsLog, read_metrics_log
from .report import (
    ClassData,
    MemoryReportError,
    add_memory_report_arguments,
    check_run_dir,
    class_data_from_files,
    read_texts,
    write_memory_report,
    write_run_memory_report,
)


__all__ = [
    "METRICS_LOG_NAME",
    "ClassData",
    "MemoryReportError",
    "MetricsLog",
    "add_memory_report_arguments",
    "check_run_dir",
    "class_data_from_files",
    "read_metrics_log",
    "read_texts",
    "write_memory_report",
    "write_run_memory_report",
]
