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


def current_umask() -> int:
    """The process umask (reading it means setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_json(path: Path, data: Any) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers see the old file or the new one.
    The file gets the mode a plain ``open`` would give (0644 under the usual umask 022), not the temporary
    file's 0600, so a group sharing a results folder can read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
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


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd or Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(allow_dirty: bool = False) -> dict[str, Any]:
    """The kvprobe checkout's commit, whether tracked files had uncommitted changes, and whether the run was
    allowed to go ahead from such a tree (``--allow-dirty``). ``None`` outside a git checkout (an installed wheel)."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    if commit is not None and commit.returncode == 0 and dirty is not None:
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip()), "allow_dirty": allow_dirty}
    return {"commit": None, "dirty": None, "allow_dirty": allow_dirty}


def check_clean_tree(path: Path, allow_dirty: bool, repo: Path | None = None) -> None:
    """Refuse to publish a record from a dirty working tree.

    A record is *published* when it lands inside the kvprobe checkout where git would track it (``results/``);
    scratch destinations (git-ignored ``runs/``, any folder outside the checkout, e.g. a test's tmp dir) and an
    installed kvprobe (no checkout) are never checked. Untracked files do not count: only changes to tracked
    files make the commit the record names differ from the code that ran. ``repo``: a folder of the checkout to
    check (default: the one kvprobe is imported from)."""
    if allow_dirty:
        return
    top = _git("rev-parse", "--show-toplevel", cwd=repo)
    if top is None or top.returncode != 0:
        return
    root = Path(top.stdout.strip()).resolve()
    dest = path.resolve()
    if not dest.is_relative_to(root):
        return
    ignored = _git("check-ignore", "-q", str(dest), cwd=root)
    if ignored is not None and ignored.returncode == 0:
        return
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=root)
    changed = [line[3:] for line in (status.stdout.splitlines() if status is not None else []) if line.strip()]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise KVProbeError(f"the working tree has uncommitted changes to tracked files ({shown}), so the record "
                           f"{dest.relative_to(root)} would name a commit that is not the code that ran: commit "
                           "(or stash) them first, or pass --allow-dirty (the record's git block then says so)")


class RecordLock:
    """An exclusive lock beside a record (``<hash>.lock``) held for a whole run, so two identical runs started
    together never both compute and append to one partial file: the second is refused with a message. The OS
    drops the lock when its process ends, so a crashed run leaves no stale lock."""

    def __init__(self, path: Path) -> None:
        self.path = path.with_name(path.stem + ".lock")
        self._fd: int | None = None

    def __enter__(self) -> "RecordLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise KVProbeError(f"another run of this exact config is in progress (pid {holder}; lock {self.path}): "
                               "wait for it to finish, then rerun this command (it resumes or reproduces)") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # before the unlock: a waiting run then creates a fresh file
            os.close(self._fd)
            self._fd = None


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


# What every record has (report, figures and claims read them all); config must name its task and model.
REQUIRED_KEYS = ("schema_version", "created", "experiment", "config", "model", "summary", "rows")


def read_record(path: Path) -> dict[str, Any]:
    """One record, checked: a file that is not JSON (truncated, half-written) or lacks a required key is an error
    naming the file, never skipped (a report built without it would silently show an older record)."""
    try:
        rec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KVProbeError(f"record {path} is corrupt ({type(exc).__name__}: {exc}); rerun its experiment with "
                           "--overwrite, or restore the file (git checkout -- <file>)") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(rec, dict) or k not in rec]
    if not missing and not all(k in rec["config"] for k in ("task", "model")):
        missing = [f"config.{k}" for k in ("task", "model") if k not in rec["config"]]
    if missing:
        raise KVProbeError(f"record {path} is incomplete: it lacks {', '.join(missing)}; rerun its experiment "
                           "with --overwrite, or restore the file (git checkout -- <file>)")
    return rec


def random_init_label(name: str) -> str:
    """How figures and tables name a random-init model: its folder's name, marked, never the machine path the
    run was given (a folder ``.../tiny-llama`` -> ``tiny-llama (random init)``)."""
    return f"{Path(name).name or name} (random init)"


def load_records(results_dir: str | Path, experiment: str | None = None) -> list[dict[str, Any]]:
    """Every finished record under ``results_dir`` (optionally of one experiment), oldest first. A corrupt or
    incomplete one stops the caller with an error naming it (:func:`read_record`)."""
    root = Path(results_dir)
    pattern = f"{experiment}/*/*.json" if experiment else "*/*/*.json"
    out = []
    for p in sorted(root.glob(pattern)):
        rec = read_record(p)
        rec["_path"] = str(p)
        if rec["model"].get("random_init"):  # every figure and table names the model by this
            rec["model"] = {**rec["model"], "name": random_init_label(rec["model"]["name"]),
                            "name_as_run": rec["model"]["name"]}
        out.append(rec)
    return sorted(out, key=lambda r: r.get("created", ""))
