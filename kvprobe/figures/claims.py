"""The claims figure: the paper's effects that kvprobe tests, one row per claim, one marker per study model (its
main record of that experiment) with its 95% interval, beside the paper's value or range from the registry
(:mod:`kvprobe.paper`); one panel per unit (a recovery or level, a rate, a paired difference, a cosine), so no
axis mixes units. The verdict is the marker's shape. Controls, identities and described rows are on the pages.
Reads the claims table (``claims.json``) beside the records, or evaluates the claims on the records given when
there is none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from kvprobe.figures.common import model_color, save, short_model, tagged

MAX_MODELS = 6  # markers of one row are offset vertically; more than six would run into the next row
SHAPES = {"reproduced": ("o", True), "not reproduced": ("X", True), "outside the paper's range": ("D", True),
          "inconclusive": ("s", False)}
# The unit of a claim's "ours", one panel each (title, x range); a value beyond the range is drawn at its edge.
UNITS = {"level": ("recovery or level (fraction of the oracle's effect)", (-0.3, 1.3)),
         "rate": ("rate (P(correct), agreement, follow rate)", (0.0, 1.05)),
         "difference": ("paired difference, a - b", (-0.6, 1.1)),
         "cosine": ("logit cosine", (0.85, 1.005))}


def _claims_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    paths = [Path(r["_path"]) for r in records if r.get("_path")]
    table = paths[0].parents[2] / "claims.json" if paths else None
    from kvprobe.claims import claims_rows, read_claims

    if table is not None and table.exists():
        return read_claims(table)
    return claims_rows(records)


def _key(path: str | None) -> tuple[str, ...]:
    return tuple(Path(path).parts[-3:]) if path else ()


def _verdict(v: str) -> str | None:
    return next((k for k in SHAPES if v.startswith(k)), None)


def unit_of(row: dict[str, Any]) -> str:
    """Which panel a claim's "ours" belongs to (its unit)."""
    if row.get("kind") == "greater" and row.get("threshold") is None:
        return "difference"
    if "cosine" in row.get("claim", ""):
        return "cosine"
    if row.get("kind") in ("at_least", "agrees"):
        return "rate"
    return "level"


def forest_models(published: list[dict[str, Any]]) -> list[str]:
    """The models the forest draws: the study's, in study order, that have a published record here."""
    from kvprobe.study import _study_file, study_models

    present = {r["model"]["name"] for r in published}
    ordered = [m for m in study_models() if m in present] if _study_file().exists() else []
    return ordered[:MAX_MODELS] or sorted(present)[:MAX_MODELS]


def fig_claims(records: list[dict[str, Any]], path: Path, claim_rows: list[dict[str, Any]] | None = None) -> None:
    """Draw the figure from ``claim_rows`` (the table just computed), else from the claims table beside the records."""
    from kvprobe.figures.common import random_init_models
    from kvprobe.runner.sections import experiment_order
    from kvprobe.study import _study_file, main_records, published_records

    # the study's published records; a folder with none (a scratch folder, a test) is drawn from its own records
    published = records if records and all("_task" in r for r in records) else \
        (published_records(records) if _study_file().exists() else []) or tagged(records)
    models = forest_models(published)
    random_init = random_init_models(published)
    colors = [model_color(m) for m in models]  # the same colour as in every other figure
    main = {k: _key(r.get("_path")) for k, r in main_records(published).items()} if _study_file().exists() else \
        {(r["experiment"], r["model"]["name"]): _key(r.get("_path")) for r in published}
    rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for row in claim_rows if claim_rows is not None else _claims_rows(published):
        if row.get("role") != "effect" or _verdict(row.get("verdict", "")) is None:
            continue  # tested effects only: controls, identities, descriptions and "not measurable" are on the pages
        if row["model"] not in models or main.get((row["experiment"], row["model"])) != _key(row.get("record")):
            continue
        rows.setdefault((unit_of(row), row["experiment"], row["claim"]), {})[row["model"]] = row
    if not rows:
        return
    order = {e: i for i, e in enumerate(experiment_order())}
    units = [u for u in UNITS if any(k[0] == u for k in rows)]
    per_unit = {u: sorted((k for k in rows if k[0] == u), key=lambda k: (order.get(k[1], len(order)), k[1], k[2]))
                for u in units}
    heights = [len(per_unit[u]) + 1.2 for u in units]
    fig, axes = plt.subplots(len(units), 1, figsize=(6.5, min(9.0, 1.2 + 0.2 * sum(heights))),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, unit in zip(axes[:, 0], units):
        title, (lo_x, hi_x) = UNITS[unit]
        keys = list(reversed(per_unit[unit]))
        labels = []
        for y, key in enumerate(keys):
            _, exp, claim = key
            text = f"{exp}: {claim}"
            labels.append(text if len(text) <= 62 else text[:60] + "..")
            first = next(iter(rows[key].values()))
            pr = first.get("paper_range")
            if pr is not None:  # the paper's value or range, from the registry
                a, b = (max(min(v, hi_x), lo_x) for v in pr)
                ax.plot([a, b] if a != b else [a], [y, y] if a != b else [y], color="black",
                        lw=3.5 if a != b else 0, marker=None if a != b else "|", ms=9, mew=1.5, alpha=0.35)
            for m, model in enumerate(models):
                row = rows[key].get(model)
                ours = (row or {}).get("ours", {})
                if row is None or ours.get("mean") is None:
                    continue
                shape, filled = SHAPES[_verdict(row["verdict"])]
                yy = y + (m - (len(models) - 1) / 2) * 0.13
                if ours.get("ci_low") is not None:
                    ax.plot([max(ours["ci_low"], lo_x), min(ours["ci_high"], hi_x)], [yy, yy], color=colors[m],
                            lw=0.9)
                ax.plot([min(max(ours["mean"], lo_x), hi_x)], [yy], marker=shape, ls="", ms=4, color=colors[m],
                        mfc=colors[m] if filled else "white", mew=0.9)
        ax.set_yticks(range(len(labels)), labels, fontsize=5.5)
        ax.set_ylim(-0.7, len(labels) - 0.3)
        ax.set_xlim(lo_x, hi_x)
        if lo_x < 0 < hi_x:
            ax.axvline(0, color="grey", lw=0.4)
        ax.tick_params(axis="x", labelsize=6)
        ax.set_title(title, fontsize=7, loc="left")
    handles = [plt.Line2D([], [], color=c, marker="o", ls="-", lw=0.9,
                          label=short_model(m) + (" (RANDOM-INIT)" if m in random_init else ""))
               for m, c in zip(models, colors)]
    handles += [plt.Line2D([], [], color="black", marker=s, ls="", mfc="black" if f else "white", label=v)
                for v, (s, f) in SHAPES.items()]
    handles.append(plt.Line2D([], [], color="black", lw=3.5, alpha=0.35, label="the paper's value or range"))
    fig.legend(handles=handles, fontsize=5.5, ncol=4, loc="upper center", bbox_to_anchor=(0.5, 0.975),
               frameon=False)
    fig.suptitle("Paper effects tested on the study's models: ours (95% CI, clipped to the axis) and the paper's",
                 fontsize=7, y=0.995)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.93))
    fig._kvprobe_laid_out = True
    save(fig, path, dpi=150)


FIGURES = {"claims_forest": ("", fig_claims)}  # every paper claim x model (reads all records: experiment "")
