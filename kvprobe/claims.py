"""The claims table: one row per paper claim x model, tested from records only (paper Appendix G's
confirmatory protocol: cluster-bootstrap CIs, TOST equivalence, McNemar, BH-FDR; statsmodels/scipy through
:mod:`kvprobe.stats.inference`).

Each experiment declares its claims next to its ``paper=`` text (``Experiment.claims``), so a new experiment
adds its own rows. A claim is recomputed from the per-instance rows a record holds, so records of every
schema version take part. Kinds:

- ``equivalent``: paired TOST that ``a - b`` (``b`` a row field or a constant, default 0) lies within the
  stated bounds ("~0", "~1", "within the paper's range");
- ``greater``: ``a > b`` on the same instances: exact McNemar for booleans, a one-sided paired t otherwise;
- ``at_least`` / ``agrees``: an exact one-sided binomial test that a rate (``a``; or the rate at which ``a``
  and ``b`` decide alike) exceeds a bound;
- ``identity``: holds by construction (e.g. full-downstream = oracle in locality); shown with our value,
  never tested, and kept out of the BH correction.

Verdicts, on BH q-values across all tested claims (alpha 0.05): ``reproduced`` (q < alpha, in the paper's
direction); ``not reproduced`` (significant the other way, our CI wholly outside the equivalence bounds, or
no effect although n reaches the n needed for 80% power, and at least ``MIN_POWERED_N`` = 10); ``not measurable`` (the inclusion filter left no
instance, no variance to test, or underpowered: n below the n needed). The n needed is for the paper's
effect given our variance (``n_paired_t``; TOST approximated by the one-sided t at the nearer bound), for
paired booleans the exact McNemar power (``n_mcnemar``: the paper's difference in rates plus our wrong-way
discordance), for rates the exact binomial (``n_binom_bound``).

Where our setting differs: the paper states margins only for accuracy (TOST delta 0.03, App. H) and cosine; for
recovery we use +-0.1 (a tenth of the oracle flip), stated in each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvprobe.stats.bootstrap import summarize
from kvprobe.stats.inference import (ALPHA, bh_fdr, binom_at_least, mcnemar_exact, n_binom_bound, n_mcnemar,
                                     n_paired_t,
                                     summarize_proportion, tost_paired)

RECOVERY_MARGIN = 0.1
# A null result counts as "not reproduced" only from this many instances on: below it, the n needed for 80% power
# is computed from a variance that a handful of instances cannot estimate (3 instances can report "3 needed").
MIN_POWERED_N = 10
ACCURACY_MARGIN = 0.03  # the paper's TOST margin for accuracy/agreement (Appendix H)
Kind = Literal["equivalent", "greater", "at_least", "agrees", "identity"]


@dataclass(frozen=True)
class Claim:
    """One testable statement of the paper about one experiment's rows (see the module docstring)."""

    key: str
    text: str
    paper: str  # the paper's number(s), as stated
    kind: Kind
    a: str  # dotted path into a row, e.g. "field_only", "cumulative.8", "methods.erratum.correct"
    b: str | float | None = None
    paper_value: float | None = None  # the paper's value of the tested quantity (a - b, or the rate)
    bounds: tuple[float, float] | None = None  # equivalence bounds on a - b
    bound: float | None = None  # rate bound of at_least / agrees
    template: str = "gated"  # task template stem the claim applies to
    gated: bool = True  # over instances that passed the inclusion gate (else all instances)


def near(key: str, text: str, paper: str, a: str, target: float, paper_value: float, margin: float =
         RECOVERY_MARGIN, template: str = "gated", paper_range: tuple[float, float] | None = None,
         gated: bool = True) -> Claim:
    """``a`` ~ ``target`` (or within the paper's range), +- ``margin``: a paired TOST against the constant."""
    lo, hi = paper_range or (target, target)
    return Claim(key, text, paper, "equivalent", a, None, paper_value, (lo - margin, hi + margin), None, template,
                 gated)


