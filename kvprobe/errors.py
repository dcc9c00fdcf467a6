"""One exception type for every user-facing failure, so the CLI can print a single clear line."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KVProbeError(Exception):
    """A problem the user can fix: the message names what is wrong and how to fix it."""

    exit_code = 2


class Interrupted(KVProbeError):
    """The user stopped a run (Ctrl-C): the message says what was kept and how to resume."""

    exit_code = 130


def closest(name: str, choices: Iterable[object], n: int = 3) -> str:
    """``" (did you mean 'a' or 'b'?)"`` for the choices closest to ``name``, or ``""`` when none is close."""
    pool = sorted({str(c) for c in choices})
    hits = difflib.get_close_matches(name, pool, n=n, cutoff=0.6)
    if not hits:  # a prefix or substring still points somewhere (e.g. 'qwen' -> the qwen aliases)
        hits = [c for c in pool if name and name.lower() in c.lower()][:n]
    return f" (did you mean {' or '.join(repr(h) for h in hits)}?)" if hits else ""


def in_checkout() -> bool:
    """Whether the working directory is a kvprobe checkout's root (its Makefile and study.yaml): messages then
    name make targets, which install what they need; elsewhere (an installed kvprobe) they name CLI commands."""
    from pathlib import Path

    return Path("Makefile").is_file() and Path("study.yaml").is_file()


def command(make: str, cli: str) -> str:
    """``make`` in a checkout, ``cli`` elsewhere (:func:`in_checkout`), in backquotes."""
    return f"`{make}`" if in_checkout() else f"`{cli}`"


def default_results_dir() -> str:
    """The records folder a command reads when not told: ``results`` in a checkout (the published records) or
    where it exists, else ``runs`` (where every run of an installed kvprobe goes)."""
    from pathlib import Path

    return "results" if in_checkout() or Path("results").is_dir() or not Path("runs").is_dir() else "runs"
