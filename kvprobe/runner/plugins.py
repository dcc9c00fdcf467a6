"""Experiments from outside the repository: folders named in ``$KVPROBE_EXPERIMENTS``.

A probe is three files in one folder: ``<name>.py`` (its ``EXPERIMENT``, with its section, claims and any figure
it draws), ``<name>.yaml`` (a config: ``experiment: <name>``) and its test. Point the variable at the folder
(several folders: separated by ``os.pathsep``) and every command finds it::

    KVPROBE_EXPERIMENTS=~/probes kvprobe run toy --model smollm2-135m

Each module of such a folder is imported as ``kvprobe.experiments.<name>``, beside the built-in experiments (a
folder is added to that package's search path), and each ``<name>.yaml`` there is a config name. A plugin module
may not take a built-in experiment's name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

EXPERIMENTS_ENV = "KVPROBE_EXPERIMENTS"

_BUILTIN: dict[str, list[str]] = {}  # package name -> its own search path, before any plugin folder


def plugin_dirs() -> list[Path]:
    """The folders of ``$KVPROBE_EXPERIMENTS`` that exist, in order."""
    raw = os.environ.get(EXPERIMENTS_ENV, "")
    return [p for p in (Path(x).expanduser().resolve() for x in raw.split(os.pathsep) if x.strip()) if p.is_dir()]


def extend_path(package: Any) -> None:
    """Set ``package.__path__`` to its own folders followed by the plugin folders (re-read from the environment
    on every call, so a changed variable takes effect); refuse a plugin module named like a built-in one."""
    from kvprobe.errors import KVProbeError

    own = _BUILTIN.setdefault(package.__name__, [p for p in package.__path__])
    extra = [str(d) for d in plugin_dirs() if str(d) not in own]
    if extra:
        builtin = {p.stem for d in own for p in Path(d).glob("*.py")}
        clash = sorted(builtin & {p.stem for d in extra for p in Path(d).glob("*.py") if not p.stem.startswith("_")})
        if clash:
            raise KVProbeError(f"${EXPERIMENTS_ENV}: {', '.join(clash)} would shadow a built-in experiment of the "
                               "same name; rename the plugin module")
    package.__path__[:] = [*own, *extra]


def plugin_config(name: str) -> Path | None:
    """``<name>.yaml`` in the first plugin folder that has one."""
    return next((d / f"{name}.yaml" for d in plugin_dirs() if (d / f"{name}.yaml").is_file()), None)
