"""Section 7 user memory: E1 accuracy against memory length, early vs late, direct vs chain (Fig. 8); E2
transplant agreement (Fig. 9); E4 cosine against the number of blocks S, contiguous vs split (Fig. 24); E3
P(correct) per edit method, direct and after a chain (Fig. 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, covers_chance, latest_per_model, mark_at_chance, save, short_model


def _e1(ax: plt.Axes, per_model: dict[str, dict[str, Any]]) -> None:
    cmap = plt.get_cmap("tab10")
    for m, (model, rec) in enumerate(per_model.items()):
        e1 = rec["summary"].get("e1")
        if not e1:
            continue
        xs = [e1["memory_tokens"][str(n)]["mean"] for n in e1["lines"]]
        for j, mode in enumerate(e1["modes"]):
            for pl in e1["placements"]:
                ys = [e1["accuracy"][mode][pl][str(n)]["mean"] for n in e1["lines"]]
                ax.plot(xs, ys, marker="os^v"[m % 4], color=cmap(2 * m + j), ls="-" if pl == "early" else "--",
                        label=f"{short_model(model)}, {mode}, {pl}")
    ax.axhline(0.5, color="grey", lw=0.7, ls=":")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("memory tokens", fontsize=7)
    ax.set_ylabel("full-recompute accuracy", fontsize=7)
    ax.set_title("E1 placement (solid early, dashed late)", fontsize=8)
    cells = [c for rec in per_model.values() if rec["summary"].get("e1")
             for by_pl in rec["summary"]["e1"]["accuracy"].values() for by_n in by_pl.values() for c in by_n.values()]
    if cells and all(covers_chance(c) for c in cells):
        mark_at_chance(ax, "every cell's full-recompute\naccuracy interval holds 0.5")


def fig_memory(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, grid = plt.subplots(2, 2, figsize=(6.5, 7.0))
    axes = grid.flat
    cmap = plt.get_cmap("tab10")
    _e1(axes[0], per_model)
    for m, (model, rec) in enumerate(per_model.items()):
        s = rec["summary"]
        variants = list(s["transplant"])
        w = 0.8 / max(1, len(variants))
        for j, v in enumerate(variants):
            bar_with_ci(axes[1], m + (j - (len(variants) - 1) / 2) * w, s["transplant"][v]["agreement"], w, cmap(j),
                        label=v if m == 0 else None)
        for k, (layout, by_s) in enumerate(s["granularity"].items()):
            xs = [int(x) for x in by_s]
            axes[2].plot(xs, [by_s[str(x)]["cosine"]["mean"] for x in xs], marker="os"[k % 2], color=cmap(m),
                         ls="-" if k == 0 else "--", label=f"{short_model(model)}, {layout}")
        if "edit" in s:
            methods = s["edit"]["methods"]
            modes = s["edit"].get("modes", ["direct"])
            bars = [(name, mode) for name in methods for mode in modes]
            w = 0.8 / len(bars)
            for j, (name, mode) in enumerate(bars):
                stat = methods[name].get(f"p_correct_{mode}", methods[name]["p_correct"])
                bar_with_ci(axes[3], m + (j - (len(bars) - 1) / 2) * w, stat, w, cmap(list(methods).index(name)),
                            label=f"{name}, {mode}" if m == 0 else None, hatch="//" if mode == "chain" else None)
    labels = [short_model(m).replace(" org. ", "\norg. ") for m in per_model]
    for ax in (axes[1], axes[3]):
        ax.set_xticks(range(len(per_model)), labels, fontsize=6)
        ax.set_ylim(0, 1.05)
    axes[1].set_ylabel("decision agreement with full recompute", fontsize=7)
    axes[1].set_title("E2 memory transplant (late)", fontsize=8)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("S independently precompiled blocks", fontsize=7)
    axes[2].set_ylabel("logit cosine vs full recompute", fontsize=7)
    axes[2].set_title("E4 granularity", fontsize=8)
    axes[3].set_ylabel("P(correct) after toggling a stored fact", fontsize=7)
    axes[3].set_title("E3 mid-session edit (hatched: after a chain)", fontsize=8)
    # E3's reference: the full recompute of the toggled memory (per mode, direct and after a chain)
    oracle = [stat for rec in per_model.values() if "edit" in rec["summary"]
              for stat in rec["summary"]["edit"].get("oracle_accuracy", {}).values()]
    if oracle and all(covers_chance(stat) for stat in oracle):
        mark_at_chance(axes[3], "full-recompute accuracy\nholds 0.5 in every model")
    # E2's agreement is vacuous where full recompute decides at chance (a constant answer agrees with itself)
    full = [rec["summary"].get("full_accuracy") for rec in per_model.values()]
    if full and all(isinstance(f, dict) and covers_chance(f) for f in full):
        mark_at_chance(axes[1], "full-recompute accuracy\nholds 0.5 in every model:\nagreement says nothing")
    for ax in axes:  # below each panel, never over the bars
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.subplots_adjust(bottom=0.15, top=0.915, hspace=0.75, wspace=0.32, left=0.09, right=0.98)
    fig._kvprobe_laid_out = True  # the legends below need the room tight_layout would take back
    fig.suptitle("User memory: composed and edited notes (paper Sec. 7)", fontsize=9)
    save(fig, path)


FIGURES = {"fig_memory": ("memory", fig_memory)}
