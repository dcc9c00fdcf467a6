"""Group-cross-validated linear probes (paper Section 3 probe (3), Appendix C (i)/(ii)).

A logistic-regression probe (standardized features) is fit on all groups but one fold and scored on the
held-out groups, so a probe cannot succeed by memorizing a scenario's surface (groups = scenarios). A fold
whose training part holds a single class is skipped; with no usable fold the accuracy is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def group_cv_accuracy(x: np.ndarray, y: Sequence[int], groups: Sequence[Any], n_splits: int = 5,
                      c: float = 1.0) -> dict[str, Any]:
    """Held-out accuracy of a logistic probe ``x -> y`` under GroupKFold, with the majority-class baseline
    of the same held-out samples ("chance")."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = np.asarray(y, dtype=int)
    keys = np.asarray([str(g) for g in groups])
    n_groups = len(set(keys.tolist()))
    out: dict[str, Any] = {"acc": None, "chance": None, "n": int(y.size), "n_groups": n_groups, "folds": 0}
    if n_groups < 2 or len(set(y.tolist())) < 2:
        return out
    correct = total = majority = 0
    for train, test in GroupKFold(n_splits=min(n_splits, n_groups)).split(x, y, keys):
        if len(set(y[train].tolist())) < 2:
            continue
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000))
        probe.fit(x[train], y[train])
        correct += int((probe.predict(x[test]) == y[test]).sum())
        majority += int(max((y[test] == v).sum() for v in (0, 1)))
        total += int(test.size)
        out["folds"] += 1
    if total:
        out["acc"], out["chance"] = correct / total, majority / total
    return out


def first_layer_at(accuracies: Sequence[float | None], threshold: float) -> int | None:
    """The earliest layer whose probe accuracy reaches ``threshold`` (None if none does)."""
    for layer, acc in enumerate(accuracies):
        if acc is not None and acc >= threshold:
            return layer
    return None


def group_cv_margins(x: np.ndarray, y: Sequence[int], groups: Sequence[Any], n_splits: int = 5,
                     c: float = 1.0) -> np.ndarray:
    """Out-of-fold signed margins of the probe of :func:`group_cv_accuracy` (same folds): per sample, the
    held-out decision function times +1 (label 1) or -1 (label 0), so > 0 means the held-out probe is right.
    NaN for samples of a skipped fold (or everywhere with under two groups or one class)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = np.asarray(y, dtype=int)
    keys = np.asarray([str(g) for g in groups])
    out = np.full(y.size, np.nan)
    n_groups = len(set(keys.tolist()))
    if n_groups < 2 or len(set(y.tolist())) < 2:
        return out
    for train, test in GroupKFold(n_splits=min(n_splits, n_groups)).split(x, y, keys):
        if len(set(y[train].tolist())) < 2:
            continue
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000))
        probe.fit(x[train], y[train])
        out[test] = probe.decision_function(x[test]) * (2 * y[test] - 1)
    return out


def settle_layer(margins: Sequence[float]) -> int | None:
    """The earliest layer from which every later signed margin is > 0 (the probe is right from there on);
    None when the last layer's margin is not > 0 (or is NaN)."""
    m = np.asarray(margins, dtype=float)
    if m.size == 0 or not m[-1] > 0:
        return None
    layer = m.size - 1
    while layer > 0 and m[layer - 1] > 0:
        layer -= 1
    return layer
