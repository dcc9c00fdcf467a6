"""Linear decodability: the conclusion is written on downstream tokens at prefill (paper Section 3 probe
(3); Appendix C (i) "a logit-probe finds both").

On the polarity 2x2 task (field value x trigger; conclusion = field equals trigger) we read ``resid_post``
of every layer at a few positions of each prompt of a pair: the last context token, the top-effect
downstream aggregator (the single position whose oracle K/V moves the stale decision most) and the
decision token. Per position, layer and label (conclusion, field identity, trigger identity) a logistic
probe is scored by group cross-validation with groups = scenario, so a probe must generalize to unseen
scenarios. The design makes conclusion and field identity independent, so the two are decoded
separately; decodability alone cannot say which one the decision uses (the causal controls do).

Probes fit on every instance by default (``fit_on: all``): decodability is a question about the
representation, not about the behavioural flip; ``fit_on: included`` restricts them to gated instances.
Where our setting differs: small models with few scenarios (12 groups at most), so held-out accuracy is
coarse; features of a run are held in memory, not in the record.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.runner.experiment import Context, Experiment
from kvprobe.probes.common import (case_row, fit_rows, layer_probe, named_slots, pair_features,
                                         polarity_instances, probe_case, probe_features, slot_tokens)
from kvprobe.probes.summary import gate_summary
from kvprobe.tasks.polarity import prompt_labels
from kvprobe.paper import headlines as paper_headlines

Position = Literal["last_context", "top_effect", "decision"]
LABELS = ("conclusion", "field", "trigger")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    positions: list[Position] = Field(default_factory=lambda: ["last_context", "top_effect", "decision"])
    n_splits: int = Field(5, ge=2, description="GroupKFold splits (capped at the number of scenarios)")
    c: float = Field(1.0, gt=0, description="inverse L2 strength of the logistic probe")
    fit_on: Literal["all", "included"] = "all"


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    case = probe_case(ctx, inst)
    slots = named_slots(ctx, case, list(ctx.params.positions))
    ctx.scratch.setdefault("features", {})[inst.index] = pair_features(ctx.lm, case.pp, slots)
    return {**case_row(ctx, inst, case), "labels": prompt_labels(inst), "probe_slots": slots,
            "probe_tokens": slot_tokens(ctx.lm, case.pp, slots)}


def recompute(ctx: Context, inst: Any, row: dict[str, Any]) -> Any:
    return pair_features(ctx.lm, probe_case(ctx, inst).pp, row["probe_slots"])


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    p = ctx.params
    out = gate_summary(rows, ctx.cfg.gate)
    use = fit_rows(rows, p.fit_on)
    feats = probe_features(ctx, use, lambda inst, row: recompute(ctx, inst, row))
    out.update(fit_on=p.fit_on, n_layers=ctx.lm.spec.n_layers)
    out["probes"] = {pos: {label: layer_probe(use, feats, pos, label, p.n_splits, p.c) for label in LABELS}
                     for pos in p.positions}
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']}, included {s['n_included']}; probes fit on {s['fit_on']} instances; "
             "held-out accuracy per layer (group-CV over scenarios)"]
    for pos, labels in s["probes"].items():
        for label, res in labels.items():
            accs = " ".join("  - " if a is None else f"{a:.2f}" for a in res["acc"])
            lines.append(f"  {pos:<13}{label:<11}n={res['n']:<4} {accs}")
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> str:
    """Best held-out accuracy over layers (and where), per position and label; chance is 0.5."""
    cells = []
    for pos, labels in s["probes"].items():
        parts = []
        for label in ("conclusion", "field"):
            accs = labels[label]["acc"]
            layers = [layer for layer, a in enumerate(accs) if a is not None]  # None: label constant there
            if not layers:
                parts.append(f"{label} n/a")
                continue
            best = max(layers, key=lambda layer: accs[layer])  # the shallowest layer among ties
            parts.append(f"{label} {accs[best]:.2f} (L{best})")
        cells.append(f"{pos}: " + ", ".join(parts))
    return "best layer accuracy, " + "; ".join(cells) + f" (fit on {s['fit_on']}, chance 0.5)"


EXPERIMENT = Experiment(name="probes", doc=__doc__, params=Params, run_instance=run_instance,
                        section="sec3", section_order=5,
                        summarize=summarize_rows, make_instances=polarity_instances, table=table, headline=headline,
                        paper=paper_headlines("probes"),
                        # No row claim: held-out probe accuracy is one group-CV fit over all rows (a summary
                        # quantity); a row holds only labels and probe slots.
                        claims=())
