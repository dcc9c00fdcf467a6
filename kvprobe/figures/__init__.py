"""One function per paper figure; each reads records only, never runs a model.

``render_all`` draws every figure whose experiment has records under ``results/``. Figures are found, not listed:

- each module of this package may define ``FIGURES`` (figure file stem -> (experiment whose published records it
  reads, or "" for all of them; drawing function(records, path))) and ``BENCH_FIGURES`` (stem -> (benchmark whose
  records it reads: ``results/bench/<name>_<model>.json``; drawing function));
- each experiment may draw its own: ``Experiment(figures={stem: draw})`` (:class:`kvprobe.runner.experiment.Experiment`),
  which reads that experiment's published records.

``FIGURES`` and ``BENCH`` (attributes of this package) are the collected tables; a stem drawn twice is an error.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

Draw = Callable[[list[dict[str, Any]], Path], None]


def _add(table: dict[str, tuple[str, Draw]], stem: str, entry: tuple[str, Draw], where: str) -> None:
    from kvprobe.errors import KVProbeError

    if stem in table:
        raise KVProbeError(f"figure '{stem}' is drawn twice ({where} and an earlier one): give one another stem")
    table[stem] = entry


def collect() -> tuple[dict[str, tuple[str, Draw]], dict[str, tuple[str, Draw]]]:
    """(figures, benchmark figures): this package's modules in name order, then the experiments' own figures in
    section order."""
    from kvprobe.runner.experiment import get_experiment
    from kvprobe.runner.sections import experiment_order

    figures: dict[str, tuple[str, Draw]] = {}
    bench: dict[str, tuple[str, Draw]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for stem, entry in getattr(module, "FIGURES", {}).items():
            _add(figures, stem, entry, f"kvprobe/figures/{info.name}.py")
        for stem, entry in getattr(module, "BENCH_FIGURES", {}).items():
            _add(bench, stem, entry, f"kvprobe/figures/{info.name}.py")
    for name in experiment_order():
        for stem, draw in get_experiment(name).figures.items():
            _add(figures, stem, (name, draw), f"experiment {name}")
    return figures, bench


def __getattr__(name: str) -> Any:
    """``FIGURES`` and ``BENCH``: collected when first asked for (see the module docstring)."""
    if name == "FIGURES":
        return collect()[0]
    if name == "BENCH":
        return collect()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    (experiment, task, model). Benchmark figures read the benchmark records in ``<results_dir>/bench/``.

    ``out_dir`` defaults to the published ``figures/`` for the published folder and to ``<results_dir>/figures/``
    for any other (:func:`kvprobe.study.output_paths`). Figures are drawn in a temporary folder and moved into
    ``out_dir`` only when drawn: a figure this call does not draw is never deleted, and a call that draws nothing
    creates nothing."""
    import shutil
    import tempfile

    from kvprobe.errors import KVProbeError
    from kvprobe.runner.records import current_umask, load_records, task_stem
    from kvprobe.study import output_paths, published_records

    if not Path(results_dir).is_dir():
        raise KVProbeError(f"no records folder {results_dir}/ (give --results the folder your runs wrote, e.g. runs)")
    out = Path(out_dir) if out_dir is not None else output_paths(results_dir)[0]
    records = load_records(results_dir)
    published = published_records(records)
    if not published:
        newest = {(r["experiment"], task_stem(r), r["model"]["name"]): {**r, "_task": task_stem(r)} for r in records}
        published = list(newest.values())
    figures, bench = collect()
    jobs: list[tuple[str, Draw, list[dict[str, Any]]]] = []
    for stem, (name, draw) in bench.items():
        jobs.append((stem, draw, bench_records(results_dir, name)))
    for stem, (experiment, draw) in figures.items():
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
