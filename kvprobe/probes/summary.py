"""Summaries every field-change record shares: the oracle-flip distribution, the gate, recoveries with CIs.

Recovery means get a cluster-bootstrap CI by scenario (instances of one scenario are not independent);
rates (booleans: oracle accuracy, follow/revert rates) get exact Clopper-Pearson intervals. Every summary
keeps the keys older records have (``mean``, ``ci_low``, ``ci_high``, ``n``) and adds ``n_clusters``,
``ci_method`` and, where there is no interval, ``ci_note``; readers of schema-1 records work unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from kvprobe.schema import Shape
from kvprobe.stats.bootstrap import quantiles, summarize
from kvprobe.stats.inference import summarize_proportion


# -- the typed shapes of these summaries (kvprobe.runner.shapes): experiments' summary and row models build on them

class Stat(Shape):
    """A mean or rate with its interval (:func:`kvprobe.stats.bootstrap.summarize`, ``summarize_proportion``);
    ``mean`` None where no instance holds a value, ``ci_low``/``ci_high`` None where there is no interval."""

    mean: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    n: int = 0
    n_clusters: int | None = None


class Split(Shape):
    """A measure over the gated instances and over all of them (:func:`recovery_summary`)."""

    gated: Stat
    all: Stat

    def over(self, which: str) -> Stat:
        """The ``"gated"`` or ``"all"`` side (:func:`which`)."""
        return self.gated if which == "gated" else self.all


Curve = dict[str, Split]  # per label (k, layer, band): a Split (:func:`kvprobe.probes.common.curve_summary`)


class Gate(Shape):
    min_flip: float
    require_oracle_correct: bool


class GatedSummary(Shape):
    """The fields :func:`gate_summary` gives every field-change summary (records before schema 2 lack the
    accuracy intervals and ``n_scenarios``, which no reader needs)."""

    gate: Gate
    n_instances: int
    n_included: int
    n_excluded: int
    oracle_flip: dict[str, Any]

    @property
    def which(self) -> Literal["gated", "all"]:
        """:func:`which` of this summary."""
        return "gated" if self.n_included else "all"


class CaseRow(Shape):
    """The fields every probe row shares (:func:`kvprobe.probes.case.case_row`) that the claims read."""

    index: int
    scenario: str
    included: bool
    flip: float | None = None


def which(summary: dict[str, Any]) -> str:
    """'gated' when any instance passed the gate, else 'all' (figures and tables say which)."""
    return "gated" if summary.get("n_included") else "all"


MIN_CI_CLUSTERS = 5  # no interval is printed from fewer scenario clusters (kvprobe's rule, as in the claims table)


def ci_cell(stat: dict[str, Any] | BaseModel | None, digits: int = 2, signed: bool = False) -> str:
    """``mean [ci_low, ci_high]`` of a summary (a dict or a :class:`Stat`), ``n/a`` when it holds no instance, and
    the mean with the reason where there is no interval (one instance or one scenario)."""
    if isinstance(stat, BaseModel):
        stat = stat.model_dump()
    if not stat or not stat.get("n") or stat.get("mean") is None:
        return "n/a"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if stat["n"] == 1:  # a bootstrap over one instance is no interval
        return f"{f.format(stat['mean'])} (one instance)"
    if stat.get("n_clusters") is not None and stat["n_clusters"] < MIN_CI_CLUSTERS:  # resamples of 2-4 scenarios
        return f"{f.format(stat['mean'])} ({stat['n_clusters']} clusters: no interval)"
    if stat.get("ci_low") is None or stat.get("ci_high") is None:
        return f"{f.format(stat['mean'])} (no CI: {stat.get('ci_note', 'one cluster')})"
    return f"{f.format(stat['mean'])} [{f.format(stat['ci_low'])}, {f.format(stat['ci_high'])}]"


def headline_stats(summary: dict[str, Any], key: str, labels: dict[str, str], digits: int = 2) -> str:
    """``label mean [lo, hi]; ...`` for entries of ``summary[key]`` (each a gated/all pair), over the gated
    instances when any passed the gate, else over all of them (then the line says so)."""
    w = which(summary)
    if w != "gated" and "n_included" in summary:  # a ratio over sub-threshold flips divides noise: none is printed
        return "none included: no recovery (oracle flips below the gate)"
    cells = [f"{label} {ci_cell(summary[key][k][w], digits)}" for k, label in labels.items() if k in summary[key]]
    return "; ".join(cells) + ("" if w == "gated" else " (all instances: none gated)")


def scenarios(rows: Sequence[dict[str, Any]]) -> list[Any]:
    """The cluster of each row: its scenario (rows without one are their own cluster)."""
    return [r.get("scenario", f"#{r.get('index', i)}") for i, r in enumerate(rows)]


def summarize_column(rows: Sequence[dict[str, Any]], values: Sequence[Any], seed: int = 0) -> dict[str, Any]:
    """A column of ``rows``: a rate with its exact interval when every present value is a bool, else a mean
    with a cluster-bootstrap CI by scenario."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return summarize_proportion(values, scenarios(rows))
    return summarize([None if v is None else float(v) for v in values], seed=seed, clusters=scenarios(rows))


