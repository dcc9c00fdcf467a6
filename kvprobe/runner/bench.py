"""Benchmark output: what a benchmark prints, kept as its text output, plus a small JSON record beside it.

Both land in ``results/bench/<name>_<model>.{txt,json}`` by atomic rename (readers see the old pair or the new
one), each naming the command and the commit it ran from. Figures read the JSON (``kvprobe.figures.BENCH``).
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvprobe.runner.records import atomic_write_json, git_commit, model_slug, package_versions


def bench_path(out_dir: str | Path, name: str, model: str, suffix: str) -> Path:
    return Path(out_dir) / f"{name}_{model_slug(model)}.{suffix}"


class BenchOutput:
    def __init__(self, name: str, model: str) -> None:
        self.name, self.model = name, model
        self.lines: list[str] = []
        self.t0 = time.perf_counter()
        self.command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        self.git = git_commit(allow_dirty=True)  # the code that runs: taken at the start, not when it ends

    def print(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, data: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
        """The JSON record (``data`` plus provenance) and the text printed so far, side by side."""
        git = self.git
        record = {"benchmark": self.name, "model": self.model, "command": self.command, "git": git,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "wall_s": time.perf_counter() - self.t0, "packages": package_versions(), **data}
        js = bench_path(out_dir, self.name, self.model, "json")
        atomic_write_json(js, record)
        head = f"# {self.command}, commit {git['commit']}{' (dirty tree)' if git['dirty'] else ''}"
        txt = bench_path(out_dir, self.name, self.model, "txt")
        fd, tmp = tempfile.mkstemp(dir=txt.parent, prefix=txt.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join([head, *self.lines]) + "\n")
        os.replace(tmp, txt)
        return js, txt
