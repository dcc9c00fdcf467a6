"""Figures of the mechanism probes (paper Section 3 probes (2)-(4), Appendix C, Tables 3-4).

Each reads the summaries of its experiment's records (newest per model). Curves and bars use the gated
instances when any passed the gate and say "all" otherwise, as Figure 3a does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import (bar_with_ci, latest_per_model, legend_below, model_color, paper_band, save,
                                   short_model)
from kvprobe.paper import paper_value
from kvprobe.probes.summary import which
from kvprobe.runner.records import task_stem


def tag(name: str, summary: dict[str, Any]) -> str:
    name = short_model(name)
    return f"{name} ({summary['n_included']}/{summary['n_instances']} incl.)" if summary.get("n_included") \
        else f"{name} (all {summary['n_instances']}; none incl.)"


def plot_curve(ax, block: dict[str, Any], w: str, label: str, x: Callable[[int, str], float] | None = None,
               **style: Any) -> list[str]:
    """A summary curve {label: {gated, all}} as a line with its CI band; returns the x labels drawn."""
    keys = [k for k, v in block.items() if v[w]["n"] and v[w]["mean"] is not None]
    xs = [x(i, k) if x else i for i, k in enumerate(keys)]
    line, = ax.plot(xs, [block[k][w]["mean"] for k in keys], marker=style.pop("marker", "o"), label=label, **style)
    def band(k: str, end: str) -> float:  # no interval (ci None): the band closes on the mean
        s = block[k][w]
        return s["mean"] if s.get(end) is None else s[end]

    ax.fill_between(xs, [band(k, "ci_low") for k in keys], [band(k, "ci_high") for k in keys],
                    color=line.get_color(), alpha=0.15)
    return keys


def grouped_bars(ax, per_model: dict[str, dict[str, Any]], keys: list[str], colors: list[str],
                 get: Callable[[dict[str, Any], str], dict[str, Any]]) -> None:
    """One group of bars per model, one bar per key, with CI whiskers."""
    width = 0.8 / max(len(keys), 1)
    for m, (name, rec) in enumerate(per_model.items()):
        for j, key in enumerate(keys):
            bar_with_ci(ax, m + (j - (len(keys) - 1) / 2) * width, get(rec["summary"], key), width, colors[j % len(colors)],
                        label=key.replace("_", " ") if m == 0 else None)
    ax.set_xticks(range(len(per_model)), [tag(n, r["summary"]).replace(" (", "\n(") for n, r in per_model.items()],
                  fontsize=7)
    ax.axhline(0, color="black", lw=0.6)
    ax.axhline(1, color="black", lw=0.4, ls=":")


def dose_axes(title: str, n: int = 1, width: float = 4.5):
    """``n`` panels in one row of a 6.5-inch page width (``width`` is kept for callers; the page sets it)."""
    fig, axes = plt.subplots(1, n, figsize=(6.5, 3.4 if n < 3 else 3.0), squeeze=False)
    fig.suptitle(title, fontsize=10)
    return fig, list(axes[0])


def fig_knockout(records: list[dict[str, Any]], path: Path) -> None:
    fig, (a, b) = dose_axes("Knockout and dose-response (paper Sec. 3 probe 4)", 2)
    for name, rec in latest_per_model(records).items():
        s, w = rec["summary"], which(rec["summary"])
        c = model_color(name)
        keys = plot_curve(a, s["knockout_top"], w, f"{tag(name, s)} top-K", color=c)
        plot_curve(a, s["knockout_random"], w, f"{short_model(name)} random-K", x=lambda i, k: keys.index(k), ls="--",
                   marker="x", color=c)
        a.set_xticks(range(len(keys)), keys, fontsize=7)
        bands = plot_curve(b, s["knockout_band"], w, short_model(name), marker="s", color=c)
        b.set_xticks(range(len(bands)), bands, fontsize=7)
    a.set_xlabel(f"top-K positions ablated ({s['ablation']})", fontsize=8)
    a.set_ylabel("return toward stale (1 - recovery)", fontsize=8)
    b.set_xlabel("position band ablated (early -> late)", fontsize=8)
    a.axhline(1, color="black", lw=0.8, ls="--")
    a.annotate("paper: returns to stale", (0, 1.0), fontsize=6, va="bottom")
    legend_below(fig, a)
    save(fig, path)


def fig_writability(records: list[dict[str, Any]], path: Path) -> None:
    fig, (a, b) = dose_axes("Writability: the decision follows an injected note (paper App. C iv)", 2)
    for name, rec in latest_per_model(records).items():
        s, w = rec["summary"], which(rec["summary"])
        keys = plot_curve(a, s["inject"], w, tag(name, s), color=model_color(name))
        a.set_xticks(range(len(keys)), keys, fontsize=7)
        keys = plot_curve(b, s["follows"], w, short_model(name), marker="s", color=model_color(name))
        b.set_xticks(range(len(keys)), keys, fontsize=7)
    a.set_xlabel("top-K notes injected (field left stale)", fontsize=8)
    a.set_ylabel("recovery toward the note", fontsize=8)
    b.set_xlabel("top-K notes injected", fontsize=8)
    b.set_ylabel("follow rate", fontsize=8)
    inject, follow = paper_value("writability.inject_all_one"), paper_value("writability.follow_rate_top8")
    paper_band(a, *inject.low_high, f"paper, all notes: {inject.shown()}")
    paper_band(b, *follow.low_high, f"paper: {follow.shown()}")
    legend_below(fig, a)
    save(fig, path)


def table4_dissociation(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    grouped_bars(ax, per_model, ["trigger_only", "notes", "trigger_and_notes"], ["#e07b39", "#3a78b5", "#2e7d32"],
                 lambda s, k: s["recovery"][k][which(s)])
    ax.set_ylabel("recovery toward the flipped conclusion", fontsize=8)
    ax.set_title("Dissociation, field held identical (paper Table 4 left)", fontsize=10)
    trigger, notes = paper_value("dissociation.trigger_only_zero@polarity"), paper_value("dissociation.notes_one@polarity")
    paper_band(ax, *trigger.low_high, f"paper trigger-only {trigger.shown()}", color="#e07b39")
    paper_band(ax, *notes.low_high, f"paper notes {notes.shown()}", color="#3a78b5")
    legend_below(fig, ax, ncol=3)
    save(fig, path)


def fig_probes(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    positions = list(next(iter(per_model.values()))["summary"]["probes"])
    fig, axes = dose_axes("Linear decodability, group-CV over scenarios (paper Sec. 3 probe 3)", len(positions), 3.6)
    for ax, pos in zip(axes, positions):
        for name, rec in per_model.items():
            s = rec["summary"]
            for label, res in s["probes"].get(pos, {}).items():
                pts = [((i + 1) / s["n_layers"], acc) for i, acc in enumerate(res["acc"]) if acc is not None]
                if pts:
                    ax.plot(*zip(*pts), marker=".", ms=3, label=f"{short_model(name)}: {label}")
        ax.axhline(0.5, color="black", lw=0.4, ls=":")
        ax.set_title(pos, fontsize=8)
        ax.set_xlabel("relative depth", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("held-out accuracy (chance 0.5)", fontsize=8)
    legend_below(fig, axes[0], ncol=2)
    save(fig, path)


def fig_timing(records: list[dict[str, Any]], path: Path) -> None:
    per_model = latest_per_model(records)
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    commit = paper_value("figure.appC_timing.commit_depth")
    ax.axvspan(*commit.low_high, color="grey", alpha=0.3, label=f"paper commit depth {commit.shown()} (Qwen3, Llama)")
    for m, (name, rec) in enumerate(per_model.items()):
        s = rec["summary"]
        pts = [((i + 1) / s["n_layers"], a) for i, a in enumerate(s["write_probe"]["acc"]) if a is not None]
        line, = ax.plot(*zip(*pts), marker=".", label=f"{tag(name, s)}: conclusion probe") if pts else \
            ax.plot([], [], label=name)
        if s["write_depth"] is not None:
            ax.axvline(s["write_depth"], color=line.get_color(), ls="--", lw=0.8)
        c = s["commit"]["commit_depth"][which(s)]
        if c["mean"] is not None:
            if c.get("ci_low") is not None:
                ax.axvspan(c["ci_low"], c["ci_high"], color=line.get_color(), alpha=0.15)
            ax.axvline(c["mean"], color=line.get_color(), lw=1.5, label=f"{short_model(name)}: decision commit")
    ax.axhline(s["decodable_at"], color="black", lw=0.4, ls=":")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("relative depth (layer + 1) / n_layers", fontsize=8)
    ax.set_ylabel("held-out accuracy of the conclusion probe", fontsize=8)
    ax.set_title("Write before commit (paper App. C ii): dashed = write depth", fontsize=9)
    legend_below(fig, ax)
    save(fig, path)


def fig_offtemplate(records: list[dict[str, Any]], path: Path) -> None:
    """Locality records grouped by task template (Appendix C off-template generalization): field-only and
    full-downstream recovery per template and model. Reads ``locality`` records. Not registered in FIGURES:
    ``render_all`` draws a registered figure whenever its experiment has records, so it would also draw
    for gated-only locality records; call it directly (or register it once render_all can skip)."""
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        newest[(task_stem(rec), rec["model"]["name"])] = rec
    per_key = {f"{t}\n{m}": r for (t, m), r in sorted(newest.items())}
    fig, ax = plt.subplots(figsize=(3.0 + 1.6 * len(per_key), 3.6))
    grouped_bars(ax, per_key, ["field_only", "full_downstream"], ["#e07b39", "#3a78b5"],
                 lambda s, k: s["recovery"][k][which(s)])
    ax.set_ylabel("decision recovery")
    ax.set_title("Off-template generalization (paper App. C)", fontsize=10)
    ax.legend(fontsize=7)
    save(fig, path)


# figure file stem -> (experiment whose records it reads, drawing function), collected by kvprobe.figures
FIGURES = {
    "fig3_knockout": ("knockout", fig_knockout),
    "fig3_probes": ("probes", fig_probes),
    "appC_writability": ("writability", fig_writability),
    "appC_timing": ("timing", fig_timing),
    "table4_dissociation": ("dissociation", table4_dissociation),
}
