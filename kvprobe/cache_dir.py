"""Where large artifacts (dequantized weights, assembled GGUF files, precompiled blocks) live.

Never inside the repository: ``$KVPROBE_CACHE`` if set, else the user cache directory.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("KVPROBE_CACHE")
    if root:
        path = Path(root)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "kvprobe"
    path.mkdir(parents=True, exist_ok=True)
    return path


def project_path(path: str | Path) -> Path:
    """A relative path as given if it exists from the working directory, else relative to the kvprobe checkout
    (so `configs/...` works from any directory of an editable install), else inside the installed package
    (a wheel ships ``configs/`` as ``kvprobe/configs/``)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    package = Path(__file__).resolve().parent
    candidates = [package.parent / p]
    if p.parts and p.parts[0] == "configs":
        candidates.append(package / p)
    return next((c for c in candidates if c.exists()), p)
