"""Figures of the App. D circuit probes (paper Figure 15a/f heads, 15c attention vs MLP, 15d scrubbing).

Each reads the newest record per model of its experiment; curves use the included instances when any passed
the inclusion rule and all instances otherwise (the legend says which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from kvprobe.figures.common import latest_per_model, legend_below, model_color, paper_band, save, short_model
from kvprobe.figures.mechanism import dose_axes, grouped_bars, plot_curve, tag
from kvprobe.paper import paper_value
from kvprobe.probes.summary import which


def _stat(stat: dict[str, Any] | None) -> dict[str, Any]:
    """A bar's statistic; without an interval (one instance) the whisker collapses onto the mean."""
    stat = dict(stat or {})
    for key in ("ci_low", "ci_high"):
        if stat.get(key) is None:
            stat[key] = stat.get("mean")
    return stat


def _curve(block: dict[str, Any]) -> dict[str, Any]:
    """A summary curve with every one-instance entry's missing interval collapsed onto its mean."""
    return {k: {w: _stat(v[w]) if isinstance(v.get(w), dict) else v.get(w) for w in ("gated", "all")}
            for k, v in block.items()}


def fig15a_heads(records: list[dict[str, Any]], path: Path) -> None:
    """(a) joint top-k read vs write heads with random-head controls; (f) per-head read effect by layer."""
    per_model = latest_per_model(records)
    n = len(per_model)
    fig = plt.figure(figsize=(6.5, 6.6))
    grid_spec = fig.add_gridspec(2, max(n, 1), height_ratios=(1.1, 1))
    a = fig.add_subplot(grid_spec[0, :])
    fig.suptitle("Read and write heads (paper Fig. 15a/f)", fontsize=10)
    for name, rec in per_model.items():
        s, w, col = rec["summary"], which(rec["summary"]), model_color(name)
        keys = plot_curve(a, _curve(s["read_top"]), w, f"{tag(name, s)} read top-k", color=col)
        plot_curve(a, _curve(s["read_random"]), w, f"{short_model(name)} read random", ls=":", marker="x", color=col)
        plot_curve(a, _curve(s["write_top"]), w, f"{short_model(name)} write top-k", ls="--", marker="s", color=col)
        a.set_xticks(range(len(keys)), keys)
    topk = paper_value("figure.fig15a_heads.read_topk")
    a.plot(range(len(topk.curve)), list(topk.curve.values()), "k*--", ms=6, lw=0.8,
           label=f"paper read top-k ({topk.model})")
    a.set_xlabel("k heads patched jointly (stale -> oracle)", fontsize=8)
    a.set_ylabel("decision recovery", fontsize=8)
    a.axhline(0, color="black", lw=0.5)
    a.axhline(1, color="black", lw=0.4, ls=":")
    a.legend(fontsize=5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    for i, (name, rec) in enumerate(per_model.items()):
        ax = fig.add_subplot(grid_spec[1, i])
        s, w = rec["summary"], which(rec["summary"])
        grid = np.full((s["n_layers"], s["n_heads"]), np.nan)
        for e in s["read_heads"]:
            if e[w]["mean"] is not None:
                grid[e["layer"], e["q_head"]] = e[w]["mean"]
        lim = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
        im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
        # an organism's short name is two words long: one per line keeps four panels' titles apart
        ax.set_title(short_model(name).replace(" org. ", " org.\n") + "\nread heads", fontsize=6.5)
        ax.set_xlabel(f"query head ({s['group_size']}/KV head)", fontsize=6)
        ax.set_ylabel("layer", fontsize=7)
        ax.tick_params(labelsize=6)
        cbar = fig.colorbar(im, ax=ax, fraction=0.08)
        cbar.ax.tick_params(labelsize=5)
    fig.tight_layout()
    fig._kvprobe_laid_out = True
    save(fig, path)


def fig15c_write_share(records: list[dict[str, Any]], path: Path) -> None:
    """Per layer: recovery from the attention vs the MLP output at the notes, and the decomposition share."""
    fig, (a, b) = dose_axes("Attention vs MLP writes the note (paper Fig. 15c)", 2, 4.8)
    for name, rec in latest_per_model(records).items():
        s, w, col = rec["summary"], which(rec["summary"]), model_color(name)
        n = s["n_layers"]
        depth = lambda i, k: (int(k) + 1) / n  # noqa: E731
        plot_curve(a, _curve(s["attn_out"]), w, f"{tag(name, s)} attention", x=depth, marker=".", ms=3, color=col)
        plot_curve(a, _curve(s["mlp_out"]), w, f"{short_model(name)} MLP", x=depth, marker="x", ms=3, ls="--",
                   color=col)
        plot_curve(b, _curve(s["decomposition_attn_share"]), w, short_model(name), x=depth, marker=".", ms=3,
                   color=col)
        c = s["causal_layer"]
        a.axvline((c["layer"] + 1) / n, color=col, lw=0.5, ls=":")
    a.set_xlabel("relative depth of the patched block", fontsize=8)
    a.set_ylabel("recovery from the block's output at the notes", fontsize=7)
    a.axhline(0, color="black", lw=0.5)
    b.set_xlabel("relative depth L", fontsize=8)
    b.set_ylabel("attention share of the residual change", fontsize=7)
    b.axhline(0.5, color="black", lw=0.4, ls=":")
    llama = paper_value("figure.fig15c_write_share.llama_attention")
    paper_band(b, *llama.low_high, llama.label())
    for ax in (a, b):
        ax.tick_params(labelsize=7)
    legend_below(fig, a, ncol=2)
    save(fig, path)


SCRUB_BARS = ["paper", "nested:1", "nested:4", "notes_only", "field_only", "notes_late",
              "notes_early", "random"]


def fig15d_scrubbing(records: list[dict[str, Any]], path: Path) -> None:
    """Fraction of the effect each hypothesis recovers, and the paper's drift / note / rest numbers."""
    per_model = latest_per_model(records)
    fig, (a, b) = dose_axes("Causal scrubbing of field -> notes -> decision (paper Fig. 15d)", 2, 5.2)
    keys = [k for k in SCRUB_BARS if any(k in r["summary"]["fraction"] for r in per_model.values())]
    grouped_bars(a, per_model, keys, [f"C{i}" for i in range(len(keys))],
                 lambda s, k: _stat(s["fraction"].get(k, {}).get(which(s))))
    a.set_ylabel("fraction of the effect recovered", fontsize=8)
    grouped_bars(b, per_model, ["drift", "note", "rest"], ["C7", "C3", "C0"],
                 lambda s, k: _stat(s["paper_metrics"][k][which(s)]))
    b.set_ylabel("share of the stale -> oracle gap", fontsize=8)
    for part, color in (("note", "C3"), ("rest", "C0")):
        entry = paper_value(f"figure.fig15d_scrubbing.{part}")
        paper_band(b, *entry.low_high, f"paper {part} {entry.shown()}", color=color)
    for ax in (a, b):
        ax.set_xticks(ax.get_xticks(), [t.get_text().replace(" (", "\n(") for t in ax.get_xticklabels()], fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
    legend_below(fig, a, ncol=4)
    h, lab = b.get_legend_handles_labels()
    b.legend(h, lab, fontsize=6, loc="upper left", frameon=False)
    save(fig, path)


FIGURES = {
    "fig15a_heads": ("heads", fig15a_heads),
    "fig15c_write_share": ("write_share", fig15c_write_share),
    "fig15d_scrubbing": ("scrubbing", fig15d_scrubbing),
}
