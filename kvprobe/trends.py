"""Trends across model size: kvprobe's own pre-registered predictions about how a measure moves with the number
of parameters, tested on the study's published records (issue: where notes take over).

The paper samples 4-9B models; kvprobe measures the same locality probe on the pretrained sizes it can run
(135M, 0.5B, 1.5B) and asks how two measures move with size, by where the rule sits relative to the field:

- the gate rate: the share of instances whose full-recompute decision moves with the field (oracle flip >= the
  inclusion threshold), over every instance;
- field-only recovery: the share of that move the field's own refreshed cache entries carry, over the gated
  instances (0: the decision reads notes downstream of the field, the paper's locality; 1: it reads the field).

A :class:`Trend` is declared beside its experiment (``Experiment.trends``) before the runs that test it, in a
commit of its own: its direction (rises / falls / flat), the rows it reads and, for "flat", kvprobe's margin.
The test is a linear GEE of the per-instance outcome on log10(parameters), with the prompt-shape cell (format
x distance) as fixed effects, clustered by scenario (the same scenarios run at every size), a bias-reduced
sandwich SE and a t with clusters - 1 df (:func:`kvprobe.stats.inference.gee_trend`). Verdicts:

- ``supported``: the 95% interval of the slope lies wholly on the predicted side of 0 (for "flat": wholly
  inside +-margin per decade of parameters);
- ``contradicted``: the interval lies wholly on the other side (for "flat": wholly outside the margin);
- ``inconclusive``: otherwise;
- ``not measurable`` (with the reason): fewer than two sizes with ``MIN_PER_SIZE`` units each, fewer than
  ``MIN_N`` units or ``MIN_CLUSTERS`` clusters in all.

Three sizes are three points on the x axis: a supported trend says the measure moves with size across these
three models (one family per size step: SmolLM2 135M, then Qwen2.5-Coder 0.5B and 1.5B), not that it follows a
line, and the curve's extension to the paper's sizes is a prediction, stated as one.

Per cell (model x format x rule position x distance) the table gives the gate rate with its exact interval, the
median flip, field-only recovery with its cluster interval and a verdict against kvprobe's margin
(:data:`kvprobe.claims.RECOVERY_MARGIN`): ``near 0`` (interval inside +-margin), ``above 0`` (interval above
+margin), ``inconclusive``, or ``not measurable`` (fewer than ``MIN_N`` gated instances or ``MIN_CLUSTERS``
clusters), and, where the record ranks positions, the in-sample field + top-k share (a description).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvprobe.claims import MIN_CLUSTERS, MIN_N, RECOVERY_MARGIN

Direction = Literal["rises", "falls", "flat"]
Measure = Literal["gate", "field_only"]
MIN_PER_SIZE = 5  # a size enters a trend only with at least this many units (gated instances for field-only)
SIZES_TASK = "sizes"  # the study task of the cross-size locality grid (configs/locality_sizes.yaml)


@dataclass(frozen=True)
class Trend:
    """One pre-registered prediction of how ``measure`` moves with log10(parameters) on the rows ``where``."""

    key: str
    text: str
    measure: Measure
    direction: Direction
    where: tuple[tuple[str, Any], ...] = ()  # (row field, value or tuple of values): the rows the trend reads
    task: str = SIZES_TASK  # the study task whose published records form the curve
    margin: float | None = None  # "flat": kvprobe's equivalence margin on the slope, per decade of parameters

    def __post_init__(self) -> None:
        if (self.direction == "flat") != (self.margin is not None):
            raise ValueError(f"trend {self.key}: a margin goes with direction 'flat', and only with it")


def _matches(row: dict[str, Any], where: Sequence[tuple[str, Any]]) -> bool:
    """Every (field, value) holds; a tuple value means "one of"."""
    return all(row.get(k) in v if isinstance(v, tuple) else row.get(k) == v for k, v in where)


def size_records(records: Sequence[dict[str, Any]], task: str = SIZES_TASK, kinds: Sequence[str] = ("pretrained",)
                 ) -> list[dict[str, Any]]:
    """The published ``locality_distance`` records of ``task`` on models of ``kinds`` (study.yaml), smallest
    model first, each with ``_params_b`` (the registry's size) set."""
    from kvprobe.models.registry import REGISTRY
    from kvprobe.study import load_study

    study = load_study().models
    out = []
    for rec in records:
        name = rec["model"]["name"]
        if rec["experiment"] != "locality_distance" or rec.get("_task") != task:
            continue
        if name not in study or study[name].kind not in kinds:
            continue
        entry = REGISTRY.get(name)
        if entry is None or entry.params_b is None:
            continue
        out.append({**rec, "_params_b": entry.params_b})
    return sorted(out, key=lambda r: (r["_params_b"], r["model"]["name"]))


def trend_units(trend: Trend, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One unit per instance: x = log10(parameters), y, its scenario cluster and its cell (format, distance)."""
    units = []
    for rec in records:
        x = math.log10(rec["_params_b"] * 1e9)
        for row in rec["rows"]:
            if not _matches(row, trend.where):
                continue
            if trend.measure == "gate":
                y = float(bool(row["included"]))
            else:
                if not row["included"] or row.get("field_only") is None or not math.isfinite(row["field_only"]):
                    continue
                y = float(row["field_only"])
            units.append({"model": rec["model"]["name"], "x": x, "y": y, "cluster": str(row.get("scenario")),
                          "cell": f"{row.get('format')}|{row.get('distance_target')}"})
    return units


def evaluate_trend(trend: Trend, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trend's test on the published size records (see the module docstring)."""
    from kvprobe.stats.inference import gee_trend

    units = trend_units(trend, records)
    per_model: dict[str, int] = {}
    for u in units:
        per_model[u["model"]] = per_model.get(u["model"], 0) + 1
    kept_models = {m for m, n in per_model.items() if n >= MIN_PER_SIZE}
    kept = [u for u in units if u["model"] in kept_models]
    row: dict[str, Any] = {"key": trend.key, "text": trend.text, "measure": trend.measure,
                           "direction": trend.direction,
                           "where": {k: list(v) if isinstance(v, tuple) else v for k, v in trend.where}, "margin": trend.margin,
                           "units_per_model": per_model, "sizes_used": sorted(kept_models),
                           "means_per_model": {m: sum(u["y"] for u in units if u["model"] == m) / n
                                               for m, n in per_model.items()}}
    n_clusters = len({u["cluster"] for u in kept})
    reason = None
    if len(kept_models) < 2:
        reason = f"fewer than two sizes with >= {MIN_PER_SIZE} units ({per_model or 'none'})"
    elif len(kept) < MIN_N or n_clusters < MIN_CLUSTERS:
        reason = f"{len(kept)} units in {n_clusters} clusters (needs >= {MIN_N} and >= {MIN_CLUSTERS})"
    if reason:
        return {**row, "verdict": f"not measurable: {reason}"}
    fit = gee_trend([u["y"] for u in kept], [u["x"] for u in kept], [u["cluster"] for u in kept],
                    [u["cell"] for u in kept])
    row.update({"slope_per_decade": fit["slope"], "ci_low": fit["ci_low"], "ci_high": fit["ci_high"],
                "p_two_sided": fit["p_two_sided"], "n": fit["n"], "n_clusters": fit["n_clusters"],
                "test": fit["test"]})
    lo, hi = fit["ci_low"], fit["ci_high"]
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return {**row, "verdict": "not measurable: no variance to fit"}
    if trend.direction == "flat":
        m = float(trend.margin or 0.0)
        verdict = "supported" if -m < lo and hi < m else "contradicted" if lo > m or hi < -m else "inconclusive"
    else:
        up = trend.direction == "rises"
        verdict = ("supported" if (lo > 0 if up else hi < 0) else
                   "contradicted" if (hi < 0 if up else lo > 0) else "inconclusive")
    return {**row, "verdict": verdict}


def declared_trends() -> list[tuple[str, Trend]]:
    """Every experiment's declared trends, as (experiment, trend)."""
    from kvprobe.runner.experiment import available_experiments, get_experiment

    out = []
    for name in sorted(available_experiments()):
        out.extend((name, t) for t in getattr(get_experiment(name), "trends", ()))
    return out


def trend_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every declared trend tested on ``records`` (the study's published ones)."""
    rows = []
    for experiment, trend in declared_trends():
        rows.append({"experiment": experiment, **evaluate_trend(trend, size_records(records, trend.task))})
    return rows


def cell_verdict(stat: dict[str, Any] | None, margin: float = RECOVERY_MARGIN) -> str:
    """A cell's field-only verdict against kvprobe's margin (see the module docstring)."""
    if not stat or not stat.get("n") or stat.get("mean") is None:
        return "not measurable: none gated"
    if stat["n"] < MIN_N or (stat.get("n_clusters") or 0) < MIN_CLUSTERS:
        return f"not measurable: {stat['n']} gated in {stat.get('n_clusters')} clusters"
    lo, hi = stat.get("ci_low"), stat.get("ci_high")
    if lo is None or hi is None:
        return "not measurable: no interval"
    if -margin < lo and hi < margin:
        return "near 0"
    if lo > margin:
        return "above 0"
    return "inconclusive"


def size_cells(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (model, format, rule position, distance) of the size records, smallest model first."""
    out = []
    for rec in records:
        for label, by_d in rec["summary"]["cells"].items():
            fmt, _, rule = label.partition(", rule ")
            for dist, cell in by_d.items():
                out.append({"model": rec["model"]["name"], "params_b": rec["_params_b"], "format": fmt,
                            "rule": rule or "format's own place", "distance": int(dist), "cell": cell,
                            "dtype": str(rec["model"].get("dtype", "")).replace("torch.", "")})
    return out
