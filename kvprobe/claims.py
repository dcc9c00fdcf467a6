"""The claims table: one row per paper claim x model, tested from records only (paper Appendix H's
confirmatory protocol: cluster-level tests, TOST equivalence, McNemar, BH-FDR; statsmodels/scipy through
:mod:`kvprobe.stats.inference`).

Each experiment declares its claims next to its ``paper=`` text (``Experiment.claims``), so a new experiment
adds its own rows. Every claim names its ``role`` (``"effect"``: one of the paper's effects; ``"control"``: a
control, sanity check or identity), the paper's ``location`` and, for an effect, the paper's ``paper_n``. A
claim is recomputed from the per-instance rows a record holds (with ``summary.row_measures``), so records of
every schema version take part. Kinds:

- ``equivalent``: TOST that ``a - b`` (``b`` a row field or a constant, default 0) lies within the stated
  bounds ("~0", "~1", "within the paper's range");
- ``greater``: ``a > b`` on the same instances: McNemar for booleans, a one-sided paired t otherwise;
- ``at_least`` / ``agrees``: an exact one-sided binomial test that a rate (``a``; or the rate at which ``a``
  and ``b`` decide alike) exceeds a bound;
- ``identity``: holds by construction (e.g. full-downstream = oracle in locality): shown, never tested;
- ``describe``: our measurement where the paper has no number for our condition: shown, never tested.

Inference at the level of independence. Instances of one scenario share a rule, a field and a template.
Whenever a claim's instances come from fewer clusters (scenarios) than instances, the test runs on the
cluster means: the TOST and the t on the clusters' mean values (or paired differences), McNemar becomes the
exact sign test over clusters, and a rate's exact binomial counts clusters (n = clusters, k = the clusters'
summed rates rounded down: the design effect taken at its largest). The power and the n needed are then in
clusters too. The interval shown is a 95% cluster bootstrap (a Clopper-Pearson interval on the same units
for rates); below ``MIN_CLUSTERS`` clusters no interval is shown ("too few clusters").

Verdicts (BH q-values within two families: the paper's effects, and the controls; alpha 0.05). No verdict
but "not measurable" from fewer than ``MIN_N`` = 10 instances or ``MIN_CLUSTERS`` = 5 clusters. A positive
verdict needs q < alpha *and* the shown 95% interval on the paper's side of every bound (inside the TOST
bounds; above 0 for ``greater``; above the rate bound), so the interval printed beside a verdict is one the
verdict is consistent with (stricter than the 90% interval a TOST at 0.05 uses).

- ``reproduced``;
- ``outside the paper's range``: an equivalence claim whose estimate and whole interval lie beyond a bound;
- ``inconclusive``: the interval straddles a bound (with the power at the paper's effect);
- ``not reproduced``: significant the other way, the interval wholly on the wrong side of a directional
  bound, or no effect although the units reach the n needed for 80% power at the paper's effect;
- ``not measurable`` (with the reason): the inclusion filter left nothing, too few instances or clusters,
  or no variance to test.

Power is reported twice, at the current number of units: at the paper's effect (``power_paper``) and at our
own estimate (``power_ours``), each with the n needed for 80%: ``n_paired_t`` (TOST approximated by the
one-sided t at the nearer bound), ``n_mcnemar`` (the paper's difference in rates plus our wrong-way
discordance), ``n_binom_bound``.

Where our setting differs: the paper states a margin only for its user-memory protocol (App. H: TOST delta
0.03 on accuracy, cosine >= 0.98). Every other bound is kvprobe's own and says so in the claim: +-0.1 for
recovery (a tenth of the oracle flip), 0.97 for decision rates (``KVPROBE_RATE_BOUND``, App. H's 0.03 margin
borrowed as kvprobe's bound, beside the paper's own n and interval).

Lineage: each row names its model's training lineage (:mod:`kvprobe.models.lineage`); successive
fine-tunes of one lineage are one replicate, so agreement among them is reported as "stable across
fine-tunes", never as replication.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvprobe.competence import CHANCE, COMPETENCE_GATE  # noqa: F401 (their home is kvprobe.competence)
from kvprobe.competence import measure as measure_competence
from kvprobe.stats.bootstrap import cluster_means, summarize
from kvprobe.stats.inference import (ALPHA, bh_fdr, binom_at_least, mcnemar_exact, n_binom_bound, n_mcnemar,
                                     n_paired_t, power_binom_bound, power_mcnemar, power_paired_t, proportion_ci,
                                     sign_test, summarize_proportion, tost_paired)

RECOVERY_MARGIN = 0.1  # kvprobe's equivalence margin for recovery: a tenth of the oracle flip
MIN_N = 10  # no verdict but "not measurable" below this many instances ...
MIN_CLUSTERS = 5  # ... or this many clusters (and no interval is shown below it)
ACCURACY_MARGIN = 0.03  # the paper's TOST margin for accuracy/agreement in its user-memory protocol (Appendix H)
KVPROBE_RATE_BOUND = 1 - ACCURACY_MARGIN  # kvprobe's own bound for decision rates (App. H's margin, borrowed)
RULE_BEFORE_FIELD = (("rule_at", "before_field"),)  # generated instances with the rule first: not the paper's layout
MIN_CONTROL_DRAWS = 20  # a random control shared by every instance is averaged over at least this many draws
RATIO_FLOOR = 0.05  # a share a / b is undefined where |b| is below this (no full-site effect to share)
DIGITS = 4  # significant digits written to claims.json: the file is byte-identical across runs and BLAS builds
# A must-fail control (a stale cache, a chunk spliced without re-rotation at a large offset, a wrong memory) beside its
# treatment: kvprobe's own margins, never the paper's (its no-rotation collapse has no LD-error counterpart).
SEPARATION_MARGIN = 0.25  # nats: the control's LD error minus the treatment's (half the inclusion rule's 0.5-nat flip)
RETAINED_MARGIN = 0.5  # the treatment's field effect retained minus the control's (half of full recompute's effect)
Kind = Literal["equivalent", "greater", "at_least", "agrees", "identity", "describe"]
Role = Literal["effect", "control"]


@dataclass(frozen=True)
class Claim:
    """One testable statement of the paper about one experiment's rows (see the module docstring).

    A declaration names what is tested and kvprobe's own bound; the paper's side (its statement, value, n,
    location and source) is the claim's entry in the registry :mod:`kvprobe.paper`, joined in by
    :func:`declared_claims` (``paper``, ``paper_value``, ``location``, ``paper_n`` are empty until then)."""

    key: str
    text: str
    kind: Kind
    a: str  # dotted path into a row, e.g. "field_only", "cumulative.8", "methods.erratum.correct"
    b: str | float | None = None
    bounds: tuple[float, float] | None = None  # kvprobe's equivalence bounds on a - b
    bound: float | None = None  # kvprobe's rate bound of at_least / agrees
    template: str = "gated"  # task template stem the claim applies to
    gated: bool = True  # over instances that passed the inclusion gate (else all instances)
    role: Role | None = None  # "effect" (one of the paper's effects) or "control" (control, sanity check, identity)
    params: tuple[tuple[str, Any], ...] = ()  # record params the claim needs, e.g. (("scheme", "erratum"),)
    only: str | None = None  # a row path that must be true for an instance to count (e.g. "full_correct")
    margin: float | None = None  # kvprobe's margin around the paper's range (``in_paper_range``)
    in_paper_range: bool = False  # bounds = the paper's range (from the registry) +- ``margin``
    # Row paths holding whether full recompute decides rightly (a bool, or a rate per instance): a tested claim
    # on a record whose full recompute is below kvprobe's competence gate is "not measurable" (an agreement with
    # a model that decides at chance, or always the same way, says nothing about the cache).
    competence: tuple[str, ...] = ()
    # rows in a condition the paper's number is not about, left out: ((row path, value), ...)
    exclude: tuple[tuple[str, Any], ...] = ()
    # the record param holding how many random draws make the control arm, where one set of draws is shared by every
    # instance (its draw-to-draw variance is then not in the interval): fewer than MIN_CONTROL_DRAWS is no test
    control_draws: str | None = None
    described: str = ""  # why a "describe" claim is shown and not tested (in-sample, a near-construction, ...)
    # joined from the registry (kvprobe.paper) by declared_claims():
    paper: str = ""  # the paper's number(s), as stated, with its model and condition
    paper_value: float | None = None  # the paper's value of the tested quantity (a - b, or the rate)
    location: str = ""  # where in the paper: "Fig. 2c", "App. D (2)", "Tab. 6"
    paper_n: str | None = None  # the paper's n behind the number ("48/48 (8 tasks x 6 samples)")
    paper_id: str | None = None  # the registry entry


def near(key: str, text: str, a: str, target: float, margin: float = RECOVERY_MARGIN, template: str = "gated",
         in_paper_range: bool = False, gated: bool = True, b: str | None = None, role: Role | None = None,
         params: tuple[tuple[str, Any], ...] = (), only: str | None = None, kind: Kind = "equivalent",
         competence: tuple[str, ...] = (), described: str = "", exclude: tuple[tuple[str, Any], ...] = (),
         control_draws: str | None = None) -> Claim:
    """``a`` (or ``a - b``) ~ ``target`` +- ``margin`` (or within the paper's range +- ``margin``): a TOST
    (``kind="describe"``: the same quantity, shown and not tested)."""
    return Claim(key, text, kind, a, b, (target - margin, target + margin), None, template, gated, role,
                 params, only, margin, in_paper_range, competence, exclude, control_draws, described)


def kvprobe_bound(claim: Claim) -> str:
    """The bound the claim is tested against, named as kvprobe's own (never the paper's), with how the paper's own
    value(s) fare against it; "" for a claim tested against nothing but 0 or its twin."""
    lh = _paper_range(claim)
    if claim.kind == "equivalent" and claim.bounds:
        lo, hi = claim.bounds
        text = (f"kvprobe's margin +-{claim.margin:g} around the paper's range: [{lo:g}, {hi:g}]" if
                claim.in_paper_range else f"kvprobe's bounds [{lo:g}, {hi:g}]")
        if lh is not None and claim.b is None:
            fits = lo <= lh[0] and lh[1] <= hi
            text += "; the paper's value lies inside" if fits else "; the paper's own value lies outside them"
        return text
    if claim.kind in ("at_least", "agrees") and claim.bound is not None:
        text = (f"kvprobe's rate bound {claim.bound:g} (an exact binomial test passes it only from "
                f"{units_to_pass(claim.bound)} units up)")
        if lh is not None:
            text += ("; the paper's value clears it" if lh[0] > claim.bound else
                     "; the paper's own value would fail it" if lh[1] <= claim.bound else
                     "; the paper's own range straddles it")
        return text
    if claim.kind == "greater" and isinstance(claim.b, (int, float)):
        text = f"kvprobe's threshold {claim.b:g}"
        if lh is not None:
            text += "; the paper's value clears it" if lh[0] > claim.b else "; the paper's own value does not clear it"
        return text
    return ""


def _paper_range(claim: Claim) -> tuple[float, float] | None:
    if not claim.paper_id:
        return None if claim.paper_value is None else (claim.paper_value, claim.paper_value)
    from kvprobe.paper import registry

    return registry()[claim.paper_id].low_high


def paper_id(experiment: str, claim: Claim) -> str:
    """The claim's id in the registry and the claims table: ``experiment.key``, ``@template`` off the gated task,
    ``[param=value,...]`` for a variant."""
    return (f"{experiment}.{claim.key}" + ("" if claim.template == "gated" else f"@{claim.template}")
            + ("" if not claim.params else "[" + ",".join(f"{k}={v}" for k, v in sorted(claim.params)) + "]"))


def bind(experiment: str, claim: Claim) -> Claim:
    """The claim with its paper side joined from the registry (:mod:`kvprobe.paper`). A claim built with its
    paper side inline (a test's) keeps it; the experiments' declarations never carry one (a test checks)."""
    from kvprobe.paper import paper_value as registry_entry

    if claim.paper:
        return claim
    pid = paper_id(experiment, claim)
    entry = registry_entry(pid)
    bounds = claim.bounds
    if claim.in_paper_range:
        if entry.low_high is None:
            raise ValueError(f"claim {pid} is declared within the paper's range, but its registry entry has no value")
        lo, hi = entry.low_high
        bounds = (lo - (claim.margin or 0.0), hi + (claim.margin or 0.0))
    return replace(claim, paper=entry.statement, paper_value=entry.single, location=entry.location,
                   paper_n=entry.n, paper_id=pid, bounds=bounds)


def declared_claims(experiment: str) -> tuple[Claim, ...]:
    """An experiment's claims with their paper side joined from the registry; a claim with no entry is an error
    naming it."""
    from kvprobe.runner.experiment import get_experiment

    return tuple(bind(experiment, c) for c in get_experiment(experiment).claims)


def claim_paths(claim: Claim) -> tuple[list[str], list[str]]:
    """The dotted paths ``claim`` reads: into a row (``a``, ``b``, ``only``, ``competence``, ``exclude``; a row as
    :func:`claim_rows` gives it, checked against the experiment's ``row_model``) and into the summary (a ``b`` of
    ``"summary.x"``: ``x``, checked against its ``summary_model``)."""
    rows, summary = [claim.a], []
    if isinstance(claim.b, str):
        (summary if claim.b.startswith("summary.") else rows).append(claim.b.removeprefix("summary."))
    rows += ([claim.only] if claim.only else []) + list(claim.competence) + [path for path, _ in claim.exclude]
    return rows, summary


def _slope(values: list[float]) -> float | None:
    """OLS slope of ``values`` against their position (per turn); None for fewer than two."""
    if len(values) < 2:
        return None
    return float(np.polyfit(np.arange(len(values), dtype=float), np.asarray(values, dtype=float), 1)[0])


def get(row: dict[str, Any], path: str) -> Any:
    """``row['methods']['erratum']['correct']`` for ``"methods.erratum.correct"`` (None where absent).

    A ``*`` step averages the rest of the path over a list (``"turns.*.cosine"``: the instance's mean cosine over
    its turns; booleans average to a rate), so the claim's unit stays the instance, not the turn. An ``@slope``
    step gives the OLS slope of the rest over the list's order (``"turns.@slope.agree"``: change per turn).
    ``"x / y"`` is the ratio of two paths (None where ``|y| < RATIO_FLOOR``)."""
    if " / " in path:
        num, den = (get(row, part.strip()) for part in path.split(" / ", 1))
        if num is None or den is None or abs(float(den)) < RATIO_FLOOR:
            return None
        return float(num) / float(den)
    cur: Any = row
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part in ("*", "@slope"):
            if not isinstance(cur, list):
                return None
            rest = ".".join(parts[i + 1:])
            vals = [float(v) for v in (get(x, rest) if rest else x for x in cur) if v is not None]
            if part == "@slope":
                return _slope(vals)
            return sum(vals) / len(vals) if vals else None
        if isinstance(cur, list) and part.isdigit():  # a per-layer list indexed by the layer
            cur = cur[int(part)] if int(part) < len(cur) else None
            continue
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def resolve(path: str, record: dict[str, Any]) -> str:
    """Fill ``{name}`` in a path from the record's summary (``"attn_share.{causal_layer}"``: the layer the
    summary chose)."""
    summary = record.get("summary") or {}

    def fill(m: re.Match[str]) -> str:
        v = get(summary, m.group(1))
        if isinstance(v, dict):  # e.g. {"layer": 20, ...}
            v = v.get("layer")
        return str(v)

    return re.sub(r"\{([\w.]+)\}", fill, path)


def _flag(v: Any) -> bool | None:
    """A binary outcome as stored: a bool, or a float 0/1 (e.g. decision agreement)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if float(v) in (0.0, 1.0):
        return bool(float(v))
    raise ValueError(f"{v!r} is not a binary outcome")


