"""Figure 3b/3c: cumulative recovery over top-ranked downstream positions, and recovery by layer band."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import latest_per_model, save


def fig3bc_suffix(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, rec in per_model.items():
        s = rec["summary"]
        ks = [k for k, v in s["cumulative"].items() if v["n"]]
        xs = list(range(len(ks)))
        means = [s["cumulative"][k]["mean"] for k in ks]
        lo = [s["cumulative"][k]["ci_low"] for k in ks]
        hi = [s["cumulative"][k]["ci_high"] for k in ks]
        a.plot(xs, means, marker="o", label=f"{name} ({s['summary_over'].split(' ')[0]})")
        a.fill_between(xs, lo, hi, alpha=0.2)
        a.set_xticks(xs, ks, fontsize=7)
        bands = s["layer_bands"]
        b.plot([f"L{x['layers'][0]}-{x['layers'][1]}" for x in bands], [x["mean"] for x in bands], marker="s", label=name)
    a.set_xlabel("top-K downstream positions patched (old -> new KV)")
    a.set_ylabel("decision recovery")
    a.axhline(1, color="black", lw=0.4, ls=":")
    a.legend(fontsize=7)
    b.set_xlabel("layer band (all downstream positions)")
    b.set_ylabel("decision recovery")
    b.tick_params(axis="x", labelsize=7)
    fig.suptitle("Suffix concentration (paper Fig. 3b/3c)", fontsize=10)
    save(fig, path)
