"""Shared plotting helpers: latest record per model, CI error bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.probes.summary import MIN_CI_CLUSTERS


GATED_TEMPLATE = "configs/tasks/gated.yaml"


def task_template(record: dict[str, Any]) -> str:
    """The task template a record was run on (as written in its config)."""
    return record["config"]["task"]["template"]


def latest_per_model(records: list[dict[str, Any]], template: str | None = None) -> dict[str, dict[str, Any]]:
    """One record per model.

    On published records (tagged ``_task`` by :func:`kvprobe.study.published_records`; what ``render_all``
    passes): without ``template``, the model's main record of the experiment (:func:`kvprobe.study.main_records`:
    the prompt shape its headline uses); with ``template``, its record on that task template's own instances
    (generated instances never count as the template's). On raw records (no ``_task``): the newest record per
    model, of ``template`` if given, else of any task but generated instances.
    """
    if records and all("_task" in r for r in records):
        if template is None:
            from kvprobe.study import main_records

            return {model: rec for (_, model), rec in main_records(records).items()}
        return {r["model"]["name"]: r for r in records
                if task_template(r) == template and not r["_task"].startswith("generated_")
                and r["_task"] == Path(template).stem}
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        task = task_template(rec)
        generated = bool(rec["config"]["task"].get("generator"))
        if (task == template and not generated) if template is not None else not generated:
            out[rec["model"]["name"]] = rec
    return out


def tagged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with their task name ``_task`` (published records carry the study's; others their task stem)."""
    from kvprobe.runner.records import task_stem

    return [r if "_task" in r else {**r, "_task": task_stem(r)} for r in records]


def main_per_model(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each model's main record (:func:`kvprobe.study.main_records`: the study's main prompt shape, else the
    template, else generated instances)."""
    from kvprobe.study import main_records

    return {model: rec for (_, model), rec in main_records(tagged(records)).items()}


def task_label(record: dict[str, Any]) -> str:
    """A short name for the record's prompt shape, for axis labels."""
    task = record.get("_task") or Path(task_template(record)).stem
    return {"gated": "template", "generated_template_system_user": "chat layout"}.get(
        task, task.replace("generated_test_", "test: ").replace("generated_", ""))


MODEL_PALETTE = ("#1b6ca8", "#d1495b", "#2e8b57", "#8d6a9f", "#e08e0b", "#555555")


def model_color(name: str) -> str:
    """One colour per study model, the same in every panel and figure (study order)."""
    from kvprobe.study import study_models, study_present

    models = study_models() if study_present() else []
    return MODEL_PALETTE[models.index(name) % len(MODEL_PALETTE)] if name in models else MODEL_PALETTE[-1]


def short_model(name: str) -> str:
    """Model names short enough for a panel title or tick label."""
    return (name.replace("qwen2.5-coder-0.5b", "qwen-0.5b").replace("qwen2.5-coder-1.5b", "qwen-1.5b")
            .replace("smollm2-135m", "smollm2")
            .replace("-gated-", " org. "))


def bar_with_ci(ax, x: float, stat: dict[str, Any], width: float, color: str, label: str | None = None,
                hatch: str | None = None) -> None:
    mean = stat.get("mean")
    if mean is None:
        return
    # no interval (one instance or one scenario: ci None; or fewer than 5 scenario clusters, kvprobe's rule for
    # printing one) draws no whisker
    few = stat.get("n_clusters") is not None and stat["n_clusters"] < MIN_CI_CLUSTERS
    lo = mean if stat.get("ci_low") is None or few else stat["ci_low"]
    hi = mean if stat.get("ci_high") is None or few else stat["ci_high"]
    ax.bar(x, mean, width=width, color=color, label=label, hatch=hatch)
    ax.errorbar(x, mean, yerr=[[mean - lo], [hi - mean]], fmt="none", ecolor="black", capsize=2, lw=0.8)


def legend_below(fig, ax, ncol: int = 2, extra: Any = None) -> None:
    """The legend of ``ax`` (and of ``extra`` axes) below the panels, never over the data; the layout leaves room
    for it and for the figure's title."""
    handles, labels = ax.get_legend_handles_labels()
    for other in extra or ():
        h, lab = other.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if not handles:
        return
    fig.legend(handles, labels, fontsize=6, ncol=ncol, loc="lower center", frameon=False)
    height = fig.get_size_inches()[1]
    rows = (len(labels) + ncol - 1) // ncol
    top = 1 - 0.3 / height if fig._suptitle is not None else 1
    fig.tight_layout(rect=(0, (0.1 + 0.12 * rows) / height, 1, top))
    fig._kvprobe_laid_out = True


def paper_band(ax, low: float, high: float, label: str, color: str = "black") -> None:
    """The paper's value (a line) or range (a band) on the y axis, labelled at the right."""
    if high - low < 1e-3:
        ax.axhline(low, color=color, lw=0.9, ls="--")
    else:
        ax.axhspan(low, high, color=color, alpha=0.15, lw=0)
    ax.annotate(label, (1.0, high), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=5.5,
                color=color)


def save(fig, path: Path, dpi: int = 130) -> None:
    if not getattr(fig, "_kvprobe_laid_out", False):
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def random_init_models(records: list[dict[str, Any]]) -> set[str]:
    """Models whose records come from seeded random weights (``--random-init``): every figure marks them."""
    return {r["model"]["name"] for r in records if r.get("random_init") or (r.get("model") or {}).get("random_init")}


def covers_chance(stat: dict[str, Any] | None, chance: float = 0.5) -> bool:
    """Whether an accuracy is indistinguishable from chance: its interval holds ``chance`` (a binary decision: 0.5)."""
    if not stat or stat.get("mean") is None:
        return False
    lo = stat["mean"] if stat.get("ci_low") is None else stat["ci_low"]
    hi = stat["mean"] if stat.get("ci_high") is None else stat["ci_high"]
    return lo <= chance <= hi


def mark_at_chance(ax, what: str) -> None:
    """Mark a panel whose reference accuracy is at chance: what it draws cannot show the paper's effect."""
    ax.set_facecolor("#f1f1f1")
    ax.text(0.5, 0.5, f"AT CHANCE: {what}", transform=ax.transAxes, ha="center", va="center", fontsize=6,
            color="#8b0000", bbox={"boxstyle": "round", "fc": "white", "ec": "#8b0000", "lw": 0.6, "alpha": 0.85},
            wrap=True, zorder=10)


SIZES_TASK = "sizes"  # study task name of the cross-size locality grid (configs/locality_sizes.yaml); "sizes_*" too


def size_cells(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cross-size locality grid: one cell per (model, format, rule position, distance) of the published
    ``locality_distance`` records whose task is :data:`SIZES_TASK` (or ``sizes_...``: a model's extra cells run
    apart), smallest model first. ``params_b`` is the model's size from the registry (None for an unknown one).
    The cross-size figure draws these cells and the report's ``locality_sizes`` block tabulates them."""
    from kvprobe.models.registry import REGISTRY

    out = []
    for rec in records:
        task = rec.get("_task", "")
        if rec["experiment"] != "locality_distance" or not (task == SIZES_TASK or task.startswith(SIZES_TASK + "_")):
            continue
        name = rec["model"]["name"]
        entry = REGISTRY.get(name)
        for label, by_d in rec["summary"]["cells"].items():
            fmt, _, rule = label.partition(", rule ")
            for dist, cell in by_d.items():
                out.append({"model": name, "params_b": entry.params_b if entry else None, "format": fmt,
                            "rule": rule or "format's own place", "distance": int(dist), "cell": cell})
    return sorted(out, key=lambda c: (c["params_b"] or 0.0, c["model"], c["format"], c["rule"], c["distance"]))
