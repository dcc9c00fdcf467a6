"""Controls that can fail (issue: discriminating controls): paired effect-minus-control contrasts, and
cross-fitted top-k rankings.

- :func:`paired_contrast`: per instance, an effect minus its control measured on the same instance (e.g. the
  re-rotated transplant minus the unrotated one); the mean difference with a cluster-bootstrap CI by scenario,
  a one-sample t on the scenario means of the differences (the unit of independence), and for binary
  outcomes the exact McNemar table.
- Cross-fitting (:func:`scenario_folds`, :func:`crossfit_scores`): a top-k set ranked on the same instance it
  is scored on beats random-k partly by selection. Here the scenarios are split into two folds; a unit's score
  for an instance of one fold is learned from the instances of the *other* fold only, and the two folds swap.
  Units must therefore be comparable across instances: heads are (layer, head) identities; context positions
  are mapped to :func:`slot_key` (the token with the instance's own field values and actions replaced by
  their roles, and its relative place in the downstream span).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from kvprobe.probes.summary import Stat, scenarios, summarize_column
from kvprobe.schema import Shape
from kvprobe.stats.inference import mcnemar_exact


# -- the typed shapes of these summaries (kvprobe.runner.shapes) ---------------------------------------------

class Contrast(Shape):
    """A :func:`paired_contrast`: the effect, its control and their paired difference."""

    effect: Stat
    control: Stat
    difference: Stat


class CrossfitAtK(Shape):
    crossfit_vs_random: Contrast
    in_sample_vs_crossfit: Contrast


class Crossfit(Shape):
    """A :func:`crossfit_summary`: over which rows, how many, and per k (the keys ``"8"``, ``"16"``, ...) the
    two contrasts."""

    __pydantic_extra__: dict[str, CrossfitAtK] = Field(init=False)
    over: str
    n: int
    n_clusters: int

    def at(self, k: int | str) -> CrossfitAtK | None:
        """The contrasts at ``k`` (None where k was not run)."""
        return (self.model_extra or {}).get(str(k))

    @property
    def ks(self) -> list[str]:
        """The ks measured, as stored (``"8"``, ``"16"``)."""
        return [k for k in self.model_extra or {} if k.isdigit()]


class PositionsCrossfitRow(Shape):
    """A row's :func:`crossfit_positions` measure (``row["crossfit"]`` in the claims' rows): ``top<k>`` per k run
    (an experiment's row model declares the ks its claims read) and the overlap with the in-sample top-k."""

    overlap_in_sample: dict[str, float] | None = None


def _cluster_t(diffs: Sequence[float], clusters: Sequence[Any]) -> dict[str, Any]:
    """One-sample two-sided t of the scenario means of ``diffs`` against 0 (scipy)."""
    from scipy.stats import ttest_1samp

    by: dict[str, list[float]] = {}
    for d, c in zip(diffs, clusters, strict=True):
        if d is not None and np.isfinite(d):
            by.setdefault(str(c), []).append(float(d))
    means = np.asarray([np.mean(v) for v in by.values()])
    out: dict[str, Any] = {"test": "one-sample t on scenario means", "n_clusters": int(means.size), "p": None}
    if means.size >= 2 and np.std(means) > 0:
        out["p"] = float(ttest_1samp(means, 0.0).pvalue)
    else:
        out["note"] = "fewer than two scenarios" if means.size < 2 else "no variance across scenarios"
    return out


def paired_contrast(rows: Sequence[dict[str, Any]], effect: Sequence[Any], control: Sequence[Any],
                    seed: int = 0) -> dict[str, Any]:
    """Effect minus control, paired per row (None where either is missing): ``difference`` (mean with a
    cluster-bootstrap CI by scenario), ``effect`` and ``control`` summaries, the scenario-level t, and for
    binary outcomes the exact McNemar test (``effect_only`` / ``control_only`` discordant counts)."""
    diffs = [None if a is None or b is None else float(a) - float(b) for a, b in zip(effect, control, strict=True)]
    out: dict[str, Any] = {"effect": summarize_column(rows, list(effect), seed),
                           "control": summarize_column(rows, list(control), seed),
                           "difference": summarize_column(rows, diffs, seed),
                           "cluster_t": _cluster_t([np.nan if d is None else d for d in diffs], scenarios(rows))}
    pairs = [(a, b) for a, b in zip(effect, control) if a is not None and b is not None]
    if pairs and all(float(v) in (0.0, 1.0) for p in pairs for v in p):
        m = mcnemar_exact([bool(float(a)) for a, _ in pairs], [bool(float(b)) for _, b in pairs])
        out["mcnemar"] = {"p": m["p"], "n": m["n"], "effect_only": m["a_only"], "control_only": m["b_only"]}
    return out


# -- cross-fitting ------------------------------------------------------------------------------------------

def scenario_folds(rows: Sequence[dict[str, Any]], seed: int = 0) -> dict[int, int]:
    """Fold 0 or 1 of every row, by scenario: the scenarios are ordered by a seeded hash and alternate
    between the folds, so instances of one scenario never sit on both sides (needs two scenarios)."""
    names = sorted({str(c) for c in scenarios(rows)}, key=lambda s: (zlib.crc32(f"{seed}:{s}".encode()), s))
    if len(names) < 2:
        raise ValueError("cross-fitting needs instances of at least two scenarios")
    fold = {s: i % 2 for i, s in enumerate(names)}
    return {int(r["index"]): fold[str(c)] for r, c in zip(rows, scenarios(rows))}


def crossfit_scores(rows: Sequence[dict[str, Any]], unit_effects: Callable[[dict[str, Any]], dict[Hashable, float]],
                    seed: int = 0) -> dict[int, dict[Hashable, float]]:
    """Per row (by index): each unit's mean effect over the rows of the OTHER fold (units never seen there
    are absent). ``unit_effects(row)`` gives that row's own in-sample effect of each unit."""
    folds = scenario_folds(rows, seed)
    sums: list[dict[Hashable, list[float]]] = [{}, {}]
    for r in rows:
        for u, e in unit_effects(r).items():
            if e is not None and np.isfinite(e):
                sums[folds[int(r["index"])]].setdefault(u, []).append(float(e))
    means = [{u: float(np.mean(v)) for u, v in s.items()} for s in sums]
    return {int(r["index"]): means[1 - folds[int(r["index"])]] for r in rows}


def crossfit_top(units: Sequence[Hashable], score: dict[Hashable, float], k: int,
                 fallback: Callable[[Hashable], float] | None = None) -> list[Hashable]:
    """The ``k`` of ``units`` with the highest cross-fitted score (units the other fold never saw score
    ``fallback(unit)``, default 0); ties keep the order of ``units``."""
    def s(u: Hashable) -> float:
        return score[u] if u in score else (fallback(u) if fallback else 0.0)
    order = sorted(range(len(units)), key=lambda i: (-s(units[i]), i))
    return [units[i] for i in order[:k]]


def slot_key(token: str, roles: dict[str, str], offset: int, span: int, n_bins: int = 8) -> tuple[str, int]:
    """A context position as something other instances also have: its token, with the instance's own words
    (field values, actions) replaced by their role (``<new_action>`` ...), and the bin of its relative place
    in the downstream span (``n_bins`` equal bins)."""
    word = token.strip()
    role = next((name for name, w in roles.items() if w and word == w), None)
    return (f"<{role}>" if role else token, min(n_bins - 1, int(n_bins * offset / max(span, 1))))


def instance_roles(inst: Any) -> dict[str, str]:
    """The instance-specific words a :func:`slot_key` abstracts: both field values and both actions."""
    return {"old_value": str(inst.old_value), "new_value": str(inst.new_value),
            "old_action": str(inst.old_action), "new_action": str(inst.new_action)}


def slot_scores(keys: Sequence[tuple[str, int]], effects: Sequence[float]) -> dict[tuple[str, int], float]:
    """One instance's mean single-slot effect per slot key (several slots can share a key)."""
    acc: dict[tuple[str, int], list[float]] = {}
    for k, e in zip(keys, effects, strict=True):
        acc.setdefault(k, []).append(float(e))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def crossfit_slots(keys: Sequence[tuple[str, int]], slots: Sequence[int], score: dict[Any, float], k: int
                   ) -> list[int]:
    """An instance's top-``k`` slots by the other fold's per-key score; a key the other fold never saw falls
    back to the mean score of its token over all bins, then to 0 (slot order breaks ties)."""
    by_token: dict[str, list[float]] = {}
    for (tok, _), v in score.items():
        by_token.setdefault(tok, []).append(v)
    token_mean = {t: float(np.mean(v)) for t, v in by_token.items()}
    units = list(range(len(slots)))
    unit_score = {i: score[keys[i]] for i in units if keys[i] in score}
    top = crossfit_top(units, unit_score, k, fallback=lambda i: token_mean.get(keys[i][0], 0.0))
    return [slots[i] for i in top]


# -- cross-fitted top-k positions (suffix, specificity, knockout) ---------------------------------------------

def keep_ranking(ctx: Any, inst: Any, case: Any, ranking: Any, descending: bool = True) -> None:
    """Remember an instance's full position ranking for :func:`crossfit_positions` (in ``ctx.scratch``: all
    downstream slots are too many for a row): its slots, their strength (higher = stronger; an ascending
    ranking is negated) and their :func:`slot_key`."""
    from kvprobe.patching.ranking import decode_token

    down = list(case.pp.downstream_slots)
    where = {s: i for i, s in enumerate(down)}
    roles = instance_roles(inst)
    keys = [slot_key(decode_token(ctx.lm.tokenizer, case.pair.ids_old[s]), roles, where.get(s, 0), len(down))
            for s in ranking.positions]
    strength = [float(e) if descending else -float(e) for e in ranking.effects]
    ctx.scratch.setdefault("crossfit", {})[inst.index] = {"inst": inst, "slots": list(ranking.positions),
                                                          "strength": strength, "keys": keys}


def _instance(ctx: Any, index: int) -> Any:
    """The run's instance ``index`` (the runner puts the run's instances on the context; probes never import it)."""
    if "all_instances_by_index" not in ctx.scratch:
        ctx.scratch["all_instances_by_index"] = {i.index: i for i in ctx.instances}
    return ctx.scratch["all_instances_by_index"][index]


def crossfit_positions(ctx: Any, rows: Sequence[dict[str, Any]], ks: Sequence[int],
                       case_of: Callable[[Any], Any], rank: Callable[[Any], Any],
                       measure: Callable[[Any, list[list[int]]], list[float]], descending: bool = True
                       ) -> dict[str, Any]:
    """Top-k positions chosen for each instance from the OTHER fold's single-position effects (per slot key),
    then measured on the instance with ``measure(case, [slots per k])``; the folds swap (:func:`scenario_folds`).

    ``case_of(inst)`` rebuilds an instance's case; ``rank(case)`` is the experiment's own ranking, recomputed
    only for rows a resumed run read from disk. Returns ``{what, folds, rows: {index: {topK: value, ...}}}``
    (a ``row_measures`` entry)."""
    kept = ctx.scratch.setdefault("crossfit", {})
    for r in rows:
        if r["index"] not in kept:
            inst = _instance(ctx, r["index"])
            keep_ranking(ctx, inst, case_of(inst), rank(case_of(inst)), descending)
    scores = crossfit_scores(rows, lambda r: slot_scores(kept[r["index"]]["keys"], kept[r["index"]]["strength"]),
                             ctx.cfg.seed)
    out_rows: dict[str, dict[str, Any]] = {}
    for r in rows:
        k = kept[r["index"]]
        sets = [crossfit_slots(k["keys"], k["slots"], scores[r["index"]], kk) for kk in ks]
        values = measure(case_of(k["inst"]), sets)
        out_rows[str(r["index"])] = {**{f"top{kk}": float(v) for kk, v in zip(ks, values)},
                                     "overlap_in_sample": {str(kk): len(set(s) & set(k["slots"][:kk])) / max(kk, 1)
                                                           for kk, s in zip(ks, sets)}}
    folds = scenario_folds(rows, ctx.cfg.seed)
    return {"what": "per instance: the top-k positions chosen by the other scenario fold's single-position "
                    "effects (per token role and relative place), measured on this instance; overlap_in_sample: "
                    "share of them in the instance's own top-k; the claims rows test these",
            "folds": {str(i): f for i, f in folds.items()}, "rows": out_rows}


def crossfit_summary(rows: Sequence[dict[str, Any]], measures: dict[str, Any], ks: Sequence[int],
                     in_sample: Callable[[dict[str, Any], int], float | None],
                     random: Callable[[dict[str, Any], int], float | None], seed: int = 0) -> dict[str, Any]:
    """Per k, over gated rows (all when none passed): cross-fitted top-k against random-k (the claim) and
    against the in-sample top-k (what the selection added), each paired per instance."""
    used = [r for r in rows if r.get("included")] or list(rows)
    used = [r for r in used if str(r["index"]) in measures["rows"]]
    cf = {k: [measures["rows"][str(r["index"])][f"top{k}"] for r in used] for k in ks}
    return {"over": "gated" if any(r.get("included") for r in rows) else "all", "n": len(used),
            "n_clusters": len({str(c) for c in scenarios(used)}),
            **{str(k): {"crossfit_vs_random": paired_contrast(used, cf[k], [random(r, k) for r in used], seed),
                        "in_sample_vs_crossfit": paired_contrast(used, [in_sample(r, k) for r in used], cf[k],
                                                                 seed)}
               for k in ks}}


def crossfit_cell(summary: Crossfit, k: int | str) -> str:
    """``cross-fit top-k X [CI] vs random-k Y (in-sample Z)`` of a :func:`crossfit_summary`."""
    from kvprobe.probes.summary import ci_cell

    c = summary.at(k)
    if c is None:
        return "n/a"
    v = c.crossfit_vs_random
    return (f"cross-fit top-{k} {ci_cell(v.effect)} vs random-{k} {ci_cell(v.control)} "
            f"(diff {ci_cell(v.difference, signed=True)}; in-sample top-{k} "
            f"{ci_cell(c.in_sample_vs_crossfit.effect)}; n {summary.n}, {summary.n_clusters} scenarios)")
