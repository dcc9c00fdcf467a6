"""kvprobe patches run as nnsight traces.

:func:`run_patched` replaces (or shifts) site activations inside one ``trace``; :class:`KVCellPatcher` runs a
kvprobe KV cell as one trace of the full base prompt per cell: the donor's key and value projections written
at the cell's slots (before RoPE and k_norm, which at the same position give the donor's cached key exactly)
and the context tokens' o_proj input held to the base run's at the patched layers, so that only the query
suffix reads the donor's K/V, as in a cache patch (see kvprobe.interop.tl for why).

nnsight runs the trace body alongside the forward, so modules are visited in execution order (layer by
layer; within a layer: input, k/v projections, o_proj input, attention output, MLP output, layer output).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvprobe.backends import HookableModel
from kvprobe.interop.sites import envoy_at
from kvprobe.patching.sites import Site

_ORDER = {"resid_pre": 0, "kv": 1, "attn_head": 2, "attn_out": 3, "mlp_out": 4, "resid_post": 5}


def _stage(site: Site) -> int:
    return _ORDER["attn_head" if site.head is not None else site.kind]


def _ids(model: Any, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    return (t.unsqueeze(0) if t.dim() == 1 else t).to(next(model._module.parameters()).device)


@torch.no_grad()
def run_patched(model: Any, lm: HookableModel, ids: Sequence[int] | torch.Tensor, patches: Mapping[Site, torch.Tensor],
                add: bool = False) -> torch.Tensor:
    """Last-position logits ``[batch, vocab]`` (float32, CPU) with each site's activation replaced (or shifted).

    ``lm`` is the kvprobe model (``as_lm(model)``), which names the modules. ``kv`` sites take a
    ``(key_proj, value_proj)`` pair of the projections' outputs ``[..., kv_heads * d_head]``."""
    spec = lm.spec
    order = sorted(patches, key=lambda s: (s.layer, _stage(s)))
    with model.trace(_ids(model, ids)):
        for site in order:
            layer = envoy_at(model, f"{spec.layers_path}.{site.layer}")
            where = slice(None) if site.position is None else site.position
            if site.kind == "resid_pre":
                targets = [(layer.input, patches[site])]
            elif site.kind == "kv":
                attn = envoy_at(layer, spec.attn_name)
                targets = [(attn.k_proj.output, patches[site][0]), (attn.v_proj.output, patches[site][1])]
            elif site.kind == "attn_out" and site.head is not None:
                d = spec.head_dim
                o_in = envoy_at(layer, spec.o_proj_name).input
                targets = [(o_in[..., site.head * d:(site.head + 1) * d], patches[site])]
            elif site.kind == "attn_out":
                targets = [(envoy_at(layer, spec.attn_name).output[0], patches[site])]
            elif site.kind == "mlp_out":
                targets = [(envoy_at(layer, spec.mlp_name).output, patches[site])]
            else:
                targets = [(layer.output, patches[site])]
            for act, value in targets:
                if add:
                    act[:, where] += value
                else:
                    act[:, where] = value
        logits = model.output.logits[:, -1].save()
    return logits.float().cpu()


class KVCellPatcher:
    """KV cells as nnsight traces: one full forward of ``base_ids`` (context + query suffix) per cell."""

    def __init__(self, model: Any, lm: HookableModel, base_ids: Sequence[int], donor_context: Sequence[int],
                 context_length: int):
        self.model, self.lm, self.ctx = model, lm, int(context_length)
        spec = lm.spec
        self.base_ids = _ids(model, base_ids)
        self.n_layers = spec.n_layers
        layers = [f"{spec.layers_path}.{l}" for l in range(spec.n_layers)]
        dk: list[Any] = []
        dv: list[Any] = []
        z: list[Any] = []
        with torch.no_grad():
            with model.trace(_ids(model, donor_context)):
                for path in layers:
                    attn = envoy_at(envoy_at(model, path), spec.attn_name)
                    dk.append(attn.k_proj.output.save())
                    dv.append(attn.v_proj.output.save())
            with model.trace(self.base_ids):
                for path in layers:
                    z.append(envoy_at(envoy_at(model, path), spec.o_proj_name).input[:, : self.ctx].save())
        self.donor_k = [t.clone() for t in dk]  # .save() hands back references: keep our own copies
        self.donor_v = [t.clone() for t in dv]
        self.base_z = [t.clone() for t in z]

    @torch.no_grad()
    def logits(self, positions: Sequence[int], layers: Sequence[int] | None = None) -> torch.Tensor:
        """Last-position logits ``[vocab]`` (float32, CPU) of one cell."""
        spec, model, ctx = self.lm.spec, self.model, self.ctx
        pos = torch.as_tensor(list(positions), dtype=torch.long)
        chosen = sorted(range(self.n_layers) if layers is None else set(layers)) if len(pos) else []
        with model.trace(self.base_ids):
            for layer in chosen:
                block = envoy_at(model, f"{spec.layers_path}.{layer}")
                attn = envoy_at(block, spec.attn_name)
                attn.k_proj.output[:, pos] = self.donor_k[layer][:, pos]
                attn.v_proj.output[:, pos] = self.donor_v[layer][:, pos]
                envoy_at(block, spec.o_proj_name).input[:, :ctx] = self.base_z[layer]
            logits = model.output.logits[0, -1].save()
        # clone: a view would keep the whole [1, seq, vocab] logits alive (~130 MB per cell at 673 tokens)
        return logits.float().cpu().clone()

    def sweep(self, cells: Sequence[Any]) -> torch.Tensor:
        """``[len(cells), vocab]`` for kvprobe :class:`KVPatch` cells."""
        return torch.stack([self.logits(c.positions, c.layers) for c in cells])
