"""ArchSpec: what kvprobe needs to know about a decoder, derived from its config alone.

Layers, query/KV heads (GQA), head_dim, the RoPE spec of every layer (Gemma 3 uses one theta for
sliding layers and another for full-attention layers), sliding windows, and where the attention,
o_proj, MLP and residual stream live as module paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvprobe.errors import KVProbeError


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer: its type, base theta and any scaling keys, exactly as the config gives them."""

    rope_type: str
    theta: float
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    vocab_size: int
    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention" per layer
    sliding_window: int | None
    rope: tuple[RopeSpec, ...]  # one per layer
    layers_path: str = "model.layers"
    attn_name: str = "self_attn"
    o_proj_name: str = "self_attn.o_proj"
    mlp_name: str = "mlp"

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 bytes of K and V for one token over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


def _rope_entry(params: dict[str, Any], partial: float) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", partial) or partial)  # transformers 5 keeps it here
    theta = params.get("rope_theta")
    if theta is None:
        raise KVProbeError(f"RoPE parameters {params} have no rope_theta; cannot derive the RoPE spec")
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    return RopeSpec(rope_type=str(rope_type), theta=float(theta), params=extra, partial_rotary_factor=partial)


def arch_spec(config: Any) -> ArchSpec:
    """Derive the ArchSpec of a transformers config (text config for multimodal wrappers)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = int(cfg.num_hidden_layers)
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        layer_types = ["full_attention"] * n_layers
        if window is not None and getattr(cfg, "use_sliding_window", True) and cfg.model_type not in (
            "llama", "qwen2", "qwen3"
        ):
            layer_types = ["sliding_attention"] * n_layers
    layer_types = tuple(str(t) for t in layer_types)
    if not any(t == "sliding_attention" for t in layer_types):
        window = None
    partial = float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    if rope_params and all(isinstance(v, dict) for v in rope_params.values()):
        # One RoPE per layer type (Gemma 3: sliding_attention / full_attention).
        per_type = {k: _rope_entry(v, partial) for k, v in rope_params.items()}
        missing = set(layer_types) - set(per_type)
        if missing:
            raise KVProbeError(f"config has RoPE parameters for {sorted(per_type)} but layer types {sorted(missing)}")
        rope = tuple(per_type[t] for t in layer_types)
    else:
        if not rope_params:
            rope_params = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
        rope = (_rope_entry(dict(rope_params), partial),) * n_layers
    return ArchSpec(
        model_type=str(cfg.model_type),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_model=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        layer_types=layer_types,
        sliding_window=int(window) if window is not None else None,
        rope=rope,
    )
