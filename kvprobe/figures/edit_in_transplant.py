"""Figure 7a: editing inside a transplant. Per edit method, recovery and P(correct) on the composed cache
(field inside a precompiled, re-rotated chunk) against the same method on a normally prefilled context; the
paper's result is points on the diagonal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import covers_chance, latest_per_model, save, short_model


def _point(stat: dict[str, Any]) -> tuple[float, float, float] | None:
    mean = stat.get("mean")
    if mean is None:
        return None
    lo = mean if stat.get("ci_low") is None else stat["ci_low"]
    hi = mean if stat.get("ci_high") is None else stat["ci_high"]
    return mean, mean - lo, hi - mean


def fig7a_edit_in_transplant(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, axes = plt.subplots(1, 2, figsize=(6.5, 4.0))
    methods: list[str] = []  # one colour per method across every model (records differ in their arms)
    for rec in per_model.values():
        methods += [n for n in rec["summary"]["methods"] if n not in methods]
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    markers = "osD^v<>"
    for ax, metric, label in ((axes[0], "recovery", "recovery"), (axes[1], "p_correct", "P(correct)")):
        ax.plot([-0.2, 1.2], [-0.2, 1.2], color="grey", lw=0.8, ls="--")
        labelled: set[str] = set()
        for m, (model, rec) in enumerate(per_model.items()):
            if metric == "recovery" and not rec["summary"].get("n_included"):
                continue  # a recovery over no gated instance divides noise: P(correct) and agreement only
            for name, b in rec["summary"]["methods"].items():
                i = methods.index(name)
                x, y = _point(b["normal"][metric]), _point(b["composed"][metric])
                if x is None or y is None:
                    continue
                ax.errorbar(x[0], y[0], xerr=[[x[1]], [x[2]]], yerr=[[y[1]], [y[2]]], fmt=markers[m % len(markers)],
                            color=cmap(i), ms=5, lw=0.7, capsize=2, label=None if name in labelled else name)
                labelled.add(name)
            if metric == "p_correct":
                reference = rec["summary"]["methods"].get("full_reprefill", {}).get("normal", {}).get("p_correct")
                chance = " (AT CHANCE: full reprefill's P(correct) holds 0.5)" if covers_chance(reference) else ""
                ax.plot([], [], markers[m % len(markers)], color="black", label=f"model: {short_model(model)}{chance}")
        ax.set_xlabel(f"{label}, normally prefilled context", fontsize=7)
        ax.set_ylabel(f"{label}, field inside the transplanted chunk", fontsize=7)
        ax.set_xlim(-0.2, 1.2)
        ax.set_ylim(-0.2, 1.2)
        ax.set_aspect("equal")
        ax.tick_params(labelsize=6)
    handles, names = axes[1].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=6, loc="lower center", ncol=3, frameon=False)
    axes[0].set_title("models with gated instances", fontsize=8)
    axes[1].set_title("every model", fontsize=8)
    fig.suptitle("Editing inside a transplant vs a normal context (paper Fig. 7a)", fontsize=9)
    fig.subplots_adjust(bottom=0.24, top=0.88, left=0.09, right=0.98, wspace=0.3)
    fig._kvprobe_laid_out = True
    save(fig, path)


FIGURES = {"fig7a_edit_in_transplant": ("edit_in_transplant", fig7a_edit_in_transplant)}
