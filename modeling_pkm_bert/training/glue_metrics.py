r"""GLUE metrics computed offline (scikit-learn, scipy).

Task metrics, with the names of the Hub's `glue` metric (fractions in [0, 1], not percentages):

* cola: `matthews_correlation` (`sklearn.metrics.matthews_corrcoef`);
* mrpc, qqp: `accuracy` and `f1` (binary F1 of class 1, `sklearn.metrics.f1_score`);
* stsb: `pearson` and `spearmanr` (`scipy.stats`);
* sst2, mnli (matched and mismatched), qnli, rte, wnli: `accuracy`.

The per-class memory usage (Figure 4) lives in `modeling_pkm_bert.analysis.class_usage`.
"""

import math

import numpy as np

from .glue_data import get_glue_task


def _arrays(predictions, references) -> tuple[np.ndarray, np.ndarray]:
    predictions, references = np.asarray(predictions), np.asarray(references)
    if predictions.shape != references.shape:
        raise ValueError(f"{predictions.shape[0]} predictions for {references.shape[0]} references")
    if predictions.size == 0:
        raise ValueError("no predictions to score")
    return predictions, references


def accuracy(predictions, references) -> float:
    """Fraction of predictions equal to their reference."""
    from sklearn.metrics import accuracy_score

    predictions, references = _arrays(predictions, references)
    return float(accuracy_score(references, predictions))


def f1(predictions, references, positive_label: int = 1) -> float:
    """Binary F1 of `positive_label` (GLUE's F1 for MRPC and QQP); 0 when neither side has a positive."""
    from sklearn.metrics import f1_score

    predictions, references = _arrays(predictions, references)
    return float(f1_score(references, predictions, pos_label=positive_label, average="binary", zero_division=0.0))


def matthews_correlation(predictions, references) -> float:
    """Matthews correlation coefficient (CoLA); 0 when predictions or references hold a single class."""
    from sklearn.metrics import matthews_corrcoef

    predictions, references = _arrays(predictions, references)
    return float(matthews_corrcoef(references, predictions))


def pearson(predictions, references) -> float:
    """Pearson correlation (STS-B); NaN when either side is constant."""
    from scipy.stats import pearsonr

    predictions, references = _arrays(predictions, references)
    if np.ptp(predictions) == 0 or np.ptp(references) == 0:
        return math.nan
    return float(pearsonr(predictions, references)[0])


def spearman(predictions, references) -> float:
    """Spearman rank correlation (STS-B; ties get their average rank); NaN when either side is constant."""
    from scipy.stats import spearmanr

    predictions, references = _arrays(predictions, references)
    if np.ptp(predictions) == 0 or np.ptp(references) == 0:
        return math.nan
    return float(spearmanr(predictions, references)[0])


def glue_compute_metrics(task_name: str, predictions, references) -> dict[str, float]:
    """The GLUE metrics of `task_name` (class ids, or scores for stsb), named as the Hub's `glue` metric names them."""
    task = get_glue_task(task_name)
    functions = {
        "accuracy": accuracy,
        "f1": f1,
        "matthews_correlation": matthews_correlation,
        "pearson": pearson,
        "spearmanr": spearman,
    }
    return {name: functions[name](predictions, references) for name in task.metrics}


def classification_metrics(predictions, references, is_regression: bool = False) -> dict[str, float]:
    """Metrics for data files without a GLUE task: `accuracy` (and `f1` for two classes), or, for regression,
    `pearson`, `spearmanr` and `mse`."""
    if is_regression:
        predictions, references = _arrays(predictions, references)
        return {
            "pearson": pearson(predictions, references),
            "spearmanr": spearman(predictions, references),
            "mse": float(np.mean((predictions - references) ** 2)),
        }
    metrics = {"accuracy": accuracy(predictions, references)}
    if set(np.unique(references).tolist()) <= {0, 1} and set(np.unique(predictions).tolist()) <= {0, 1}:
        metrics["f1"] = f1(predictions, references)
    return metrics



__all__ = [
    "accuracy",
    "classification_metrics",
    "f1",
    "glue_compute_metrics",
    "matthews_correlation",
    "pearson",
    "spearman",
]
