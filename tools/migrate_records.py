"""Bring committed records to their experiment's current summary shape, once.

    python tools/migrate_records.py [--results results] [--experiment NAME ...] [--check]

For every experiment that declares ``summary_model`` (:mod:`kvprobe.runner.shapes`), each record under
``<results>/<experiment>/<model>/<hash>.json`` gets the model's optional fields it lacks (those older records predate,
e.g. ``crossfit`` before cross-fitting) written explicitly as null, at the end of its summary, where the runner
writes them (:func:`kvprobe.runner.shapes.complete`). Nothing else changes: the file name, the config hash, every
other value, and the formatting (the runner's own writer, :func:`kvprobe.runner.records.atomic_write_json`, so a
diff shows only the added keys). A record whose bytes that writer would not reproduce is left alone and named. Each
completed summary is validated against the model. Running it again changes nothing.

Second, for every experiment: a param declared ``hash_neutral(default, neutral=OLD)`` (a design fault fixed under a
new default, :func:`kvprobe.schema.hash_neutral`) is written into the ``params_resolved`` of each record that predates
it, with the value those records ran under (``OLD``), so the record states its design and keeps its name.

``--check`` writes nothing and exits 1 if any record would change (or fails its model).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from kvprobe.runner.experiment import Experiment, available_experiments, get_experiment
from kvprobe.runner.records import atomic_write_json
from kvprobe.runner.shapes import complete


def _as_written(data: dict) -> str:
    """The text :func:`atomic_write_json` writes for ``data``."""
    return json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n"


def migrate_experiment(exp: Experiment, results: Path, check: bool) -> tuple[list[Path], list[str]]:
    """(records that changed, or would change under ``check``; problems: a record the writer would not reproduce
    byte for byte, or a summary its model rejects)."""
    changed: list[Path] = []
    problems: list[str] = []
    for path in sorted((results / exp.name).glob("*/*.json")):
        text = path.read_text()
        record = json.loads(text)
        if _as_written(record) != text:
            problems.append(f"{path}: not in the runner's formatting; left as it is")
            continue
        summary = complete(exp.summary_model, record["summary"])
        try:
            exp.summary_model.model_validate(summary)
        except ValidationError as exc:
            problems.append(f"{path}: the summary does not match {exp.name}'s summary model: {exc}")
            continue
        if summary is record["summary"]:
            continue
        changed.append(path)
        if not check:
            atomic_write_json(path, {**record, "summary": summary})
    return changed, problems


def state_neutral_params(exp: Experiment, results: Path, check: bool) -> list[Path]:
    """Records that lack a param with a declared neutral (older) value get it, explicitly (see the module doc)."""
    neutral = {name: info.json_schema_extra["hash_neutral_value"] for name, info in exp.params.model_fields.items()
               if isinstance(info.json_schema_extra, dict) and "hash_neutral_value" in info.json_schema_extra}
    changed: list[Path] = []
    for path in sorted((results / exp.name).glob("*/*.json")) if neutral else []:
        text = path.read_text()
        record = json.loads(text)
        resolved = record.get("params_resolved")
        missing = {k: v for k, v in neutral.items() if resolved is not None and k not in resolved}
        if not missing or _as_written(record) != text:
            continue
        changed.append(path)
        if not check:
            atomic_write_json(path, {**record, "params_resolved": {**resolved, **missing}})
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results", help="the records folder (default: results)")
    ap.add_argument("--experiment", action="append", help="only this experiment (repeatable; default: every "
                                                          "experiment that declares a summary model)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a record would change")
    args = ap.parse_args(argv)
    names = args.experiment or sorted(available_experiments())
    exps = [e for e in map(get_experiment, names) if e.summary_model is not None]
    total, bad = 0, []
    for exp in exps:
        changed, problems = migrate_experiment(exp, Path(args.results), args.check)
        total += len(changed)
        bad += problems
        n = len(list((Path(args.results) / exp.name).glob("*/*.json")))
        print(f"{exp.name}: {len(changed)} of {n} records {'to migrate' if args.check else 'migrated'}")
    for exp in map(get_experiment, names):
        stated = state_neutral_params(exp, Path(args.results), args.check)
        total += len(stated)
        if stated:
            print(f"{exp.name}: {len(stated)} records {'to state' if args.check else 'state'} a fixed param's older "
                  f"value")
    for p in bad:
        print(p, file=sys.stderr)
    return 1 if bad or (args.check and total) else 0


if __name__ == "__main__":
    sys.exit(main())
