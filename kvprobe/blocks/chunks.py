"""Precompiled chunks (paper Section 5) in the block store, and the paper's edits as block operations.

A chunk is prefilled once in isolation (``kvprobe.kv.compose.precompile``) and stored as blocks of
``block_tokens`` positions each, chained vLLM-style by prefix hash. Serving loads it from the store (a RAM hit
or a promotion from disk) and splices it with ``kvprobe.kv.compose.Spliced``: nothing is recomputed.

The edits never rewrite a stored payload:

- an erratum is a new block appended after the chunk's last block (``store_erratum``);
- an in-place field refresh is a child block over the field's positions, naming the block it refreshes as
  its parent (``store_refresh``); a re-rotated chunk is a child naming its source (``store_rerotated``).

``kvprobe.kv.blocks.Block`` (the single-file library's object) goes into the store with ``put_block``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvprobe.backends import HookableModel
from kvprobe.blocks.record import Identity, Policy, tokens_hash
from kvprobe.blocks.store import BlockStore
from kvprobe.errors import KVProbeError
from kvprobe.kv.blocks import Block, tokenizer_hash
from kvprobe.kv.compose import precompile
from kvprobe.kv.rope import rerotate
from kvprobe.kv.state import KVState


def _context(lm: HookableModel) -> tuple[str, str]:
    return str(lm.fingerprint), tokenizer_hash(getattr(lm, "tokenizer", None))


def chunk_identities(lm: HookableModel, ids: Sequence[int], n_layers: int, kv_heads: int, block_tokens: int | None = None,
                     start: int = 0, prefix_ids: Sequence[int] = ()) -> list[Identity]:
    """The identities of a chunk's blocks: positions [start, start+len) cut every ``block_tokens``; each block's
    prefix hash covers ``prefix_ids`` and the chunk's tokens before it."""
    ctx = _context(lm)
    ids = [int(i) for i in ids]
    seq = tokens_hash(ids, *ctx, str(start), str(tokens_hash(list(prefix_ids), *ctx)))
    step = block_tokens or max(len(ids), 1)
    out = []
    for lo in range(0, len(ids), step):
        hi = min(lo + step, len(ids))
        before = list(prefix_ids) + ids[:lo]
        out.append(Identity(seq, start + lo, start + hi, 0, n_layers, 0, kv_heads,
                            tokens_hash(before, *ctx) if before else 0))
    return out


def store_chunk(store: BlockStore, lm: HookableModel, ids: Sequence[int], block_tokens: int | None = None,
                policy: Policy = Policy(), state: KVState | None = None) -> list[int]:
    """Precompile ``ids`` alone at positions 0..L-1 (unless ``state`` is given) and store it; returns block ids.
    Blocks already in the store are not written again."""
    state = precompile(lm, list(ids)) if state is None else state
    if state.length != len(ids):
        raise KVProbeError(f"a state of {state.length} slots for a chunk of {len(ids)} tokens")
    idents = chunk_identities(lm, ids, state.n_layers, state.keys[0].shape[1], block_tokens)
    return [store.put(ident, state.slice(ident.pos_start, ident.pos_stop), policy) for ident in idents]


def load_chunk(store: BlockStore, lm: HookableModel, ids: Sequence[int], block_tokens: int | None = None) -> KVState | None:
    """The chunk's isolated KV from the store (RAM hit or disk promotion), or None if any block is missing."""
    if not ids:
        return None
    idents = chunk_identities(lm, ids, lm.spec.n_layers, lm.spec.n_kv_heads, block_tokens)
    bids = [i.block_id for i in idents]
    if not all(b in store for b in bids):
        return None
    parts = [store.get(b) for b in bids]
    state = parts[0]
    for p in parts[1:]:
        state = state.concat(p)
    return state


def store_erratum(store: BlockStore, lm: HookableModel, after: int, erratum_ids: Sequence[int], state: KVState,
                  prefix_ids: Sequence[int]) -> int:
    """An erratum as a new block after block ``after``: ``state`` is the erratum's K/V (computed over the
    prefix ``prefix_ids``, which ends with the stale context)."""
    ctx = _context(lm)
    ident = Identity(tokens_hash(list(erratum_ids), *ctx, "erratum"), int(state.positions.min()),
                     int(state.positions.max()) + 1, 0, state.n_layers, 0, state.keys[0].shape[1],
                     tokens_hash(list(prefix_ids), *ctx))
    return store.append(after, ident, state)


def store_refresh(store: BlockStore, lm: HookableModel, parent: int, field_ids: Sequence[int], state: KVState) -> int:
    """An in-place field refresh: the field's recomputed K/V as a child block of the block holding the stale
    field. The parent keeps its payload (a reader takes the child's slots over the parent's)."""
    pid = store.identity(parent)
    lo, hi = int(state.positions.min()), int(state.positions.max()) + 1
    if lo < pid.pos_start or hi > pid.pos_stop:
        raise KVProbeError(f"refreshed positions [{lo}, {hi}) lie outside the parent block [{pid.pos_start}, "
                           f"{pid.pos_stop})")
    return store.derive(parent, state, seq_id=tokens_hash(list(field_ids), *_context(lm), "refresh", str(parent)))


def store_rerotated(store: BlockStore, lm: HookableModel, parent: int, target_positions: Sequence[int] | torch.Tensor) -> int:
    """The parent block re-rotated to ``target_positions`` (a transplant target), as a child block."""
    moved = rerotate(store.get(parent), target_positions, lm)
    return store.derive(parent, moved)


def put_block(store: BlockStore, block: Block) -> int:
    """A ``kvprobe.kv.blocks.Block`` into the store, its identity packed (content hashes become 64-bit ids)."""
    bi = block.identity
    layers = bi.layers
    if list(layers) != list(range(layers[0], layers[-1] + 1)):
        raise KVProbeError(f"the store holds contiguous layer ranges; the block has layers {layers}")
    ctx = (bi.model_fingerprint, bi.tokenizer_hash)
    ident = Identity(tokens_hash(list(block.token_ids), *ctx), bi.position_start, bi.position_stop, layers[0],
                     layers[-1] + 1, bi.kv_heads[0], bi.kv_heads[1],
                     int(bi.prefix_hash, 16) if bi.prefix_hash else 0,
                     int(bi.parent[:16], 16) if bi.parent else 0)
    return store.put(ident, block.payload)
