"""Graded measures and must-fail controls of the application experiments (memory, τ², two-hop, agent, LoCoMo,
edit-in-transplant, long horizon, transplant).

A binary "agrees with full recompute" is vacuous where full recompute answers one way whatever the content (a
stale cache then agrees too). So every arm of an application record also carries graded measures, read even
when every decision is the same:

- ``ld``: the two-action logit difference under the arm's cache (:func:`kvprobe.probes.decision.read_actions`),
  and ``ld_error``, its distance from full recompute's (nats); for a free-form answer (LoCoMo) the measure is
  ``gold_logprob``, the teacher-forced log-probability of the gold answer
  (:func:`kvprobe.probes.decision.answer_logprob`);
- ``retained``, the *field effect retained*: (LD under the arm's cache of the new content minus under its cache
  of the old) / (the same under full recompute). 1 is full recompute's response to the change, 0 a cache that
  ignores it (a stale cache: 0 by construction). Undefined (None) where full recompute's own field effect is
  below :data:`MIN_FIELD_EFFECT` nats (a ratio over noise);

and every treatment stands beside a control that must fail (:func:`control_entry`): a stale or frozen cache, the
chunk spliced without re-rotation at a large offset, shuffled blocks, an evidence-ablated or wrong memory. The
``separation`` is the control's error minus the treatment's (nats; > 0: the control is further from full
recompute), and ``retained_separation`` the treatment's retained field effect minus the control's; summaries
give both with cluster-bootstrap CIs by scenario (:func:`controls_summary`). A splice moved ``far_offset``
positions up and re-rotated must read as in place (:func:`far_check`: ~0), which a splice that skips the
re-rotation fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvprobe.probes.controls import paired_contrast
from kvprobe.probes.summary import ci_cell, summarize_column

MIN_FIELD_EFFECT = 0.5  # nats: kvprobe's floor on full recompute's field effect (the inclusion rule's min_flip)
FAR_OFFSET = 2048  # positions: kvprobe's default large offset for the no-rotation control (>= 2,000)


def field_effect_retained(arm_new: float | None, arm_old: float | None, full_new: float | None,
                          full_old: float | None, floor: float | None = None) -> float | None:
    """(arm_new - arm_old) / (full_new - full_old), None where an LD is missing or |full's effect| < ``floor``
    (default :data:`MIN_FIELD_EFFECT`, read at call time)."""
    if None in (arm_new, arm_old, full_new, full_old):
        return None
    effect = float(full_new) - float(full_old)  # type: ignore[arg-type]
    if abs(effect) < (MIN_FIELD_EFFECT if floor is None else floor):
        return None
    return (float(arm_new) - float(arm_old)) / effect  # type: ignore[arg-type]


def arm_entry(value: float, full: float, retained: float | None = None, measure: str = "ld",
              **extra: Any) -> dict[str, Any]:
    """An arm's graded read: its ``measure`` (default ``ld``; LoCoMo's ``gold_logprob``), ``<measure>_error`` =
    |value - full recompute's| and, where measured, the field effect ``retained`` (plus ``extra``, e.g. ``agree``)."""
    out: dict[str, Any] = {measure: float(value), f"{measure}_error": abs(float(value) - float(full))}
    if retained is not None:
        out["retained"] = float(retained)
    return {**out, **extra}


def control_entry(treatment: str, arms: dict[str, dict[str, Any]], control: str, measure: str = "ld") -> dict[str, Any]:
    """A must-fail control beside its treatment, both :func:`arm_entry` dicts in ``arms``: the measure of each,
    their errors and the ``separation`` (control's error minus the treatment's), each side's ``retained`` and
    the ``retained_separation`` (treatment minus control) where both have one, and each side's agreement."""
    t, c = arms[treatment], arms[control]
    err = f"{measure}_error"
    out: dict[str, Any] = {"treatment": treatment, "measure": measure, "value": c[measure],
                           "treatment_value": t[measure], "error": c[err], "treatment_error": t[err],
                           "separation": c[err] - t[err]}
    if t.get("retained") is not None and c.get("retained") is not None:
        out.update(retained=c["retained"], treatment_retained=t["retained"],
                   retained_separation=t["retained"] - c["retained"])
    if "agree" in t and "agree" in c:
        out.update(agree=bool(c["agree"]), treatment_agree=bool(t["agree"]))
    return out


