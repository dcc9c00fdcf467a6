"""Patch sweeps over KV sites: many (positions x layers) cells, each read as one decision.

``kv_sweep`` is the one entry point every probe uses for cell sweeps (suffix concentration, specificity,
knockout, writability ...). Each cell takes the donor's K/V at its positions and layers into the base
state. The reference engine builds each patched state with :meth:`KVState.mix` and reads them in batches;
the engine choice never changes the numbers beyond float error (tested side by side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


import torch

from kvprobe.backends import HookableModel
from kvprobe.kv.readout import read_logits
from kvprobe.kv.state import KVState


@dataclass(frozen=True)
class KVPatch:
    """Donor K/V at ``positions`` (context slots) on ``layers`` (None = every layer)."""

    positions: tuple[int, ...]
    layers: tuple[int, ...] | None = None

    @staticmethod
    def of(positions: Sequence[int], layers: Sequence[int] | None = None) -> "KVPatch":
        return KVPatch(tuple(int(p) for p in positions), None if layers is None else tuple(int(x) for x in layers))


def kv_sweep(lm: HookableModel, base: KVState, donor: KVState, cells: Sequence[KVPatch], suffix: Sequence[int],
             batch_size: int = 16, engine: str = "auto", token_ids: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[len(cells), vocab]`` after ``suffix`` over base-with-each-cell's-patch.

    ``donor`` may also be a zero/mean state (ablation) built by the caller: any KVState of the same shape.
    With ``token_ids`` only those logits are returned (``[len(cells), len(token_ids)]``); the shared engine
    then computes only those columns of the unembedding. A TransformerLens bridge or an nnsight model is
    converted at the public boundary (``kvprobe.probes.sweep``, ``kvprobe.interop.as_lm``), not here.
    """
    if engine not in ("auto", "shared", "mix"):
        raise ValueError(f"engine must be auto, shared or mix; got {engine!r}")
    if base.batch != 1 or donor.batch != 1:
        # One base and one donor per sweep: a batch of donors would make each cell a batch of its own.
        raise ValueError(f"kv_sweep takes batch-1 base and donor states (got batch {base.batch} and "
                         f"{donor.batch}); sweep each donor separately")
    if engine in ("auto", "shared"):
        from kvprobe.patching.shared_engine import shared_kv_sweep, supports_shared

        if supports_shared(lm):
            return shared_kv_sweep(lm, base, donor, cells, suffix, batch_size=max(batch_size, 64), token_ids=token_ids)
        if engine == "shared":
            raise ValueError("the shared-base engine does not support this model's attention")
    out = []
    for lo in range(0, len(cells), batch_size):
        chunk = cells[lo:lo + batch_size]
        states = [base.mix(donor, c.positions, c.layers) for c in chunk]
        logits = read_logits(lm, states, suffix, batch_size=batch_size)
        out.append(logits if token_ids is None else logits[:, list(token_ids)])
    return torch.cat(out) if out else torch.empty(0)
