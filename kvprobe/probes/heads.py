"""Read and write heads, GQA-aware (paper App. D (1)).

Under grouped-query attention one KV head serves a group of ``n_heads / n_kv_heads`` query heads (query head q
reads KV head ``q // group``, as ``repeat_kv`` lays them out). A write head is a (layer, kv_head): its K/V is
what later tokens read, so it is patched and reported per KV head, with the query group it serves. A read head
is a (layer, q_head): its output at the decision token is patched and reported per query head, with the KV
head it reads. Neither is ever padded or repeated up to the other's count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvprobe.probes.sweep import KV, HeadOut, Joint


def group_size(spec: Any) -> int:
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(f"{spec.n_heads} query heads do not split into {spec.n_kv_heads} KV groups")
    return spec.n_heads // spec.n_kv_heads


def query_group(spec: Any, kv_head: int) -> list[int]:
    """The query heads that read ``kv_head``."""
    g = group_size(spec)
    return list(range(kv_head * g, (kv_head + 1) * g))


def kv_head_of(spec: Any, q_head: int) -> int:
    """The KV head query head ``q_head`` reads."""
    return q_head // group_size(spec)


def write_label(layer: int, kv_head: int) -> str:
    return f"L{layer}.KV{kv_head}"


def read_label(layer: int, q_head: int) -> str:
    return f"L{layer}.Q{q_head}"


def write_heads(spec: Any) -> list[tuple[int, int]]:
    return [(layer, h) for layer in range(spec.n_layers) for h in range(spec.n_kv_heads)]


def read_heads(spec: Any) -> list[tuple[int, int]]:
    return [(layer, h) for layer in range(spec.n_layers) for h in range(spec.n_heads)]


def write_patch(heads: Sequence[tuple[int, int]], slots: Sequence[int], source: str = "oracle") -> KV | Joint:
    """The source's K/V at ``slots`` on the given (layer, kv_head)s, jointly."""
    parts = tuple(KV.of(slots, [layer], [h], source) for layer, h in heads)
    return parts[0] if len(parts) == 1 else Joint(parts)


def read_patch(heads: Sequence[tuple[int, int]], source: str = "oracle") -> HeadOut:
    return HeadOut.of(heads, source)


def top_heads(effects: dict[tuple[int, int], float], k: int) -> list[tuple[int, int]]:
    """The ``k`` heads of largest effect (NaN last; ties in head order)."""
    order = sorted(effects, key=lambda h: -effects[h] if np.isfinite(effects[h]) else float("inf"))
    return order[:k]


def random_heads(pool: Sequence[tuple[int, int]], k: int, n_draws: int, seed: Sequence[int]) -> list[list[tuple[int, int]]]:
    rng = np.random.default_rng(list(seed))
    return [[pool[i] for i in sorted(rng.choice(len(pool), size=min(k, len(pool)), replace=False))]
            for _ in range(n_draws)]