def get(row: dict[str, Any], path: str) -> Any:
    """``row['methods']['erratum']['correct']`` for ``"methods.erratum.correct"`` (None where absent).

    A ``*`` step averages the rest of the path over a list (``"turns.*.cosine"``: the instance's mean cosine over
    its turns; booleans average to a rate), so the claim's unit stays the instance, not the turn."""
    cur: Any = row
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part == "*":
            if not isinstance(cur, list):
                return None
            rest = ".".join(parts[i + 1:])
            vals = [float(v) for v in (get(x, rest) if rest else x for x in cur) if v is not None]
            return sum(vals) / len(vals) if vals else None
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _flag(v: Any) -> bool | None:
    """A binary outcome as stored: a bool, or a float 0/1 (e.g. decision agreement)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if float(v) in (0.0, 1.0):
        return bool(float(v))
    raise ValueError(f"{v!r} is not a binary outcome")


def _clusters(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [str(r.get("scenario", f"#{r.get('index', i)}")) for i, r in enumerate(rows)]


def _ours(stat: dict[str, Any]) -> dict[str, Any]:
    keep = ("mean", "ci_low", "ci_high", "ci_method", "n", "n_clusters", "ci_note", "k")
    return {k: stat[k] for k in keep if k in stat}


def claim_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's rows, each with the per-instance measures its summary computed after every row existed
    (``summary.row_measures``: ``{name: {"rows": {index: {...}}}}``, e.g. a direction fit on the training
    families and read on one held-out pair) under ``row[name]``."""
    measures = (record.get("summary") or {}).get("row_measures") or {}
    if not measures:
        return list(record.get("rows", []))
    out = []
    for r in record.get("rows", []):
        extra = {name: m["rows"][str(r.get("index"))] for name, m in measures.items()
                 if str(r.get("index")) in m.get("rows", {})}
        out.append({**r, **extra} if extra else r)
    return out


def evaluate(claim: Claim, record: dict[str, Any]) -> dict[str, Any]:
    """The claim on one record's rows (with their summary-computed measures, :func:`claim_rows`): ours with
    CI, the test and its p, the n needed (no verdict yet: that waits for the BH q across all claims,
    :func:`claims_rows`)."""
    rows = claim_rows(record)
    used = [r for r in rows if r.get("included")] if claim.gated else list(rows)
    out: dict[str, Any] = {"claim": claim.text, "key": claim.key, "kind": claim.kind, "paper": claim.paper,
                           "paper_value": claim.paper_value, "bounds": claim.bounds, "bound": claim.bound,
                           "over": "gated" if claim.gated else "all", "n_rows": len(rows), "p": None,
                           "n": 0, "n_needed": None, "test": None, "ours": {}, "notes": [],
                           "paper_point": claim.paper_value}
    b_path = claim.b if isinstance(claim.b, str) else None
    passed = len(used)
    used = [r for r in used if get(r, claim.a) is not None and (b_path is None or get(r, b_path) is not None)]
    out["n"] = len(used)
    if not used:
        out["status"] = "empty"
        # A record older than the measure (e.g. before summaries carried row_measures) is not an empty filter.
        out["notes"].append("inclusion filter empty" if claim.gated and rows and not passed
                            else "no rows carry this measure (record predates it?)")
        return out
    clusters = _clusters(used)
    a = [get(r, claim.a) for r in used]
    b = [get(r, b_path) for r in used] if b_path else [float(claim.b or 0.0)] * len(used)

    if claim.kind == "identity":
        vals = [float(v) for v in a]
        out["ours"] = _ours(summarize(vals, clusters=clusters))
        out["test"] = "identity (holds by construction: not tested)"
        out["max_abs_deviation"] = float(np.max(np.abs(np.asarray(vals) - (claim.paper_value or 0.0))))
        out["status"] = "identity"
        return out

    if claim.kind in ("at_least", "agrees"):
        flags = [_flag(v) for v in a] if claim.kind == "at_least" else \
            [_flag(u) == _flag(v) for u, v in zip(a, b)]
        k, n = sum(flags), len(flags)
        out["ours"] = _ours(summarize_proportion(flags, clusters))
        test = binom_at_least(k, n, claim.bound)
        out.update(test=test["test"], p=test["p"])
        if claim.kind == "agrees":
            mc = mcnemar_exact([_flag(v) for v in a], [_flag(v) for v in b])
            out["mcnemar_p"] = mc["p"]
            out["notes"].append(f"McNemar (exact) P(correct) {claim.a} vs {claim.b}: p={mc['p']:.3g}")
        out["n_needed"] = n_binom_bound(claim.paper_value, claim.bound) if claim.paper_value is not None else None
        out["status"] = "tested"
        return out

    diffs = [float(u) - float(v) for u, v in zip(
        [float(_flag(x)) if isinstance(x, bool) else x for x in a],
        [float(_flag(x)) if isinstance(x, bool) else x for x in b])]
    # ours: the paired difference, or the measure itself when it is compared with a constant
    shown = diffs if b_path else [float(_flag(x)) if isinstance(x, bool) else float(x) for x in a]
    out["ours"] = _ours(summarize(shown, clusters=clusters))
    out["mean_diff"] = float(np.mean(diffs))
    if not b_path and claim.paper_value is not None and claim.kind == "greater":
        out["paper_point"] = float(claim.b or 0.0) + claim.paper_value  # on the scale of ours (the measure)
    sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else float("nan")
    out["sd"] = sd if np.isfinite(sd) else None
    if claim.kind == "equivalent":
        low, upp = claim.bounds
        test = tost_paired([float(x) for x in a], b, low, upp)
        out.update(test=test["test"], p=test["p"])
        if test.get("note"):
            out["notes"].append(test["note"])
        center = claim.paper_value if claim.paper_value is not None else (low + upp) / 2
        out["n_needed"] = n_paired_t(min(center - low, upp - center), sd)
    else:  # greater
        if all(isinstance(x, bool) for x in a) and (b_path is None or all(isinstance(x, bool) for x in b)):
            if b_path is None:
                raise ValueError(f"claim {claim.key}: a rate against a constant is an at_least claim")
            test = mcnemar_exact(a, b)
            out.update(test="McNemar (exact, two-sided)", p=test["p"], discordant=[test["a_only"], test["b_only"]])
            if claim.paper_value is not None:  # the paper's effect plus our wrong-way discordance (kept feasible)
                b_only = min(test["b_only"] / len(a), (1 - claim.paper_value) / 2)
                out["n_needed"] = n_mcnemar(b_only + claim.paper_value, b_only)
                out["status"] = "tested"
                return out
        else:
            from scipy.stats import ttest_1samp

            p = float(ttest_1samp(diffs, 0.0, alternative="greater").pvalue) if sd and np.isfinite(sd) else None
            out.update(test="paired t (one-sided, a > b)", p=p)
            if p is None:
                out["notes"].append("no variance: t undefined")
        effect = claim.paper_value
        if effect is None:
            effect = float(np.mean(diffs))
            out["notes"].append("the paper gives no number: power for our observed effect")
        out["n_needed"] = n_paired_t(effect, sd)
    out["status"] = "tested"
    return out


