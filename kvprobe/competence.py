"""Competence verdicts read from the screen's records (``experiments/screen.py``; paper App. H's inclusion gate).

``competence(model, task, mode)`` answers from the record whether full recompute decides ``task`` above chance on
``model`` in ``mode``: ``(accuracy, ci, varies, competent)``. An agreement claim on a model x task x mode whose
full recompute is not competent has no verdict: :func:`gate_note` gives the line to print instead ("not
measurable: below the competence gate ..."). ``competent`` is None where the screen had too few instances or
clusters for a verdict.

The records read are those the study publishes for the model (``study.yaml``; a model may be screened in parts,
some tasks or modes per run, and each task x mode must come from one record); without one, the only screen
record of the model under ``results/screen/``; several unpublished ones are an error naming them.

The competence measure itself has one implementation here, whoever reads it: :func:`measure` (accuracy over the
decisions, its exact interval, the verdict of :func:`is_competent` under kvprobe's gate). The screen's cells give
their verdict by :func:`is_competent` (``experiments/screen.py``), :func:`competence` re-judges a screen cell under
another gate by it, and a claim's own competence rows (:func:`kvprobe.claims.competence`: full recompute's
correctness recorded in each row of the claim's record) are measured by :func:`measure`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvprobe.errors import KVProbeError, closest
from kvprobe.stats.inference import proportion_ci

SCREEN = "screen"
COMPETENCE_GATE = 0.80  # kvprobe's gate on full-recompute accuracy (the paper's App. H admits a model at >= 0.80)
CHANCE = 0.5  # two actions: the full recompute must also be right above chance (exact CI)


class Competence(NamedTuple):
    """Full-recompute accuracy, its exact 95% interval, whether the decision follows the field on any instance
    (None where the reader does not record it), and the verdict (None: too few instances or clusters)."""

    accuracy: float
    ci: tuple[float, float]
    varies: bool | None
    competent: bool | None


def is_competent(accuracy: float, ci_low: float | None, gate: float = COMPETENCE_GATE,
                 chance: float = CHANCE) -> bool:
    """kvprobe's competence verdict: full recompute right on at least ``gate`` of its decisions and above chance
    (the exact interval's lower end above ``chance``)."""
    return bool(ci_low is not None and ci_low > chance and accuracy >= gate)


def measure(correct: Sequence[float], gate: float = COMPETENCE_GATE, chance: float = CHANCE) -> Competence | None:
    """Competence from full recompute's correctness per decision (booleans as 0/1, or a rate per instance): the
    accuracy, the exact (Clopper-Pearson) interval on the correct count rounded, and :func:`is_competent`. None
    without a decision."""
    n = len(correct)
    if not n:
        return None
    k = sum(correct)
    lo, hi = proportion_ci(int(round(k)), n)
    acc = k / n
    return Competence(acc, (lo, hi), None, is_competent(acc, lo, gate, chance))


def _model_name(record: dict[str, Any]) -> str:
    return str(record.get("model", {}).get("name") or record["config"]["model"])


def screen_records(model: str, records: Sequence[dict[str, Any]] | None = None,
                   results_dir: str | Path = "results", study_path: str | Path | None = None) -> list[dict[str, Any]]:
    """The screen records of ``model`` the study publishes (a model may be screened in parts: some tasks or
    modes per run); without a published one, its only screen record. Among ``records`` if given, else those
    under ``results_dir``."""
    from kvprobe.study import is_published

    if records is None:
        from kvprobe.runner.records import load_records

        records = load_records(results_dir, SCREEN)
    mine = [r for r in records if r.get("experiment") == SCREEN and _model_name(r) == model]
    if not mine:
        raise KVProbeError(f"no screen record for model '{model}'; run `python -m kvprobe run configs/screen.yaml "
                           f"--model {model}` (and list it in study.yaml to publish it)")
    published = [r for r in mine if is_published(model, str(r.get("config_hash")), study_path)]
    if published or len(mine) == 1:
        return published or mine
    hashes = ", ".join(sorted(str(r.get("config_hash")) for r in mine))
    raise KVProbeError(f"{len(mine)} screen records for model '{model}' ({hashes}) and none published: list the "
                       "screen runs of this model in study.yaml, or remove the stale records")


def _cell(records: Sequence[dict[str, Any]], task: str, mode: str) -> dict[str, Any]:
    """The task x mode cell: exactly one of the model's screen records must hold it."""
    have = [r["summary"]["cells"][task][mode] for r in records if mode in r["summary"]["cells"].get(task, {})]
    if len(have) == 1:
        return have[0]
    if have:
        hashes = ", ".join(str(r.get("config_hash")) for r in records)
        raise KVProbeError(f"{len(have)} screen records ({hashes}) hold '{task}' x '{mode}': publish one of them")
    screened = sorted(f"{t}/{m}" for r in records for t, ms in r["summary"]["cells"].items() for m in ms)
    name = f"{task}/{mode}"
    raise KVProbeError(f"'{name}'{closest(name, screened)} was not screened for this model; screened: "
                       f"{', '.join(screened)}")


def competence(model: str, task: str, mode: str = "direct", records: Sequence[dict[str, Any]] | None = None,
               results_dir: str | Path = "results", gate: float | None = None,
               study_path: str | Path | None = None) -> Competence:
    """``(accuracy, ci, varies, competent)`` of ``model`` on ``task`` in ``mode`` from its screen record.
    ``gate`` replaces the record's gate (the lower bound must still exceed chance)."""
    c = _cell(screen_records(model, records, results_dir, study_path), task, mode)
    acc = c["accuracy"]
    competent = c["competent"]
    if gate is not None and competent is not None:
        competent = is_competent(acc["mean"], acc["ci_low"], gate, c["chance"])
    return Competence(float(acc["mean"]), (float(acc["ci_low"]), float(acc["ci_high"])), bool(c["varies"]),
                      competent)


def gate_note(model: str, task: str, mode: str = "direct", records: Sequence[dict[str, Any]] | None = None,
              results_dir: str | Path = "results", gate: float | None = None,
              study_path: str | Path | None = None) -> str | None:
    """None where ``model`` is competent on ``task`` x ``mode``; otherwise why an agreement claim there is not
    measurable (below the gate, no verdict, or not screened)."""
    try:
        c = competence(model, task, mode, records, results_dir, gate, study_path)
    except KVProbeError as exc:
        return f"not measurable: competence not screened ({exc})"
    if c.competent:
        return None
    cell = f"full-recompute accuracy {c.accuracy:.2f} [{c.ci[0]:.2f}, {c.ci[1]:.2f}]"
    if c.competent is None:
        return f"not measurable: the competence screen has no verdict ({cell}; too few instances or clusters)"
    return f"not measurable: below the competence gate ({cell}{'' if c.varies else ', one answer whatever the field'})"
