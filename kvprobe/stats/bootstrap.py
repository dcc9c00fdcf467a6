"""Percentile bootstrap CIs (plain and cluster), seeded so a record's CIs are reproducible.

Instances of one scenario share a rule, a field and a template, so they are not independent: the default
CI of a recovery mean resamples whole scenarios (:func:`cluster_bootstrap_ci`; scipy's ``bootstrap`` has no
cluster option, so this one resampling loop is ours). With fewer than two clusters a percentile bootstrap
has nothing to resample and gives no interval: the summary then says so (``ci_low = ci_high = None`` and
``ci_note``) instead of printing a zero-width CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def bootstrap_ci(values: Sequence[float], n_boot: int = 10_000, level: float = 0.95, seed: int = 0,
                 stat=np.mean) -> tuple[float, float, float]:
    """(statistic, low, high) of ``stat`` over ``values``, NaNs dropped; NaNs everywhere if nothing is left."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    if x.size == 1:
        return float(stat(x)), float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    boots = stat(x[idx], axis=1)
    alpha = (1 - level) / 2
    return float(stat(x)), float(np.quantile(boots, alpha)), float(np.quantile(boots, 1 - alpha))


def _finite_pairs(values: Sequence[float | None], clusters: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Values and their cluster keys, with missing (None/NaN) values dropped from both."""
    keep = [(float(v), str(c)) for v, c in zip(values, clusters, strict=True)
            if v is not None and np.isfinite(float(v))]
    return (np.asarray([v for v, _ in keep], dtype=float), np.asarray([c for _, c in keep], dtype=object))


def cluster_bootstrap_ci(values: Sequence[float], clusters: Sequence[Any], n_boot: int = 10_000,
                         level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Mean with a CI that resamples whole clusters (e.g. scenarios or personas), not single instances.

    Each resample draws as many clusters as there are, with replacement, and takes the instance-weighted
    mean of the drawn clusters (the same estimator as the point mean)."""
    vals, keys = _finite_pairs(values, clusters)
    if vals.size == 0:
        return float("nan"), float("nan"), float("nan")
    groups = [vals[keys == k] for k in np.unique(keys)]
    sums = np.array([g.sum() for g in groups])
    counts = np.array([g.size for g in groups])
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(groups), size=(n_boot, len(groups)))
    boots = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    alpha = (1 - level) / 2
    return float(vals.mean()), float(np.quantile(boots, alpha)), float(np.quantile(boots, 1 - alpha))


def summarize(values: Sequence[float | None], seed: int = 0, n_boot: int = 10_000,
              clusters: Sequence[Any] | None = None) -> dict[str, Any]:
    """{mean, ci_low, ci_high, n, n_clusters, ci_method[, ci_note]} for a record's summary block.

    With ``clusters`` (one key per value, e.g. the scenario) the CI is a cluster bootstrap; without, each
    value is its own cluster (a plain percentile bootstrap). Fewer than two clusters: no interval."""
    keys = list(range(len(values))) if clusters is None else list(clusters)
    vals, groups = _finite_pairs(values, keys)
    n, n_clusters = int(vals.size), int(len(set(groups.tolist())))
    method = "cluster bootstrap (percentile, by scenario)" if clusters is not None else "bootstrap (percentile)"
    out: dict[str, Any] = {"mean": float(vals.mean()) if n else None, "ci_low": None, "ci_high": None, "n": n,
                           "n_clusters": n_clusters, "ci_method": method}
    if n_clusters < 2:
        out["ci_note"] = "no instance" if n == 0 else \
            f"{'one instance' if n == 1 else 'one cluster'}: a bootstrap over one cluster is no interval"
        return out
    _, lo, hi = cluster_bootstrap_ci(vals, groups, n_boot=n_boot, seed=seed)
    out.update(ci_low=lo, ci_high=hi)
    return out


def quantiles(values: Sequence[float]) -> dict[str, float]:
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    if x.size == 0:
        return {}
    q = np.quantile(x, [0.0, 0.25, 0.5, 0.75, 1.0])
    return {"min": float(q[0]), "q25": float(q[1]), "median": float(q[2]), "q75": float(q[3]), "max": float(q[4])}


def cluster_means(values: Sequence[float | None], clusters: Sequence[Any]) -> tuple[list[str], list[float]]:
    """(cluster keys, mean value per cluster), keys sorted, missing values dropped: the unit of a test when
    instances share scenarios (a t, TOST or sign test on these is a test at the level of independence)."""
    vals, keys = _finite_pairs(values, clusters)
    order = sorted(set(keys.tolist()))
    return order, [float(vals[keys == k].mean()) for k in order]