_NOT_DECISIONS = ("cosine", "latency", "rollback", "weights_unchanged")  # measures a constant model does not pass


def competence(claim: Claim, rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Whether full recompute decides the record's task (:func:`kvprobe.competence.measure`, the one competence
    measure: right on at least ``COMPETENCE_GATE`` of its decisions and above chance), over every instance of the
    record (not only the included ones), read from the claim's ``competence`` row paths. None where the claim
    names no competence measure or reads no decision (a cosine or a latency is not made vacuous by a constant
    answer)."""
    paths = [p for p in (claim.a, claim.b) if isinstance(p, str)]
    if not claim.competence or all(any(w in p for w in _NOT_DECISIONS) for p in paths):
        return None
    values = [float(_num_or_bool(v)) for r in rows for p in claim.competence if (v := get(r, p)) is not None]
    c = measure_competence(values)
    if c is None:
        return {"competent": False, "n": 0, "reason": "no competence measure in the rows (full recompute's "
                                                       "correctness not recorded)"}
    n, (lo, hi) = len(values), c.ci
    reason = (f"below the competence gate: full recompute right on {c.accuracy:.2f} [{lo:.2f}, {hi:.2f}] of {n} "
              f"decisions (kvprobe's gate: >= {COMPETENCE_GATE:.2f} and above chance)")
    return {"competent": c.competent, "accuracy": c.accuracy, "ci_low": lo, "ci_high": hi, "n": n,
            **({} if c.competent else {"reason": reason})}


def _clusters(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [str(r.get("scenario", f"#{r.get('index', i)}")) for i, r in enumerate(rows)]


def _ours(stat: dict[str, Any]) -> dict[str, Any]:
    keep = ("mean", "ci_low", "ci_high", "ci_method", "n", "n_clusters", "ci_note", "k")
    out = {k: stat[k] for k in keep if k in stat}
    if out.get("n_clusters", 0) < MIN_CLUSTERS and out.get("n"):
        out.update(ci_low=None, ci_high=None, ci_note=f"too few clusters ({out.get('n_clusters', 0)} < "
                                                      f"{MIN_CLUSTERS}): no interval")
    return out


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


def _binary(values: Sequence[Any]) -> bool:
    """Paired outcomes stored as booleans or as floats 0/1 (e.g. decision agreement): tested as booleans."""
    return all(isinstance(v, bool) or (isinstance(v, (int, float)) and float(v) in (0.0, 1.0)) for v in values)


def _num_or_bool(x: Any) -> float:
    return float(_flag(x)) if isinstance(x, bool) else float(x)


def _power_block(out: dict[str, Any], n_units: int, paper_effect: float | None, our_effect: float | None,
                 sd: float | None, kind: str, **kw: Any) -> None:
    """Power at the current number of units and the units needed for 80%, at the paper's effect and at ours."""
    for tag, eff in (("paper", paper_effect), ("ours", our_effect)):
        power, need = None, None
        if eff is not None and np.isfinite(eff):
            if kind == "t":
                power = power_paired_t(eff, sd, n_units) if sd else None
                need = n_paired_t(eff, sd) if sd else None
            elif kind == "sign":
                b_only = kw["b_only"]
                a_only = min(1.0 - b_only, max(eff + b_only, 0.0))
                power = power_mcnemar(a_only, b_only, n_units) if a_only > b_only else 0.0
                need = n_mcnemar(a_only, b_only)
            elif kind == "binom":
                bound = kw["bound"]
                power = power_binom_bound(eff, bound, n_units) if eff > bound else 0.0
                need = n_binom_bound(eff, bound)
        out[f"power_{tag}"] = power
        out[f"n_needed_{tag}"] = need
    out["n_needed"] = out["n_needed_paper"] if out["n_needed_paper"] is not None else out["n_needed_ours"]


