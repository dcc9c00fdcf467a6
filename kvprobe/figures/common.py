"""Shared plotting helpers: latest record per model, CI error bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt


GATED_TEMPLATE = "configs/tasks/gated.yaml"


def task_template(record: dict[str, Any]) -> str:
    """The task template a record was run on (as written in its config)."""
    return record["config"]["task"]["template"]


def latest_per_model(records: list[dict[str, Any]], template: str | None = None) -> dict[str, dict[str, Any]]:
    """The newest record for each model name (records come sorted oldest first).

    With ``template`` only records of that task (:func:`task_template`) count, so that an off-template run of
    the same experiment (e.g. locality on the two-hop task) never replaces the main figure's bar. Without it,
    records of generated instances (``task.generator``) are left out: they are variants of a probe, not its
    main run, and are read by name where a figure wants them.
    """
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        task = task_template(rec)
        if (task == template) if template is not None else not task.startswith("generator:"):
            out[rec["model"]["name"]] = rec
    return out


def bar_with_ci(ax, x: float, stat: dict[str, Any], width: float, color: str, label: str | None = None) -> None:
    mean = stat.get("mean")
    if mean is None:
        return
    # no interval (one instance or one scenario: ci None) draws no whisker
    lo = mean if stat.get("ci_low") is None else stat["ci_low"]
    hi = mean if stat.get("ci_high") is None else stat["ci_high"]
    ax.bar(x, mean, width=width, color=color, label=label)
    ax.errorbar(x, mean, yerr=[[mean - lo], [hi - mean]], fmt="none", ecolor="black", capsize=2, lw=0.8)


def save(fig, path: Path, dpi: int = 130) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
