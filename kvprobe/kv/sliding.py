"""Sliding-window layers: kvprobe's full per-token KV against the default truncating cache.

Gemma 2/3 (and Mistral-style models) attend over a window on some layers. transformers' default cache keeps
only the last ``window - 1`` tokens of such a layer; kvprobe keeps every token's KV on every layer and lets
the attention mask enforce the window (:func:`kvprobe.kv.readout.prefill`). Both give the same logits when
tokens are only *appended* after a block. They differ when the composition needs KV that lies more than a
window back from the block's end: slicing a sub-block out of a longer precompile, patching or recomputing
a position there. This module measures both policies on one random chunk longer than the window, so the
gate can report them side by side (issue: composable cache, "sliding window").
"""

from __future__ import annotations

from typing import Any

import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv.gate import relative_error  # the gate's measure, so both reports compare alike
from kvprobe.backends.hf import hf_prefill, hf_read_logits
from kvprobe.models.arch import arch_spec


@torch.no_grad()
def _reference_logits(model: torch.nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Last-token logits of one uncached forward of ``ids`` placed at ``start``."""
    ids = ids.to(model.device)
    pos = torch.arange(start, start + ids.numel(), device=model.device)[None]
    return model(input_ids=ids[None], position_ids=pos, use_cache=False,
                 logits_to_keep=1).logits[0, -1].float().cpu()  # on the CPU, as read_logits returns them


@torch.no_grad()
def truncating_cache(model: torch.nn.Module, ids: torch.Tensor, start: int) -> Any:
    """The cache transformers builds by default for ``ids`` at ``start`` (sliding layers truncated)."""
    from transformers.cache_utils import DynamicCache

    ids = ids.to(model.device)
    pos = torch.arange(start, start + ids.numel(), device=model.device)[None]
    out = model(input_ids=ids[None], position_ids=pos, cache=DynamicCache(config=model.config), use_cache=True,
                logits_to_keep=1)
    return out.cache


@torch.no_grad()
def compare_window_policies(model: torch.nn.Module, chunk_len: int, offset: int, seed: int = 0,
                            suffix_len: int = 3) -> dict[str, Any] | None:
    """Full per-token KV vs the default truncating cache for a chunk longer than the window.

    Returns None for a model without sliding-window layers. Otherwise reports, per policy, the KV slots each
    sliding layer keeps and its KV bytes, and two compositions checked against uncached forwards:

    - ``append``: the chunk prefilled at ``offset`` under each policy, a random suffix appended: relative
      error of the suffix's next-token logits;
    - ``prefix_splice``: the chunk's first ``chunk_len - window`` tokens (all older than the window at the
      chunk's end) sliced out of the precompile and followed by the suffix. The truncating cache holds
      none of their KV on sliding layers, so it cannot serve this splice.

    Both policies prefill at ``offset`` directly, so only the cache policy differs; re-rotation is what
    :func:`kvprobe.kv.gate.run_gate` checks.
    """
    spec = arch_spec(model.config)
    if spec.sliding_window is None:
        return None
    window = int(spec.sliding_window)
    if chunk_len <= window:
        raise KVProbeError(f"chunk_len={chunk_len} must exceed the sliding window ({window}) to compare the "
                           f"window policies; pass --chunk-len {window + 64} or more")
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (chunk_len,), generator=g)
    suffix = torch.randint(0, vocab, (suffix_len,), generator=g)
    sliding = [i for i, s in enumerate(spec.is_sliding) if s]

    # Both policies prefill the chunk at ``offset`` itself: this isolates the cache policy (the rotation is
    # the gate's business, checked above it).
    full = hf_prefill(model, ids, positions=torch.arange(offset, offset + chunk_len))  # every token, every layer
    ref_append = _reference_logits(model, torch.cat([ids, suffix]), offset)
    kv_append = hf_read_logits(model, full, suffix, suffix_positions=range(offset + chunk_len,
                                                                          offset + chunk_len + suffix_len))[0]

    trunc = truncating_cache(model, ids, offset)
    pos = torch.arange(offset + chunk_len, offset + chunk_len + suffix_len, device=model.device)[None]
    tr_append = model(input_ids=suffix[None].to(model.device), position_ids=pos, cache=trunc, use_cache=True,
                      logits_to_keep=1).logits[0, -1].float().cpu()
    trunc_slots = [int(trunc.layers[i].keys.shape[-2]) for i in sliding]
    trunc_bytes = sum(int(layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
                      for layer in trunc.layers)

    k = chunk_len - window  # every one of these tokens is older than the window at the chunk's end
    prefix = full.slice(0, k)  # causal: exactly the KV of ids[:k] at offset, if every token was kept
    ref_prefix = _reference_logits(model, torch.cat([ids[:k], suffix]), offset)
    kv_prefix = hf_read_logits(model, prefix, suffix, suffix_positions=range(offset + k, offset + k + suffix_len))[0]
    return {
        "window": window,
        "chunk_len": chunk_len,
        "offset": offset,
        "sliding_layers": len(sliding),
        "full_kv": {"slots_per_sliding_layer": chunk_len, "kv_bytes": full.nbytes(),
                    "append_logit_rel": relative_error(kv_append, ref_append),
                    "prefix_splice_tokens": k, "prefix_splice_logit_rel": relative_error(kv_prefix, ref_prefix)},
        "truncating": {"slots_per_sliding_layer": min(trunc_slots), "kv_bytes": trunc_bytes,
                       "append_logit_rel": relative_error(tr_append, ref_append),
                       "prefix_splice_tokens": k,
                       "prefix_splice_logit_rel": None,
                       "prefix_splice": f"unavailable: sliding layers keep only the last {min(trunc_slots)} of "
                                        f"{chunk_len} tokens, none of the first {k}"},
    }


def format_window_comparison(cmp: dict[str, Any]) -> str:
    f, t = cmp["full_kv"], cmp["truncating"]
    return "\n".join([
        f"sliding window {cmp['window']} on {cmp['sliding_layers']} layers; chunk {cmp['chunk_len']} at offset "
        f"{cmp['offset']}",
        f"{'policy':>12}{'slots/sliding layer':>21}{'KV MB':>8}{'append logit rel':>18}{'prefix splice':>16}",
        f"{'full KV':>12}{f['slots_per_sliding_layer']:>21}{f['kv_bytes'] / 2**20:>8.1f}{f['append_logit_rel']:>18.1e}"
        f"{f['prefix_splice_logit_rel']:>16.1e}",
        f"{'truncating':>12}{t['slots_per_sliding_layer']:>21}{t['kv_bytes'] / 2**20:>8.1f}"
        f"{t['append_logit_rel']:>18.1e}{'unavailable':>16}",
        f"prefix splice = the first {f['prefix_splice_tokens']} tokens sliced from the precompile, suffix appended",
    ])
