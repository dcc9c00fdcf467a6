"""Timing: the note is written before it is read (paper Appendix C (ii)).

On the polarity 2x2 task, within the single prefill pass: the write depth is the shallowest layer at which
the conclusion becomes linearly decodable on the downstream aggregator (group-CV logistic probe over
scenarios, as in probes.py; conclusion independent of field identity by the 2x2 design) at accuracy >=
``decodable_at``; the commit depth is, per prompt, the earliest layer from which the decision token's
logit-lens margin (the model's final norm + unembedding applied to each layer's resid_post at the last
position; action logit difference new-minus-old) keeps its final sign. Depths are relative: (layer + 1) /
n_layers, the fraction of decoder layers applied. The paper: write 0.31-0.39 vs commit 0.73-0.77
(Qwen3-8B/4B, Llama-3.1-8B); 0.19-0.26 vs 0.47-0.48 (Gemma-2, Mistral).

The aggregator is the top-effect downstream position (``aggregator: top_effect``) or the last context
token (``last_context``). Where our setting differs: small models (few layers, so depths are coarse) and at
most 12 scenarios as CV groups; the probe fits on every instance by default (``fit_on``), the commit
depth is summarized over gated and over all instances.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from kvprobe.claims import Claim
from kvprobe.metrics import logit_diff
from kvprobe.patching.residuals import commit_layer, logit_lens, relative_depth
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.probes.common import (case_row, fit_rows, layer_probe, named_slots, pair_features,
                                         polarity_instances, probe_case, probe_features, slot_tokens)
from kvprobe.probes.controls import paired_contrast
from kvprobe.probes.summary import ci_cell, gate_summary, recovery_summary, which
from kvprobe.stats.probe import first_layer_at, group_cv_margins, settle_layer
from kvprobe.tasks.polarity import prompt_labels
from kvprobe.paper import headlines as paper_headlines


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    aggregator: Literal["top_effect", "last_context"] = "top_effect"
    decodable_at: float = Field(0.8, gt=0.5, le=1.0, description="held-out accuracy that counts as decodable")
    n_splits: int = Field(5, ge=2)
    c: float = Field(1.0, gt=0)
    fit_on: Literal["all", "included"] = "all"


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    case = probe_case(ctx, inst)
    slots = named_slots(ctx, case, [p.aggregator, "decision"])
    feats = pair_features(lm, case.pp, slots)
    ctx.scratch.setdefault("features", {})[inst.index] = {"aggregator": feats[p.aggregator]}
    pair, n = case.pair, lm.spec.n_layers
    row = {**case_row(ctx, inst, case), "labels": prompt_labels(inst), "probe_slots": slots,
           "probe_tokens": slot_tokens(lm, case.pp, slots)}
    for i, prompt in enumerate(("old", "new")):
        lens = logit_lens(lm, torch.from_numpy(feats["decision"][i]))
        margin = logit_diff(lens, pair.new_action_id, pair.old_action_id).double().tolist()
        row[f"lens_ld_{prompt}"] = margin
        row[f"commit_depth_{prompt}"] = relative_depth(commit_layer(margin), n)
    row["commit_depth"] = (row["commit_depth_old"] + row["commit_depth_new"]) / 2
    return row


def recompute(ctx: Context, inst: Any, row: dict[str, Any]) -> Any:
    agg = ctx.params.aggregator
    return {"aggregator": pair_features(ctx.lm, probe_case(ctx, inst).pp, {agg: row["probe_slots"][agg]})[agg]}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    p, n = ctx.params, ctx.lm.spec.n_layers
    out = gate_summary(rows, ctx.cfg.gate)
    use = fit_rows(rows, p.fit_on)
    feats = probe_features(ctx, use, lambda inst, row: recompute(ctx, inst, row))
    probe = layer_probe(use, feats, "aggregator", "conclusion", p.n_splits, p.c)
    write = first_layer_at(probe["acc"], p.decodable_at)
    out.update(aggregator=p.aggregator, fit_on=p.fit_on, n_layers=n, decodable_at=p.decodable_at,
               write_probe=probe, write_layer=write,
               write_depth=None if write is None else relative_depth(write, n))
    paired = _paired_depths(use, feats, p, n)
    out["row_measures"] = {"write_vs_commit": {
        "what": "per instance: write depth (the earliest layer from which the held-out conclusion probe is right on "
                "the aggregator for the rest of the stack, mean of the two prompts), its commit depth, and commit "
                "minus write; the claims rows test these", "rows": paired}}
    kept = [r for r in rows if str(r["index"]) in paired]
    kept_g = [r for r in kept if r["included"]] or kept
    out["write_before_commit_paired"] = paired_contrast(
        kept_g, [paired[str(r["index"])]["commit_depth"] for r in kept_g],
        [paired[str(r["index"])]["write_depth"] for r in kept_g], seed=ctx.cfg.seed)
    out["write_before_commit_paired"]["over"] = "gated" if kept_g is not kept else "all"
    out["write_before_commit_paired"]["n_never_written"] = sum(
        paired[str(r["index"])]["write_depth"] is None for r in kept_g)
    out["commit"] = recovery_summary(rows, ["commit_depth", "commit_depth_old", "commit_depth_new"], seed=ctx.cfg.seed)
    commit = out["commit"]["commit_depth"][which(out)]["mean"]
    out["write_before_commit"] = None if write is None or commit is None else out["write_depth"] < commit
    return out


def _paired_depths(rows: list[dict[str, Any]], feats: dict[int, Any], p: Params, n: int) -> dict[str, Any]:
    """Per row: write depth from the out-of-fold signed margins of the same group-CV probe, per layer (two
    prompts per row, as in :func:`layer_probe`), beside the row's commit depth."""
    if not rows:
        return {}
    x = np.concatenate([feats[r["index"]]["aggregator"] for r in rows])  # [2 * rows, layers, d]
    y = [v for r in rows for v in r["labels"]["conclusion"]]
    groups = [r["scenario"] for r in rows for _ in range(2)]
    margins = np.stack([group_cv_margins(x[:, layer], y, groups, p.n_splits, p.c) for layer in range(x.shape[1])],
                       axis=1)  # [2 * rows, layers]
    out = {}
    for i, r in enumerate(rows):
        layers = [settle_layer(margins[2 * i + j]) for j in range(2)]
        write = None if None in layers else float(np.mean([relative_depth(w, n) for w in layers]))
        out[str(r["index"])] = {"write_depth": write, "commit_depth": r["commit_depth"],
                                "commit_minus_write": None if write is None else r["commit_depth"] - write}
    return out


