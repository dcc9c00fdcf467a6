"""Exact re-rotation of cached keys (paper Section 5, Figure 4b; Section 8 / Figure 22 for the variants).

Cached keys are post-RoPE, values are position-free. Moving a block of KV from the positions its keys
were rotated at to new positions is a pure rotation by the difference of the RoPE phases:

    k(q) = R(theta(q) - theta(p)) k(p)

The phases ``theta(x) = x * inv_freq`` are computed exactly as the model computes them (fp32, from the
model's own rotary module, so llama3 banding, linear / yarn / longrope frequencies and per-layer-type
thetas all come from the model itself), and the rotation by their difference is done in float64. Any
attention scaling the variant bakes into cos/sin (yarn, longrope) is already in the cached key and is
not applied again. Partial rotary moves only the rotary channels.

Refused with a clear error (never guessed): dynamic NTK / longrope past their base length (their
frequencies change with the sequence length), M-RoPE (Qwen2-VL / Qwen3-VL) and MLA (DeepSeek-V2/V3),
which kvprobe does not re-rotate yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState

_INTERLEAVED = {"gptj", "glm", "chatglm", "cohere"}  # adjacent-pair layout; HF default is rotate-half
_MROPE = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni"}
_MLA = {"deepseek_v2", "deepseek_v3", "kimi_k2"}
_DYNAMIC = {"dynamic", "longrope"}


@dataclass(frozen=True)
class LayerRope:
    """The model's own inverse frequencies for one layer and how its channels are laid out."""

    inv_freq: torch.Tensor  # [rotary_dim / 2], fp32 as the model uses it
    head_dim: int
    interleaved: bool = False
    rope_type: str = "default"
    base_length: int | None = None  # for length-dependent variants

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def _unwrap(model_or_lm: Any) -> Any:
    return model_or_lm.model if not isinstance(model_or_lm, torch.nn.Module) else model_or_lm


def _rotary_module(model: Any) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise KVProbeError(f"no rotary embedding module found in {type(model).__name__}; cannot re-rotate its keys")


def layer_ropes(model_or_lm: Any) -> list[LayerRope]:
    """One LayerRope per decoder layer, read from the model's rotary module (refusing inexact variants)."""
    model = _unwrap(model_or_lm)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mtype = str(cfg.model_type)
    if mtype in _MROPE or getattr(cfg, "rope_parameters", {}) and "mrope_section" in (cfg.rope_parameters or {}):
        raise KVProbeError(f"{mtype}: M-RoPE re-rotation (sectioned / interleaved temporal axis) is not implemented; "
                           "refusing rather than rotating the spatial channels wrongly")
    if mtype in _MLA:
        raise KVProbeError(f"{mtype}: MLA caches a latent plus a decoupled k_pe; re-rotating only k_pe is not "
                           "implemented, so kvprobe refuses to transplant this model's cache")
    rotary = _rotary_module(model)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    interleaved = mtype in _INTERLEAVED
    base = getattr(cfg, "original_max_position_embeddings", None) or getattr(cfg, "max_position_embeddings", None)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    out = []
    for layer_type in layer_types:
        per_type = getattr(rotary, f"{layer_type}_inv_freq", None)
        inv = per_type if per_type is not None else getattr(rotary, "original_inv_freq", rotary.inv_freq)
        rope_type = rotary.rope_type[layer_type] if isinstance(getattr(rotary, "rope_type", None), dict) else \
            str(getattr(rotary, "rope_type", "default"))
        params = cfg.rope_parameters.get(layer_type, cfg.rope_parameters) if isinstance(
            getattr(cfg, "rope_parameters", None), dict) else {}
        if isinstance(params, dict):
            base = params.get("original_max_position_embeddings", base)
        out.append(LayerRope(inv.detach().float().cpu(), head_dim, interleaved, rope_type, base))
    return out


def _phase(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """theta(x) exactly as the model computes it (fp32 product), widened to float64."""
    return (positions.float()[:, None] * inv_freq[None, :]).double()


def rotate_keys(keys: torch.Tensor, from_pos: torch.Tensor, to_pos: torch.Tensor, rope: LayerRope) -> torch.Tensor:
    """Keys ``[batch, heads, slots, head_dim]`` rotated at ``from_pos`` -> rotated at ``to_pos`` (new tensor)."""
    if rope.rope_type in _DYNAMIC and rope.base_length is not None:
        top = int(max(from_pos.max(), to_pos.max()))
        if top >= rope.base_length:
            raise KVProbeError(f"{rope.rope_type} RoPE changes its frequencies past {rope.base_length} positions "
                               f"(asked for {top}); re-rotation there cannot be exact")
    elif rope.rope_type == "dynamic":
        raise KVProbeError("dynamic NTK RoPE has no fixed frequencies to re-rotate with")
    delta = _phase(to_pos, rope.inv_freq) - _phase(from_pos, rope.inv_freq)  # [slots, rotary_dim/2]
    cos, sin = delta.cos(), delta.sin()
    k = keys.double()
    r = rope.rotary_dim
    rot, rest = k[..., :r], k[..., r:]
    if rope.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = torch.stack([y1, y2], dim=-1).flatten(-2)
    else:
        half = r // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rot, rest], dim=-1).to(keys.dtype)


def rerotate(state: KVState, target_positions: Sequence[int] | torch.Tensor, model_or_lm: Any) -> KVState:
    """A new state whose keys are rotated at ``target_positions``; values are shared (position-free)."""
    to_pos = torch.as_tensor(list(target_positions) if not isinstance(target_positions, torch.Tensor)
                             else target_positions, dtype=torch.long)
    if to_pos.shape != state.positions.shape:
        raise KVProbeError(f"{to_pos.numel()} target positions for a state of {state.length} slots")
    ropes = layer_ropes(model_or_lm)
    if len(ropes) != state.n_layers:
        raise KVProbeError(f"model has {len(ropes)} layers, state {state.n_layers}")
    keys = [rotate_keys(k, state.positions.to(k.device), to_pos.to(k.device), rope)
            for k, rope in zip(state.keys, ropes)]
    return state.with_positions(to_pos, keys)


def shift(state: KVState, offset: int, model_or_lm: Any) -> KVState:
    """Move every slot by ``offset`` positions."""
    return rerotate(state, state.positions + offset, model_or_lm)
