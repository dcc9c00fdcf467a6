"""Organisms shipped with kvprobe register as model aliases (base model + LoRA adapter).

Each organism is a folder under ``organisms/<alias>/`` (top level of a checkout) holding ``card.json`` (base alias,
recipe, data hashes, held-out evaluation) and the adapter files written by peft. Registration and loading
live in :mod:`kvprobe.models` (which reads these folders as data); this module names the folder for training.
"""

from __future__ import annotations

from kvprobe.models.registry import ORGANISMS_DIR, organism_dirs, register_organisms

__all__ = ["ORGANISMS_DIR", "organism_dirs", "register_organisms"]
