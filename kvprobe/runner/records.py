"""JSON records: written atomically, never overwritten silently, resumable from per-instance rows.

A run writes ``results/<experiment>/<model>/<config-hash>.json``. While it runs, each finished instance is
appended to ``<config-hash>.partial.jsonl`` beside it, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from kvprobe.errors import KVProbeError

SCHEMA_VERSION = 2  # 2: CIs clustered by scenario, exact intervals for proportions (summaries gain ci_method, n_clusters)
_PACKAGES = ("kvprobe", "torch", "transformers", "nnsight", "transformer-lens", "sae-lens", "peft", "gguf",
             "numpy", "scikit-learn", "statsmodels", "pandas", "pydantic")


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf become null, tuples lists, numpy/torch scalars plain numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def atomic_write_json(path: Path, data: Any) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(data), f, indent=1, sort_keys=False, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": None, "dirty": None}


def model_slug(name: str) -> str:
    return Path(name).name if ("/" in name or os.sep in name) else name


def task_id(record: dict[str, Any]) -> str:
    """The task a record ran on: its template path as written in the config, or, for generated instances
    (``task.generator``), ``generator:<split>:<format+format>`` so they never count as the template's; the
    split reads ``template`` when the generator renders the template's own scenarios (``task.scenarios``)."""
    task = record["config"]["task"]
    gen = task.get("generator")
    if gen:
        split = "template" if task.get("scenarios") else gen["split"]
        return f"generator:{split}:{'+'.join(gen['formats'])}"
    return task["template"]


def task_stem(record: dict[str, Any]) -> str:
    """Short task name for tables and claims: the template file's stem (``gated``), or
    ``generated_<split>_<format+format>``."""
    task_name = task_id(record)
    if task_name.startswith("generator:"):
        _, split, formats = task_name.split(":")
        return f"generated_{split}_{formats}"
    return Path(task_name).stem


def record_path(output_dir: str | Path, experiment: str, model: str, config_hash: str) -> Path:
    return Path(output_dir) / experiment / model_slug(model) / f"{config_hash}.json"


class RecordWriter:
    """Owns one record: refuses to clobber a finished one, resumes or restarts a partial one."""

    def __init__(self, path: Path, overwrite: bool = False, fresh: bool = False) -> None:
        self.path = path
        self.partial = path.with_name(path.stem + ".partial.jsonl")
        if path.exists() and not overwrite:
            raise KVProbeError(f"a record for this exact config already exists: {path}. "
                               "Pass --overwrite to replace it, or change the config (e.g. --set seed=1)")
        if fresh:
            self.partial.unlink(missing_ok=True)
        self.done: dict[int, dict[str, Any]] = {}
        if self.partial.exists():
            for line in self.partial.read_text().splitlines():
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by the interruption; that instance is redone
                    self.done[int(row["index"])] = row

    def add_row(self, row: dict[str, Any]) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with self.partial.open("a") as f:
            f.write(json.dumps(_clean(row), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[int(row["index"])] = row

    def finish(self, record: dict[str, Any]) -> Path:
        record = {"schema_version": SCHEMA_VERSION, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  **record}
        atomic_write_json(self.path, record)
        self.partial.unlink(missing_ok=True)
        return self.path


def load_records(results_dir: str | Path, experiment: str | None = None) -> list[dict[str, Any]]:
    """Every finished record under ``results_dir`` (optionally of one experiment), oldest first."""
    root = Path(results_dir)
    pattern = f"{experiment}/*/*.json" if experiment else "*/*/*.json"
    out = []
    for p in sorted(root.glob(pattern)):
        try:
            rec = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("schema_version"):
            rec["_path"] = str(p)
            out.append(rec)
    return sorted(out, key=lambda r: r.get("created", ""))
