"""Held-out requests that are not near-copies of a target, and the entity a request is about.

A held-out measure (how far an edit of one request spreads to others) means little when the held-outs are the
target's prompt with one id changed: they then share every token but a few, and any edit keyed on the prompt
moves them with it. :func:`pick_distinct` keeps, from a stream of candidate prompts, only those whose token
similarity (:func:`token_similarity`) to the target and to every candidate kept before stays at or under a
bound. :func:`entity_of` names the entity a request is about (a generated request's id, e.g. ``"E4312"``), the
natural subject of a per-entity edit.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kvprobe.errors import KVProbeError

_REF = re.compile(r"\b[A-Z][0-9]{4}\b")  # a generated request's id (kvprobe.tasks.generator: letter + 4 digits)


def token_similarity(a: Sequence[int], b: Sequence[int]) -> float:
    """How near a copy one prompt is of another: difflib's ratio 2M / (|a| + |b|) over the token ids (M: tokens
    in matching blocks); 1.0 for identical prompts."""
    return difflib.SequenceMatcher(None, list(a), list(b), autojunk=False).ratio()


def pick_distinct(target: Sequence[int], candidates: Iterable[tuple[Any, Sequence[int]]], n: int,
                  max_similarity: float) -> list[tuple[Any, Sequence[int], float]]:
    """The first ``n`` candidates (item, token ids) whose similarity to ``target`` and to every candidate kept
    before is at most ``max_similarity``, each with its similarity to the target. Fewer if the candidates run
    out (the stream is read lazily, up to the ``n``-th kept)."""
    kept: list[tuple[Any, Sequence[int], float]] = []
    for item, ids in candidates:
        sim = token_similarity(target, ids)
        if sim <= max_similarity and all(token_similarity(ids, k[1]) <= max_similarity for k in kept):
            kept.append((item, ids, sim))
            if len(kept) == n:
                break
    return kept


def entity_of(inst: Any) -> str:
    """The entity a request is about: a generated request's id (the last ``[A-Z]dddd`` after the field, e.g.
    "E4312"), else a template request's customer name."""
    refs = _REF.findall(inst.after_field)
    if refs:
        return refs[-1]
    m = re.search(r"customer: ([^\n]+)", inst.after_field)
    if m:
        return m.group(1).strip()
    raise KVProbeError(f"instance {inst.index}: no entity id or customer after the field")


def entity_or_none(inst: Any) -> str | None:
    try:
        return entity_of(inst)
    except KVProbeError:
        return None
