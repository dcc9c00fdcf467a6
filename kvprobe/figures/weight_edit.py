"""Table 1 as a figure: KV edits vs weight edits (efficacy, contamination, collateral, latency x erratum)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save, short_model

MEASURES = (("efficacy", "efficacy\n(the target flips)"), ("contamination", "contamination\n(held-out requests flip)"),
            ("collateral", "collateral\n(unrelated decisions move)"))


def table1_weight_edit(records: list[dict[str, Any]], path: Path) -> None:
    # one group per (model, task): the v2 design (gated_10_scenarios) beside the first one on the same model
    per_model = ({f"{short_model(r['model']['name'])}\n{r['_task']}": r for r in records}
                 if records and all("_task" in r for r in records) else latest_per_model(records))
    if not per_model:
        return
    names = list(per_model)
    methods: list[str] = []
    for rec in per_model.values():
        methods += [m for m in rec["summary"]["methods"] if m not in methods]
    fig, grid = plt.subplots(2, 2, figsize=(6.5, 5.6))
    axes = list(grid.flat)
    width = 0.8 / len(methods)
    cmap = plt.get_cmap("tab10")
    for ax, (key, label) in zip(axes, MEASURES):
        labelled: set[str] = set()  # each method in the legend once, the first time a group has it
        for m, name in enumerate(names):
            for j, method in enumerate(methods):
                b = per_model[name]["summary"]["methods"].get(method)
                if b is None:
                    continue
                x = m + (j - (len(methods) - 1) / 2) * width
                bar_with_ci(ax, x, b[key], width, cmap(j), label=None if method in labelled else method)
                labelled.add(method)
                if b.get("identity") and key != "efficacy":
                    ax.text(x, 0.02, "id", ha="center", fontsize=6, rotation=90)  # 0 by construction
        ax.set_xticks(range(len(names)), [n if "\n" in n else short_model(n) for n in names], fontsize=6)
        ax.set_ylim(0, 1.05)
        ax.set_title(label, fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
    ax = axes[3]
    for m, name in enumerate(names):
        for j, method in enumerate(methods):
            b = per_model[name]["summary"]["methods"].get(method)
            if b is not None:
                ax.bar(m + (j - (len(methods) - 1) / 2) * width, b["latency_x_erratum_median"], width, color=cmap(j))
    ax.set_yscale("log")
    ax.tick_params(axis="y", labelsize=6)
    ax.set_xticks(range(len(names)), [n if "\n" in n else short_model(n) for n in names], fontsize=6)
    ax.set_title("edit latency\n(x the erratum, median, one run)", fontsize=8)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(methods), 6), fontsize=6,
               frameon=False)
    fig.subplots_adjust(bottom=0.15, top=0.88, wspace=0.3, hspace=0.45, left=0.08, right=0.98)
    fig._kvprobe_laid_out = True  # the legend sits below the axes: keep this layout
    fig.suptitle("KV editing vs weight editing for per-request state (paper Table 1; 'id' = identity)", fontsize=9)
    save(fig, path)


FIGURES = {"table1_weight_edit": ("weight_edit", table1_weight_edit)}  # Table 1: KV vs weight edits
