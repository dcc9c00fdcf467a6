"""The shared-base sweep engine: many patched cache states read in one forward without copying the cache.

A KV patch sweep reads N cells, each "base state with the donor's K/V at a few slots of a few layers".
Materializing N full caches costs N x (layers x slots) of memory traffic, which dominates a one-token
readout on CPU. Here every row of the batch shares the base K/V tensors (batch 1, broadcast), and each
row carries only its own overrides (at most M slots per layer). A custom attention function computes

    scores = q . K_base  (broadcast over rows)   with the overridden columns replaced by q . K_override
    out    = p . V_base  + sum_over_overrides p_m (V_override - V_base)_m  + the suffix tokens' own terms

which is the same attention, exactly, as over the materialized patched cache (tested against the
reference path in kv_sweep to float error).

Layer sharing (exact): a cell that patches only layers >= l leaves layers < l exactly as the base computes
them, so the suffix's hidden state entering layer l is the base's. The base suffix pass is run once and kept
per layer; cells are grouped by their first patched layer and each group runs only layers l.. (the skipped
layers return the kept base output). Cells spread evenly over layers then cost about half a one-token
forward each. With ``token_ids`` only those columns of the unembedding are computed (a decision read needs
two), which removes the vocabulary projection from the per-cell cost.

Supported: decoder families whose attention calls the cache and then the attention interface with
(query, key, value, mask, scaling[, softcap]): Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvprobe.backends import HookableModel
from kvprobe.kv.state import KVState

ENGINE_NAME = "kvprobe_shared"
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3"}


@dataclass
class SharedKV:
    """What one layer hands the attention function: the shared base, per-row overrides, the new tokens."""

    base_k: torch.Tensor  # [1, Hkv, S, D]
    base_v: torch.Tensor
    idx: torch.Tensor | None  # [N, M] override slots (padded by repeating a row's own entry)
    valid: torch.Tensor | None  # [N, M] which entries are real (padding must not count twice)
    over_k: torch.Tensor | None  # [N, Hkv, M, D]
    over_v: torch.Tensor | None
    new_k: torch.Tensor | None = None  # [N, Hkv, T, D], set by update()
    new_v: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:  # some attention code inspects key.shape[-2] for the kv length
        s = self.base_k.shape
        t = 0 if self.new_k is None else self.new_k.shape[-2]
        return torch.Size((s[0], s[1], s[2] + t, s[3]))


def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class SharedLayer(DynamicLayer):
        def __init__(self, shared: SharedKV) -> None:
            super().__init__()
            self.shared = shared
            self.lazy_initialization(shared.base_k, shared.base_v)
            self.keys, self.values = shared.base_k, shared.base_v  # gives get_seq_length / mask sizes

        def update(self, key_states, value_states, *args, **kwargs):
            s = self.shared
            shared = SharedKV(s.base_k, s.base_v, s.idx, s.valid, s.over_k, s.over_v, key_states, value_states)
            return shared, shared

    return SharedLayer


def shared_attention(module: torch.nn.Module, query: torch.Tensor, key: SharedKV, value: SharedKV,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    kv = key
    n, hq, t, d = query.shape
    hkv = kv.base_k.shape[1]
    g = hq // hkv
    scaling = d ** -0.5 if scaling is None else scaling
    q = query.reshape(n, hkv, g, t, d)
    scores = torch.einsum("nhgtd,hsd->nhgts", q, kv.base_k[0]) * scaling
    if kv.idx is not None:
        s_over = torch.einsum("nhgtd,nhmd->nhgtm", q, kv.over_k) * scaling
        where = kv.idx[:, None, None, None, :].expand(n, hkv, g, t, kv.idx.shape[1])
        scores = scores.scatter(-1, where, s_over)
    s_new = torch.einsum("nhgtd,nhud->nhgtu", q, kv.new_k) * scaling
    scores = torch.cat([scores, s_new], dim=-1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : scores.shape[-1]]
        mask = mask.reshape(mask.shape[0], 1, 1, t, -1)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    s = kv.base_k.shape[2]
    p_base, p_new = probs[..., :s], probs[..., s:]
    out = torch.einsum("nhgts,hsd->nhgtd", p_base, kv.base_v[0])
    out = out + torch.einsum("nhgtu,nhud->nhgtd", p_new, kv.new_v)
    if kv.idx is not None:
        where = kv.idx[:, None, None, None, :].expand(n, hkv, g, t, kv.idx.shape[1])
        p_over = probs[..., :s].gather(-1, where) * kv.valid[:, None, None, None, :].to(probs.dtype)
        base_at = kv.base_v[0][:, kv.idx]  # [Hkv, N, M, D]
        delta = kv.over_v - base_at.permute(1, 0, 2, 3)
        out = out + torch.einsum("nhgtm,nhmd->nhgtd", p_over, delta)
    out = out.reshape(n, hq, t, d).transpose(1, 2).contiguous()
    return out, None


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ENGINE_NAME, shared_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ENGINE_NAME, sdpa_mask)
    _REGISTERED = True


@contextmanager
def _attention_implementation(model: Any, name: str):
    configs = [model.config]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if text is not model.config:
        configs.append(text)
    old = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = name
        yield
    finally:
        for c, o in zip(configs, old):
            c._attn_implementation = o


def supports_shared(lm: HookableModel) -> bool:
    spec = getattr(lm, "spec", None)
    return spec is not None and spec.model_type in SUPPORTED


def _overrides(base: KVState, donor: KVState, cells: Sequence[Any], layer: int):
    rows = [c.positions if (c.layers is None or layer in c.layers) else () for c in cells]
    m = max((len(r) for r in rows), default=0)
    if m == 0:
        return None, None, None, None
    idx = torch.zeros(len(rows), m, dtype=torch.long)
    valid = torch.zeros(len(rows), m, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            idx[i, : len(r)] = torch.as_tensor(r)
            idx[i, len(r):] = r[0]
            valid[i, : len(r)] = True
    dk, dv = donor.keys[layer], donor.values[layer]
    # [N, Hkv, M, D]: row i takes the (batch-1) donor at its slots; invalid rows read base.
    over_k = dk[0][:, idx].permute(1, 0, 2, 3)
    over_v = dv[0][:, idx].permute(1, 0, 2, 3)
    empty = ~valid.any(dim=1)
    if empty.any():  # rows with no override at this layer: their padded entry is base K/V (inert)
        bk, bv = base.keys[layer][0][:, idx[empty]], base.values[layer][0][:, idx[empty]]
        over_k[empty], over_v[empty] = bk.permute(1, 0, 2, 3), bv.permute(1, 0, 2, 3)
    return idx.to(dk.device), valid.to(dk.device), over_k, over_v


def first_patched_layer(cell: Any, n_layers: int) -> int:
    """The lowest layer a cell patches (``n_layers`` for a cell that patches nothing)."""
    if not cell.positions:
        return n_layers
    return 0 if cell.layers is None else min(cell.layers)


@contextmanager
def _skip_layers(layers: Sequence[torch.nn.Module], outputs: Sequence[torch.Tensor], upto: int, n: int):
    """Layers ``< upto`` return the kept base output (expanded to ``n`` rows) instead of computing."""
    saved = []
    for j in range(upto):
        layer = layers[j]
        saved.append(layer.__dict__.get("forward"))
        layer.forward = lambda *args, _out=outputs[j], **kwargs: _out.expand(n, -1, -1)
    try:
        yield
    finally:
        for j, old in enumerate(saved):
            if old is None:
                del layers[j].forward
            else:
                layers[j].forward = old


def _decoder_layers(lm: HookableModel) -> Sequence[torch.nn.Module]:
    from kvprobe.patching.hooks import _get

    return _get(lm.model, lm.spec.layers_path)


def _final_logits(model: Any, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """The model's logits for ``token_ids`` only, from the backbone's last (normed) hidden state."""
    head = model.get_output_embeddings()
    idx = torch.as_tensor(list(token_ids), dtype=torch.long, device=hidden.device)
    bias = None if getattr(head, "bias", None) is None else head.bias[idx]
    logits = torch.nn.functional.linear(hidden, head.weight[idx], bias).float()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def shared_kv_sweep(lm: HookableModel, base: KVState, donor: KVState, cells: Sequence[Any], suffix: Sequence[int],
                    batch_size: int = 64, token_ids: Sequence[int] | None = None,
                    share_layers: bool = True) -> torch.Tensor:
    """Logits ``[len(cells), vocab]`` (``[len(cells), len(token_ids)]`` with ``token_ids``): the same numbers
    as the reference sweep, without per-cell caches; ``share_layers`` runs each cell from its first patched
    layer on (exact, see the module docstring)."""
    from transformers.cache_utils import DynamicCache

    if base.batch != 1 or donor.batch != 1:
        raise ValueError("the shared engine needs batch-1 base and donor states")
    _register()
    model = lm.model
    device = next(model.parameters()).device
    layer_cls = _layer_class()
    suffix_t = torch.as_tensor(list(suffix), dtype=torch.long)
    pos = torch.arange(base.next_position, base.next_position + suffix_t.numel())
    n_layers = base.n_layers
    layers = _decoder_layers(lm)
    backbone = model.get_decoder() if token_ids is not None else None

    def forward(chunk: Sequence[Any], start: int = 0) -> torch.Tensor:
        n = len(chunk)
        cache = DynamicCache()
        # Layers below ``start`` are skipped (they return the kept base output): no overrides to build there.
        cache.layers = [layer_cls(SharedKV(base.keys[i], base.values[i],
                                           *(_overrides(base, donor, chunk, i) if i >= start else (None,) * 4)))
                        for i in range(n_layers)]
        kwargs = dict(input_ids=suffix_t.unsqueeze(0).expand(n, -1).to(device),
                      position_ids=pos.unsqueeze(0).expand(n, -1).to(device), cache=cache, use_cache=True)
        if backbone is not None:
            hidden = backbone(**kwargs).last_hidden_state[:, -1]
            return _final_logits(model, hidden, token_ids).cpu()
        return model(**kwargs, logits_to_keep=1).logits[:, -1].float().cpu()

    outs: list[tuple[list[int], torch.Tensor]] = []
    with _attention_implementation(model, ENGINE_NAME):
        if not share_layers:
            for lo in range(0, len(cells), batch_size):
                outs.append((list(range(lo, min(lo + batch_size, len(cells)))), forward(cells[lo:lo + batch_size])))
        else:
            kept: list[torch.Tensor] = []
            handles = [layer.register_forward_hook(lambda m, a, out: kept.append(out[0] if isinstance(out, tuple)
                                                                                  else out))
                       for layer in layers]
            try:
                forward([_NO_PATCH])  # the base suffix pass: every layer's output, batch 1
            finally:
                for h in handles:
                    h.remove()
            starts = [first_patched_layer(c, n_layers) for c in cells]
            order = sorted(range(len(cells)), key=lambda i: starts[i])
            for start in sorted(set(starts)):
                group = [i for i in order if starts[i] == start]
                for lo in range(0, len(group), batch_size):
                    idx = group[lo:lo + batch_size]
                    with _skip_layers(layers, kept, start, len(idx)):
                        outs.append((idx, forward([cells[i] for i in idx], start)))
    if not outs:
        return torch.empty(0)
    result = torch.empty(len(cells), outs[0][1].shape[-1])
    for idx, logits in outs:
        result[idx] = logits
    return result


@dataclass(frozen=True)
class _Unpatched:
    positions: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None


_NO_PATCH = _Unpatched()
