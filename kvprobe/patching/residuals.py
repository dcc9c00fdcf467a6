"""Residual-stream reads for linear probes and the logit lens (paper Section 3 probe (3), Appendix C (ii)).

- :func:`resid_stack`: ``resid_post`` of every layer at chosen positions of one forward, as ``[layers,
  positions, d_model]`` (the paper's ``output_hidden_states`` on the prefill);
- :func:`logit_lens`: the model's own final norm and unembedding (and final logit soft-capping where the
  family has it) applied to any residual vector, so the last layer's lens equals the model's logits;
- :func:`commit_layer`: the earliest layer from which a per-layer margin keeps its final sign.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvprobe.backends import HookableModel
from kvprobe.kv.state import KVState
from kvprobe.patching.hooks import capture
from kvprobe.patching.sites import Site


@torch.no_grad()
def resid_stack(lm: HookableModel, ids: Sequence[int], positions: Sequence[int], prior: KVState | None = None,
                layers: Sequence[int] | None = None) -> torch.Tensor:
    """``resid_post`` at ``positions`` (token indices of this forward) for ``layers`` (default all):
    ``[len(layers), len(positions), d_model]``, float32 on CPU, from one forward over ``ids``."""
    layers = list(range(lm.spec.n_layers)) if layers is None else list(layers)
    sites = [Site("resid_post", layer) for layer in layers]
    got = capture(lm, list(ids), sites, prior=prior)
    idx = torch.as_tensor(list(positions), dtype=torch.long)
    return torch.stack([got[s][0].index_select(0, idx.to(got[s].device)) for s in sites]).float().cpu()


def _final_norm(model: Any) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder.norm


@torch.no_grad()
def logit_lens(lm: HookableModel, resid: torch.Tensor) -> torch.Tensor:
    """Logits (float32, CPU) of residual vectors ``[..., d_model]`` through the final norm and unembedding."""
    model = lm.model
    p = next(model.parameters())
    h = _final_norm(model)(resid.to(p.device, p.dtype))
    logits = model.get_output_embeddings()(h).float()
    cap = getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                  "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.cpu()


def commit_layer(margins: Sequence[float]) -> int:
    """Index of the earliest layer from which ``margins`` keep the last layer's sign (a margin of exactly
    zero counts as no sign, so it breaks a run)."""
    final = margins[-1] > 0
    layer = len(margins) - 1
    while layer > 0 and (margins[layer - 1] > 0) == final and margins[layer - 1] != 0:
        layer -= 1
    return layer


def relative_depth(layer: int, n_layers: int) -> float:
    """Depth of ``resid_post`` of ``layer`` as the fraction of decoder layers applied: (layer + 1) / n."""
    return (layer + 1) / n_layers