def far_check(rotated_far: float, rotated_near: float) -> float:
    """|LD of the re-rotated splice moved ``far_offset`` up - LD of the same splice at its own place|: RoPE attention
    reads relative positions only, so an exact re-rotation gives ~0 (fp32 error); a splice whose keys are not
    re-rotated to where they land gives the no-rotation control's gap instead."""
    return abs(float(rotated_far) - float(rotated_near))


def _rows(items: Iterable[tuple[Any, dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(stand-in rows carrying the scenario, the entries) of ``(scenario, entry)`` pairs."""
    pairs = list(items)
    return [{"scenario": s} for s, _ in pairs], [e for _, e in pairs]


def _per_name(items: Iterable[tuple[Any, dict[str, dict[str, Any]]]]
              ) -> Iterable[tuple[str, list[tuple[dict[str, Any], dict[str, Any]]]]]:
    """Each arm or control name, in first-seen order, with the (row, entry) pairs of the instances that have it."""
    rows, entries = _rows(items)
    for name in dict.fromkeys(n for e in entries for n in e):
        yield name, [(r, e[name]) for r, e in zip(rows, entries) if name in e]


def arms_summary(items: Iterable[tuple[Any, dict[str, dict[str, Any]]]], seed: int = 0,
                 measure: str = "ld") -> dict[str, Any]:
    """Per arm over ``(scenario, {arm: arm_entry})`` pairs: the ``measure``, its error and ``retained`` (mean with
    a cluster-bootstrap CI by scenario; ``retained`` over the instances where it is defined), agreement and, where
    the arms carry one, the logit cosine."""
    out: dict[str, Any] = {}
    for name, have in _per_name(items):
        sub = [r for r, _ in have]
        block = {k: summarize_column(sub, [a.get(k) for _, a in have], seed) for k in (measure, f"{measure}_error")}
        if any(a.get("retained") is not None for _, a in have):
            block["retained"] = summarize_column(sub, [a.get("retained") for _, a in have], seed)
        if any("agree" in a for _, a in have):
            block["agreement"] = summarize_column(sub, [a.get("agree") for _, a in have], seed)
        if any("cosine" in a for _, a in have):
            block["cosine"] = summarize_column(sub, [a.get("cosine") for _, a in have], seed)
        out[name] = block
    return out


def _sides(sub: list[dict[str, Any]], control: list[Any], treatment: list[Any], first: str, seed: int
           ) -> dict[str, Any]:
    """Both sides summarized and their paired difference (``first`` minus the other; cluster CI, and McNemar
    for decisions), keyed ``control`` / ``treatment`` / ``separation``."""
    ctrl_first = first == "control"
    c = paired_contrast(sub, control if ctrl_first else treatment, treatment if ctrl_first else control, seed)
    out = {"control": c["effect" if ctrl_first else "control"], "treatment": c["control" if ctrl_first else "effect"],
           "separation": c["difference"], "cluster_t": c["cluster_t"]}
    if "mcnemar" in c:
        out["mcnemar"] = c["mcnemar"]
    return out


def controls_summary(items: Iterable[tuple[Any, dict[str, dict[str, Any]]]], seed: int = 0) -> dict[str, Any]:
    """Per control over ``(scenario, {control: control_entry})`` pairs: the treatment's name, the measure and, each
    with both sides and a paired ``separation`` (cluster-bootstrap CI by scenario): ``error`` (control minus
    treatment: > 0, the control is further from full recompute), ``retained`` (treatment minus control, where
    measured) and ``agreement`` with full recompute's decision (treatment minus control; McNemar)."""
    out: dict[str, Any] = {}
    for name, have in _per_name(items):
        sub = [r for r, _ in have]
        cs = [c for _, c in have]
        block: dict[str, Any] = {"treatment": cs[0]["treatment"], "measure": cs[0]["measure"], "n": len(cs),
                                 "error": _sides(sub, [c["error"] for c in cs], [c["treatment_error"] for c in cs],
                                                 "control", seed)}
        if any(c.get("retained") is not None for c in cs):
            block["retained"] = _sides(sub, [c.get("retained") for c in cs],
                                       [c.get("treatment_retained") for c in cs], "treatment", seed)
        if any("agree" in c for c in cs):
            block["agreement"] = _sides(sub, [c.get("agree") for c in cs], [c.get("treatment_agree") for c in cs],
                                        "treatment", seed)
        out[name] = block
    return out


_UNITS = {"ld": "two-action LD, nats", "gold_logprob": "teacher-forced log-prob of the gold answer, nats"}


def graded_lines(graded: dict[str, Any] | None, controls: dict[str, Any] | None, indent: str = "  ",
                 measure: str = "ld") -> list[str]:
    """Table lines: each arm's measure, its error and retained field effect; each control beside its treatment
    with the separation and its CI. Empty for a record without graded measures (older records)."""
    lines: list[str] = []
    if graded:
        lines.append(f"{indent}graded ({_UNITS.get(measure, measure)}; error = |value - full recompute's|"
                     + ("; field effect retained, 1 = full recompute's" if any("retained" in b for b in graded.values())
                        else "") + "):")
        for name, b in graded.items():
            cells = [f"{measure} {ci_cell(b[measure], 2, signed=True)}", f"error {ci_cell(b[f'{measure}_error'])}"]
            if "retained" in b:
                cells.append(f"retained {ci_cell(b['retained'])}")
            if "agreement" in b:
                cells.append(f"agree {ci_cell(b['agreement'])}")
            lines.append(f"{indent}  {name:<20}" + "; ".join(cells))
    if controls:
        lines.append(f"{indent}must-fail controls beside their treatment (control vs treatment; separation: error "
                     "control - treatment, nats, > 0 = the control fails; retained and agreement: treatment - "
                     "control):")
        for name, b in controls.items():
            e = b["error"]
            cell = (f"{indent}  {name:<20}vs {b['treatment']}: error {ci_cell(e['control'])} vs "
                    f"{ci_cell(e['treatment'])}, separation {ci_cell(e['separation'], 2, signed=True)}")
            if "retained" in b:
                r = b["retained"]
                cell += (f"; retained {ci_cell(r['control'])} vs {ci_cell(r['treatment'])} "
                         f"({ci_cell(r['separation'], 2, signed=True)})")
            if "agreement" in b:
                a = b["agreement"]
                cell += f"; agree {ci_cell(a['control'])} vs {ci_cell(a['treatment'])}"
            lines.append(cell)
    return lines


def controls_headline(controls: dict[str, Any] | None) -> str:
    """``controls: name sep +x.xx [lo, hi], ...`` for a headline ("" without controls)."""
    if not controls:
        return ""
    return "controls: " + ", ".join(f"{n} sep {ci_cell(b['error']['separation'], 2, signed=True)}"
                                    for n, b in controls.items())


def pick(names: Sequence[str], allowed: Sequence[str], key: str) -> list[str]:
    """A params validator's body for a controls list: a subset of ``allowed``, each once (may be empty)."""
    if any(v not in allowed for v in names) or len(set(names)) != len(names):
        raise ValueError(f"{key} must be a subset of {list(allowed)}, each once; got {list(names)}")
    return list(names)


def retained_across_turns(turns: list[dict[str, Any]], new_value: str, reference: str, treatment: str,
                          controls: Mapping[str, str] | None = None) -> None:
    """A multi-turn trajectory's graded measures, written into its turns: from turn 2 on, each arm's field effect
    retained (the turn-to-turn change of LD(new value's action - old) under the arm's cache, over the same under
    full recompute, whose LD each turn holds under ``reference``), then the frozen cache beside ``treatment`` and
    each further control beside its treatment (``controls``: control arm -> treatment arm, where present).
    Each turn's LDs are right - wrong; a turn whose ``value`` is not ``new_value`` is turned to new - old."""
    def oriented(t: dict[str, Any], ld: float) -> float:
        return ld if t["value"] == new_value else -ld

    for prev, t in zip(turns, turns[1:]):
        ref_new, ref_old = oriented(t, t[reference]), oriented(prev, prev[reference])
        for name, a in t["graded"].items():
            ret = field_effect_retained(oriented(t, a["ld"]), oriented(prev, prev["graded"][name]["ld"]), ref_new,
                                        ref_old)
            if ret is not None:
                a["retained"] = ret
        t["controls"] = {"frozen": control_entry(treatment, t["graded"], "frozen")}
        for control, treated in (controls or {}).items():
            if control in t["graded"]:
                t["controls"][control] = control_entry(treated, t["graded"], control)
