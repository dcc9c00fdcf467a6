"""Donor states for knockout: what a knocked-out slot's K/V is replaced with (paper Section 3 probe (4)).

- ``stale``: the other prefill's K/V at the same slot (the oracle's note put back to the old conclusion);
- ``mean``: the slot-wise mean of the two prefills (the mean over the pair's two field values, at the same
  slot and RoPE rotation, so keys stay rotated at their own positions);
- ``zero``: zero keys and values (the slot's score becomes 0 and it contributes nothing to the output).

Every kind is a full KVState of the base's shape, so it goes through ``kv_sweep`` like any donor.
"""

from __future__ import annotations

import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState

ABLATIONS = ("stale", "mean", "zero")


def ablation_donor(kind: str, base: KVState, other: KVState) -> KVState:
    """The donor that ablates ``base`` toward ``other`` (or to the pair mean / zero) at patched slots."""
    if kind == "stale":
        return other
    if kind == "mean":
        return KVState(tuple((a + b) / 2 for a, b in zip(base.keys, other.keys)),
                       tuple((a + b) / 2 for a, b in zip(base.values, other.values)), base.positions)
    if kind == "zero":
        return KVState(tuple(torch.zeros_like(k) for k in base.keys), tuple(torch.zeros_like(v) for v in base.values),
                       base.positions)
    raise KVProbeError(f"ablation '{kind}' is not one of {', '.join(ABLATIONS)}")
