"""Organisms shipped with kvprobe register as model aliases (base model + LoRA adapter).

Each organism is a folder under ``kvprobe/organism/organisms/<alias>/`` holding ``card.json`` (base alias,
recipe, data hashes, held-out evaluation) and the adapter files written by peft.
"""

from __future__ import annotations

import json
from pathlib import Path

ORGANISMS_DIR = Path(__file__).parent / "organisms"


def organism_dirs() -> list[Path]:
    return sorted(p.parent for p in ORGANISMS_DIR.glob("*/card.json"))


def register_organisms() -> None:
    from kvprobe.models.registry import REGISTRY, ModelEntry, register

    for folder in organism_dirs():
        card = json.loads((folder / "card.json").read_text())
        alias = card["alias"]
        if alias in REGISTRY:
            continue
        base = REGISTRY.get(card["base_model"])
        register(ModelEntry(alias, "organism", base.family if base else "unknown", card["base_model"],
                            gguf_file=str(folder), chat=base.chat if base else True, note=f"trained organism: {card.get('summary', 'LoRA adapter')}"))