def evaluate(claim: Claim, record: dict[str, Any]) -> dict[str, Any]:
    """The claim on one record's rows (with their summary-computed measures, :func:`claim_rows`): ours with
    CI, the test on the units of independence and its p, power at the paper's effect and at ours (no verdict
    yet: that waits for the BH q within the claim's family, :func:`claims_rows`)."""
    rows = claim_rows(record)
    gate = competence(claim, rows)
    used = [r for r in rows if r.get("included")] if claim.gated else list(rows)
    if claim.exclude:
        kept = [r for r in used if not any(get(r, path) == value for path, value in claim.exclude)]
        if used and not kept:  # every instance is in a condition the paper's number is not about
            return {"claim": claim.text, "key": claim.key, "kind": claim.kind, "role": claim.role,
                    "paper": claim.paper, "out_of_condition": True, "n": 0, "status": "empty",
                    "notes": ["no instance in the paper's condition (" + ", ".join(
                        f"{p} {v}" for p, v in claim.exclude) + " left out)"]}
        used = kept
    gate_passed = len(used)
    if claim.only:
        used = [r for r in used if get(r, claim.only)]
    a_path = resolve(claim.a, record)
    b_path = resolve(claim.b, record) if isinstance(claim.b, str) else None
    b_summary = b_path is not None and b_path.startswith("summary.")
    out: dict[str, Any] = {"claim": claim.text, "key": claim.key, "kind": claim.kind, "role": claim.role,
                           "paper": claim.paper, "location": claim.location, "paper_n": claim.paper_n,
                           "paper_value": claim.paper_value, "bounds": claim.bounds, "bound": claim.bound,
                           "over": ("gated" if claim.gated else "all") + (f", {claim.only}" if claim.only else ""),
                           "n_rows": len(rows), "p": None,
                           "n": 0, "n_clusters": 0, "unit": None, "n_units": 0, "n_needed": None, "test": None,
                           "ours": {}, "notes": [], "kvprobe_bound": kvprobe_bound(claim) or None,
                           "paper_range": _paper_range(claim)}
    if claim.control_draws and claim.kind not in ("identity", "describe"):
        draws = _record_params(record).get(claim.control_draws)
        if draws is not None and int(draws) < MIN_CONTROL_DRAWS:
            out.update(status="empty", control_draws=int(draws),
                       notes=[f"the random control is {draws} draws shared by every instance; kvprobe needs >= "
                              f"{MIN_CONTROL_DRAWS} (rerun with params.{claim.control_draws}={MIN_CONTROL_DRAWS})"])
            return out
    if gate is not None:
        out["competence"] = gate
        if not gate["competent"] and claim.kind not in ("identity", "describe"):
            out.update(status="empty", notes=[gate["reason"]])
            return out
    if b_summary:  # a constant the summary computed (e.g. the record's write depth)
        const = get(record.get("summary") or {}, b_path[len("summary."):])
        b_path = None
        if const is None:
            out.update(status="empty", notes=[f"the summary has no {claim.b[len('summary.'):]}"])
            return out
        b_const: float = float(const)
        out["b_value"] = b_const
    else:
        b_const = float(claim.b) if isinstance(claim.b, (int, float)) else 0.0
    passed = len(used)
    used = [r for r in used if get(r, a_path) is not None and (b_path is None or get(r, b_path) is not None)]
    out["n"] = len(used)
    if not used:
        out["status"] = "empty"
        # Say which filter emptied the set: a record older than the measure (or a config that skipped its arm) is
        # not an inclusion filter that nothing passed, nor a subset (``only``) the model never entered.
        if claim.gated and rows and not gate_passed:
            note = "inclusion filter empty"
        elif claim.only and gate_passed and not passed:
            note = f"no row has {claim.only}"
        else:
            note = "no rows carry this measure (its arm not run, or the record predates it)"
        out["notes"].append(note)
        return out
    clusters = _clusters(used)
    n_clusters = len(set(clusters))
    clustered = n_clusters < len(used)
    out.update(n_clusters=n_clusters, unit="cluster" if clustered else "instance",
               n_units=n_clusters if clustered else len(used))
    a = [get(r, a_path) for r in used]
    b = [get(r, b_path) for r in used] if b_path else [b_const] * len(used)

    if claim.kind in ("identity", "describe"):
        vals = [_num_or_bool(v) - (_num_or_bool(w) if b_path else 0.0) for v, w in zip(a, b)]
        out["ours"] = _ours(summarize(vals, clusters=clusters))
        if claim.kind == "identity":
            out["test"] = "identity (holds by construction: not tested)"
            out["max_abs_deviation"] = float(np.max(np.abs(np.asarray(vals) - (claim.paper_value or 0.0))))
        else:
            out["test"] = "described, not tested: " + (claim.described or "the paper has no number for this "
                                                                            "condition")
        out["status"] = claim.kind
        return out

    if claim.kind in ("at_least", "agrees"):
        flags = [_flag(v) for v in a] if claim.kind == "at_least" else \
            [_flag(u) == _flag(v) for u, v in zip(a, b)]
        k, n = sum(flags), len(flags)
        if clustered:  # clusters as the units: k = the clusters' summed rates, rounded down
            _, rates = cluster_means([float(f) for f in flags], clusters)
            k_u, n_u = int(math.floor(sum(rates) + 1e-9)), len(rates)
            lo, hi = proportion_ci(k_u, n_u)
            out["ours"] = _ours({"mean": k / n, "ci_low": lo, "ci_high": hi, "n": n, "k": k, "n_clusters": n_clusters,
                                 "ci_method": f"clopper-pearson (exact) on clusters ({k_u}/{n_u})"})
        else:
            k_u, n_u = k, n
            out["ours"] = _ours(summarize_proportion(flags, clusters))
        n_min = units_to_pass(claim.bound)
        if n_u < n_min and n >= MIN_N and n_clusters >= MIN_CLUSTERS:  # not even all n_u successes could pass
            out.update(status="describe", unreachable=True,
                       test=f"described: kvprobe's rate bound {claim.bound:g} cannot be passed at {n_u} "
                            f"{'clusters' if clustered else 'instances'} (even {n_u} of {n_u} needs >= {n_min})")
            return out
        test = binom_at_least(k_u, n_u, claim.bound)
        out.update(test=test["test"] + (" over clusters" if clustered else ""), p=test["p"], k_units=k_u)
        if claim.kind == "agrees":
            mc = mcnemar_exact([_flag(v) for v in a], [_flag(v) for v in b])
            out["mcnemar_p"] = mc["p"]
            out["notes"].append(f"McNemar (exact, instances) P(correct) {claim.a} vs {claim.b}: p={mc['p']:.3g}")
        _power_block(out, n_u, claim.paper_value, k_u / n_u, None, "binom", bound=claim.bound)
        out["status"] = "tested"
        return out

    a_num = [_num_or_bool(x) for x in a]
    b_num = [_num_or_bool(x) for x in b]
    diffs = [u - v for u, v in zip(a_num, b_num)]
    # ours: the paired difference (also against a constant the summary computed, e.g. commit - write depth),
    # or the measure itself when it is compared with a stated constant
    shown = diffs if (b_path or b_summary) else a_num
    out["ours"] = _ours(summarize(shown, clusters=clusters))
    out["mean_diff"] = float(np.mean(diffs))
    if not b_path and not b_summary and claim.kind == "greater":
        # ours shows ``a`` itself: the verdict compares its interval with the constant, not with 0
        out["threshold"] = b_const
    if clustered:
        _, unit_a = cluster_means(a_num, clusters)
        _, unit_b = cluster_means(b_num, clusters)
    else:
        unit_a, unit_b = a_num, b_num
    unit_d = [u - v for u, v in zip(unit_a, unit_b)]
    sd = float(np.std(unit_d, ddof=1)) if len(unit_d) > 1 else float("nan")
    out["sd"] = sd if np.isfinite(sd) else None
    sd_or_none = out["sd"] or None
    if claim.kind == "equivalent":
        low, upp = claim.bounds
        test = tost_paired(unit_a, unit_b, low, upp)
        out.update(test=test["test"] + (" on cluster means" if clustered else ""), p=test["p"])
        if test.get("note"):
            out["notes"].append(test["note"])
        ours_mean = float(np.mean(unit_d))
        center = claim.paper_value if claim.paper_value is not None else (low + upp) / 2
        _power_block(out, len(unit_d), min(center - low, upp - center),
                     min(ours_mean - low, upp - ours_mean), sd_or_none, "t")
    else:  # greater
        if b_path is None and all(isinstance(x, bool) for x in a):
            raise ValueError(f"claim {claim.key}: a rate against a constant is an at_least claim")
        booleans = b_path is not None and _binary(a) and _binary(b)
        if booleans and not clustered:
            test = mcnemar_exact([_flag(x) for x in a], [_flag(x) for x in b])
            out.update(test="McNemar (exact, two-sided)", p=test["p"], discordant=[test["a_only"], test["b_only"]])
            b_only = min(test["b_only"] / len(a), 0.5)
            paper_eff = None if claim.paper_value is None else min(claim.paper_value, 1.0 - 2 * b_only)
            _power_block(out, len(a), paper_eff, (test["a_only"] - test["b_only"]) / len(a), None, "sign",
                         b_only=b_only)
        elif booleans:  # McNemar with the cluster as the unit: the sign test over the clusters' mean differences
            test = sign_test(unit_d)
            out.update(test="exact sign test over clusters (McNemar, cluster as unit; two-sided)", p=test["p"],
                       discordant=[test["positive"], test["negative"]])
            b_only = min(test["negative"] / len(unit_d), 0.5)
            paper_eff = None if claim.paper_value is None else min(claim.paper_value, 1.0 - 2 * b_only)
            _power_block(out, len(unit_d), paper_eff, (test["positive"] - test["negative"]) / len(unit_d), None,
                         "sign", b_only=b_only)
        else:
            from scipy.stats import ttest_1samp

            p = float(ttest_1samp(unit_d, 0.0, alternative="greater").pvalue) if sd_or_none else None
            out.update(test="paired t (one-sided, a > b)" + (" on cluster means" if clustered else ""), p=p)
            if p is None:
                out["notes"].append("no variance: t undefined")
            # the paper's effect on a - b: against a constant, its level (the registry's value) minus the constant
            paper_effect = claim.paper_value - b_const if (claim.paper_value is not None and "threshold" in out) \
                else claim.paper_value
            _power_block(out, len(unit_d), paper_effect, float(np.mean(unit_d)), sd_or_none, "t")
        if claim.paper_value is None:
            out["notes"].append("the paper gives no number: power only at our estimate")
    out["status"] = "tested"
    return out


