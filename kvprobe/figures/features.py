"""Figures of the direction and SAE probes (paper Figure 15b: a conclusion direction; Figure 15e: SAE features).

Each reads the newest record per model of its experiment. Recoveries are over held-out families; the legend
says whether over included pairs or (none included) over all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from kvprobe.figures.common import latest_per_model, save, short_model, task_template
from kvprobe.paper import paper_value


def _mean(stat: dict[str, Any] | None) -> float:
    return np.nan if not stat or stat.get("mean") is None else float(stat["mean"])


def _err(stat: dict[str, Any] | None) -> tuple[float, float]:
    m = _mean(stat)
    if not stat or stat.get("ci_low") is None or not np.isfinite(m):
        return 0.0, 0.0
    return m - stat["ci_low"], stat["ci_high"] - m


def widest_per_model_and_task(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model and task template (the gated task unnamed, others in parentheses): the record with the most
    sites, the newest among equals (records come sorted oldest first)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        stem = Path(task_template(rec)).stem
        name = rec["model"]["name"] + ("" if stem == "gated" else f" ({stem})")
        if name not in out or len(rec["summary"].get("sites", [])) >= len(out[name]["summary"].get("sites", [])):
            out[name] = rec
    return out


def fig15b_directions(records: list[dict[str, Any]], path: Path) -> None:
    """Per model: (left) held-out recovery per site of the full-site patch, DAS, the difference-of-means
    direction and random directions; (middle) steering dose curves at the site where the difference of means
    recovers most; (right) held-out decodability of the residual difference-of-means projection per layer.
    One row per model and task: the record covering the most sites (the newest among equals), so a narrower
    follow-up run (e.g. boundless DAS at one site) does not replace the main one."""
    per_model = widest_per_model_and_task(records)
    fig, axes = plt.subplots(len(per_model), 3, figsize=(6.5, 2.7 * len(per_model) + 0.4), squeeze=False)
    kinds = [("full", "full site", "tab:gray"), ("sub:das", "DAS", "tab:purple"), ("dir:dom", "diff. of means", "tab:blue"),
             ("dir:random", "random 1-D", "tab:orange")]
    for row, (name, rec) in zip(axes, per_model.items()):
        s = rec["summary"]
        sites = s.get("sites", [])
        a = row[0]
        for j, (key, label, color) in enumerate(kinds):
            xs = np.arange(len(sites)) + (j - 1.5) * 0.2
            stats = [x["effects"].get(key, {}).get("recovery") for x in sites]
            errs = np.array([_err(st) for st in stats]).T if sites else np.zeros((2, 0))
            a.bar(xs, [_mean(st) for st in stats], 0.2, yerr=errs, color=color, label=label, capsize=2)
        a.set_xticks(range(len(sites)), [x["site"] for x in sites], rotation=45, fontsize=6)
        over = sites[0]["effects"].get("recovery_over", "included") if sites else "included"
        a.set_title(f"{short_model(name)}: held-out ({over})", fontsize=7)
        a.axhline(0, color="black", lw=0.5)
        a.axhline(1, color="black", lw=0.4, ls=":")
        dom = paper_value("figure.fig15b_directions.dom")
        a.axhspan(*dom.low_high, color="black", alpha=0.3, lw=0)
        a.annotate(f"paper dom {dom.shown()} (not the same quantity)", (1.0, dom.low_high[1]),
                   xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=5)
        a.legend(fontsize=5)
        b = row[1]
        scored = [x for x in sites if np.isfinite(_mean(x["effects"]["dir:dom"]["recovery"]))]
        if scored:
            best = max(scored, key=lambda x: _mean(x["effects"]["dir:dom"]["recovery"]))
            for key, color in (("dom", "tab:blue"), ("random0", "tab:orange")):
                curve = best["effects"]["steering"][key]
                alphas = [float(a_) for a_ in curve]
                b.errorbar(alphas, [_mean(v["recovery"]) for v in curve.values()],
                           yerr=np.array([_err(v["recovery"]) for v in curve.values()]).T, marker="o", color=color,
                           label=f"{'diff. of means' if key == 'dom' else 'random'} (IIA " +
                                 "/".join(f"{_mean(v['iia']):.2f}" for v in curve.values()) + ")", capsize=2)
            b.set_title(f"steering at {best['site']} (x gap {best['gap']:.2f})", fontsize=7)
            b.set_xlabel("steering alpha", fontsize=7)
            b.set_ylabel("recovery to other decision", fontsize=7)
            b.axhline(0, color="black", lw=0.5)
            b.legend(fontsize=4.5, loc="lower right", frameon=False)
        c = row[2]
        acc = s.get("layer_decodability") or []
        c.plot(range(len(acc)), acc, marker=".")
        c.axhline(0.5, color="black", lw=0.4, ls=":")
        c.set_ylim(0, 1.05)
        c.set_xlabel("layer", fontsize=7)
        c.set_title("held-out acc., dom projection", fontsize=7)
    fig.suptitle("A conclusion direction at the notes (paper Fig. 15b)", fontsize=10)
    save(fig, path)


def fig15e_sae(records: list[dict[str, Any]], path: Path) -> None:
    """Per model: clamping dose curves (top-k conclusion features vs k random live features) and the
    training-family vs held-out-family AUC of the top features, per SAE site."""
    per_model = latest_per_model(records)
    fig, axes = plt.subplots(len(per_model), 2, figsize=(6.5, 2.7 * len(per_model) + 0.4), squeeze=False)
    for row, (name, rec) in zip(axes, per_model.items()):
        s = rec["summary"]
        a, b = row
        for site, rep in s["saes"].items():
            r = rep["reconstruction"]
            if "clamping" in rep:
                c = rep["clamping"]
                ks = list(c["top"])
                for kind, color, ls in (("top", "tab:red", "-"), ("random", "tab:gray", ":")):
                    a.errorbar(range(len(ks)), [_mean(c[kind][k]["recovery"]) for k in ks],
                               yerr=np.array([_err(c[kind][k]["recovery"]) for k in ks]).T, color=color, ls=ls,
                               marker="o", capsize=2, label=f"{site} SAE {kind}-k (EV {r['explained_variance']:.3f}, "
                                                            f"dCE {r['delta_ce']:+.3f})")
                a.set_xticks(range(len(ks)), ks)
            top = rep["features"]["top"]
            xs = np.arange(len(top)) + (0.2 if site == "v" else -0.2)
            b.bar(xs - 0.1, [t["auc_train"] for t in top], 0.2, label=f"{site}: train families")
            b.bar(xs + 0.1, [np.nan if t["auc_held_out"] is None else t["auc_held_out"] for t in top], 0.2,
                  label=f"{site}: held-out families")
        a.set_xlabel("top-k features clamped at the notes", fontsize=7)
        a.set_ylabel("recovery to other decision", fontsize=7)
        a.set_title(f"{short_model(name)}: clamping (held-out pairs)", fontsize=7)
        clamp = paper_value("figure.fig15e_sae.clamp_topk")
        a.plot(range(len(clamp.curve)), list(clamp.curve.values()), "k*--", ms=5, lw=0.8,
               label=f"paper, k={'/'.join(clamp.curve)} ({clamp.model})")
        a.axhline(0, color="black", lw=0.5)
        a.legend(fontsize=5)
        b.axhline(0.5, color="black", lw=0.4, ls=":")
        b.set_ylim(0, 1.05)
        b.set_xlabel("feature rank (on training families)", fontsize=7)
        b.set_ylabel("ROC AUC, block vs allow", fontsize=7)
        b.set_title(f"{short_model(name)}: layer {s['layer']} SAE features", fontsize=7)
        b.legend(fontsize=5)
    fig.suptitle("SAE features of the conclusion (paper Fig. 15e)", fontsize=10)
    save(fig, path)


FIGURES = {"fig15b_directions": ("directions", fig15b_directions), "fig15e_sae": ("sae", fig15e_sae)}
