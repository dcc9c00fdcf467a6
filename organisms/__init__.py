"""kvprobe-organisms: this folder installed as a package, so an installed kvprobe finds the recommended organisms
(``organisms/<alias>/``: card, adapter config and weights) and the registry without a checkout."""

from pathlib import Path


def root() -> Path:
    """The organisms folder (``registry.yaml`` and one folder per organism): kvprobe's ``KVPROBE_ORGANISMS``."""
    return Path(__file__).resolve().parent
