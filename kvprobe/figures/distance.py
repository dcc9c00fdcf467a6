"""Locality against distance (paper Figure 3a, swept over distance and prompt format).

One row per model (the cells of all its ``locality_distance`` records, newest first): the oracle flip (median, nats), the inclusion
rate under the record's gate, and field-only recovery (mean over included instances, cluster-bootstrap CI)
against the measured field-to-decision distance, one line per format. A cell with no included instance has
no recovery point (a ratio over sub-threshold flips is noise); the paper's single point (Llama-3.1-8B,
field-only at ~725 tokens, from the paper registry) is drawn for reference.

The cross-size view (``fig3a_locality_sizes``): the grid of ``configs/locality_sizes.yaml`` on the pretrained
sizes, field-only recovery against model size with the rule before vs after the field, beside the paper's 8B
value (its cells come from :func:`kvprobe.figures.common.size_cells`, which the report's table reads too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import short_model
from kvprobe.paper import paper_value
from kvprobe.probes.summary import MIN_CI_CLUSTERS



def _paper_point() -> tuple[float, float]:
    """The paper's locality point (Llama-3.1-8B): field-to-decision distance in tokens, field-only recovery."""
    point = paper_value("figure.fig3a_locality_distance.paper_point").curve
    return point["distance"], point["field_only"]
MARKERS = {"system_user": "o", "user_turn": "s", "document_qa": "^", "few_shot": "D", "tool_call": "v",
           "gated_template": "X", "email": "P"}


def _cells_per_model(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model, every (format, distance) cell its records measured (a newer record's cell replaces an
    older one's, so a focused rerun of one cell with more families refines the grid; cells on the fixed
    template's hand-written scenarios are kept apart, dashed) and the newest gate."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:  # oldest first
        entry = out.setdefault(rec["model"]["name"], {"cells": {}, "gate": None})
        # Hand-written template scenarios are other families than generated ones: their own lines.
        tag = ", template scenarios" if rec["config"]["task"].get("scenarios") else ""
        for fmt, by_d in rec["summary"]["cells"].items():
            entry["cells"].setdefault(fmt + tag, {}).update(by_d)
        entry["gate"] = rec["summary"]["gate"]["min_flip"]
    return out


def fig_locality_distance(records: list[dict[str, Any]], path: Path) -> None:
    # published records carry their task: the rule-position grid (same experiment) is another figure's cells
    per_model = _cells_per_model([r for r in records if r.get("_task", "distance") == "distance"])
    if not per_model:
        return
    labels_all = sorted({lab for e in per_model.values() for lab in e["cells"]},
                        key=lambda lab: (lab.split(",")[0] not in MARKERS, list(MARKERS).index(lab.split(",")[0])
                                         if lab.split(",")[0] in MARKERS else 0, lab))
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels_all)}  # same line, same color
    fig, axes = plt.subplots(len(per_model), 3, figsize=(6.5, 2.2 * len(per_model) + 1.2), squeeze=False)
    for row, (name, entry) in zip(axes, per_model.items()):
        for fmt, by_d in entry["cells"].items():
            cells = sorted(by_d.values(), key=lambda c: c["distance_tokens_mean"])
            xs = [c["distance_tokens_mean"] for c in cells]
            kw = dict(marker=MARKERS.get(fmt.split(",")[0], "o"), ms=4, lw=1.2, label=fmt, color=colors[fmt],
                      ls="--" if fmt.endswith("template scenarios") else "-")
            row[0].plot(xs, [c["oracle_flip"].get("median") for c in cells], **kw)
            row[1].plot(xs, [c["inclusion_rate"] for c in cells], **kw)
            rec_pts = [(x, c["recovery"]["field_only"]["gated"]) for x, c in zip(xs, cells) if c["n_included"]]
            if rec_pts:
                row[2].plot([x for x, _ in rec_pts], [s["mean"] for _, s in rec_pts], **kw)
                for x, s in rec_pts:
                    if s.get("ci_low") is not None and s.get("ci_high") is not None and \
                            (s.get("n_clusters") or MIN_CI_CLUSTERS) >= MIN_CI_CLUSTERS:  # none from < 5 clusters
                        row[2].vlines(x, s["ci_low"], s["ci_high"], color=colors[fmt], lw=0.8)
        gate = entry["gate"]
        row[0].axhline(gate, color="black", lw=0.6, ls=":")
        row[0].set_ylabel(f"{short_model(name)}\noracle flip, median (nats)", fontsize=7)
        row[1].set_ylabel(f"included (flip >= {gate})", fontsize=7)
        row[1].set_ylim(-0.05, 1.05)
        row[2].set_ylabel("field-only recovery", fontsize=7)
        row[2].axhline(0, color="black", lw=0.6)
        row[2].axhline(1, color="black", lw=0.4, ls=":")
        row[2].plot(*_paper_point(), marker="*", color="black", ms=9, ls="none", label="paper (Llama-3.1-8B)")
        for ax in row:
            ax.set_xscale("log")
            ax.set_xlim(30, 3000)  # the whole swept range on every panel
            ax.set_xlabel("distance (tokens)", fontsize=7)
            ax.tick_params(labelsize=7)
    axes[0][0].set_title("effect size", fontsize=9)
    axes[0][1].set_title("inclusion rate", fontsize=9)
    axes[0][2].set_title("field-only (included)", fontsize=9)
    handles, labels = axes[0][2].get_legend_handles_labels()
    for ax in axes[:, 0]:
        h, lab = ax.get_legend_handles_labels()
        handles += [x for x, y in zip(h, lab) if y not in labels]
        labels += [y for y in lab if y not in labels]
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=6, frameon=False)
    fig.suptitle("Locality against distance and format (paper Fig. 3a, one point of this curve)", fontsize=9)
    height = fig.get_size_inches()[1]
    rows = (len(labels) + 3) // 4
    fig.tight_layout(rect=(0, (0.15 + 0.12 * rows) / height, 1, 1 - 0.3 / height))  # room for legend and title
    fig.savefig(path, dpi=130)
    plt.close(fig)


