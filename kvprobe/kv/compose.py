"""Compose a context from live prefills and precompiled blocks (paper Section 5, Figure 4b / 6).

A block precompiled in isolation (positions 0..L-1) is re-rotated to where it lands and concatenated; the
pieces after it are prefilled over the assembled state. Seam repair recomputes the first k tokens of a
spliced block with the real preceding context (the boundary recompute of CacheBlend / EPIC), and re-rotates
the rest of the block to follow them.

:func:`splice_spans` is the splice every composition experiment runs: a token sequence with spans cut out,
each span precompiled alone (once per distinct token content), spliced back between the live head and the
live tail, in the given order, optionally unrotated (the no-rotation control) and optionally with the whole
context moved ``start`` positions up (a late placement: a span precompiled at 0..L-1 then lands >= ``start``
positions from where it was precompiled, so an unrotated splice is off by at least that much).
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


def splice(lm: HookableModel, prior: KVState | None, block: Spliced, start: int = 0) -> KVState:
    """``prior`` followed by the block at the next positions (at ``start`` when there is no prior)."""
    start = prior.next_position if prior is not None else start
    k = min(block.seam, len(block.ids))
    state = prior
    if k:  # boundary tokens see the real context
        state = prefill(lm, list(block.ids[:k]), prior=state,
                        positions=None if prior is not None else list(range(start, start + k)))
    rest = block.state.slice(k)
    target = torch.arange(start + k, start + len(block.ids))
    moved = rerotate(rest, target, lm) if block.rotate else rest.with_positions(target, rest.keys)
    return moved if state is None else state.concat(moved)


def assemble(lm: HookableModel, pieces: Sequence[Live | Spliced], start: int = 0) -> KVState:
    """One KVState from pieces in order: live pieces are prefilled, spliced ones re-rotated and appended. The
    first piece sits at position ``start`` (0: the prompt's own positions; RoPE attention reads only relative
    positions, so a context moved up as a whole computes the same logits)."""
    state: KVState | None = None
    for piece in pieces:
        if isinstance(piece, Live):
            if piece.ids:
                at = None if state is not None or not start else list(range(start, start + len(piece.ids)))
                state = prefill(lm, list(piece.ids), prior=state, positions=at)
        else:
            state = splice(lm, state, piece, start)
    if state is None:
        raise ValueError("nothing to assemble")
    return state


Compiled = dict[tuple[int, ...], KVState]


def splice_spans(lm: HookableModel, ids: Sequence[int], cuts: Sequence[int], end: int | None = None, *,
                 seam: int = 0, rotate: bool = True, start: int = 0, order: Sequence[int] | None = None,
                 compiled: Compiled | None = None) -> KVState:
    """``ids[:cuts[0]]`` live, the spans ``ids[cuts[i]:cuts[i+1]]`` each precompiled alone and spliced (in
    ``order``, span indices; default as cut), then ``ids[cuts[-1]:end]`` live; the cache ends at ``end``
    (default: the end of ``ids``; e.g. ``len(ids) - r`` to leave an answer prefix of ``r`` tokens to read).

    ``seam`` boundary tokens of the first spliced span are recomputed over the real context; ``rotate`` False
    is the no-rotation control (keys keep their isolated positions' rotation); ``start`` moves the whole
    context up (the spans then land ``start`` + their offset positions from where they were precompiled).
    ``compiled`` caches each span's isolated prefill by its token ids across calls (a span with the same
    tokens, e.g. an unchanged block of an edited memory, is precompiled once)."""
    if len(cuts) < 2 or list(cuts) != sorted(cuts):
        raise ValueError(f"cuts must be at least two ascending token indices; got {list(cuts)}")
    compiled = {} if compiled is None else compiled
    spans = [tuple(ids[x:y]) for x, y in zip(cuts, cuts[1:])]
    order = list(range(len(spans))) if order is None else list(order)
    if sorted(order) != list(range(len(spans))):
        raise ValueError(f"order must be a permutation of the {len(spans)} spans; got {order}")
    for span in spans:
        if span not in compiled:
            compiled[span] = precompile(lm, span)
    blocks = [Spliced(spans[j], compiled[spans[j]], seam=seam if i == 0 else 0, rotate=rotate)
              for i, j in enumerate(order)]
    stop = len(ids) if end is None else end
    return assemble(lm, [Live(tuple(ids[:cuts[0]])), *blocks, Live(tuple(ids[cuts[-1]:stop]))], start)
