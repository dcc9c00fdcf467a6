"""The claims summary figure: one row per paper claim, one marker per study model (its main record of that
experiment), ours beside the paper's value, the verdict in the marker's shape; effects above, controls below.
One page. Reads the committed claims table (``results/claims.json``) beside the records, or evaluates the
claims on the records given when there is none. Identities are left out; the tests and CIs are on the pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import model_color, save, short_model, tagged

MAX_MODELS = 6  # markers of one row are offset vertically; more than six would run into the next row
SHAPES = {"reproduced": ("o", True), "not reproduced": ("X", True), "outside the paper's range": ("D", True),
          "inconclusive": ("s", False), "not measurable": ("o", False)}
XLIM = (-0.3, 1.3)


def _claims_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    paths = [Path(r["_path"]) for r in records if r.get("_path")]
    table = paths[0].parents[2] / "claims.json" if paths else None
    from kvprobe.claims import claims_rows, read_claims

    if table is not None and table.exists():
        return read_claims(table)
    return claims_rows(records)


def _key(path: str | None) -> tuple[str, ...]:
    return tuple(Path(path).parts[-3:]) if path else ()


def _verdict(v: str) -> str:
    return next((k for k in SHAPES if v.startswith(k)), "not measurable")


def forest_models(published: list[dict[str, Any]]) -> list[str]:
    """The models the forest draws: the study's, in study order, that have a published record here."""
    from kvprobe.study import study_models

    present = {r["model"]["name"] for r in published}
    return [m for m in study_models() if m in present][:MAX_MODELS] or sorted(present)[:MAX_MODELS]


def fig_claims(records: list[dict[str, Any]], path: Path) -> None:
    from kvprobe.runner.pages import EXPERIMENT_ORDER
    from kvprobe.study import main_records, published_records

    # the study's published records; a folder with none (a scratch folder, a test) is drawn from its own records
    published = records if records and all("_task" in r for r in records) else \
        published_records(records) or tagged(records)
    models = forest_models(published)
    colors = [model_color(m) for m in models]  # the same colour as in every other figure
    main = {k: _key(r.get("_path")) for k, r in main_records(published).items()}
    rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    paper: dict[tuple[str, str, str], float | None] = {}
    for row in _claims_rows(published):
        if "identity" in (row.get("status"), row.get("kind")) or row.get("verdict", "").startswith("identity"):
            continue
        if row["model"] not in models or main.get((row["experiment"], row["model"])) != _key(row.get("record")):
            continue
        role = "control" if row.get("role") == "control" else "effect"
        key = (role, row["experiment"], row["claim"])
        rows.setdefault(key, {})[row["model"]] = row
        paper.setdefault(key, row.get("paper_point", row.get("paper_value")))
    if not rows:
        return
    order = {e: i for i, e in enumerate(EXPERIMENT_ORDER)}
    keys = sorted(rows, key=lambda k: (k[0] != "effect", order.get(k[1], len(order)), k[1]))
    fig, ax = plt.subplots(figsize=(6.5, min(9.0, 1.5 + 0.19 * len(keys))))
    labels = []
    for y, key in enumerate(reversed(keys)):
        role, exp, claim = key
        text = f"{exp}: {claim}"
        labels.append(text if len(text) <= 70 else text[:68] + "..")
        if paper[key] is not None:
            ax.plot([min(max(paper[key], XLIM[0]), XLIM[1])], [y], marker="|", color="black", ms=9, mew=1.5)
        for m, model in enumerate(models):
            row = rows[key].get(model)
            mean = (row or {}).get("ours", {}).get("mean")
            if row is None or mean is None:
                continue
            shape, filled = SHAPES[_verdict(row["verdict"])]
            x = min(max(mean, XLIM[0]), XLIM[1])
            ax.plot([x], [y + (m - (len(models) - 1) / 2) * 0.13], marker=shape, ls="", ms=4.5, color=colors[m],
                    mfc=colors[m] if filled else "white", mew=1.0)
    n_effects = sum(k[0] == "effect" for k in keys)
    if n_effects < len(keys):
        ax.axhline(len(keys) - n_effects - 0.5, color="black", lw=0.8)
        ax.text(XLIM[1], len(keys) - n_effects - 0.45, "effects above, controls below", ha="right", va="bottom",
                fontsize=6)
    ax.set_yticks(range(len(labels)), labels, fontsize=5.5)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlim(*XLIM)
    ax.axvline(0, color="grey", lw=0.4)
    ax.axvline(1, color="grey", lw=0.4, ls=":")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("our mean (recovery, rate or cosine), clipped to the axis;  |  the paper's value", fontsize=6)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=short_model(m))
               for m, c in zip(models, colors)]
    handles += [plt.Line2D([], [], color="black", marker=s, ls="", mfc="black" if f else "white", label=v)
                for v, (s, f) in SHAPES.items()]
    ax.legend(handles=handles, fontsize=6, ncol=3, loc="lower center", bbox_to_anchor=(0.35, 1.0), frameon=False)
    save(fig, path, dpi=150)
