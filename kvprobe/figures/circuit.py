"""Figures of the App. D circuit probes (paper Figure 15a/f heads, 15c attention vs MLP, 15d scrubbing).

Each reads the newest record per model of its experiment; curves use the included instances when any passed
the inclusion rule and all instances otherwise (the legend says which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvprobe.figures.common import latest_per_model, save
from kvprobe.figures.mechanism import dose_axes, grouped_bars, plot_curve, tag
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
    fig, axes = dose_axes("Read and write heads (paper Fig. 15a/f)", 1 + len(per_model), 4.2)
    a = axes[0]
    for name, rec in per_model.items():
        s, w = rec["summary"], which(rec["summary"])
        keys = plot_curve(a, _curve(s["read_top"]), w, f"{tag(name, s)} read top-k")
        plot_curve(a, _curve(s["read_random"]), w, f"{name} read random", ls=":", marker="x")
        plot_curve(a, _curve(s["write_top"]), w, f"{name} write top-k", ls="--", marker="s")
        plot_curve(a, _curve(s["write_random"]), w, f"{name} write random", ls=":", marker="+")
        a.set_xticks(range(len(keys)), keys)
    a.set_xlabel("k heads patched jointly (stale -> oracle)")
    a.set_ylabel("decision recovery")
    a.axhline(0, color="black", lw=0.5)
    a.axhline(1, color="black", lw=0.4, ls=":")
    a.legend(fontsize=5)
    for ax, (name, rec) in zip(axes[1:], per_model.items()):
        s, w = rec["summary"], which(rec["summary"])
        grid = np.full((s["n_layers"], s["n_heads"]), np.nan)
        for e in s["read_heads"]:
            if e[w]["mean"] is not None:
                grid[e["layer"], e["q_head"]] = e[w]["mean"]
        lim = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
        im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
        ax.set_title(f"{name}: read head recovery", fontsize=8)
        ax.set_xlabel(f"query head (groups of {s['group_size']} share a KV head)")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, fraction=0.05)
    save(fig, path)


def fig15c_write_share(records: list[dict[str, Any]], path: Path) -> None:
    """Per layer: recovery from the attention vs the MLP output at the notes, and the decomposition share."""
    fig, (a, b) = dose_axes("Attention vs MLP writes the note (paper Fig. 15c)", 2, 4.8)
    for name, rec in latest_per_model(records).items():
        s, w = rec["summary"], which(rec["summary"])
        n = s["n_layers"]
        depth = lambda i, k: (int(k) + 1) / n  # noqa: E731
        plot_curve(a, _curve(s["attn_out"]), w, f"{tag(name, s)} attention", x=depth, marker=".")
        plot_curve(a, _curve(s["mlp_out"]), w, f"{name} MLP", x=depth, marker="x", ls="--")
        plot_curve(b, _curve(s["decomposition_attn_share"]), w, name, x=depth, marker=".")
        c = s["causal_layer"]
        a.axvline((c["layer"] + 1) / n, color="grey", lw=0.5, ls=":")
    a.set_xlabel("relative depth of the patched block")
    a.set_ylabel("decision recovery (block output at the notes, stale -> oracle)")
    a.axhline(0, color="black", lw=0.5)
    a.legend(fontsize=6)
    b.set_xlabel("relative depth L")
    b.set_ylabel("attention share of the residual change at the notes after L")
    b.axhline(0.5, color="black", lw=0.4, ls=":")
    b.legend(fontsize=6)
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
    a.set_ylabel("fraction of the effect recovered")
    a.legend(fontsize=6)
    grouped_bars(b, per_model, ["drift", "note", "rest"], ["C7", "C3", "C0"],
                 lambda s, k: _stat(s["paper_metrics"][k][which(s)]))
    b.set_ylabel("share of the stale -> oracle gap")
    b.legend(fontsize=6)
    save(fig, path)


CIRCUIT_FIGURES = {
    "fig15a_heads": ("heads", fig15a_heads),
    "fig15c_write_share": ("write_share", fig15c_write_share),
    "fig15d_scrubbing": ("scrubbing", fig15d_scrubbing),
}
