"""Section 7 user memory: E1 accuracy against memory length, early vs late, direct vs chain (Fig. 8); E2
transplant agreement (Fig. 9); E4 cosine against the number of blocks S, contiguous vs split (Fig. 24); E3
P(correct) per edit method, direct and after a chain (Fig. 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save


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
                        label=f"{model.split('-gated')[0] + (' organism' if '-gated' in model else '')}, {mode}, {pl}")
    ax.axhline(0.5, color="grey", lw=0.7, ls=":")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("memory tokens")
    ax.set_ylabel("full-recompute accuracy")
    ax.set_title("E1 placement (solid early, dashed late)", fontsize=9)


def fig_memory(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 5.0))
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
                         ls="-" if k == 0 else "--", label=f"{model}, {layout}")
        if "edit" in s:
            methods = s["edit"]["methods"]
            modes = s["edit"].get("modes", ["direct"])
            bars = [(name, mode) for name in methods for mode in modes]
            w = 0.8 / len(bars)
            for j, (name, mode) in enumerate(bars):
                stat = methods[name].get(f"p_correct_{mode}", methods[name]["p_correct"])
                bar_with_ci(axes[3], m + (j - (len(bars) - 1) / 2) * w, stat, w, cmap(list(methods).index(name)),
                            label=f"{name}, {mode}" if m == 0 else None, hatch="//" if mode == "chain" else None)
    labels = [m.replace("-gated", "\n-gated") for m in per_model]
    for ax in (axes[1], axes[3]):
        ax.set_xticks(range(len(per_model)), labels, fontsize=7)
        ax.set_ylim(0, 1.05)
    axes[1].set_ylabel("decision agreement with full recompute")
    axes[1].set_title("E2 memory transplant (late)", fontsize=9)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("S independently precompiled blocks")
    axes[2].set_ylabel("logit cosine vs full recompute")
    axes[2].set_title("E4 granularity", fontsize=9)
    axes[3].set_ylabel("P(correct) after toggling a stored fact")
    axes[3].set_title("E3 mid-session edit (hatched: after a chain)", fontsize=9)
    for ax in axes:  # below each panel, never over the bars
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.subplots_adjust(bottom=0.3, wspace=0.3, left=0.05, right=0.98)
    fig._kvprobe_laid_out = True  # the legends below need the room tight_layout would take back
    fig.suptitle("User memory: composed and edited notes (paper Sec. 7)", fontsize=10)
    save(fig, path)


FIGURES = {"fig_memory": ("memory", fig_memory)}
