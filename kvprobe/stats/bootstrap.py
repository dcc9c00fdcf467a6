"""Percentile bootstrap CIs (plain and cluster), seeded so a record's CIs are reproducible."""

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


def cluster_bootstrap_ci(values: Sequence[float], clusters: Sequence[Any], n_boot: int = 10_000,
                         level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Mean with a CI that resamples whole clusters (e.g. scenarios or personas), not single instances."""
    vals = np.asarray(values, dtype=float)
    keys = np.asarray([str(c) for c in clusters])
    ok = np.isfinite(vals)
    vals, keys = vals[ok], keys[ok]
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


def summarize(values: Sequence[float], seed: int = 0, n_boot: int = 10_000) -> dict[str, float]:
    """{mean, ci_low, ci_high, n} for a record's summary block."""
    mean, lo, hi = bootstrap_ci(values, n_boot=n_boot, seed=seed)
    n = int(sum(1 for v in values if v is not None and np.isfinite(v)))
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "n": n}


def quantiles(values: Sequence[float]) -> dict[str, float]:
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    if x.size == 0:
        return {}
    q = np.quantile(x, [0.0, 0.25, 0.5, 0.75, 1.0])
    return {"min": float(q[0]), "q25": float(q[1]), "median": float(q[2]), "q75": float(q[3]), "max": float(q[4])}
