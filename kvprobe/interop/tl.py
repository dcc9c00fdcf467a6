"""kvprobe patches run through a TransformerLens ``TransformerBridge``'s own hooks.

:func:`run_patched` is kvprobe's :func:`kvprobe.patching.hooks.run_patched` (site activations replaced or
shifted) as one ``run_with_hooks`` call. :class:`KVCellPatcher` is how a TransformerLens user runs kvprobe's
KV cell ("the base cache with the donor's K/V at these slots and layers, read by the query suffix") the way
``transformer_lens.patching.generic_activation_patch`` runs any patch: one full forward of the base prompt per
cell, with hooks. In a full forward, a key patched at slot p of layer l would also be read by the *context*
tokens after p and change their later K/V, which a cache patch does not do; so the cell also holds the context
tokens' attention output (``hook_z``) at the patched layers to the base run's, leaving only the suffix to read
the donor's K/V. That makes the two numerically the same patch (tested to <= 1e-4), at a full forward a cell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvprobe.backends import HookableModel
from kvprobe.interop.sites import tl_hook_name
from kvprobe.patching.sites import Site


def _ids(ids: Sequence[int] | torch.Tensor, device: Any) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    return (t.unsqueeze(0) if t.dim() == 1 else t).to(device)


def _device(bridge: Any) -> torch.device:
    return next(bridge.original_model.parameters()).device


@torch.no_grad()
def run_patched(bridge: Any, ids: Sequence[int] | torch.Tensor, patches: Mapping[Site, torch.Tensor],
                lm: HookableModel | None = None, add: bool = False) -> torch.Tensor:
    """Last-position logits ``[batch, vocab]`` (float32, CPU) of one forward with each site's activation
    replaced by (or, with ``add``, shifted by) its tensor. ``kv`` sites take a ``(keys, values)`` pair shaped
    like TL's hooks, ``[..., kv_heads, d_head]``. Pass the kvprobe model as ``lm`` for Gemma-style families."""
    hooks = []
    for site, value in patches.items():
        names = tl_hook_name(site, lm)
        pairs = zip(names, value) if site.kind == "kv" else [(names, value)]
        for name, val in pairs:
            def fn(act, hook, site=site, val=val):
                where = slice(None) if site.position is None else site.position
                idx = (slice(None), where) if site.head is None else (slice(None), where, site.head)
                v = val.to(act.dtype).to(act.device)
                act = act.clone()
                act[idx] = act[idx] + v if add else v.expand_as(act[idx])
                return act
            hooks.append((name, fn))
    logits = bridge.run_with_hooks(_ids(ids, _device(bridge)), fwd_hooks=hooks)
    return logits[:, -1].float().cpu()


class KVCellPatcher:
    """KV cells through the bridge's hooks: one full forward of ``base_ids`` (context + query suffix) per cell.

    ``donor_context`` is the donor prompt's context (same length as the base context). Built once: the
    donor's post-RoPE keys and values and the base run's per-head attention outputs at every layer."""

    def __init__(self, bridge: Any, base_ids: Sequence[int], donor_context: Sequence[int], context_length: int):
        self.bridge, self.ctx = bridge, int(context_length)
        device = _device(bridge)
        self.base_ids = _ids(base_ids, device)
        with torch.no_grad():
            _, donor = bridge.run_with_cache(_ids(donor_context, device),
                                             names_filter=lambda n: n.endswith(("attn.hook_rot_k", "attn.hook_v")))
            _, base = bridge.run_with_cache(self.base_ids, names_filter=lambda n: n.endswith("attn.hook_z"))
        n_layers = bridge.cfg.n_layers
        self.donor_k = [donor[f"blocks.{l}.attn.hook_rot_k"] for l in range(n_layers)]
        self.donor_v = [donor[f"blocks.{l}.attn.hook_v"] for l in range(n_layers)]
        self.base_z = [base[f"blocks.{l}.attn.hook_z"][:, : self.ctx] for l in range(n_layers)]
        self.n_layers = n_layers

    def hooks(self, positions: Sequence[int], layers: Sequence[int] | None) -> list[tuple[str, Any]]:
        pos = torch.as_tensor(list(positions), dtype=torch.long)
        out: list[tuple[str, Any]] = []
        for layer in (range(self.n_layers) if layers is None else layers):
            k, v, z = self.donor_k[layer], self.donor_v[layer], self.base_z[layer]

            def put_k(act, hook, k=k):
                act[:, pos] = k[:, pos].to(act.dtype)
                return act

            def put_v(act, hook, v=v):
                act[:, pos] = v[:, pos].to(act.dtype)
                return act

            def hold_z(act, hook, z=z):  # context tokens keep the base's attention output: a cache patch
                act[:, : self.ctx] = z.to(act.dtype)
                return act

            out += [(f"blocks.{layer}.attn.hook_rot_k", put_k), (f"blocks.{layer}.attn.hook_v", put_v),
                    (f"blocks.{layer}.attn.hook_z", hold_z)]
        return out

    @torch.no_grad()
    def logits(self, positions: Sequence[int], layers: Sequence[int] | None = None) -> torch.Tensor:
        """Last-position logits ``[vocab]`` (float32, CPU) of one cell."""
        if not list(positions):
            return self.bridge(self.base_ids)[0, -1].float().cpu().clone()
        out = self.bridge.run_with_hooks(self.base_ids, fwd_hooks=self.hooks(positions, layers))
        # clone: a view would keep the whole [1, seq, vocab] logits alive (~130 MB per cell at 673 tokens)
        return out[0, -1].float().cpu().clone()

    def sweep(self, cells: Sequence[Any]) -> torch.Tensor:
        """``[len(cells), vocab]`` for kvprobe :class:`KVPatch` cells."""
        return torch.stack([self.logits(c.positions, c.layers) for c in cells])
