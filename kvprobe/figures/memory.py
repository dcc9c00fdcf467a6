"""Section 7 user memory: E2 transplant agreement and cosine (Fig. 9), E4 agreement and cosine against the
number of blocks S, contiguous vs split (Fig. 24), E3 P(correct) per edit method (Fig. 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save


def fig_memory(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    if not per_model:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    cmap = plt.get_cmap("tab10")
    for m, (model, rec) in enumerate(per_model.items()):
        s = rec["summary"]
        variants = list(s["transplant"])
        w = 0.8 / max(1, len(variants))
        for j, v in enumerate(variants):
            bar_with_ci(axes[0], m + (j - (len(variants) - 1) / 2) * w, s["transplant"][v]["agreement"], w, cmap(j),
                        label=v if m == 0 else None)
        for k, (layout, by_s) in enumerate(s["granularity"].items()):
            xs = [int(x) for x in by_s]
            axes[1].plot(xs, [by_s[str(x)]["cosine"]["mean"] for x in xs], marker="os"[k % 2], color=cmap(m),
                         ls="-" if k == 0 else "--", label=f"{model}, {layout}")
        if "edit" in s:
            methods = list(s["edit"]["methods"])
            w = 0.8 / len(methods)
            for j, name in enumerate(methods):
                bar_with_ci(axes[2], m + (j - (len(methods) - 1) / 2) * w, s["edit"]["methods"][name]["p_correct"],
                            w, cmap(j), label=name if m == 0 else None)
    for ax in (axes[0], axes[2]):
        ax.set_xticks(range(len(per_model)), list(per_model), fontsize=7)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("decision agreement with full recompute")
    axes[0].set_title("E2 memory transplant (late)", fontsize=9)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("S independently precompiled blocks")
    axes[1].set_ylabel("logit cosine vs full recompute")
    axes[1].set_title("E4 granularity", fontsize=9)
    axes[2].set_ylabel("P(correct) after toggling a stored fact")
    axes[2].set_title("E3 mid-session edit", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=6)
    fig.suptitle("User memory: composed and edited notes (paper Sec. 7)", fontsize=10)
    save(fig, path)


FIGURES = {"fig_memory": ("memory", fig_memory)}
