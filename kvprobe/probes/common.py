"""What the mechanism probes share (paper Section 3 probes (2)-(4), Appendix C controls).

- the names of :mod:`kvprobe.probes.case` (``Case``, ``probe_case``, ``case_row``, ``same_decision``,
  ``ld_from_recovery``), so an experiment imports its probe helpers from one place;
- :func:`polarity_instances`: the ``make_instances`` of the probes that need the polarity 2x2 task;
- :func:`pair_features` / :func:`probe_features` / :func:`layer_probe`: residual features of both prompts of
  a pair, kept per run in ``ctx.scratch`` (too large for rows; recomputed for rows a resumed run already
  had), and group-CV probes over them;
- :class:`RankingParams` / :func:`rank_positions`: how suffix and specificity rank downstream positions (an
  exact single-slot sweep, or AtP* then an exact check of its top cells);
- :func:`curve_summary` / :func:`binned_profile` / :func:`curves_table`: summaries of per-row curves (a
  dict label -> value, or a list), over gated and over all instances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvprobe.backends import HookableModel
from kvprobe.patching.pairs import PairPrefill
from kvprobe.patching.ranking import decode_token, rank_downstream
from kvprobe.patching.residuals import resid_stack
from kvprobe.probes.case import Case, case_row, ld_from_recovery, probe_case, same_decision  # noqa: F401
from kvprobe.probes.summary import recovery_summary, which
from kvprobe.schema import hash_neutral
from kvprobe.stats.probe import group_cv_accuracy
from kvprobe.tasks.gated import load_template

# Case, probe_case, case_row, ld_from_recovery and same_decision live in kvprobe.probes.case (re-exported here
# for the experiments that import them from this module).


class RankingParams(BaseModel):
    """The position ranking of the suffix / specificity probes. ``exact`` patches every downstream slot alone
    (one shared-base sweep, as the committed records did); ``atp`` ranks all slots by AtP* (one forward and one
    backward pass, kvprobe.patching.atp) and re-measures its ``atp_verify_top`` best exactly: cheap on long
    contexts. The probes' recoveries are always measured exactly; only the order of slots beyond the verified
    ones is AtP*'s, so a top-K set with K <= atp_verify_top can differ from the exact ranking's only by AtP*
    false negatives (slots it ranked below ``atp_verify_top``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ranking: str = hash_neutral("exact", pattern="^(exact|atp)$", description="'exact' or 'atp' (AtP* + verify)")
    atp_verify_top: int = hash_neutral(32, ge=1, description="with ranking 'atp': slots re-measured exactly")


def rank_positions(ctx: Any, case: Case) -> Any:
    """Downstream slots of ``case`` by single-slot recovery (oracle K/V into the stale cache), per the run's
    :class:`RankingParams`."""
    p = ctx.params
    if p.ranking == "atp":
        from kvprobe.patching.atp import atp_position_ranking

        return atp_position_ranking(ctx.lm, case.pp, case.anchor, p.atp_verify_top, ctx.cfg.batch_size)
    return rank_downstream(ctx.lm, case.pp, case.anchor, ctx.cfg.batch_size)


def polarity_instances(ctx: Any) -> list[Any]:
    """Polarity 2x2 instances from ``cfg.task`` (the template must put ``{trigger}`` in every rule)."""
    from kvprobe.tasks.polarity import generate_polarity_instances

    task = ctx.cfg.task
    ctx.template = load_template(task.template)
    insts = generate_polarity_instances(ctx.template, task.n_instances, ctx.cfg.seed, task.scenarios, task.n_filler)
    ctx.scratch["instances"] = {i.index: i for i in insts}
    return insts


# -- residual features and probes -------------------------------------------------------------------------

def named_slots(ctx: Any, case: Case, names: Sequence[str]) -> dict[str, int | None]:
    """Context slot of each named probe position: ``last_context`` (the last slot before the query suffix),
    ``top_effect`` (the downstream slot whose oracle K/V alone moves the stale decision most) or
    ``decision`` (None: the query suffix's last token, where the decision is read)."""
    slots: dict[str, int | None] = {}
    for name in names:
        if name == "last_context":
            slots[name] = case.pp.context_length - 1
        elif name == "top_effect":
            slots[name] = rank_downstream(ctx.lm, case.pp, case.anchor, ctx.cfg.batch_size).positions[0]
        elif name == "decision":
            slots[name] = None
        else:
            raise ValueError(f"probe position '{name}' is not one of last_context, top_effect, decision")
    return slots


def pair_features(lm: HookableModel, pp: PairPrefill, slots: dict[str, int | None], layers: Sequence[int] | None = None
                  ) -> dict[str, np.ndarray]:
    """``resid_post`` of both prompts (old, new) at named context slots (None = the decision token, read
    over each prompt's own cache): name -> ``[2, layers, d_model]`` float32."""
    ctx_named = {n: s for n, s in slots.items() if s is not None}
    out: dict[str, list[np.ndarray]] = {n: [] for n in slots}
    for ids, state in ((pp.pair.ids_old, pp.old), (pp.pair.ids_new, pp.new)):
        if ctx_named:
            acts = resid_stack(lm, ids[: pp.context_length], list(ctx_named.values()), layers=layers)
            for j, name in enumerate(ctx_named):
                out[name].append(acts[:, j].numpy())
        if len(ctx_named) < len(slots):
            acts = resid_stack(lm, pp.suffix, [len(pp.suffix) - 1], prior=state, layers=layers)
            for name in slots:
                if slots[name] is None:
                    out[name].append(acts[:, 0].numpy())
    return {n: np.stack(v) for n, v in out.items()}


def slot_tokens(lm: HookableModel, pp: PairPrefill, slots: dict[str, int | None]) -> dict[str, str]:
    return {n: decode_token(lm.tokenizer, pp.pair.ids_old[s] if s is not None else pp.suffix[-1])
            for n, s in slots.items()}


def probe_features(ctx: Any, rows: Sequence[dict[str, Any]],
                   compute: Callable[[Any, dict[str, Any]], dict[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
    """Features of every row: those ``run_instance`` kept in ``ctx.scratch['features']``, and, for rows a
    resumed run read back from disk, ``compute(instance, row)`` again."""
    kept = ctx.scratch.setdefault("features", {})
    for row in rows:
        if row["index"] not in kept:
            kept[row["index"]] = compute(ctx.scratch["instances"][row["index"]], row)
    return {r["index"]: kept[r["index"]] for r in rows}


def layer_probe(rows: Sequence[dict[str, Any]], feats: dict[int, dict[str, np.ndarray]], position: str,
                label: str, n_splits: int, c: float) -> dict[str, Any]:
    """Per layer, the group-CV accuracy (groups = scenario) of a logistic probe for ``label`` from the
    features at ``position``; two samples per row (its old and new prompt)."""
    if not rows:
        return {"acc": [], "chance": [], "n": 0, "n_groups": 0}
    x = np.concatenate([feats[r["index"]][position] for r in rows])  # [2 * rows, layers, d]
    y = [v for r in rows for v in r["labels"][label]]
    groups = [r["scenario"] for r in rows for _ in range(2)]
    fits = [group_cv_accuracy(x[:, layer], y, groups, n_splits, c) for layer in range(x.shape[1])]
    return {"acc": [f["acc"] for f in fits], "chance": [f["chance"] for f in fits], "n": len(y),
            "n_groups": fits[0]["n_groups"]}


def fit_rows(rows: Sequence[dict[str, Any]], fit_on: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["included"]] if fit_on == "included" else list(rows)


# -- summaries of curves ------------------------------------------------------------------------------------

def _as_dict(curve: Any) -> dict[str, Any]:
    return {str(i): v for i, v in enumerate(curve)} if isinstance(curve, list) else dict(curve)


def curve_summary(rows: Sequence[dict[str, Any]], key: str | Callable[[dict[str, Any]], Any],
                  seed: int = 0) -> dict[str, Any]:
    """Per label of each row's curve (``row[key]``, or ``key(row)``; a dict, or a list indexed 0..n-1): mean
    with a cluster-bootstrap CI by scenario over gated and over all instances. Booleans summarize as rates
    with exact (Clopper-Pearson) intervals."""
    get = key if callable(key) else (lambda row: row[key])
    flat, labels = [], []
    for row in rows:
        curve = _as_dict(get(row))
        labels += [k for k in curve if k not in labels]
        flat.append({"included": row["included"], "scenario": row.get("scenario", f"#{row.get('index')}"),
                     **{k: (v if v is None or isinstance(v, bool) else float(v)) for k, v in curve.items()}})
    for f in flat:
        for k in labels:
            f.setdefault(k, None)
    return recovery_summary(flat, labels, seed=seed)


def binned_profile(values: Sequence[float | None], n_bins: int) -> list[float | None]:
    """Mean of ``values`` in ``n_bins`` equal bins of relative position (None where a bin is empty)."""
    n = len(values)
    out: list[float | None] = []
    for b in range(n_bins):
        part = [v for v in values[b * n // n_bins:(b + 1) * n // n_bins] if v is not None and np.isfinite(v)]
        out.append(float(np.mean(part)) if part else None)
    return out


def curves_table(summary: dict[str, Any], sections: Sequence[tuple[str, str]]) -> str:
    """Terminal table: the gate line, then per section (title, summary key) one line per label."""
    w = which(summary)
    g = summary["gate"]
    lines = [f"instances {summary['n_instances']}, included {summary['n_included']} (inclusion rule: oracle flip >= "
             f"{g['min_flip']} nats); oracle flip median {summary['oracle_flip'].get('median', float('nan')):.3f}; "
             f"means over {w} instances"]
    for title, key in sections:
        lines.append(title)
        for label, stat in summary[key].items():
            s = stat[w]
            cell = "n/a" if not s["n"] or s["mean"] is None else \
                f"{s['mean']:+.3f} (no CI: {s.get('ci_note', '')}) n={s['n']}" if s.get("ci_low") is None else \
                f"{s['mean']:+.3f} [{s['ci_low']:+.3f}, {s['ci_high']:+.3f}] n={s['n']}"
            lines.append(f"  {label:<14}{cell}")
    return "\n".join(lines)
