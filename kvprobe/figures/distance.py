"""Locality against distance (paper Figure 3a, swept over distance and prompt format).

One row per model (the cells of all its ``locality_distance`` records, newest first): the oracle flip (median, nats), the inclusion
rate under the record's gate, and field-only recovery (mean over included instances, cluster-bootstrap CI)
against the measured field-to-decision distance, one line per format. A cell with no included instance has
no recovery point (a ratio over sub-threshold flips is noise); the paper's single point (Llama-3.1-8B,
field-only at ~725 tokens, from the paper registry) is drawn for reference.

The cross-size view (``fig3a_locality_sizes``): the grid of ``configs/locality_sizes.yaml`` on the pretrained
sizes, field-only recovery against model size with the rule before vs after the field, beside the paper's 8B
value, the two organisms as reference points (its records come from :func:`kvprobe.trends.size_records`, which the
report's table and the trend tests read too).
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


RULE_GROUPS = {  # one line per rule position (formats pooled), and the paper's layout apart
    "rule before field": ("tab:blue", "-", "o", (("rule_at", "before_field"), ("format", ("user_turn", "document_qa")))),
    "rule after field": ("tab:orange", "--", "s", (("rule_at", "after_field"), ("format", ("user_turn", "document_qa")))),
    "paper's layout (rule after)": ("tab:green", "-.", "D", (("format", "gated_template"),)),
}


def _group_points(rec: dict[str, Any], where: Any, dist: int) -> dict[str, Any] | None:
    """Gate rate (exact CI) and field-only recovery over gated rows (cluster CI) of one record's rows in a group."""
    from kvprobe.probes.summary import scenarios, summarize_column
    from kvprobe.stats.inference import summarize_proportion
    from kvprobe.trends import matches

    rows = [r for r in rec["rows"] if matches(r, where) and r.get("distance_target") == dist]
    if not rows:
        return None
    gated = [r for r in rows if r["included"]]
    return {"gate": summarize_proportion([bool(r["included"]) for r in rows], scenarios(rows)),
            "field_only": summarize_column(gated, [r.get("field_only") for r in gated]) if gated else None}


def _pooled_by_model(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per model, its size-grid records' rows together (a model's grid may run in parts: sizes_*)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        name = rec["model"]["name"]
        if name in out:
            out[name]["rows"] = out[name]["rows"] + rec["rows"]
        else:
            out[name] = {"model": rec["model"], "_params_b": rec["_params_b"], "rows": list(rec["rows"])}
    return list(out.values())


def _ci_ok(stat: dict[str, Any] | None) -> bool:
    return bool(stat and stat.get("ci_low") is not None and stat.get("ci_high") is not None
                and (stat.get("n_clusters") or MIN_CI_CLUSTERS) >= MIN_CI_CLUSTERS)  # no interval from < 5 clusters


