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

from kvprobe.figures.common import bar_with_ci, latest_per_model, legend_below, model_color, save, short_model
from kvprobe.paper import paper_value

MODEL_COLORS = ("#3a78b5", "#e07b39", "#2e7d32", "#8e44ad", "#c0392b", "#7f8c8d", "#16a085")


def _which(summary: dict[str, Any]) -> str:
    return "gated" if summary["n_included"] else "all"


def _tag(name: str, summary: dict[str, Any]) -> str:
    shown = "" if summary["n_included"] else ", all shown"
    return f"{short_model(name)} ({summary['n_included']}/{summary['n_instances']} incl.{shown})"


def _panels(n: int, width: float = 4.2, height: float = 3.4):
    """``n`` panels, at most two per row, on a 6.5-inch page width (empty cells hidden)."""
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5, 2.8 * rows + 0.4), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]




def _paper_frontier() -> dict[str, tuple[float, float]]:
    """The paper's Table 6 (Qwen3-8B): method -> (recompute %, P(correct)), from the registry."""
    xs, ys = paper_value("figure.fig16_edit_frontier.points").curve, paper_value("figure.fig16_edit_frontier.correct").curve
    return {m: (xs[m], ys[m]) for m in xs}


METHOD_COLORS = {"stale": "#9e9e9e", "in_place": "#e07b39", "erratum": "#d1495b", "field_erratum": "#8d6a9f",
                 "hoist_to_end": "#2e8b57", "cacheblend@15%": "#8c564b", "full_downstream": "#1b6ca8",
                 "full_reprefill": "#000000"}


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
        for m, b in sorted(points, key=lambda mb: mb[1]["recompute_fraction"]):
            x, y = 100 * b["recompute_fraction"], b["p_correct"][which]["mean"]
            ax.scatter([x], [y], marker="s" if b.get("needs_prompt_surgery") else "o", s=30, zorder=3,
                       color=METHOD_COLORS.get(m, "#555555"), label=m.replace("_", " "))
        for m, (x, y) in _paper_frontier().items():
            ax.scatter([x], [y], marker="x", s=22, color=METHOD_COLORS.get(m, "#555555"), lw=1, zorder=2)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(-0.2, 130)
        ax.set_ylim(-0.05, 1.1)
        ax.set_xlabel("recompute (% of context tokens)", fontsize=8)
        ax.set_ylabel("P(correct)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title(_tag(name, s), fontsize=8)
    axes[0].scatter([], [], marker="x", color="black", label="paper, Qwen3-8B (Tab. 6)")
    axes[0].scatter([], [], marker="s", color="black", label="needs prompt surgery")
    fig.suptitle("Edit cost/correctness frontier (paper Fig. 16, Table 6)", fontsize=10)
    legend_below(fig, axes[0], ncol=4)
    save(fig, path)


def fig17_selective_k(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for i, (name, rec) in enumerate(per_model.items()):
        sweep = rec["summary"]["selective_k"]
        if not sweep:
            continue
        color = model_color(name)
        ks = [s["k"] for s in sweep]
        k_star = rec["summary"]["k_star"]  # None: no K in the sweep reaches the recovery threshold
        ax.plot(ks, [s["p_correct"] for s in sweep], "-o", color=color, ms=3,
                label=f"{_tag(name, rec['summary'])}, K* " + (f"= {k_star}" if k_star is not None else f"> {max(ks)}"))
        ax.plot(ks, [s["recovery"] for s in sweep], "--", color=color, lw=0.8)
    ax.set_xscale("log", base=2)
    ax.axhline(1, color="black", lw=0.4, ls=":")
    ax.set_xlabel("K (downstream tokens recomputed with the field)", fontsize=8)
    ax.set_ylabel("P(correct) (solid), recovery (dashed)", fontsize=8)
    ax.set_title("field+selective@K (paper Fig. 17: K* ~ 4 at 8B, > 64 at 4B)", fontsize=9)
    legend_below(fig, ax, ncol=1)
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
    ax.set_xticks(range(len(labels)), [lab.replace("_", " ") for lab in labels], fontsize=6, rotation=20)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("P(correct)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)


def fig3d_edit_wording(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, axes = _panels(len(per_model))
    for ax, (name, rec) in zip(axes, per_model.items()):
        s = rec["summary"]
        wordings = list(s["wordings"])
        _grouped_bars(ax, s, [[f"{arm}/{w}" for w in wordings] for arm in s["arms"]], wordings, s["arms"])
        wording = paper_value("figure.fig3d_edit_wording.p_safe")
        for i, w in enumerate(wordings):
            if w in wording.curve:
                ax.plot([i - 0.4, i + 0.4], [wording.curve[w]] * 2, color="black", lw=1.2, ls="--")
        ax.set_title(_tag(name, s), fontsize=8)
    axes[0].plot([], [], color="black", ls="--",
                 label="paper P(safe), Qwen3-8B: new value already in context, after a chain (not a stale cache)")
    fig.suptitle("Erratum wording (paper Fig. 3d)", fontsize=10)
    legend_below(fig, axes[0], ncol=3)
    save(fig, path)


def fig2c_edit_cot(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, axes = _panels(len(per_model))
    for ax, (name, rec) in zip(axes, per_model.items()):
        s = rec["summary"]
        methods = [k.split("/", 1)[1] for k in s["methods"] if k.startswith("direct/")]
        cot = s["modes"]["cot"]
        # the chain budget is per record (24 tokens on the organisms, 48 on the chat shape): in each title
        _grouped_bars(ax, s, [[f"{mode}/{m}" for m in methods] for mode in ("direct", "cot")], methods,
                      ["direct", "after a greedy chain"])
        if "in_place" in methods:  # the paper's in-place result, direct and with a chain (Qwen3-8B)
            i, paper = methods.index("in_place"), paper_value("figure.fig2c_edit_cot.in_place").curve
            ax.plot([i - 0.4, i], [paper["direct"]] * 2, [i, i + 0.4], [paper["chain"]] * 2, color="black", lw=1.2,
                    ls="--")
        ax.set_title(f"{_tag(name, s)}; chain {cot['chain_tokens']} tok", fontsize=8)
    in_place = paper_value("figure.fig2c_edit_cot.in_place")
    axes[0].plot([], [], color="black", ls="--", label=f"paper in_place ({in_place.model}): "
                 f"{in_place.curve['direct']:.2f} direct, {in_place.curve['chain']:.2f} with a chain")
    fig.suptitle("Chain-of-thought gates the in-place edit (paper Fig. 2c)", fontsize=10)
    legend_below(fig, axes[0], ncol=3)
    save(fig, path)


def fig23_long_horizon(records: list[dict[str, Any]], path: Path) -> None:
    per_run: dict[str, dict[str, Any]] = {}
    for rec in records:  # newest record per (model, scheme): the erratum scheme is a control, drawn alongside
        per_run[f"{rec['model']['name']} [{rec['summary']['scheme']}]"] = rec
    fig, (a, b) = _panels(2, width=4.6)
    # App. G's bands are for the append-only erratum scheme (no stale KV): drawn as that scheme's, not field_erratum's
    for ax, key, what in ((a, "long_horizon.agreement_in_range[scheme=erratum]", "agreement"),
                          (b, "long_horizon.cosine_high[scheme=erratum]", "cosine")):
        lo, hi = paper_value(key).low_high
        ax.axhspan(lo, hi, color="grey", alpha=0.2, lw=0, label=f"paper {what} {paper_value(key).shown()} "
                                                                "(erratum scheme, no stale KV)")
    low = 1.0
    for i, (name, rec) in enumerate(per_run.items()):
        s, color = rec["summary"], model_color(rec["model"]["name"])
        turns = [t["turn"] for t in s["per_turn"]]
        cos = [t["cosine"] for t in s["per_turn"]]
        low = min(low, *cos)
        slope = s["agreement_slope_per_turn"]["slope"]
        style = "--o" if s["scheme"] == "erratum" else "-o"  # App. G's scheme apart from field+erratum
        a.plot(turns, [t["agreement"] for t in s["per_turn"]], style, ms=2.5, color=color,
               label=f"{_tag(name, s)}, slope {slope:+.3f}/turn")
        b.plot(turns, cos, style, ms=2.5, color=color, label=f"{short_model(name)}: cosine "
                                                            f"{s['cosine_first_third']:.3f} -> {s['cosine_last_third']:.3f}")
    a.set_ylim(-0.05, 1.05)
    a.set_xlabel("turn", fontsize=8)
    a.set_ylabel("agreement with full reprefill", fontsize=8)
    b.set_ylim(min(0.95, low - 0.005), 1.002)
    b.ticklabel_format(axis="y", useOffset=False)
    b.set_xlabel("turn", fontsize=8)
    b.set_ylabel("decision-logit cosine", fontsize=8)
    for ax in (a, b):
        ax.tick_params(labelsize=7)
    fig.suptitle("No compounding error over a long trajectory (paper Fig. 23)", fontsize=10)
    legend_below(fig, a, ncol=2, extra=[b])
    save(fig, path)


# figure file stem -> (experiment whose records it reads, drawing function), collected by kvprobe.figures
FIGURES = {
    "fig16_edit_frontier": ("edit_frontier", fig16_edit_frontier),
    "fig17_selective_k": ("edit_frontier", fig17_selective_k),
    "fig3d_edit_wording": ("edit_wording", fig3d_edit_wording),
    "fig2c_edit_cot": ("edit_cot", fig2c_edit_cot),
    "fig23_long_horizon": ("long_horizon", fig23_long_horizon),
}
