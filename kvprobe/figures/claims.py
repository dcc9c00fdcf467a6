"""The claims forest plot: per paper claim x model, ours (mean and 95% CI) beside the paper's value, the
equivalence bounds or rate bound shaded, coloured by verdict (kvprobe.claims; paper Appendix H's
confirmatory protocol), the paper's effects above the controls. Claims whose inclusion filter left no instance are not drawn; identities are drawn
grey. Reads records only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import save

COLORS = {"reproduced": "tab:green", "outside the paper's range": "tab:purple", "inconclusive": "tab:olive",
          "not reproduced": "tab:red", "not measurable": "tab:orange", "identity": "tab:gray",
          "no paper number": "tab:gray"}


def fig_claims(records: list[dict[str, Any]], path: Path) -> None:
    from kvprobe.claims import claims_rows

    rows = [r for r in claims_rows(records) if r["ours"].get("mean") is not None]
    # the paper's effects first, then controls / sanity checks / identities, with a rule between the blocks
    rows = [r for r in rows if r.get("role") == "effect"] + [r for r in rows if r.get("role") != "effect"]
    n_controls = sum(r.get("role") != "effect" for r in rows)
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.6))
    labels = []
    for y, r in enumerate(reversed(rows)):
        o, head = r["ours"], r["verdict"].split(" (")[0]
        color = COLORS.get(head, "black")
        if r.get("bounds"):
            ax.plot(r["bounds"], [y, y], color=color, alpha=0.25, lw=7, solid_capstyle="butt")
        elif r.get("bound") is not None:
            ax.plot([r["bound"], 1.0], [y, y], color=color, alpha=0.25, lw=7, solid_capstyle="butt")
        if o.get("ci_low") is not None:
            ax.plot([o["ci_low"], o["ci_high"]], [y, y], color=color, lw=1.5)
        ax.plot(o["mean"], y, "o", color=color, ms=5)
        if r.get("paper_point") is not None:
            ax.plot(r["paper_point"], y, "x", color="black", ms=6)
        tmpl = "" if r["template"] == "gated" else f" [{r['template']}]"
        role = "effect" if r.get("role") == "effect" else "control"
        labels.append(f"[{role}] {r['claim']}{tmpl} - {r['model']}")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(-0.8, len(labels) - 0.2)
    if 0 < n_controls < len(rows):
        ax.axhline(n_controls - 0.5, color="black", lw=0.8)  # controls below the rule, the paper's effects above
    ax.axvline(0, color="black", lw=0.4)
    ax.axvline(1, color="black", lw=0.4, ls=":")
    handles = [plt.Line2D([], [], color=c, marker="o", ls="-", label=k) for k, c in COLORS.items()]
    handles.append(plt.Line2D([], [], color="black", marker="x", ls="", label="paper"))
    ax.set_xlabel("ours: mean [95% CI]; shaded: the bounds tested", fontsize=8)
    ax.legend(handles=handles, fontsize=7, ncol=3, loc="upper right", bbox_to_anchor=(1.0, -0.6 / len(labels) - 0.04))
    ax.set_title("Paper claims, ours vs paper (verdicts on BH q)", fontsize=9)
    save(fig, path, dpi=100)  # one row per claim x model (hundreds): 130 dpi put the PNG over 2 MiB
    # and at 460 rows 100 dpi does too: a 128-colour palette keeps it near 0.7 MiB (flat colours, no loss worth
    # the name). Pillow is matplotlib's own image dependency.
    from PIL import Image

    with Image.open(path) as im:
        palette = im.convert("RGB").quantize(colors=128)
    palette.save(path, optimize=True)