def gate_summary(rows: Sequence[dict[str, Any]], gate: Any) -> dict[str, Any]:
    flips = [r["flip"] for r in rows]
    included = [r for r in rows if r["included"]]
    clusters = scenarios(rows)
    return {
        "gate": {"min_flip": gate.min_flip, "require_oracle_correct": gate.require_oracle_correct},
        "n_instances": len(rows),
        "n_included": len(included),
        "n_excluded": len(rows) - len(included),
        "oracle_flip": quantiles(flips),
        "oracle_accuracy": sum(bool(r["oracle_correct"]) for r in rows) / max(len(rows), 1),
        "stale_accuracy": sum(bool(r["stale_correct"]) for r in rows) / max(len(rows), 1),
        "oracle_accuracy_ci": summarize_proportion([bool(r["oracle_correct"]) for r in rows], clusters),
        "stale_accuracy_ci": summarize_proportion([bool(r["stale_correct"]) for r in rows], clusters),
        "n_scenarios": len(set(map(str, clusters))),
    }


def recovery_summary(rows: Sequence[dict[str, Any]], keys: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Per key: mean recovery with a cluster-bootstrap CI by scenario (a rate with its exact interval for
    boolean columns), over gated instances, and over all instances for contrast."""
    gated = [r for r in rows if r["included"]]
    out: dict[str, Any] = {}
    for key in keys:
        out[key] = {"gated": summarize_column(gated, [r.get(key) for r in gated], seed),
                    "all": summarize_column(rows, [r.get(key) for r in rows], seed)}
    return out


def format_recovery_table(summary: dict[str, Any], keys: Sequence[str]) -> str:
    g = summary["gate"]
    lines = [f"instances {summary['n_instances']}, included {summary['n_included']} "
             f"(inclusion rule: oracle flip >= {g['min_flip']} nats); oracle flip median "
             f"{summary['oracle_flip'].get('median', float('nan')):.3f} nats",
             f"{'state':<18}{'recovery, included':<36}{'recovery, all':<36}"]
    if not summary["n_included"]:  # every flip is below the threshold: a recovery is a ratio of noise
        return "\n".join(lines[:1] + [f"recoveries not shown: no instance passed the inclusion rule, so each would be "
                                      "a ratio over a flip of noise (the record keeps them)"])
    for key in keys:
        r = summary["recovery"][key]

        def cell(s: dict[str, Any]) -> str:
            if s["n"] == 0 or s["mean"] is None:
                return "n/a"
            if s.get("ci_low") is None:
                return f"{s['mean']:+.3f} (no CI) n={s['n']}"
            return f"{s['mean']:+.3f} [{s['ci_low']:+.3f}, {s['ci_high']:+.3f}] n={s['n']}"

        lines.append(f"{key:<18}{cell(r['gated']):<36}{cell(r['all']):<36}")
    return "\n".join(lines)


def table_markdown(rows: Sequence[Sequence[str]], columns: Sequence[str]) -> str:
    """A markdown table (a ``|`` inside a cell becomes ``/``), for the report and the blocks beside the records."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)
