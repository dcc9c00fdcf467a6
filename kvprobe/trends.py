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

from kvprobe.claims import MIN_CLUSTERS, MIN_N, RECOVERY_MARGIN, stable

Direction = Literal["rises", "falls", "flat"]
Measure = Literal["gate", "field_only"]
MIN_PER_SIZE = 5  # a size enters a trend only with at least this many units (gated instances for field-only)
DTYPE_CHECK_TASK = "dtype_check"  # the study task of a reduced-precision run's full-precision check
SIZES_TASK = "sizes"  # the study task of the cross-size locality grid (configs/locality_sizes.yaml); "sizes_*" too


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


def matches(row: dict[str, Any], where: Sequence[tuple[str, Any]]) -> bool:
    """Every (field, value) holds; a tuple value means "one of"."""
    return all(row.get(k) in v if isinstance(v, tuple) else row.get(k) == v for k, v in where)


def in_size_grid(experiment: str, task: str) -> bool:
    """Whether a run belongs to the cross-size grid (its parts ``sizes_*`` and the dtype check): these have their own
    table (the ``locality_sizes`` block) and stay out of the section tables."""
    return experiment == "locality_distance" and (task == SIZES_TASK or task.startswith(SIZES_TASK + "_")
                                                  or task == DTYPE_CHECK_TASK)


def size_records(records: Sequence[dict[str, Any]], task: str = SIZES_TASK, kinds: Sequence[str] = ("pretrained",)
                 ) -> list[dict[str, Any]]:
    """The published ``locality_distance`` records of ``task`` (or ``task_...``: a model's grid run in parts) on models
    of ``kinds`` (study.yaml), smallest model first, each with ``_params_b`` set: the registry's size (the model card's), else the parameters the
    record counted (an organism: its base plus the adapter)."""
    from kvprobe.models.registry import REGISTRY
    from kvprobe.study import load_study, study_present

    if not study_present():  # an installed kvprobe or a scratch folder: no study, so no model kinds and no curve
        return []
    study = load_study().models
    out = []
    for rec in records:
        name = rec["model"]["name"]
        run_task = rec.get("_task") or ""
        if rec["experiment"] != "locality_distance" or not (run_task == task or run_task.startswith(task + "_")):
            continue
        if name not in study or study[name].kind not in kinds:
            continue
        entry = REGISTRY.get(name)
        size = entry.params_b if entry is not None and entry.params_b else (rec["model"].get("n_params") or 0) / 1e9
        if size:
            out.append({**rec, "_params_b": size})
    return sorted(out, key=lambda r: (r["_params_b"], r["model"]["name"]))