def fig_locality_sizes(records: list[dict[str, Any]], path: Path) -> None:
    """Field-only recovery and the gate rate against model size (the cross-size view of paper Fig. 3a): one column
    per distance, recovery over gated instances (cluster CI) above, the gate rate (exact CI) below, one line per rule
    position over the pretrained sizes (formats pooled), the paper's layout apart; the two organisms as hollow
    reference points at their base model's size, the paper's Llama-3.1-8B value marked."""
    from kvprobe.trends import size_records

    pretrained = _pooled_by_model(size_records(records))
    organisms = _pooled_by_model(size_records(records, kinds=("organism",)))
    if not pretrained:
        return
    distances = sorted({r["distance_target"] for rec in pretrained for r in rec["rows"]})
    fig, axes = plt.subplots(2, len(distances), figsize=(6.5, 5.2), squeeze=False, sharex=True, sharey="row",
                             gridspec_kw={"height_ratios": [1.6, 1]})
    for col, dist in enumerate(distances):
        top, bottom = axes[0][col], axes[1][col]
        for i, (label, (color, ls, marker, where)) in enumerate(RULE_GROUPS.items()):
            shift = 1 + 0.06 * (i - 1)  # side by side at one size, so equal values stay visible
            line_x, gate_y, rec_x, rec_y = [], [], [], []
            for rec in pretrained:
                pt = _group_points(rec, where, dist)
                if pt is None:
                    continue
                x = rec["_params_b"] * shift
                g = pt["gate"]
                line_x.append(x)
                gate_y.append(g["mean"])
                bottom.vlines(x, g["ci_low"], g["ci_high"], color=color, lw=0.9)
                fo = pt["field_only"]
                if fo and fo.get("mean") is not None:
                    rec_x.append(x)
                    rec_y.append(fo["mean"])
                    if _ci_ok(fo):
                        top.vlines(x, fo["ci_low"], fo["ci_high"], color=color, lw=0.9)
                    top.annotate(f"{fo['n']}", (x, fo["mean"]), textcoords="offset points", xytext=(4, 2),
                                 fontsize=6, color=color)
            if line_x:
                bottom.plot(line_x, gate_y, color=color, ls=ls, marker=marker, ms=4, lw=1.2, label=label)
                top.plot(rec_x, rec_y, color=color, ls=ls, marker=marker, ms=4, lw=1.2)
            for rec in organisms:
                pt = _group_points(rec, where, dist)
                if pt is None:
                    continue
                x = rec["_params_b"] * shift * 1.12
                bottom.plot(x, pt["gate"]["mean"], marker=marker, mfc="none", color=color, ms=5, ls="none")
                fo = pt["field_only"]
                if fo and fo.get("mean") is not None:
                    top.plot(x, fo["mean"], marker=marker, mfc="none", color=color, ms=5, ls="none")
        if dist >= 500:  # the paper's point: its template, the field ~725 tokens before the decision
            top.plot(LLAMA_8B_PARAMS_B, _paper_point()[1], marker="*", color="black", ms=10, ls="none")
            top.annotate(f"paper, Llama-3.1-8B\n~{_paper_point()[0]:.0f} tok", (LLAMA_8B_PARAMS_B, _paper_point()[1]),
                         textcoords="offset points", xytext=(-30, 10), fontsize=6)
        top.axhline(0, color="black", lw=0.6)
        top.axhline(1, color="black", lw=0.4, ls=":")
        measured = [r["distance_tokens"] for rec in pretrained for r in rec["rows"] if r.get("distance_target") == dist]
        top.set_title(f"field ~{dist} tokens before the decision\n(measured {min(measured)}-{max(measured)})",
                      fontsize=7)
        bottom.set_ylim(-0.05, 1.05)
        bottom.set_xscale("log")
        bottom.set_xlim(0.09, 12)
        bottom.set_xticks([0.135, 0.5, 1.5, 8], ["135M", "0.5B", "1.5B", "8B"])
        bottom.minorticks_off()
        bottom.set_xlabel("model size (parameters)", fontsize=8)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("field-only recovery\n(gated instances, 95% cluster CI)", fontsize=7)
    axes[1][0].set_ylabel("gate rate\n(95% exact CI)", fontsize=7)
    handles, labels = axes[1][-1].get_legend_handles_labels()
    for ax in axes[1]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], marker="o", mfc="none", color="gray", ls="none"))
    labels.append("organism (LoRA on the 135M / 0.5B), same colours")
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=6, frameon=False)
    fig.suptitle("Where notes take over: the field's share of the decision against model size\n"
                 "(pretrained SmolLM2-135M, Qwen2.5-Coder-0.5B and -1.5B; numbers: gated instances)", fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 0.94))
    fig.savefig(path, dpi=130)
    plt.close(fig)


DISTANCE_FIGURES["fig3a_locality_sizes"] = ("locality_distance", fig_locality_sizes)

FIGURES = DISTANCE_FIGURES  # what kvprobe.figures collects from each of its modules