def verdict(row: dict[str, Any], alpha: float = ALPHA) -> str:
    """reproduced / not reproduced / not measurable (with the reason), from the row's q and n."""
    status, q, n, need = row.get("status"), row.get("q"), row["n"], row.get("n_needed")
    if status == "identity":
        return "identity (by construction)"
    if status == "empty":
        return "not measurable (" + (row["notes"][0] if row["notes"] else "no instance") + ")"
    ours = row["ours"]
    lo, hi = ours.get("ci_low"), ours.get("ci_high")
    kind = row["kind"]
    if q is not None and q < alpha:
        if kind == "greater" and row.get("mean_diff", 0.0) <= 0:
            return "not reproduced (significant, opposite direction)"
        return "reproduced"
    if kind == "equivalent" and lo is not None and (lo > row["bounds"][1] or hi < row["bounds"][0]):
        return "not reproduced (CI outside the bounds)"
    if kind in ("at_least", "agrees") and hi is not None and hi < row["bound"]:
        return "not reproduced (CI below the bound)"
    if q is None:
        return "not measurable (" + (row["notes"][0] if row["notes"] else "no test") + ")"
    if need is not None and n >= max(need, MIN_POWERED_N):
        return f"not reproduced (n {n} >= {need} needed)"
    floor = "?" if need is None else max(need, MIN_POWERED_N)
    return f"not measurable (underpowered: n {n} < {floor} needed)"


def _template_stem(record: dict[str, Any]) -> str:
    from kvprobe.runner.records import task_stem

    return task_stem(record)