def _power_note(row: dict[str, Any]) -> str:
    pw, need = row.get("power_paper"), row.get("n_needed_paper")
    if pw is None and need is None:
        pw, need, at = row.get("power_ours"), row.get("n_needed_ours"), "our estimate"
    else:
        at = "the paper's effect"
    unit = "clusters" if row.get("unit") == "cluster" else "instances"
    parts = []
    if pw is not None:
        parts.append(f"power {pw:.2f} at {at}")
    if need is not None:
        parts.append(f"{need} {unit} needed")
    return "; ".join(parts)


def units_to_pass(bound: float, alpha: float = ALPHA) -> int:
    """The fewest units with which an exact one-sided binomial test can reject "rate <= bound" at all (every unit a
    success: p = bound ** n < alpha); 99 for kvprobe's 0.97."""
    return int(math.floor(math.log(alpha) / math.log(bound))) + 1


def verdict(row: dict[str, Any], alpha: float = ALPHA) -> str:
    """The verdict of the module docstring, from the row's q, interval, n, clusters and power."""
    status, q = row.get("status"), row.get("q")
    if status == "identity":
        return "identity (by construction)"
    if status == "describe" and row.get("unreachable"):
        return "described only (no n here can pass kvprobe's rate bound)"
    if status == "describe":
        return "described only (" + (row.get("test") or "not tested").removeprefix("described, not tested: ") + ")"
    if status == "empty":
        return "not measurable (" + (row["notes"][0] if row["notes"] else "no instance") + ")"
    n = row["n"]
    n_clusters = row.get("n_clusters", row["ours"].get("n_clusters", n))
    if n < MIN_N:
        return f"not measurable (n {n} < {MIN_N})"
    if n_clusters < MIN_CLUSTERS:
        return f"not measurable (too few clusters: {n_clusters} < {MIN_CLUSTERS})"
    if q is None:
        return "not measurable (" + (row["notes"][0] if row["notes"] else "no test") + ")"
    lo, hi = row["ours"].get("ci_low"), row["ours"].get("ci_high")
    kind, powered = row["kind"], _powered(row)
    note = _power_note(row)
    if kind == "equivalent":
        low, upp = row["bounds"]
        if lo > upp or hi < low:
            return "outside the paper's range"
        if q < alpha and low <= lo and hi <= upp:
            return "reproduced"
        if lo < low <= hi or lo <= upp < hi:
            return "inconclusive (CI straddles a bound" + (f"; {note})" if note else ")")
        return f"inconclusive (CI inside the bounds, q {q:.2g} >= {alpha})"
    if kind == "greater":
        # against a constant, ours is ``a`` and its interval must clear the constant; else ours is a - b
        thr = row.get("threshold", 0.0)
        at = "zero" if thr == 0.0 else f"the threshold {thr:g}"
        if q < alpha and row.get("mean_diff", 0.0) < 0:
            return "not reproduced (significant, opposite direction)"
        if q < alpha and lo > thr:
            return "reproduced"
        if hi <= thr:
            return f"not reproduced (CI at or below {at})"
        if powered and row.get("power_paper") is not None and lo <= thr:
            return f"not reproduced (CI includes {at} although {note})"
        return "inconclusive (" + (f"CI includes {at}" if lo <= thr else f"q {q:.2g} >= {alpha}") + \
            (f"; {note})" if note else ")")
    # at_least / agrees
    if q < alpha and lo > row["bound"]:
        return "reproduced"
    if hi < row["bound"]:
        return "not reproduced (CI below the bound)"
    if powered and row.get("power_paper") is not None:
        return f"not reproduced (no effect although {note})"
    return "inconclusive (CI straddles the bound" + (f"; {note})" if note else ")")


