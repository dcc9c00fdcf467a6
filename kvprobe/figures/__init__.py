"""One function per paper figure; each reads records only, never runs a model.

``render_all`` draws every figure whose experiment has records under ``results/``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from kvprobe.figures.locality import fig3a_locality, figC_offtemplate  # noqa: E402
from kvprobe.figures.specificity import table4_specificity  # noqa: E402
from kvprobe.figures.suffix import fig3bc_suffix  # noqa: E402
from kvprobe.figures.transplant import fig6b_transplant  # noqa: E402
from kvprobe.errors import KVProbeError  # noqa: E402
from kvprobe.runner.records import current_umask, load_records  # noqa: E402

# figure file stem -> (experiment whose records it reads, drawing function(records, path))
FIGURES: dict[str, tuple[str, Callable[[list[dict[str, Any]], Path], None]]] = {
    "fig3a_locality": ("", fig3a_locality),  # reads locality and locality_distance (the rule-position runs)
    "figC_offtemplate": ("locality", figC_offtemplate),
    "fig3bc_suffix": ("suffix", fig3bc_suffix),
    "fig6b_transplant": ("transplant", fig6b_transplant),
    "table4_specificity": ("specificity", table4_specificity),
}

from kvprobe.figures.edit import EDIT_FIGURES  # noqa: E402

FIGURES.update(EDIT_FIGURES)  # editing: figures 2c, 3d, 16, 17, 23

from kvprobe.figures.mechanism import MECHANISM_FIGURES  # noqa: E402

FIGURES.update(MECHANISM_FIGURES)  # mechanism: knockout, probes, writability, timing, Table 4 left

from kvprobe.figures.circuit import CIRCUIT_FIGURES  # noqa: E402

FIGURES.update(CIRCUIT_FIGURES)  # App. D circuit: heads (15a/f), attention vs MLP (15c), scrubbing (15d)

from kvprobe.figures.distance import DISTANCE_FIGURES  # noqa: E402

FIGURES.update(DISTANCE_FIGURES)  # locality against distance and format (Fig. 3a swept)

from kvprobe.figures.claims import fig_claims  # noqa: E402

FIGURES["claims_forest"] = ("", fig_claims)  # every paper claim x model (reads all records: experiment "")

from kvprobe.figures.features import FEATURE_FIGURES  # noqa: E402

FIGURES.update(FEATURE_FIGURES)  # App. D directions (15b) and SAE features (15e)

from kvprobe.figures.edit_in_transplant import FIGURES as EDIT_IN_TRANSPLANT_FIGURES  # noqa: E402

FIGURES.update(EDIT_IN_TRANSPLANT_FIGURES)  # Sec. 6: editing inside a transplant (7a)

from kvprobe.figures.twohop_blocks import FIGURES as TWOHOP_BLOCKS_FIGURES  # noqa: E402

FIGURES.update(TWOHOP_BLOCKS_FIGURES)  # App. G: two-hop facts across precompiled blocks
from kvprobe.figures.weight_edit import table1_weight_edit  # noqa: E402

FIGURES["table1_weight_edit"] = ("weight_edit", table1_weight_edit)  # Table 1: KV vs weight edits

from kvprobe.figures.tau2 import sec9_tau2  # noqa: E402

FIGURES["sec9_tau2"] = ("tau2", sec9_tau2)  # Sec. 9: τ²-bench retail

from kvprobe.figures.memory import FIGURES as MEMORY_FIGURES  # noqa: E402

FIGURES.update(MEMORY_FIGURES)  # Sec. 7: user memory E2/E3/E4 (Figs. 9, 10, 24)

from kvprobe.figures.agent import FIGURES as AGENT_FIGURES  # noqa: E402

FIGURES.update(AGENT_FIGURES)  # Sec. 6: the unified edit+compose agent (7b)

from kvprobe.figures.locomo import FIGURES as LOCOMO_FIGURES  # noqa: E402

FIGURES.update(LOCOMO_FIGURES)  # Sec. 7: LoCoMo external validity (Fig. 11)

from kvprobe.figures.serve import BENCH_FIGURES  # noqa: E402

# figure file stem -> (benchmark whose records it reads: results/bench/<name>_<model>.json, drawing function)
BENCH: dict[str, tuple[str, Callable[[list[dict[str, Any]], Path], None]]] = dict(BENCH_FIGURES)  # Fig. 14a


def bench_records(results_dir: str | Path, name: str) -> list[dict[str, Any]]:
    """The committed records of one benchmark (``benchmarks/<name>.py`` writes ``<name>_<model>.json``)."""
    import json

    paths = sorted(Path(results_dir, "bench").glob(f"{name}_*.json"))
    recs = [json.loads(p.read_text()) for p in paths]
    return [r for r in recs if r.get("benchmark") == name]


def render_all(results_dir: str | Path = "results", out_dir: str | Path | None = None) -> list[Path]:
    """Every figure from the records the study publishes (``study.yaml``), never from scratch or archive records:
    each figure gets the published records of its experiment, tagged with their task (``_task``). A folder with
    no published record at all (a scratch folder: ``kvprobe figures --results runs``, or any folder of an
    installed kvprobe, which has no study file) is drawn from all of its records, the newest per
    (experiment, task, model). Benchmark figures (``BENCH``) read the benchmark records in ``<results_dir>/bench/``.

    ``out_dir`` defaults to the published ``figures/`` for the published folder and to ``<results_dir>/figures/``
    for any other (:func:`kvprobe.study.output_paths`). Figures are drawn in a temporary folder and moved into
    ``out_dir`` only when drawn: a figure this call does not draw is never deleted, and a call that draws nothing
    creates nothing."""
    import shutil
    import tempfile

    from kvprobe.runner.records import task_stem
    from kvprobe.study import output_paths, published_records

    if not Path(results_dir).is_dir():
        raise KVProbeError(f"no records folder {results_dir}/ (give --results the folder your runs wrote, e.g. runs)")
    out = Path(out_dir) if out_dir is not None else output_paths(results_dir)[0]
    records = load_records(results_dir)
    published = published_records(records)
    if not published:
        newest = {(r["experiment"], task_stem(r), r["model"]["name"]): {**r, "_task": task_stem(r)} for r in records}
        published = list(newest.values())
    jobs: list[tuple[str, Callable[[list[dict[str, Any]], Path], None], list[dict[str, Any]]]] = []
    for stem, (name, draw) in BENCH.items():
        jobs.append((stem, draw, bench_records(results_dir, name)))
    for stem, (experiment, draw) in FIGURES.items():
        jobs.append((stem, draw, [r for r in published if not experiment or r["experiment"] == experiment]))
    written = []
    with tempfile.TemporaryDirectory(prefix="kvprobe-figures-") as tmp:
        for stem, draw, recs in jobs:
            if not recs:
                continue
            drawn = Path(tmp) / f"{stem}.png"
            draw(recs, drawn)
            if drawn.exists():  # a figure may find nothing of its kind among the records (e.g. no off-template run)
                written.append(drawn)
        if not written:
            raise KVProbeError(f"no figure to draw from the records under {results_dir}/ (none of their experiments "
                               "has a figure, or the folder holds no records): nothing written")
        out.mkdir(parents=True, exist_ok=True)
        mask = current_umask()
        final = []
        for drawn in written:
            target = out / drawn.name
            shutil.move(drawn, target)
            target.chmod(0o666 & ~mask)  # a temporary file's 0600 would follow it
            final.append(target)
    return final
