"""Table 4 (right) as a figure: top-k vs random-k injection, knockout dose-response, and writability."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import latest_per_model, save


def table4_specificity(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, rec in per_model.items():
        m = rec["summary"]["measures"]
        ks = sorted(int(k[3:]) for k in m if k.startswith("top") and k[3:].isdigit())
        for ax, prefix, title in ((a, "", "inject oracle notes into stale"), (b, "knockout_", "knock notes back to stale")):
            ax.plot(ks, [m[f"{prefix}top{k}"]["mean"] for k in ks], marker="o", label=f"{name} top-k")
            ax.plot(ks, [m[f"{prefix}rand{k}"]["mean"] for k in ks], marker="x", ls="--", label=f"{name} random-k")
            ax.set_title(title, fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("k downstream positions")
    a.set_ylabel("decision recovery")
    b.set_ylabel("return toward stale")
    a.legend(fontsize=6)
    fig.suptitle("Specificity and knockout (paper Table 4, probe 4)", fontsize=10)
    save(fig, path)
