"""Exact re-rotation of post-RoPE keys: move cached keys from the positions they were rotated at to new ones.

The paper's composing operation (Section 5: "because the attention library caches post-RoPE keys, we
re-rotate the chunk's keys from their source positions to the target positions (values are
position-free)"; Section 8 and Appendix F for the attention-variant adapters) needs a rotation that is
*exact*: a transplanted chunk must equal the same chunk prefilled at the target offset to float tolerance
(DESIGN.md, core idea 3: "RoPE is exact or refused").

How exactness is obtained:

- The frequencies are the model's own. They are read from the model's rotary-embedding module (the buffers
  transformers built with ``ROPE_INIT_FUNCTIONS`` for each layer type), never recomputed from theta, so
  linear, llama3 banding, yarn, longrope and per-layer-type theta (Gemma 3) come out exactly as the model
  applies them.
- A key cached at position ``p`` is ``s * R(a(p)) k`` where ``s`` is the rope's attention scaling (yarn,
  longrope) and ``a(p)`` the angle transformers computes in float32 (``float32(p) * inv_freq``). Moving it
  to ``q`` multiplies by the pure rotation ``R(a(q) - a(p))``: the scaling is already in the key and is not
  applied a second time. The angle difference of the two float32 angles is taken in float64 and its
  cos/sin in float64, so the result is the key the model itself would have produced at ``q`` up to float32
  rounding of one rotation, at any offset below 2**24.
- Only the first ``rotary_dim`` channels move (partial rotary); the rest pass through untouched.
- M-RoPE (Qwen2-VL sectioned, Qwen3-VL interleaved; paper Section 8, Figure 22b): each frequency rotates
  by one of three position components (temporal, height, width). :func:`rotate_keys` takes ``[3, slots]``
  positions for these models, so an image chunk can move along the temporal component only; a
  :class:`KVState` holds one position per slot, which is exact for text tokens (all three components equal).
- MLA (DeepSeek-V2/V3, paper Section 8 "Adapter", Figure 22a): transformers caches the position-free
  compressed latent in a layer's key slot and the decoupled, already-rotated ``k_pe`` sub-vector in its
  value slot. Only ``k_pe`` is re-rotated (complex adjacent pairs on V2, rotate-half on V3); the latent is
  copied.

Refused with :class:`~kvprobe.errors.KVProbeError`, never rotated approximately: dynamic NTK (its
frequencies depend on the longest sequence seen, so no fixed rotation is exact past the base length),
unknown rope types, M-RoPE implementations other than Qwen2/2.5-VL's and Qwen3-VL's, MLA variants other
than DeepSeek-V2/V3's, longrope moves across its short/long switch, and rotary layouts not verified here
(GPT-J/Llama 4 style pairs, ...).

Longrope switches between its short and long factors on the longest position of the forward call
(``max(position_ids) + 1 > original_max_position_embeddings``). Within one regime re-rotation is exact.
Across the switch it cannot be: a chunk prefilled with the short factors attends within itself
differently from one prefilled with the long factors, so its deeper layers' keys and values differ and no
rotation reproduces an offset prefill. Such a move is refused. The regime of a state is the one
transformers picks for one call over its slots (``state.next_position``), which is what
:func:`kvprobe.kv.readout.prefill` does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState

# rope types whose keys re-rotate exactly by the angle difference (frequencies fixed per forward call)
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# model types whose rotary channels pair (2i, 2i+1) (Cohere/GLM "interleaved" layout); verified by tests
INTERLEAVED_MODEL_TYPES = frozenset({"cohere", "cohere2", "glm", "glm4"})
# model types with a layout or representation this module does not handle (refused, with the reason)
_REFUSED_MODEL_TYPES = {
    "gptj": "GPT-J rotates interleaved channel pairs; that layout is not verified here",
    "codegen": "CodeGen rotates interleaved channel pairs; that layout is not verified here",
    "llama4": "Llama 4 uses complex (interleaved) RoPE with no-RoPE chunked layers; not supported",
    "helium": "Helium rotates interleaved channel pairs; that layout is not verified here",
    "ernie4_5": "ERNIE 4.5 rotates interleaved channel pairs; that layout is not verified here",
    "ernie4_5_moe": "ERNIE 4.5 rotates interleaved channel pairs; that layout is not verified here",
    "cohere2_moe": "Cohere2-MoE's rotary layout is not verified here",
}
# MLA models: the rotary layout of the k_pe their cache holds (V2: complex pairs; V3 de-interleaves first)
MLA_LAYOUTS = {"deepseek_v2": "interleaved", "deepseek_v3": "half"}
_MROPE_MODEL_TYPE = re.compile(r"(^|_)vl($|_)|qwen2_vl|qwen2_5_vl|qwen3_vl|qwen3_omni|glm4v")
# M-RoPE rotary classes whose frequency -> (t, h, w) component map is implemented here
MROPE_CLASSES = {"Qwen2VLRotaryEmbedding": "sectioned", "Qwen2_5_VLRotaryEmbedding": "sectioned",
                 "Qwen3VLTextRotaryEmbedding": "interleaved"}
_MAX_EXACT_POSITION = 2 ** 24  # float32 represents every integer position below this


@dataclass(frozen=True, eq=False)
class RopeLayerInfo:
    """What re-rotating one layer's keys needs, taken from the model's own rotary embedding.

    ``inv_freq`` holds the ``rotary_dim // 2`` inverse frequencies (float32, CPU) exactly as the model
    applies them; ``attention_scaling`` is the factor its cos/sin carry (1.0 except yarn/longrope): every
    cached key already holds it once, so re-rotation never applies it. ``layout`` is ``"half"`` (HF
    rotate-half: channel ``i`` pairs with ``i + rotary_dim/2``), ``"interleaved"`` (``2i`` with ``2i+1``) or
    ``"none"`` (a layer without RoPE: keys are position-free). Longrope layers also carry the long-factor
    frequencies and the base length that selects between them. ``rotated_slot`` names the cache slot that
    holds the rotated vectors: ``"keys"``, or ``"values"`` for MLA (the value slot holds ``k_pe``).
    """

    rope_type: str
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    layout: str = "half"
    long_inv_freq: torch.Tensor | None = None
    original_max_position: int | None = None
    layer_type: str | None = None
    rotated_slot: str = "keys"
    mrope: str | None = None  # "sectioned" | "interleaved" (M-RoPE), None otherwise
    mrope_components: tuple[int, ...] | None = None  # per frequency: 0 temporal, 1 height, 2 width

    @property
    def rotary_dim(self) -> int:
        return 0 if self.layout == "none" else 2 * int(self.inv_freq.numel())

    def is_long(self, seq_len: int) -> bool:
        """Whether a forward call whose largest position is ``seq_len - 1`` uses longrope's long factors."""
        return self.long_inv_freq is not None and self.original_max_position is not None \
            and seq_len > self.original_max_position

    def inv_freq_for(self, seq_len: int) -> torch.Tensor:
        """The frequencies a forward call whose largest position is ``seq_len - 1`` rotates with."""
        return self.long_inv_freq if self.is_long(seq_len) and self.long_inv_freq is not None else self.inv_freq

    def check_regimes(self, from_seq_len: int, to_seq_len: int) -> None:
        """Refuse a longrope move across its short/long switch (see the module docstring)."""
        if self.is_long(from_seq_len) != self.is_long(to_seq_len):
            src, dst = ("long" if self.is_long(n) else "short" for n in (from_seq_len, to_seq_len))
            raise KVProbeError(
                f"longrope uses its short factors while every position of a call is below {self.original_max_position} "
                f"and its long factors otherwise; this move goes from the {src} regime (positions up to {from_seq_len - 1}) "
                f"to the {dst} regime (up to {to_seq_len - 1}). A chunk prefilled under one set of "
                "factors has different deeper-layer KV than under the other, so no re-rotation equals an offset "
                f"prefill: keep source and target on one side of {self.original_max_position}")

    def describe(self) -> str:
        extra = f", x{self.attention_scaling:.4g} in cos/sin" if self.attention_scaling != 1.0 else ""
        slot = ", MLA: k_pe in the value slot, latent copied" if self.rotated_slot == "values" else ""
        if self.mrope:
            slot += f", M-RoPE {self.mrope} t/h/w {[self.mrope_components.count(c) for c in range(3)]}"
        return f"{self.rope_type} ({self.layout}, rotary_dim {self.rotary_dim}{extra}{slot})"