def latest(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Newest record per (experiment, task template, model); records come oldest first."""
    newest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rec in sorted(records, key=lambda r: r.get("created", "")):
        newest[(rec["experiment"], _template_stem(rec), rec["model"]["name"])] = rec
    return [newest[k] for k in sorted(newest)]


def claims_rows(records: Sequence[dict[str, Any]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Every declared claim on the newest record of each (experiment, template, model), with BH q-values
    across all tested claims and a verdict."""
    from kvprobe.runner.experiment import available_experiments, get_experiment

    known = available_experiments()
    out = []
    for rec in latest(records):
        if rec["experiment"] not in known:
            continue
        stem = _template_stem(rec)
        # Generated instances are gated-decision pairs too (kvprobe.tasks.generator): the gated claims apply,
        # and the row keeps the generated task's name so the table tells the two apart.
        task = "gated" if stem.startswith("generated_") else stem
        for claim in get_experiment(rec["experiment"]).claims:
            if claim.template != task:
                continue
            row = {"experiment": rec["experiment"], "template": stem, "model": rec["model"]["name"],
                   **evaluate(claim, rec), "record": rec.get("_path"),
                   "schema_version": rec.get("schema_version")}
            out.append(row)
    qs = bh_fdr([r["p"] if r.get("status") == "tested" else None for r in out], alpha)
    for row, q in zip(out, qs):
        row["q"] = q
        row["verdict"] = verdict(row, alpha)
    return out


def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if abs(v) < 1e-3 and v != 0 else f"{v:.{digits}f}"


def ours_cell(row: dict[str, Any]) -> str:
    o = row["ours"]
    if o.get("mean") is None:
        return "n/a"
    rate = "k" in o
    cell = f"{o['mean']:.2f}" if rate else f"{o['mean']:+.3f}"
    if o.get("ci_low") is not None:
        cell += f" [{o['ci_low']:.2f}, {o['ci_high']:.2f}]" if rate else f" [{o['ci_low']:+.3f}, {o['ci_high']:+.3f}]"
    else:
        cell += " (no CI)"
    return cell + (f" ({o['k']}/{o['n']})" if rate else f" n={o['n']}")


COLUMNS = ("claim", "model", "paper", "ours [95% CI]", "test", "p", "BH q", "verdict", "n / n for 80% power")


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        claim = r["claim"] + ("" if r["template"] == "gated" else f" ({r['template']})")
        cells = [claim, r["model"], r["paper"], ours_cell(r), r["test"] or "-", _num(r.get("p")), _num(r.get("q")),
                 r["verdict"], f"{r['n']} / {r['n_needed'] if r.get('n_needed') is not None else '-'}"]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def load_claims(results_dir: str | Path = "results") -> list[dict[str, Any]]:
    from kvprobe.runner.records import load_records

    return claims_rows(load_records(results_dir))


def write_claims(results_dir: str | Path = "results", out: str | Path | None = None
                 ) -> tuple[Path, list[dict[str, Any]]]:
    """Evaluate every claim and write them to ``<results>/claims.json`` (a pure function of the records)."""
    from kvprobe.runner.records import atomic_write_json

    rows = load_claims(results_dir)
    path = Path(out) if out else Path(results_dir) / "claims.json"
    atomic_write_json(path, {"alpha": ALPHA, "correction": "Benjamini-Hochberg (fdr_bh) across tested claims",
                             "claims": rows})
    return path, rows


def claims_markdown(results_dir: str | Path = "results") -> str:
    """The claims table for RESULTS.md (``make report``)."""
    rows = load_claims(results_dir)
    return markdown(rows) if rows else "(no records with declared claims)"


def summary_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        head = r["verdict"].split(" (")[0]
        counts[head] = counts.get(head, 0) + 1
    return counts



def _cmd_claims(args: Any) -> int:
    from kvprobe.errors import KVProbeError

    path, rows = write_claims(args.results, args.out)
    if not rows:
        raise KVProbeError(f"no records with declared claims under {args.results}/ (run an experiment first)")
    print(markdown(rows))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in summary_counts(rows).items()))
    print(f"claims: {path}")
    if args.figure:
        from kvprobe.figures import claims as claims_figure  # noqa: F401  (sets the Agg backend first)
        from kvprobe.runner.records import load_records

        figure = Path(args.figure)
        figure.parent.mkdir(parents=True, exist_ok=True)
        claims_figure.fig_claims(load_records(args.results), figure)
        print(f"figure: {figure}")
    return 0


def register(sub: Any) -> None:
    """The ``kvprobe claims`` sub-command (registered from kvprobe.runner.extra_commands)."""
    p = sub.add_parser("claims", help="test every declared paper claim on the newest records; write the table")
    p.add_argument("--results", default="results")
    p.add_argument("--out", help="where the claims JSON goes (default: <results>/claims.json)")
    p.add_argument("--figure", default="figures/claims_forest.png", help="forest plot path ('' for none)")
    p.set_defaults(func=_cmd_claims)