def _powered(row: dict[str, Any]) -> bool:
    need = row.get("n_needed_paper")
    return need is not None and row.get("n_units", 0) >= max(need, 2)


def _template_stem(record: dict[str, Any]) -> str:
    from kvprobe.runner.records import task_stem

    return task_stem(record)


def _record_params(record: dict[str, Any]) -> dict[str, Any]:
    return ((record.get("config") or {}).get("params")) or {}


def latest(records: Sequence[dict[str, Any]], variant_keys: dict[str, Sequence[str]] | None = None
           ) -> list[dict[str, Any]]:
    """Newest record per (experiment, task template, model, variant); records come oldest first. A variant is
    the record's value of each param a claim of the experiment selects on (e.g. long_horizon's ``scheme``),
    so a record of one variant never hides another's."""
    variant_keys = variant_keys or {}
    newest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rec in sorted(records, key=lambda r: r.get("created", "")):
        params = _record_params(rec)
        variant = tuple(str(params.get(k)) for k in variant_keys.get(rec["experiment"], ()))
        newest[(rec["experiment"], _template_stem(rec), rec["model"]["name"], variant)] = rec
    return [newest[k] for k in sorted(newest)]


def _applies(claim: Claim, record: dict[str, Any]) -> bool:
    params = _record_params(record)
    return all(params.get(k) == v for k, v in claim.params)