# -- reading the model's own rotary embedding --------------------------------------------------------------
def _as_module(model_or_config: Any) -> torch.nn.Module | None:
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config
    inner = getattr(model_or_config, "model", None)  # a LoadedModel
    return inner if isinstance(inner, torch.nn.Module) else None


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _is_rotary(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "rope_type")


def _rotary_modules_of_model(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found = [(name, m) for name, m in model.named_modules() if _is_rotary(m)]
    return [(n, m) for n, m in found if not re.search(r"vision|visual|image|audio", n)]


def _rotary_from_config(cfg: Any) -> torch.nn.Module:
    """Instantiate the rotary-embedding class of the config's own modeling module (no weights needed)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError:
        raise KVProbeError(f"no causal-LM class for config {type(cfg).__name__}: pass the model itself") from None
    module = importlib.import_module(model_cls.__module__)
    prefix = model_cls.__name__.removesuffix("ForCausalLM")
    names = [f"{prefix}RotaryEmbedding"] + sorted(
        n for n in dir(module) if n.endswith("RotaryEmbedding") and "Vision" not in n and "Multimodal" not in n)
    for name in names:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            return cls(cfg)
    raise KVProbeError(f"{model_cls.__module__} defines no rotary embedding: pass the model itself")


def _refuse_unsupported(cfg: Any) -> None:
    model_type = str(getattr(cfg, "model_type", ""))
    if is_mla(cfg) and model_type not in MLA_LAYOUTS:
        raise KVProbeError(f"{model_type}: an MLA cache whose k_pe layout is not verified here (verified: "
                           f"{', '.join(MLA_LAYOUTS)}); refusing rather than rotating the latent cache wrongly")
    if model_type in _REFUSED_MODEL_TYPES:
        raise KVProbeError(f"{model_type}: {_REFUSED_MODEL_TYPES[model_type]}; re-rotation refused")


def _uses_mrope(cfg: Any) -> bool:
    params = getattr(cfg, "rope_parameters", None) or {}
    flat = [params] + [v for v in params.values() if isinstance(v, dict)]
    return any("mrope_section" in p or p.get("mrope_interleaved") or "mrope" in str(p.get("rope_type", ""))
               for p in flat) or bool(_MROPE_MODEL_TYPE.search(str(getattr(cfg, "model_type", ""))))


def mrope_components(kind: str, section: Sequence[int], n_freq: int) -> tuple[int, ...]:
    """Which position component (0 t, 1 h, 2 w) each of the ``n_freq`` frequencies rotates by.

    Sectioned (Qwen2-VL): consecutive blocks of ``section[0]``, ``section[1]``, ``section[2]`` frequencies.
    Interleaved (Qwen3-VL): temporal by default, height at 1, 4, 7, ... below ``3 * section[1]``, width at
    2, 5, 8, ... below ``3 * section[2]`` (transformers' ``recomposition_frequencies``, read not guessed).
    """
    if kind == "sectioned":
        comps = [c for c, n in enumerate(section) for _ in range(int(n))]
    else:
        comps = [0] * n_freq
        for c in (1, 2):
            for f in range(c, 3 * int(section[c]), 3):
                comps[f] = c
    if len(comps) != n_freq:
        raise KVProbeError(f"mrope_section {list(section)} does not cover the {n_freq} rotary frequencies")
    return tuple(comps)


def is_mla(cfg: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2 style): a compressed latent plus a decoupled RoPE k_pe."""
    return getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None


def _check_rope_type(rope_type: str, model_type: str, where: str) -> None:
    if "dynamic" in rope_type:
        raise KVProbeError(
            f"{model_type}{where}: dynamic NTK RoPE recomputes its frequencies from the longest sequence seen, so "
            "no fixed rotation reproduces it past its base length; re-rotation refused (use a static rope_type)")
    if rope_type not in EXACT_ROPE_TYPES:
        raise KVProbeError(f"{model_type}{where}: rope_type '{rope_type}' is not one kvprobe re-rotates exactly "
                           f"(supported: {', '.join(EXACT_ROPE_TYPES)}); re-rotation refused")


def rope_layer_info(model_or_config: Any) -> tuple[RopeLayerInfo, ...]:
    """One :class:`RopeLayerInfo` per decoder layer, from the model's own rotary embedding.

    Accepts a model (``nn.Module``), a :class:`~kvprobe.models.loading.LoadedModel`, a transformers config
    (the rotary class of its modeling module is instantiated: no weights), or an already built sequence of
    infos (returned as is). Raises :class:`KVProbeError` for every variant that cannot be re-rotated exactly.
    """
    if isinstance(model_or_config, Sequence) and model_or_config \
            and all(isinstance(i, RopeLayerInfo) for i in model_or_config):
        return tuple(model_or_config)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = _as_module(model_or_config)
    cfg = _text_config(model.config if model is not None else model_or_config)
    model_type = str(getattr(cfg, "model_type", "?"))
    _refuse_unsupported(cfg)
    n_layers = int(cfg.num_hidden_layers)
    per_layer: list[torch.nn.Module]
    if model is not None:
        found = _rotary_modules_of_model(model)
        if not found:
            raise KVProbeError(f"{model_type}: no rotary embedding module found; the model does not use RoPE")
        if len(found) == 1:
            per_layer = [found[0][1]] * n_layers
        else:  # one rotary module per layer (older layouts): map them by layer index
            by_layer = {int(m.group(1)): mod for name, mod in found if (m := re.search(r"layers\.(\d+)\.", name))}
            if sorted(by_layer) != list(range(n_layers)):
                raise KVProbeError(f"{model_type}: {len(found)} rotary modules that do not map one per layer")
            per_layer = [by_layer[i] for i in range(n_layers)]
    else:
        per_layer = [_rotary_from_config(cfg)] * n_layers

    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers)
    no_rope = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = RoPE, 0 = NoPE
    layout = "interleaved" if model_type in INTERLEAVED_MODEL_TYPES else "half"
    mla = is_mla(cfg)
    if mla:
        layout = MLA_LAYOUTS[model_type]
    cache: dict[tuple[int, str | None], RopeLayerInfo] = {}
    infos = []
    for i, rot in enumerate(per_layer):
        lt = layer_types[i] if isinstance(rot.rope_type, dict) else None
        key = (id(rot), lt)
        if key not in cache:  # layers sharing one rotary setting share one info (and one cos/sin in rerotate)
            cache[key] = _info_of(rot, lt, model_type, layout, ROPE_INIT_FUNCTIONS)
        info = cache[key]
        if no_rope is not None and not no_rope[i]:
            info = RopeLayerInfo("none", info.inv_freq, layout="none", layer_type=lt)
        if mla and info.rotary_dim != int(cfg.qk_rope_head_dim):
            raise KVProbeError(f"{model_type}: rotary_dim {info.rotary_dim} != qk_rope_head_dim {cfg.qk_rope_head_dim}")
        infos.append(replace(info, rotated_slot="values") if mla else info)
    return tuple(infos)


def _info_of(rot: torch.nn.Module, layer_type: str | None, model_type: str, layout: str,
             init_fns: dict) -> RopeLayerInfo:
    rcfg = rot.config
    if layer_type is not None:
        rope_type = rot.rope_type.get(layer_type)
        if rope_type is None:
            raise KVProbeError(f"{model_type}: layer type '{layer_type}' has no RoPE parameters; re-rotation refused")
        prefix = f"{layer_type}_"
        params = rcfg.rope_parameters[layer_type]
        where = f" ({layer_type} layers)"
    else:
        rope_type, prefix, params, where = rot.rope_type, "", rcfg.rope_parameters, ""
    _check_rope_type(str(rope_type), model_type, where)
    mrope, comps = None, None
    if hasattr(rot, "mrope_section") or _uses_mrope(rcfg):
        mrope = MROPE_CLASSES.get(type(rot).__name__)
        if mrope is None or not hasattr(rot, "mrope_section"):
            raise KVProbeError(f"{model_type}: M-RoPE in {type(rot).__name__}, whose temporal/height/width channel map "
                               f"is not verified here (verified: {', '.join(MROPE_CLASSES)}); re-rotation refused")
    inv = getattr(rot, f"{prefix}original_inv_freq", None)
    if inv is None:
        inv = getattr(rot, f"{prefix}inv_freq")
    scaling = float(getattr(rot, f"{prefix}attention_scaling", getattr(rot, "attention_scaling", 1.0)))
    long_inv, orig = None, None
    if rope_type == "longrope":
        orig = int(params.get("original_max_position_embeddings")
                   or getattr(rcfg, "original_max_position_embeddings", None) or rcfg.max_position_embeddings)
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        long_inv, long_scaling = init_fns["longrope"](rcfg, torch.device("cpu"), seq_len=orig + 1, **kwargs)
        long_inv = long_inv.detach().to("cpu", torch.float32).clone()
        if float(long_scaling) != scaling:
            raise KVProbeError(f"{model_type}{where}: longrope attention scaling differs between its short and long "
                               "regimes; re-rotation refused")
    if mrope is not None:
        comps = mrope_components(mrope, rot.mrope_section, int(inv.numel()))
    return RopeLayerInfo(rope_type=str(rope_type), inv_freq=inv.detach().to("cpu", torch.float32).clone(),
                         attention_scaling=scaling, layout=layout, long_inv_freq=long_inv,
                         original_max_position=orig, layer_type=layer_type, mrope=mrope, mrope_components=comps)


# -- the rotation ---------------------------------------------------------------------------------------
def _positions(pos: Sequence[int] | torch.Tensor, n: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(pos if isinstance(pos, torch.Tensor) else list(pos), dtype=torch.long).reshape(-1).cpu()
    if t.numel() != n:
        raise KVProbeError(f"{t.numel()} {what} positions for {n} slots")
    if t.numel() and (t.min() < 0 or t.max() >= _MAX_EXACT_POSITION):
        raise KVProbeError(f"{what} positions must lie in [0, 2**24) (float32 RoPE angles are exact only there)")
    return t


def _per_frequency(pos: torch.Tensor, info: RopeLayerInfo) -> torch.Tensor:
    """``[slots, n_freq]`` positions each frequency rotates by: one per slot, or M-RoPE's (t, h, w) pick."""
    if pos.dim() == 1:
        return pos[:, None].expand(-1, info.inv_freq.numel())
    comps = torch.as_tensor(info.mrope_components, dtype=torch.long)
    return pos[comps, :].T  # pos is [3, slots]


def _is_three_component(pos: Any) -> bool:
    return isinstance(pos, torch.Tensor) and pos.dim() == 2 or (
        not isinstance(pos, torch.Tensor) and len(pos) == 3 and all(isinstance(p, Sequence) for p in pos))


def _positions3(pos: Any, n: int, what: str) -> torch.Tensor:
    """M-RoPE positions as ``[3, slots]`` (a 1-D sequence means all three components are equal)."""
    t = torch.as_tensor(pos, dtype=torch.long).cpu()
    if t.dim() == 1:
        t = t[None].expand(3, -1)
    if t.shape != (3, n):
        raise KVProbeError(f"{what} M-RoPE positions must be [3, {n}] (t, h, w); got {tuple(t.shape)}")
    if t.min() < 0 or t.max() >= _MAX_EXACT_POSITION:
        raise KVProbeError(f"{what} positions must lie in [0, 2**24) (float32 RoPE angles are exact only there)")
    return t


def _cos_sin(info: RopeLayerInfo, from_pos: torch.Tensor, to_pos: torch.Tensor, from_seq_len: int,
             to_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (float64, ``[slots, rotary_dim/2]``) of the pure rotation taking angle a(from) to a(to)."""
    # The model's angles, bit for bit: float32(position) * float32 inv_freq, one float32 product.
    a_from = _per_frequency(from_pos, info).to(torch.float32) * info.inv_freq_for(from_seq_len)[None, :]
    a_to = _per_frequency(to_pos, info).to(torch.float32) * info.inv_freq_for(to_seq_len)[None, :]
    delta = a_to.double() - a_from.double()  # exact: difference of two float32 numbers
    return delta.cos(), delta.sin()


def _apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    cos = cos.to(keys.device, work)
    sin = sin.to(keys.device, work)
    r = 2 * cos.shape[-1]
    k = keys.to(work)
    rot, rest = k[..., :r], k[..., r:]
    if layout == "half":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:  # interleaved pairs (2i, 2i+1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1).to(keys.dtype)


def rotate_keys(keys: torch.Tensor, from_pos: Sequence[int] | torch.Tensor, to_pos: Sequence[int] | torch.Tensor,
                rope_layer_info: RopeLayerInfo, *, from_seq_len: int | None = None,
                to_seq_len: int | None = None) -> torch.Tensor:
    """Keys ``[batch, kv_heads, slots, head_dim]`` rotated at ``from_pos[slot]``, re-rotated to ``to_pos[slot]``.

    For M-RoPE models either position may be ``[3, slots]`` (temporal, height, width), e.g. to move an image
    chunk along the temporal component only; a 1-D sequence stands for three equal components.

    Applies the pure rotation by the angle difference (no attention scaling: the keys carry it once
    already), to the first ``rotary_dim`` channels only. Returns a new tensor; ``keys`` is never modified.
    ``from_seq_len`` / ``to_seq_len`` name the forward-call length that picked longrope's regime (default:
    largest position + 1; a move across the regime switch is refused); other rope types ignore them.
    """
    if keys.dim() != 4:
        raise KVProbeError(f"keys must be [batch, kv_heads, slots, head_dim]; got shape {tuple(keys.shape)}")
    n = keys.shape[-2]
    info = rope_layer_info
    if _is_three_component(from_pos) or _is_three_component(to_pos):
        if info.mrope is None:
            raise KVProbeError("[3, slots] (t, h, w) positions are for M-RoPE models; this RoPE takes one per slot")
        f3, t3 = (_positions3(p, n, w) for p, w in ((from_pos, "source"), (to_pos, "target")))
        if info.rotary_dim > keys.shape[-1]:
            raise KVProbeError(f"rotary_dim {info.rotary_dim} exceeds the keys' head_dim {keys.shape[-1]}")
        cos, sin = _cos_sin(info, f3, t3, int(f3.max()) + 1, int(t3.max()) + 1)
        return _apply(keys, cos, sin, info.layout)
    f = _positions(from_pos, n, "source")
    t = _positions(to_pos, n, "target")
    if info.rotary_dim > keys.shape[-1]:
        raise KVProbeError(f"rotary_dim {info.rotary_dim} exceeds the keys' head_dim {keys.shape[-1]}")
    if info.layout == "none" or n == 0:
        return keys.clone()
    fs = from_seq_len if from_seq_len is not None else int(f.max()) + 1
    ts = to_seq_len if to_seq_len is not None else int(t.max()) + 1
    info.check_regimes(fs, ts)
    if torch.equal(f, t) and info.inv_freq_for(fs) is info.inv_freq_for(ts):
        return keys.clone()
    cos, sin = _cos_sin(info, f, t, fs, ts)
    return _apply(keys, cos, sin, info.layout)


def rerotate(state: KVState, target_positions: Sequence[int] | torch.Tensor, model_or_config: Any) -> KVState:
    """A new state whose keys were re-rotated from ``state.positions`` to ``target_positions``.

    The paper's transplant (Section 5; Section 8 / Appendix F for the adapters): post-RoPE keys are
    re-rotated exactly with the model's own RoPE, values are position-free and shared by reference (MLA:
    the value slot's k_pe is re-rotated and the key slot's latent shared).
    ``model_or_config`` is the model, a LoadedModel, its config, or the output of :func:`rope_layer_info`.
    Input tensors are never modified.
    """
    target = _positions(target_positions, state.length, "target")
    infos = rope_layer_info(model_or_config)
    if len(infos) != state.n_layers:
        raise KVProbeError(f"the model has {len(infos)} layers, the state {state.n_layers}")
    if state.length == 0:
        return state.with_positions(target, [k.clone() for k in state.keys])
    src = _positions(state.positions, state.length, "source")
    fs, ts = state.next_position, int(target.max()) + 1
    memo: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
    keys, values = list(state.keys), list(state.values)  # untouched slots are shared (write-once)
    for i, info in enumerate(infos):
        slot = values if info.rotated_slot == "values" else keys
        k = slot[i]
        if info.rotary_dim > k.shape[-1]:
            raise KVProbeError(f"rotary_dim {info.rotary_dim} exceeds the rotated vectors' size {k.shape[-1]}")
        if info.layout == "none":
            slot[i] = k.clone()
            continue
        if id(info) not in memo:  # layers sharing one rotary setting share one cos/sin
            info.check_regimes(fs, ts)
            same = torch.equal(src, target) and info.inv_freq_for(fs) is info.inv_freq_for(ts)
            memo[id(info)] = None if same else _cos_sin(info, src, target, fs, ts)
        cs = memo[id(info)]
        slot[i] = k.clone() if cs is None else _apply(k, cs[0], cs[1], info.layout)
    if any(info.rotated_slot == "values" for info in infos):
        return KVState(tuple(keys), tuple(values), target.to(torch.long))
    return state.with_positions(target, keys)


def rotated_vectors(state: KVState, infos: Sequence[RopeLayerInfo]) -> list[torch.Tensor]:
    """Per layer, the cached tensor that carries RoPE: the keys, or MLA's k_pe (the value slot)."""
    return [v if info.rotated_slot == "values" else k for k, v, info in zip(state.keys, state.values, infos)]


def shift(state: KVState, offset: int, model_or_config: Any) -> KVState:
    """Move every slot of ``state`` by ``offset`` positions (re-rotating its keys)."""
    return rerotate(state, state.positions + int(offset), model_or_config)
