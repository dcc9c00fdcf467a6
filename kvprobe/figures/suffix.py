"""Figure 3b/3c: cumulative recovery over top-ranked downstream positions, recovery by layer (single layers
and bands), and the position profile (single-position effect by relative downstream position)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvprobe.figures.common import latest_per_model, save
from kvprobe.figures.mechanism import dose_axes, plot_curve, tag
from kvprobe.probes.summary import which


def fig3bc_suffix(records: list[dict[str, Any]], path: Path) -> None:
    fig, (a, b, c) = dose_axes("Suffix concentration (paper Fig. 3b/3c)", 3, 3.8)
    for name, rec in latest_per_model(records).items():
        s, w = rec["summary"], which(rec["summary"])
        keys = plot_curve(a, s["cumulative"], w, tag(name, s))
        a.set_xticks(range(len(keys)), keys, fontsize=7)
        n = rec["model"]["n_layers"]
        if s.get("per_layer"):
            plot_curve(b, s["per_layer"], w, name, x=lambda i, k: (int(k) + 1) / n, marker=".")
        bands = {f"L{x['layers'][0]}-{x['layers'][1]}": x for x in s["layer_bands"]}
        plot_curve(b, bands, w, f"{name} bands", x=lambda i, k: (bands[k]["layers"][1] + 1) / n, marker="s", ls="--")
        bins = len(s["position_profile"])
        plot_curve(c, s["position_profile"], w, name, x=lambda i, k: (int(k) + 0.5) / bins, marker=".")
        top = ", ".join(repr(t) for t, _ in s["most_frequent_top_tokens"][:6])
        c.annotate(f"{name} top tokens: {top}", (0.02, 0.95), xycoords="axes fraction", fontsize=6, va="top")
    a.set_xlabel("top-K downstream positions patched" + (" + field" if s.get("include_field") else ""))
    a.set_ylabel("decision recovery")
    a.axhline(1, color="black", lw=0.4, ls=":")
    a.legend(fontsize=6)
    b.set_xlabel("relative depth of the patched layer(s)")
    b.legend(fontsize=6)
    c.set_xlabel("relative downstream position (field -> decision)")
    c.set_ylabel("single-position recovery")
    save(fig, path)
