"""Compose a context from live prefills and precompiled blocks (paper Section 5, Figure 4b / 6).

A block precompiled in isolation (positions 0..L-1) is re-rotated to where it lands and concatenated; the
pieces after it are prefilled over the assembled state. Seam repair recomputes the first k tokens of a
spliced block with the real preceding context (the boundary recompute of CacheBlend / EPIC), and re-rotates
the rest of the block to follow them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


from kvprobe.backends import HookableModel
from kvprobe.kv.readout import prefill
from kvprobe.kv.rope import rerotate
from kvprobe.kv.state import KVState

import torch


def precompile(lm: HookableModel, ids: Sequence[int]) -> KVState:
    """KV of a chunk prefilled alone at positions 0..L-1."""
    return prefill(lm, list(ids))


@dataclass(frozen=True)
class Live:
    """Tokens prefilled in place over whatever precedes them."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Spliced:
    """A precompiled block (its token ids and isolated KV) spliced in; ``seam`` boundary tokens recomputed."""

    ids: tuple[int, ...]
    state: KVState
    seam: int = 0
    rotate: bool = True  # False is the no-rotation control: keys keep their isolated positions' rotation


def splice(lm: HookableModel, prior: KVState | None, block: Spliced) -> KVState:
    """``prior`` followed by the block at the next positions."""
    start = prior.next_position if prior is not None else 0
    k = min(block.seam, len(block.ids))
    state = prior
    if k:
        state = prefill(lm, list(block.ids[:k]), prior=state)  # boundary tokens see the real context
    rest = block.state.slice(k)
    target = torch.arange(start + k, start + len(block.ids))
    moved = rerotate(rest, target, lm) if block.rotate else rest.with_positions(target, rest.keys)
    return moved if state is None else state.concat(moved)


def assemble(lm: HookableModel, pieces: Sequence[Live | Spliced]) -> KVState:
    """One KVState from pieces in order: live pieces are prefilled, spliced ones re-rotated and appended."""
    state: KVState | None = None
    for piece in pieces:
        if isinstance(piece, Live):
            if piece.ids:
                state = prefill(lm, list(piece.ids), prior=state)
        else:
            state = splice(lm, state, piece)
    if state is None:
        raise ValueError("nothing to assemble")
    return state