DISTANCE_FIGURES = {"fig3a_locality_distance": ("locality_distance", fig_locality_distance)}


# The paper's field-only value on its headline model (Sec. 3 (1)): Llama-3.1-8B, its template (the rule in the
# policy after the session context that holds the field), the field ~725 tokens before the decision.
LLAMA_8B_PARAMS_B = 8.0  # where the paper's Llama-3.1-8B point sits on the size axis
RULE_STYLE = {"before field": ("tab:blue", "-"), "after field": ("tab:orange", "--")}


def fig_locality_sizes(records: list[dict[str, Any]], path: Path) -> None:
    """Field-only recovery against model size, the rule before vs after the field (the cross-size view of
    paper Fig. 3a): one column per distance, recovery (included instances, cluster CI) above and the inclusion
    rate below, one line per (format, rule position) over the pretrained sizes; the paper's 8B value marked."""
    from kvprobe.figures.common import size_cells

    cells = [c for c in size_cells(records) if c["params_b"]]
    if not cells:
        return
    distances = sorted({c["distance"] for c in cells})
    fig, axes = plt.subplots(2, len(distances), figsize=(6.5, 5.4), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    lines = sorted({(c["format"], c["rule"]) for c in cells})
    for col, dist in enumerate(distances):
        top, bottom = axes[0][col], axes[1][col]
        for i, (fmt, rule) in enumerate(lines):
            part = sorted((c for c in cells if (c["format"], c["rule"], c["distance"]) == (fmt, rule, dist)),
                          key=lambda c: c["params_b"])
            if not part:
                continue
            color, ls = RULE_STYLE.get(rule, ("tab:gray", ":"))
            kw = dict(color=color, ls=ls, marker=MARKERS.get(fmt, "o"), ms=5, lw=1.2, label=f"{fmt}, rule {rule}")
            shift = 1 + 0.05 * (i - (len(lines) - 1) / 2)  # side by side at one size, so equal values stay visible
            bottom.plot([c["params_b"] * shift for c in part], [c["cell"]["inclusion_rate"] for c in part], **kw)
            pts = [(c["params_b"] * shift, c["cell"]) for c in part if c["cell"]["n_included"]]
            if pts:
                top.plot([x for x, _ in pts], [cell["recovery"]["field_only"]["gated"]["mean"] for _, cell in pts],
                         **kw)
            for x, cell in pts:
                s = cell["recovery"]["field_only"]["gated"]
                if s.get("ci_low") is not None and s.get("ci_high") is not None and \
                        (s.get("n_clusters") or MIN_CI_CLUSTERS) >= MIN_CI_CLUSTERS:  # no interval from < 5 clusters
                    top.vlines(x, s["ci_low"], s["ci_high"], color=color, lw=0.9)
                top.annotate(f"{cell['n_included']}/{cell['n']}", (x, s["mean"]), textcoords="offset points",
                             xytext=(4, 3 if rule == "before field" else -9), fontsize=6, color=color)
        top.plot(LLAMA_8B_PARAMS_B, _paper_point()[1], marker="*", color="black", ms=10, ls="none",
                 label=f"paper: Llama-3.1-8B, rule after field, ~{_paper_point()[0]:.0f} tok")
        top.axhline(0, color="black", lw=0.6)
        top.axhline(1, color="black", lw=0.4, ls=":")
        measured = [c["cell"]["distance_tokens_mean"] for c in cells if c["distance"] == dist]
        top.set_title(f"field {dist} tokens before the decision\n(measured {min(measured):.0f}-{max(measured):.0f})",
                      fontsize=7)
        bottom.set_ylim(-0.05, 1.05)
        bottom.set_xscale("log")
        bottom.set_xlim(0.09, 12)
        bottom.set_xticks([0.135, 0.5, 1.5, 8], ["135M", "0.5B", "1.5B", "8B"])
        bottom.minorticks_off()
        bottom.set_xlabel("model size (parameters)", fontsize=8)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("field-only recovery\n(included instances, 95% cluster CI)", fontsize=7)
    axes[1][0].set_ylabel("included\n(oracle flip >= gate)", fontsize=7)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=6, frameon=False)
    fig.suptitle("Locality across pretrained sizes: does the decision read the field?\n(paper Fig. 3a, by size)",
                 fontsize=8)
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)


DISTANCE_FIGURES["fig3a_locality_sizes"] = ("locality_distance", fig_locality_sizes)

FIGURES = DISTANCE_FIGURES  # what kvprobe.figures collects from each of its modules
