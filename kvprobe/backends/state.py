"""KVState: a cache state as data.

Per layer, keys and values of shape ``[batch, kv_heads, slots, head_dim]`` (keys post-RoPE, exactly as the
model caches them), plus ``positions[slot]``: the absolute position each slot's key was rotated at, so
re-rotation and splicing never have to guess.

States are write-once: every operation returns a new state and never modifies a tensor in place. Layers an
operation does not touch are shared with the parent (no copy), which is what makes building many patched
states from two prefills cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvprobe.errors import KVProbeError


def _as_index(positions: Sequence[int] | torch.Tensor, length: int) -> torch.Tensor:
    idx = torch.as_tensor(list(positions) if not isinstance(positions, torch.Tensor) else positions, dtype=torch.long)
    if idx.numel() and (idx.min() < 0 or idx.max() >= length):
        raise KVProbeError(f"slot indices must lie in [0, {length}); got {idx.min().item()}..{idx.max().item()}")
    return idx


@dataclass(frozen=True, eq=False)
class KVState:
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: torch.Tensor  # [slots], long

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise KVProbeError("a KVState needs as many value tensors as key tensors")
        slots = self.positions.shape[0]
        for k, v in zip(self.keys, self.values):
            if k.shape[-2] != slots or v.shape[-2] != slots or k.shape[0] != self.keys[0].shape[0]:
                raise KVProbeError(f"layer tensors {tuple(k.shape)} / {tuple(v.shape)} do not match {slots} slots")

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])

    @property
    def next_position(self) -> int:
        """The position a token appended after this state gets by default."""
        return int(self.positions.max().item()) + 1 if self.length else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_cache(cls, cache, positions: torch.Tensor | None = None) -> "KVState":
        """Take the tensors of a transformers cache (a full, non-truncating cache: see :meth:`to_cache`)."""
        keys = tuple(layer.keys for layer in cache.layers)
        values = tuple(layer.values for layer in cache.layers)
        n = keys[0].shape[-2]
        for layer in cache.layers:
            total = getattr(layer, "cumulative_length", None)
            if layer.keys.shape[-2] != n or (isinstance(total, int) and total != n):
                raise KVProbeError("cache holds a window-truncated layer; prefill with kvprobe.prefill (full per-token KV)")
        if positions is None:
            positions = torch.arange(n)
        return cls(keys, values, positions.to(torch.long).cpu())

    def to_cache(self):
        """A transformers DynamicCache holding every slot on every layer.

        Sliding-window layers get full per-token KV too; the attention mask enforces the window, so
        states spliced or edited beyond the window stay exact (the paper's Section 8 remedy).
        """
        from transformers.cache_utils import DynamicCache, DynamicLayer

        layers = []
        for k, v in zip(self.keys, self.values):
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            layers.append(layer)
        cache = DynamicCache()
        cache.layers = layers
        return cache

    # -- operations (all return new states) -------------------------------------------------------
    def mix(self, other: "KVState", positions: Sequence[int] | torch.Tensor,
            layers: Sequence[int] | None = None) -> "KVState":
        """This state with ``other``'s K/V at the given slots (and layers; all layers by default)."""
        self._check_compatible(other)
        idx = _as_index(positions, self.length)
        chosen = set(range(self.n_layers)) if layers is None else {int(layer) for layer in layers}
        if any(layer < 0 or layer >= self.n_layers for layer in chosen):
            raise KVProbeError(f"layers must lie in [0, {self.n_layers})")
        if idx.numel() == 0 or not chosen:
            return self
        keys, values = list(self.keys), list(self.values)
        for layer in chosen:
            keys[layer] = _put(self.keys[layer], other.keys[layer], idx)
            values[layer] = _put(self.values[layer], other.values[layer], idx)
        return KVState(tuple(keys), tuple(values), self.positions)

    def mix_heads(self, other: "KVState", heads: Sequence[int], positions: Sequence[int] | torch.Tensor | None = None,
                  layers: Sequence[int] | None = None) -> "KVState":
        """This state with ``other``'s K/V on the given KV heads only (at ``positions``, all slots by default,
        and ``layers``, all by default). Under GQA a KV head serves its whole query group."""
        self._check_compatible(other)
        idx = _as_index(range(self.length) if positions is None else positions, self.length)
        chosen = range(self.n_layers) if layers is None else sorted({int(layer) for layer in layers})
        hs = torch.as_tensor(sorted({int(h) for h in heads}), dtype=torch.long)
        if hs.numel() and (hs.min() < 0 or hs.max() >= self.keys[0].shape[1]):
            raise KVProbeError(f"KV heads must lie in [0, {self.keys[0].shape[1]})")
        if idx.numel() == 0 or hs.numel() == 0:
            return self
        keys, values = list(self.keys), list(self.values)
        for layer in chosen:
            keys[layer] = _put_heads(self.keys[layer], other.keys[layer], idx, hs)
            values[layer] = _put_heads(self.values[layer], other.values[layer], idx, hs)
        return KVState(tuple(keys), tuple(values), self.positions)

    def with_layers(self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor]) -> "KVState":
        """Replace whole layer tensors (used by edits that compute new K/V for a few layers)."""
        ks, vs = list(self.keys), list(self.values)
        for layer, t in keys.items():
            ks[layer] = t
        for layer, t in values.items():
            vs[layer] = t
        return KVState(tuple(ks), tuple(vs), self.positions)

    def slice(self, start: int, stop: int | None = None) -> "KVState":
        """Slots ``[start, stop)`` as views (no copy)."""
        stop = self.length if stop is None else stop
        return KVState(tuple(k[:, :, start:stop] for k in self.keys), tuple(v[:, :, start:stop] for v in self.values),
                       self.positions[start:stop])

    def select(self, slots: Sequence[int] | torch.Tensor) -> "KVState":
        idx = _as_index(slots, self.length)
        return KVState(tuple(k.index_select(2, idx.to(k.device)) for k in self.keys),
                       tuple(v.index_select(2, idx.to(v.device)) for v in self.values), self.positions[idx])

    def concat(self, other: "KVState") -> "KVState":
        """Slots of ``other`` appended after this state's (their recorded positions kept as they are)."""
        if other.n_layers != self.n_layers or other.batch != self.batch:
            raise KVProbeError("concat needs states with the same layers and batch")
        return KVState(tuple(torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)),
                       tuple(torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)),
                       torch.cat([self.positions, other.positions]))

    def with_positions(self, positions: torch.Tensor, keys: Sequence[torch.Tensor]) -> "KVState":
        """Same values, new keys rotated at new positions (re-rotation builds states this way)."""
        return KVState(tuple(keys), self.values, positions.to(torch.long).cpu())

    def batch_item(self, i: int) -> "KVState":
        return KVState(tuple(k[i:i + 1] for k in self.keys), tuple(v[i:i + 1] for v in self.values), self.positions)

    @staticmethod
    def stack(states: Sequence["KVState"]) -> "KVState":
        """Concatenate states along the batch axis; they must agree on slots and positions."""
        first = states[0]
        for s in states[1:]:
            first._check_compatible(s)
        if len(states) == 1:
            return first
        return KVState(tuple(torch.cat([s.keys[i] for s in states]) for i in range(first.n_layers)),
                       tuple(torch.cat([s.values[i] for s in states]) for i in range(first.n_layers)),
                       first.positions)

    def clone(self) -> "KVState":
        return KVState(tuple(k.clone() for k in self.keys), tuple(v.clone() for v in self.values),
                       self.positions.clone())

    def max_abs_diff(self, other: "KVState") -> float:
        self._check_compatible(other)
        return max(max((a - b).abs().max().item() for a, b in zip(self.keys, other.keys)),
                   max((a - b).abs().max().item() for a, b in zip(self.values, other.values)))

    def _check_compatible(self, other: "KVState") -> None:
        if other.n_layers != self.n_layers or other.length != self.length:
            raise KVProbeError(f"states differ in shape: {self.n_layers} layers x {self.length} slots vs "
                               f"{other.n_layers} x {other.length}")
        if not torch.equal(self.positions, other.positions):
            raise KVProbeError("states hold keys rotated at different positions; re-rotate one first")


def _put(base: torch.Tensor, donor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    batch = max(base.shape[0], donor.shape[0])  # a batch-1 state broadcasts against a batch of donors
    out = base.expand(batch, -1, -1, -1).clone()
    idx = idx.to(base.device)
    out[:, :, idx] = donor[:, :, idx]
    return out


def _put_heads(base: torch.Tensor, donor: torch.Tensor, idx: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    batch = max(base.shape[0], donor.shape[0])
    out = base.expand(batch, -1, -1, -1).clone()
    h, i = heads.to(base.device)[:, None], idx.to(base.device)[None, :]
    out[:, h, i] = donor.expand(batch, -1, -1, -1)[:, h, i]
    return out
