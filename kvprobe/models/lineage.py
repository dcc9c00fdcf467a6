"""An organism's training lineage, read from the organism cards: the chain of adapters it was continued from
(``recipe.init_from``), down to its pretrained base (``base_model``).

Successive fine-tunes of one lineage share most of their training, so agreement between them is stability,
not an independent replicate. Cards are read from the organism registry's folder (``organisms/<alias>/card.json``,
:data:`kvprobe.models.organisms.ORGANISMS_DIR`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def card_dirs() -> list[Path]:
    """Folders that may hold organism cards: the organism registry's (a checkout's ``organisms/``)."""
    from kvprobe.models.organisms import ORGANISMS_DIR

    roots = [Path(ORGANISMS_DIR), _PACKAGE_ROOT.parent / "organisms"]
    seen: list[Path] = []
    for root in roots:
        if root.is_dir() and root.resolve() not in seen:
            seen.append(root.resolve())
    return seen


@functools.lru_cache(maxsize=1)
def _cards() -> dict[str, dict[str, Any]]:
    cards: dict[str, dict[str, Any]] = {}
    for root in card_dirs():
        for path in sorted(root.glob("*/card.json")):
            card = json.loads(path.read_text())
            cards.setdefault(card.get("alias", path.parent.name), card)
    return cards


def parent(alias: str) -> str | None:
    """The alias ``alias`` was continued from (another organism, or its pretrained base); None for a
    pretrained model."""
    card = _cards().get(alias)
    if card is None:
        return None
    recipe = card.get("recipe") or {}
    return recipe.get("init_from") or card.get("init_from") or card.get("base_model") or recipe.get("base_model")


def lineage(alias: str) -> list[str]:
    """The chain from the pretrained base to ``alias``, base first (``[alias]`` for a pretrained model)."""
    chain = [alias]
    while (up := parent(chain[-1])) is not None and up not in chain:
        chain.append(up)
    return chain[::-1]


def lineage_root(alias: str) -> str:
    """The lineage's first fine-tune (its independent start), or the model itself when it is pretrained:
    models that share a root count as one replicate."""
    chain = lineage(alias)
    return chain[1] if len(chain) > 1 else chain[0]