def trend_units(trend: Trend, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One unit per instance: x = log10(parameters), y, its scenario cluster and its cell (format, distance)."""
    units = []
    for rec in records:
        x = math.log10(rec["_params_b"] * 1e9)
        for row in rec["rows"]:
            if not matches(row, trend.where):
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
        have = ", ".join(f"{m} {k}" for m, k in per_model.items()) or "none"
        reason = f"fewer than two sizes with >= {MIN_PER_SIZE} units ({have})"
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


CELL_COLUMNS = ("model", "params", "dtype", "prompt shape", "rule", "distance (measured)", "gated / all [95% exact CI]",
                "flip median (nats)", "field-only recovery, gated [95% cluster CI]", "verdict (kvprobe margin 0.1)",
                "field + top-8 downstream, gated (in-sample)")


def sizes_markdown(records: Sequence[dict[str, Any]]) -> str:
    """The cross-size grid, one row per cell, pretrained sizes then the organisms (RESULTS.md's
    ``<!-- kvprobe:locality_sizes -->`` block)."""
    from kvprobe.probes.summary import ci_cell
    from kvprobe.probes.summary import table_markdown as markdown_table

    rows = []
    for kinds in (("pretrained",), ("organism",)):
        for c in size_cells(size_records(records, kinds=kinds)):
            cell = c["cell"]
            gate = cell.get("inclusion_ci") or {}
            flip = cell["oracle_flip"].get("median")
            fo = cell["recovery"]["field_only"]["gated"]
            top = (cell.get("field_top_k") or {}).get("gated")
            gate_ci = (f" [{gate['ci_low']:.2f}, {gate['ci_high']:.2f}]" if gate.get("ci_low") is not None else "")
            rows.append([c["model"], f"{c['params_b']:g} B", c["dtype"], c["format"], c["rule"],
                         f"{c['distance']} ({cell['distance_tokens_mean']:.0f})",
                         f"{cell['n_included']}/{cell['n']}{gate_ci}", "n/a" if flip is None else f"{flip:.2f}",
                         ci_cell(fo), cell_verdict(fo), ci_cell(top) if top else "-"])
    return markdown_table(rows, CELL_COLUMNS) if rows else "(no cross-size locality record published yet)"


TREND_COLUMNS = ("trend (kvprobe's pre-registered prediction)", "measure", "units per model", "slope per decade of "
                 "parameters [95% CI]", "p (two-sided)", "verdict")


def trends_markdown(rows: Sequence[dict[str, Any]], short: bool = False) -> str:
    """The trend rows of ``claims.json`` as a table (the ``<!-- kvprobe:size_trends -->`` block; ``short``: the
    trend's name, slope and verdict only, for RESULTS.md, the full table on the locality_sizes page)."""
    from kvprobe.probes.summary import table_markdown as markdown_table

    out = []
    for r in rows:
        slope = r.get("slope_per_decade")
        cell = "-" if slope is None else f"{slope:+.2f} [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]"
        if short:
            out.append([f"`{r['key']}`", cell, r["verdict"]])
            continue
        p = r.get("p_two_sided")
        measure = {"gate": "gate rate (all instances)", "field_only": "field-only recovery (gated)"}[r["measure"]]
        units = ", ".join(f"{m} {n}" for m, n in r.get("units_per_model", {}).items()) or "none"
        out.append([f"`{r['key']}`: {r['text']}", measure, units, cell, "-" if p is None else f"{p:.2g}",
                    r["verdict"]])
    if not out:
        return "(no trend declared)"
    return markdown_table(out, (TREND_COLUMNS[0], TREND_COLUMNS[3], TREND_COLUMNS[5]) if short else TREND_COLUMNS)


def dtype_check_markdown(records: Sequence[dict[str, Any]], model: str, run_task: str = SIZES_TASK,
                         check_task: str = DTYPE_CHECK_TASK) -> str:
    """The same instances in two dtypes (a reduced-precision run and its full-precision check, matched by instance
    index): per instance the oracle flip and field-only recovery in each, and the largest differences
    (RESULTS' ``<!-- kvprobe:dtype_check MODEL -->`` block)."""
    from kvprobe.probes.summary import table_markdown as markdown_table

    def find(task: str) -> dict[str, Any] | None:
        return next((r for r in records if r["model"]["name"] == model and r.get("_task") == task
                     and r["experiment"] == "locality_distance"), None)

    run, check = find(run_task), find(check_task)
    if run is None or check is None:
        return f"(no {run_task} / {check_task} pair of records for {model} yet)"
    by_index = {r["index"]: r for r in run["rows"]}
    out, d_flip, d_fo = [], [], []
    for c in check["rows"]:
        r = by_index.get(c["index"])
        if r is None or r.get("scenario") != c.get("scenario"):
            continue
        d_flip.append(abs(r["flip"] - c["flip"]))
        fo = "-"
        if r["included"] and c["included"]:
            d_fo.append(abs(r["field_only"] - c["field_only"]))
            fo = f"{c['field_only']:.3f} / {r['field_only']:.3f}"
        out.append([str(c["index"]), str(c.get("scenario")), f"{c['flip']:.2f} / {r['flip']:.2f}",
                    f"{c['included']} / {r['included']}", fo])
    dt = (str(check["model"].get("dtype", "")).replace("torch.", ""), str(run["model"].get("dtype", "")).replace("torch.", ""))
    head = (f"{len(out)} instances, {dt[0]} / {dt[1]}: largest flip difference "
            f"{max(d_flip, default=float('nan')):.3f} nats, largest field-only difference "
            f"{max(d_fo, default=float('nan')):.3f}")
    cols = ("instance", "scenario", f"oracle flip, {dt[0]} / {dt[1]} (nats)", "gated", f"field-only, {dt[0]} / {dt[1]}")
    return head + "\n\n" + markdown_table(out, cols)


def with_trends(doc: dict[str, Any], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The claims file with kvprobe's pre-registered trends across model size tested on the same records, under
    ``trends`` (kvprobe's own predictions, apart from the paper's claims)."""
    trends = trend_rows(records)
    return {**doc, "trends": stable(trends)} if trends else doc
