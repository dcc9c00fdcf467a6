"""Activation sites with names independent of the hooking library.

``Site(kind, layer, position, head)`` names one place in the forward pass:

- ``kv``: the cached key/value of slot ``position`` at ``layer`` (patched by mixing KVStates, no hook);
- ``resid_pre`` / ``resid_post``: the residual stream entering / leaving decoder layer ``layer``;
- ``attn_out``: the attention block's output (after o_proj) at ``layer``; with ``head`` set, that head's
  slice of the o_proj *input* (its contribution before the output projection);
- ``mlp_out``: the MLP block's output at ``layer``.

``position`` is a token index in the forward being run (None = every position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvprobe.errors import KVProbeError

SiteKind = Literal["kv", "resid_pre", "resid_post", "attn_out", "mlp_out"]
SITE_KINDS: tuple[str, ...] = ("kv", "resid_pre", "resid_post", "attn_out", "mlp_out")


@dataclass(frozen=True, order=True)
class Site:
    kind: SiteKind
    layer: int
    position: int | None = None
    head: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SITE_KINDS:
            raise KVProbeError(f"site kind '{self.kind}' is not one of {', '.join(SITE_KINDS)}")
        if self.head is not None and self.kind != "attn_out":
            raise KVProbeError(f"a head index only applies to attn_out sites, not {self.kind}")

    def __str__(self) -> str:
        parts = [self.kind, f"L{self.layer}"]
        if self.head is not None:
            parts.append(f"H{self.head}")
        if self.position is not None:
            parts.append(f"P{self.position}")
        return ".".join(parts)
