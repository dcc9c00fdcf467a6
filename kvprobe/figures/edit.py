"""Editing figures (paper Section 4, Appendices E and G), drawn from records only.

- Figure 16 (edit_frontier): P(correct) vs recompute fraction per method; field+selective@K as a line;
- Figure 17 (edit_frontier): the field+selective@K sweep, P(correct) and recovery vs K, one line per model;
- Figure 3d (edit_wording): P(correct) per erratum wording;
- Figure 2c (edit_cot): P(correct) per method, direct vs after a reasoning chain;
- Figure 23 (long_horizon): per-turn decision agreement and logit cosine, evolving cache vs full reprefill.

Every panel uses gated instances when any passed the gate, else all instances (said in the label).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import bar_with_ci, latest_per_model, save

MODEL_COLORS = ("#3a78b5", "#e07b39", "#2e7d32", "#8e44ad", "#c0392b", "#7f8c8d", "#16a085")


def _which(summary: dict[str, Any]) -> str:
    return "gated" if summary["n_included"] else "all"


def _tag(name: str, summary: dict[str, Any]) -> str:
    shown = "" if summary["n_included"] else ", all shown"
    return f"{name} ({summary['n_included']}/{summary['n_instances']} gated{shown})"


def _panels(n: int, width: float = 4.2, height: float = 3.4):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, axes[0]


def fig16_edit_frontier(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, axes = _panels(len(per_model))
    for ax, (name, rec) in zip(axes, per_model.items()):
        s, which = rec["summary"], _which(rec["summary"])
        sel = [(100 * b["recompute_fraction"], b["p_correct"][which]["mean"]) for m, b in s["methods"].items()
               if m.startswith("selective@") and b["p_correct"][which]["n"]]
        if sel:
            ax.plot(*zip(*sorted(sel)), "-o", color="#999999", ms=3, lw=1, label="field+selective@K")
        points = [(m, b) for m, b in s["methods"].items()
                  if not m.startswith("selective@") and b["p_correct"][which]["n"]]
        for i, (m, b) in enumerate(sorted(points, key=lambda mb: mb[1]["recompute_fraction"])):
            x, y = 100 * b["recompute_fraction"], b["p_correct"][which]["mean"]
            ax.scatter([x], [y], marker="s" if b.get("needs_prompt_surgery") else "o", s=28, zorder=3)
            ax.annotate(m.replace("_", " ") + (" (surgery)" if b.get("needs_prompt_surgery") else ""), (x, y),
                        textcoords="offset points", xytext=(3, 4 + 8 * (i % 4)), fontsize=6,
                        arrowprops={"arrowstyle": "-", "lw": 0.3, "color": "#666666"})
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(-0.2, 130)
        ax.set_ylim(-0.05, 1.1)
        ax.set_xlabel("recompute (% of context tokens)")
        ax.set_ylabel("P(correct)")
        ax.set_title(_tag(name, s), fontsize=8)
        ax.legend(fontsize=6, loc="center right", frameon=False)
    fig.suptitle("Edit cost/correctness frontier (paper Fig. 16, Table 6)", fontsize=10)
    save(fig, path)


def fig17_selective_k(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for i, (name, rec) in enumerate(per_model.items()):
        sweep = rec["summary"]["selective_k"]
        if not sweep:
            continue
        color = MODEL_COLORS[i % len(MODEL_COLORS)]
        ks = [s["k"] for s in sweep]
        ax.plot(ks, [s["p_correct"] for s in sweep], "-o", color=color, ms=3,
                label=f"{_tag(name, rec['summary'])}, K*={rec['summary']['k_star']}")
        ax.plot(ks, [s["recovery"] for s in sweep], "--", color=color, lw=0.8)
    ax.set_xscale("log", base=2)
    ax.axhline(1, color="black", lw=0.4, ls=":")
    ax.set_xlabel("K (downstream tokens recomputed with the field)")
    ax.set_ylabel("P(correct) (solid), recovery (dashed)")
    ax.set_title("field+selective@K (paper Fig. 17)", fontsize=10)
    ax.legend(fontsize=6, frameon=False)
    save(fig, path)


def _grouped_bars(ax, summary: dict[str, Any], groups: list[list[str]], labels: list[str], series: list[str]) -> None:
    """Bars of P(correct) with CIs: one cluster per label, one bar per series (``groups[series][label]``)."""
    which = _which(summary)
    width = 0.8 / len(series)
    for j, (keys, sname) in enumerate(zip(groups, series)):
        for i, key in enumerate(keys):
            stat = summary["methods"].get(key, {}).get("p_correct", {}).get(which, {})
            bar_with_ci(ax, i + (j - (len(series) - 1) / 2) * width, dict(stat), width,
                        MODEL_COLORS[j % len(MODEL_COLORS)], label=sname if i == 0 else None)
    ax.set_xticks(range(len(labels)), [lab.replace("_", " ") for lab in labels], fontsize=7, rotation=15)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("P(correct)")
    ax.legend(fontsize=6, frameon=False)


def fig3d_edit_wording(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, axes = _panels(len(per_model))
    for ax, (name, rec) in zip(axes, per_model.items()):
        s = rec["summary"]
        wordings = list(s["wordings"])
        _grouped_bars(ax, s, [[f"{arm}/{w}" for w in wordings] for arm in s["arms"]], wordings, s["arms"])
        ax.set_title(_tag(name, s), fontsize=8)
    fig.suptitle("Erratum wording (paper Fig. 3d)", fontsize=10)
    save(fig, path)


def fig2c_edit_cot(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, axes = _panels(len(per_model))
    for ax, (name, rec) in zip(axes, per_model.items()):
        s = rec["summary"]
        methods = [k.split("/", 1)[1] for k in s["methods"] if k.startswith("direct/")]
        cot = s["modes"]["cot"]
        _grouped_bars(ax, s, [[f"{mode}/{m}" for m in methods] for mode in ("direct", "cot")], methods,
                      ["direct", f"chain ({cot['chain_tokens']} tok, greedy)"])
        ax.set_title(_tag(name, s), fontsize=8)
    fig.suptitle("Chain-of-thought gates the in-place edit (paper Fig. 2c)", fontsize=10)
    save(fig, path)


def fig23_long_horizon(records: list[dict[str, Any]], path: Path) -> None:
    per_run: dict[str, dict[str, Any]] = {}
    for rec in records:  # newest record per (model, scheme): the erratum scheme is a control, drawn alongside
        per_run[f"{rec['model']['name']} [{rec['summary']['scheme']}]"] = rec
    fig, (a, b) = _panels(2, width=4.6)
    low = 1.0
    for i, (name, rec) in enumerate(per_run.items()):
        s, color = rec["summary"], MODEL_COLORS[i % len(MODEL_COLORS)]
        turns = [t["turn"] for t in s["per_turn"]]
        cos = [t["cosine"] for t in s["per_turn"]]
        low = min(low, *cos)
        slope = s["agreement_slope_per_turn"]["slope"]
        a.plot(turns, [t["agreement"] for t in s["per_turn"]], "-o", ms=2.5, color=color,
               label=f"{_tag(name, s)}, slope {slope:+.3f}/turn")
        b.plot(turns, cos, "-o", ms=2.5, color=color, label=f"{name}: {s['cosine_first_third']:.3f} -> "
                                                            f"{s['cosine_last_third']:.3f}")
    a.set_ylim(-0.05, 1.05)
    a.set_xlabel("turn")
    a.set_ylabel("decision agreement with full reprefill")
    b.set_ylim(min(0.95, low - 0.005), 1.002)
    b.ticklabel_format(axis="y", useOffset=False)
    b.set_xlabel("turn")
    b.set_ylabel("decision-logit cosine")
    for ax in (a, b):
        ax.legend(fontsize=6, frameon=False)
    fig.suptitle("No compounding error over a long trajectory (paper Fig. 23)", fontsize=10)
    save(fig, path)


# figure file stem -> (experiment whose records it reads, drawing function); merged into FIGURES
EDIT_FIGURES = {
    "fig16_edit_frontier": ("edit_frontier", fig16_edit_frontier),
    "fig17_selective_k": ("edit_frontier", fig17_selective_k),
    "fig3d_edit_wording": ("edit_wording", fig3d_edit_wording),
    "fig2c_edit_cot": ("edit_cot", fig2c_edit_cot),
    "fig23_long_horizon": ("long_horizon", fig23_long_horizon),
}
