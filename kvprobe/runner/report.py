"""The results table: one markdown row per (experiment, task template, model), from the newest record.

Every number in the README's results section is printed by ``kvprobe report`` from committed records, so
docs and records cannot drift apart. Each experiment module supplies its own ``headline`` (which numbers
matter) and ``paper`` (the paper's values for the same measure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvprobe.runner.experiment import available_experiments, get_experiment
from kvprobe.runner.records import load_records

COLUMNS = ("experiment", "task", "model", "gated / all", "oracle flip median (nats)", "headline (mean [95% CI])",
           "paper")


def template_stem(record: dict[str, Any]) -> str:
    return Path(record["config"]["task"]["template"]).stem


def latest_records(results_dir: str | Path) -> list[dict[str, Any]]:
    """Newest record per (experiment, task template, model), ordered by experiment then model."""
    newest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rec in load_records(results_dir):  # oldest first, so later ones replace earlier ones
        newest[(rec["experiment"], template_stem(rec), rec["model"]["name"])] = rec
    return [newest[k] for k in sorted(newest)]


def gate_cells(summary: dict[str, Any]) -> tuple[str, str]:
    if "n_included" not in summary:  # e.g. transplant: no field change, no gate
        return f"- / {summary.get('n_instances', '?')}", "-"
    median = summary.get("oracle_flip", {}).get("median")
    return (f"{summary['n_included']} / {summary['n_instances']}",
            "-" if median is None else f"{median:.2f}")


def report_rows(results_dir: str | Path = "results", experiments: list[str] | None = None) -> list[list[str]]:
    known = available_experiments()
    rows = []
    for rec in latest_records(results_dir):
        name = rec["experiment"]
        if name not in known or (experiments and name not in experiments):
            continue
        exp = get_experiment(name)
        summary, stem = rec["summary"], template_stem(rec)
        headline = exp.headline(summary) if exp.headline else "(no headline defined)"
        gated, flip = gate_cells(summary)
        rows.append([name, stem, rec["model"]["name"], gated, flip, headline, exp.paper.get(stem, "")])
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)