def _lineage_fields(model: str) -> dict[str, Any]:
    from kvprobe.models.lineage import lineage, lineage_root

    chain = lineage(model)
    return {"lineage": " > ".join(chain), "lineage_root": lineage_root(model),
            "pretrained": len(chain) == 1}


def claims_rows(records: Sequence[dict[str, Any]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Every declared claim on the newest record of each (experiment, template, model, variant), with BH
    q-values within each role's family (effects; controls) and a verdict."""
    from kvprobe.runner.experiment import available_experiments

    known = available_experiments()
    claims_of = {name: declared_claims(name) for name in sorted(known)}
    variant_keys = {name: sorted({k for c in cl for k, _ in c.params}) for name, cl in claims_of.items()}
    out = []
    for rec in latest(records, variant_keys):
        if rec["experiment"] not in known:
            continue
        stem = _template_stem(rec)
        # Generated instances are gated-decision pairs too (kvprobe.tasks.generator): the gated claims apply,
        # and the row keeps the generated task's name so the table tells the two apart.
        task = "gated" if stem.startswith("generated_") else stem
        for claim in claims_of[rec["experiment"]]:
            if claim.template != task or not _applies(claim, rec):
                continue
            measured = evaluate(claim, rec)
            if measured.get("out_of_condition"):  # e.g. the rule before the field: no paper counterpart, no row
                continue
            row = {"experiment": rec["experiment"], "template": stem, "model": rec["model"]["name"],
                   **_lineage_fields(rec["model"]["name"]), **measured,
                   "variant": dict(claim.params) or None, "record": rec.get("_path"),
                   "schema_version": rec.get("schema_version")}
            out.append(row)
    for role in ("effect", "control"):
        family = [r for r in out if (r["role"] or "control") == role]
        qs = bh_fdr([r["p"] if r.get("status") == "tested" else None for r in family], alpha)
        for row, q in zip(family, qs):
            row["q"] = q
            row["bh_family"] = role
    for row in out:
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
    elif (o.get("n_clusters") or 0) < MIN_CLUSTERS:
        cell += " (too few clusters)"
    else:
        cell += " (no CI)"
    return cell + (f" ({o['k']}/{o['n']})" if rate else f" n={o['n']}")


def paper_cell(row: dict[str, Any]) -> str:
    bits = [row["paper"]]
    if row.get("kvprobe_bound"):
        bits.append(row["kvprobe_bound"])
    if row.get("location") and row["location"] not in row["paper"]:
        bits.append(row["location"])
    if row.get("paper_n"):
        bits.append(f"paper n: {row['paper_n']}")
    return "; ".join(bits)


def _power_cell(row: dict[str, Any]) -> str:
    if row.get("status") != "tested":
        return f"{row['n']} ({row.get('n_clusters', 0)} cl.)"
    unit = "cl." if row.get("unit") == "cluster" else "inst."
    pw = [f"{'-' if row.get(f'power_{t}') is None else format(row[f'power_{t}'], '.2f')}" for t in ("paper", "ours")]
    need = [str(row.get(f"n_needed_{t}")) if row.get(f"n_needed_{t}") is not None else "-" for t in ("paper", "ours")]
    return (f"{row['n']} ({row.get('n_clusters', 0)} cl.); tested on {row['n_units']} {unit}; power {pw[0]} / "
            f"{pw[1]}; need {need[0]} / {need[1]}")


COLUMNS = ("claim", "model (lineage root)", "paper (location; paper's n)", "ours [95% CI]", "test", "p", "BH q",
           "verdict", "n (clusters); units; power at paper / ours; units needed")


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table in two blocks: the paper's effects, then controls / sanity checks / identities."""
    blocks = []
    for role, title in (("effect", "Paper effects"), ("control", "Controls, sanity checks and identities")):
        part = [r for r in rows if (r.get("role") or "control") == role]
        if not part:
            continue
        lines = [f"**{title}** ({len(part)} rows; BH within this block)", "",
                 "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in part:
            claim = r["claim"] + ("" if r["template"] == "gated" else f" ({r['template']})")
            model = r["model"] + ("" if r.get("lineage_root") in (None, r["model"]) else f" ({r['lineage_root']})")
            cells = [claim, model, paper_cell(r), ours_cell(r), r["test"] or "-", _num(r.get("p")),
                     _num(r.get("q")), r["verdict"], _power_cell(r)]
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def headline(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: k of N paper effects reproduced (effects with a paper number only; controls never count),
    with the other verdicts."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("role") != "effect" or r.get("status") == "describe" or r.get("kind") in ("describe", "identity"):
            continue
        h = out.setdefault(r["model"], {"effects": 0, "reproduced": 0, "verdicts": {}, "by_template": {}})
        head = r["verdict"].split(" (")[0]
        # per task shape too (the pretrained models are read on several prompt shapes)
        for tally in (h, h["by_template"].setdefault(r["template"], {"effects": 0, "reproduced": 0,
                                                                      "verdicts": {}})):
            tally["effects"] += 1
            tally["verdicts"][head] = tally["verdicts"].get(head, 0) + 1
            tally["reproduced"] += head == "reproduced"
    for model, h in out.items():
        h["verdicts"] = dict(sorted(h["verdicts"].items()))
        h["by_template"] = {t: f"{v['reproduced']} of {v['effects']} reproduced ("
                            + ", ".join(f"{k}: {n}" for k, n in sorted(v["verdicts"].items())) + ")"
                            for t, v in sorted(h["by_template"].items())}
        unmeasurable = h["verdicts"].get("not measurable", 0)
        h["testable"] = h["effects"] - unmeasurable
        h["text"] = (f"{model}: {h['reproduced']} of {h['testable']} testable paper effects reproduced"
                     + (f" ({unmeasurable} more not measurable here)" if unmeasurable else ""))
    return dict(sorted(out.items()))


def lineage_summary(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per effect claim (key, template kind): the independent lineages in which it is reproduced. Several
    fine-tunes of one lineage reproducing it are one replicate: "stable across fine-tunes"."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("role") != "effect" or not r["verdict"].startswith("reproduced"):
            continue
        key = f"{r['experiment']}.{r['key']}" + ("" if r["template"] == "gated" else f" ({r['template']})")
        per = out.setdefault(key, {})
        per.setdefault(r["lineage_root"], set()).add(r["model"])
    summary = {}
    for key in sorted(out):
        lines = {root: sorted(models) for root, models in sorted(out[key].items())}
        summary[key] = {"independent_lineages": len(lines),
                        "reading": "; ".join(f"{root}: " + (f"stable across fine-tunes ({len(m)} models)"
                                                            if len(m) > 1 else m[0]) for root, m in lines.items())}
    return summary


def stable(obj: Any) -> Any:
    """Floats rounded to ``DIGITS`` significant digits (last-ulp differences between BLAS runs vanish), tuples as
    lists, NaN as None: claims.json is byte-identical when regenerated."""
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else float(f"{obj:.{DIGITS}g}")
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [stable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return stable(obj.item())
    return obj


def claim_records(results_dir: str | Path = "results", scope: Literal["study", "archive"] = "study"
                  ) -> list[dict[str, Any]]:
    """The records a claims table reads. ``study``: the records the study publishes (``study.yaml``), so
    ``claims.json``, the README and RESULTS.md give one headline, and BH runs within the study's own rows; a
    folder with no study model (a scratch ``runs/``) gives all its records. ``archive``: every other record (its
    own page)."""
    from kvprobe.runner.records import load_records
    from kvprobe.study import _study_file, archive_records, published_records

    records = load_records(results_dir)
    if not _study_file().exists():  # an installed kvprobe outside a checkout: no study, every record
        return records if scope == "study" else []
    published = published_records(records)
    if scope == "archive":
        return archive_records(records) if published else []
    return published or records


def load_claims(results_dir: str | Path = "results", scope: Literal["study", "archive"] = "study"
                ) -> list[dict[str, Any]]:
    return claims_rows(claim_records(results_dir, scope))


# A claim's declaration (the same on every model) is written once, under "declarations"; a row keeps what was
# measured. These fields of an in-memory row are the declaration's, or repeat another field.
_DECLARED = ("claim", "paper", "location", "paper_n", "kind", "paper_value", "paper_range", "kvprobe_bound", "bounds",
             "bound", "over", "variant")
_DROPPED = ("pretrained", "n_rows", "bh_family", "sd", "status", "schema_version",
            "experiment", "key", "lineage_root", "n", "n_clusters", "n_needed", "mean_diff")
_DEFAULT_CI = "cluster bootstrap (percentile, by scenario)"


def _slim_row(cid: str, r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid}
    for k, v in r.items():
        if k in _DECLARED + _DROPPED or v is None:
            continue
        if (k, v) in (("template", "gated"), ("unit", "instance")):
            continue  # the defaults, named in the file's "rows" note
        if k == "notes":  # a note the verdict already says is not repeated
            v = [n for n in v if n not in r.get("verdict", "")]
            if not v:
                continue
        if k == "ours":
            v = {kk: vv for kk, vv in v.items() if vv is not None and not (kk == "ci_method" and vv == _DEFAULT_CI)}
        if k == "record":  # results/<experiment>/<model>/<record>.json
            v = Path(v).stem
        if k == "lineage":  # the chain, each fine-tune without its base's name: "smollm2-135m > gated > gated-v2"
            base = v.split(" > ")[0]
            v = ">".join([base] + [a.removeprefix(base + "-") for a in v.split(" > ")[1:]])
        if k == "test" and r.get("status") in ("identity", "describe"):
            continue  # the verdict says it was not tested
        out[k] = v
    return out


def claim_id(row: dict[str, Any]) -> str:
    """``experiment.key`` (with ``@template`` off the gated task and ``[param=value]`` for a variant)."""
    cid = f"{row['experiment']}.{row['key']}"
    if row.get("variant"):
        cid += "[" + ",".join(f"{k}={v}" for k, v in sorted(row["variant"].items())) + "]"
    return cid


def claims_document(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The claims file: the protocol, the headline per model, lineages, each claim's declaration once, and
    one row per claim x record with what was measured (floats at ``DIGITS`` significant digits)."""
    declarations: dict[str, dict[str, Any]] = {}
    lineages: dict[str, str] = {}
    slim = []
    for r in rows:
        cid = claim_id(r) + ("" if r["template"] == "gated" or r["template"].startswith("generated_")
                             else f"@{r['template']}")
        declarations.setdefault(cid, {k: r.get(k) for k in _DECLARED})
        lineages.setdefault(r["model"], {"chain": r.get("lineage", r["model"]),
                                         "root": r.get("lineage_root", r["model"])})
        slim.append(_slim_row(cid, r))
    return stable({"alpha": ALPHA, "min_n": MIN_N, "min_clusters": MIN_CLUSTERS,
                    "correction": "Benjamini-Hochberg (fdr_bh) within two families: paper effects; controls",
                    "tests": "on cluster (scenario) means whenever clusters < instances; a positive verdict needs "
                             "q < alpha and the shown 95% interval on the paper's side of every bound",
                    "rows": "id: a key of declarations; template: gated unless stated; unit (of the test): instance "
                            "unless stated; lineage: the base, then each fine-tune it was continued from, joined by '>' "
                            "(aliases without the base's name; full chains under lineages); "
                            "record: results/<experiment>/<model>/<record>.json; ours: "
                            f"mean and 95% interval ({_DEFAULT_CI} unless ci_method says otherwise), n instances, "
                            "n_clusters; n_units: what the test counted (unit instance or cluster)",
                    "headline": headline(rows), "lineage": lineage_summary(rows),
                    "lineages": dict(sorted(lineages.items())), "declarations": dict(sorted(declarations.items())),
                    "claims": slim})


def expanded_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a claims file (:func:`claims_document`) with their declarations joined back in: each row gets
    ``claim``, ``paper``, ``paper_value``, ... from ``declarations``, its ``experiment`` and ``key`` from its id,
    and ``record`` as the path ``results/<experiment>/<model>/<record>.json``."""
    declarations = doc.get("declarations", {})
    out = []
    for slim in doc.get("claims", []):
        cid = slim["id"]
        experiment, rest = cid.split(".", 1)
        row = {**declarations.get(cid, {}), **slim, "experiment": experiment,
               "key": rest.split("@")[0].split("[")[0]}
        row.setdefault("template", "gated")
        row.setdefault("test", None)
        ours = row.get("ours") or {}
        row.setdefault("n", ours.get("n", 0))
        row.setdefault("n_clusters", ours.get("n_clusters", 0))
        row.setdefault("lineage_root", (doc.get("lineages", {}).get(slim["model"]) or {}).get("root", slim["model"]))
        kind = row.get("kind")
        row.setdefault("status", kind if kind in ("identity", "describe") else
                       "tested" if row.get("p") is not None else "untested")
        if slim.get("record"):  # the record's folder is the model's slug (a Hugging Face id's or a path's last part)
            from kvprobe.runner.records import model_slug

            row["record"] = f"results/{experiment}/{model_slug(slim['model'])}/{slim['record']}.json"
        out.append(row)
    return out


def read_claims(path: str | Path) -> list[dict[str, Any]]:
    """The committed claims table (``results/claims.json``) as full rows (:func:`expanded_rows`)."""
    import json

    return expanded_rows(json.loads(Path(path).read_text()))


def write_document(path: Path, doc: dict[str, Any]) -> None:
    """Atomically, compact JSON with one claims row per line (small, and a diff shows which rows changed)."""
    import json
    import os
    import tempfile

    dumps = functools.partial(json.dumps, separators=(",", ":"), allow_nan=False)
    head = [f" {dumps(k)}: {dumps(v)}," for k, v in doc.items() if k != "claims"]
    body = ",\n".join("  " + dumps(r) for r in doc["claims"])
    text = "{\n" + "\n".join(head) + '\n "claims": [\n' + body + "\n ]\n}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_claims(results_dir: str | Path = "results", out: str | Path | None = None
                 ) -> tuple[Path, list[dict[str, Any]]]:
    """Evaluate every claim and write them to ``<results>/claims.json`` (a pure function of the records; `kvprobe
    claims` adds kvprobe's trends across size, :func:`kvprobe.trends.with_trends`)."""
    records = claim_records(results_dir)
    rows = claims_rows(records)
    path = Path(out) if out else Path(results_dir) / "claims.json"
    write_document(path, claims_document(rows))
    return path, rows


def claims_markdown(results_dir: str | Path = "results") -> str:
    """The claims table for RESULTS.md (``make report``): the headline per model, then the two blocks."""
    rows = load_claims(results_dir)
    if not rows:
        return "(no records with declared claims)"
    heads = "\n".join(f"- {h['text']}" for h in headline(rows).values())
    return heads + "\n\n" + markdown(rows)


def summary_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        head = f"{r.get('role') or 'control'}: " + r["verdict"].split(" (")[0]
        counts[head] = counts.get(head, 0) + 1
    return dict(sorted(counts.items()))
