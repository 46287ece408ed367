"""Classification metrics: accuracy, balanced accuracy, AUROC, per-class sensitivity/specificity."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

__all__ = ["classification_metrics"]


def classification_metrics(
    probs: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    label_names: list[str] | None = None,
) -> dict[str, Any]:
    """Metrics of predicted class probabilities against integer labels.

    Args:
        probs: ``[N, K]`` class probabilities (rows sum to 1).
        labels: ``[N]`` integer labels in ``[0, K)``.
        label_names: optional class names for the per-class entries.

    Returns:
        ``accuracy``, ``balanced_accuracy``, ``auroc`` (binary: of class 1; multi-class:
        one-vs-rest macro average; ``nan`` when a split has a single class), ``per_class``
        (sensitivity = recall, specificity) and ``confusion_matrix`` (rows: true class).
    """
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    k = p.shape[1]
    pred = p.argmax(1)
    cm = np.zeros((k, k), dtype=np.int64)
    np.add.at(cm, (y, pred), 1)
    names = label_names or [str(i) for i in range(k)]
    per_class: dict[str, dict[str, float]] = {}
    recalls = []
    for c in range(k):
        tp = cm[c, c]
        fn = cm[c].sum() - tp
        fp = cm[:, c].sum() - tp
        tn = cm.sum() - tp - fn - fp
        sens = tp / (tp + fn) if tp + fn else float("nan")
        spec = tn / (tn + fp) if tn + fp else float("nan")
        per_class[names[c]] = {
            "sensitivity": float(sens),
            "specificity": float(spec),
            "support": int(tp + fn),
        }
        if tp + fn:
            recalls.append(sens)
    present = np.unique(y)
    auroc = float("nan")
    if len(present) > 1:
        if k == 2:
            auroc = float(roc_auc_score(y, p[:, 1]))
        elif len(present) == k:
            auroc = float(roc_auc_score(y, p, multi_class="ovr", average="macro"))
    return {
        "n": int(len(y)),
        "accuracy": float((pred == y).mean()) if len(y) else float("nan"),
        "balanced_accuracy": float(np.mean(recalls)) if recalls else float("nan"),
        "auroc": auroc,
        "per_class": per_class,
        "confusion_matrix": cm.tolist(),
    }
