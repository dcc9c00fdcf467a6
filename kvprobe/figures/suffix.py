"""Figure 3b/3c: cumulative recovery over top-ranked downstream positions, recovery by layer (single layers
and bands), and the position profile (single-position effect by relative downstream position)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvprobe.figures.common import latest_per_model, legend_below, model_color, paper_band, save, short_model
from kvprobe.figures.mechanism import dose_axes, plot_curve, tag
from kvprobe.paper import paper_value
from kvprobe.probes.summary import which


def fig3bc_suffix(records: list[dict[str, Any]], path: Path) -> None:
    fig, (a, b, c) = dose_axes("Suffix concentration (paper Fig. 3b/3c)", 3, 3.8)
    for name, rec in latest_per_model(records).items():
        s, w = rec["summary"], which(rec["summary"])
        col = model_color(name)
        keys = plot_curve(a, s["cumulative"], w, tag(name, s), color=col)
        a.set_xticks(range(len(keys)), keys, fontsize=7)
        n = rec["model"]["n_layers"]
        if s.get("per_layer"):
            plot_curve(b, s["per_layer"], w, short_model(name), x=lambda i, k: (int(k) + 1) / n, marker=".", ms=3,
                       color=col)
        bands = {f"L{x['layers'][0]}-{x['layers'][1]}": x for x in s["layer_bands"]}
        plot_curve(b, bands, w, f"{short_model(name)} bands", x=lambda i, k: (bands[k]["layers"][1] + 1) / n,
                   marker="s", ms=3, ls="--", color=col)
        bins = len(s["position_profile"])
        plot_curve(c, s["position_profile"], w, short_model(name), x=lambda i, k: (int(k) + 0.5) / bins, marker=".",
                   ms=3, color=col)
    a.set_xlabel("top-K positions patched" + (" + field" if s.get("include_field") else ""), fontsize=7)
    a.set_ylabel("decision recovery", fontsize=7)
    a.axhline(1, color="black", lw=0.4, ls=":")
    # the suffix curve's top-8 across the paper's seven released models (Fig. 3b draws Llama's alone)
    top8 = paper_value("suffix.crossfit_top8_recovery")
    paper_band(a, *top8.low_high, f"paper top-8 {top8.shown()} (7 models)")
    b.set_xlabel("relative depth (solid: one layer; dashed: band)", fontsize=7)
    c.set_xlabel("relative position (field -> decision)", fontsize=7)
    c.set_ylabel("single-position recovery", fontsize=7)
    for ax in (a, b, c):
        ax.tick_params(labelsize=6)
    legend_below(fig, a, ncol=3)  # the top tokens of each model are on the suffix page (docs/results)
    save(fig, path)


FIGURES = {"fig3bc_suffix": ("suffix", fig3bc_suffix)}