def table(s: dict[str, Any]) -> str:
    w = which(s)
    accs = " ".join("  - " if a is None else f"{a:.2f}" for a in s["write_probe"]["acc"])
    c = s["commit"]["commit_depth"][w]
    write = "never decodable" if s["write_depth"] is None else f"{s['write_depth']:.2f}"
    return (f"instances {s['n_instances']}, included {s['n_included']}; {s['n_layers']} layers\n"
            f"conclusion probe on the {s['aggregator']} aggregator (fit on {s['fit_on']}), accuracy per layer: {accs}\n"
            f"write depth (first layer >= {s['decodable_at']}): {write}\n"
            f"commit depth (logit-lens sign settles, {w} instances): {ci_cell(c)}\n"
            f"written before committed (pooled depths): {s['write_before_commit']}"
            + (f"\n{_paired_cell(s)}" if "write_before_commit_paired" in s else ""))


def _paired_cell(s: dict[str, Any]) -> str:
    c = s["write_before_commit_paired"]
    t = c["cluster_t"]
    return (f"commit - write, paired per instance ({c['over']}, n {c['difference']['n']}, "
            f"{c['difference']['n_clusters']} scenarios; {c['n_never_written']} never written): "
            f"{ci_cell(c['difference'], 2, signed=True)} (write {ci_cell(c['control'])}, commit {ci_cell(c['effect'])}"
            + (f"; scenario-mean t p {t['p']:.2g}" if t.get("p") is not None else "") + ")")


def headline(s: dict[str, Any]) -> str:
    w = which(s)
    accs = [a for a in s["write_probe"]["acc"] if a is not None]
    write = (f"never reaches {s['decodable_at']} (peak {max(accs):.2f})" if s["write_depth"] is None
             else f"{s['write_depth']:.2f}")
    return ((f"{_paired_cell(s)}; " if "write_before_commit_paired" in s else "")
            + f"pooled write depth {write}; commit depth {ci_cell(s['commit']['commit_depth'][w])}"
            + ("" if w == "gated" else " (all instances: none gated)"))


EXPERIMENT = Experiment(name="timing", doc=__doc__, params=Params, run_instance=run_instance,
                        section="appC", section_order=2,
                        summarize=summarize_rows, make_instances=polarity_instances, table=table, headline=headline,
                        paper=paper_headlines("timing"),
                        # The paper's claim is the ordering: the note is written before the decision commits. The write depth is one
                        # group-CV probe fit over all instances (the summary's ``write_depth``), so the test is each
                        # instance's commit depth against it (one-sided, on cluster means).
                        claims=(Claim("write_before_commit", "the note is written before the decision commits: "
                                      "commit depth minus write depth > 0, per instance (paired)", "greater",
                                      "write_vs_commit.commit_depth", "write_vs_commit.write_depth", template="polarity",
                                      role="effect"),))
