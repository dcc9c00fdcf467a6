"""kvprobe sites <-> TransformerLens (TransformerBridge) hook names and nnsight module paths.

The table (docs/interop.md) in code. Conventions, checked by tests/test_interop.py on every tiny family:

- ``attn_out`` is the attention module's output (after o_proj). On Llama/Qwen/Mistral that is TL's
  ``blocks.{l}.hook_attn_out``; Gemma 2/3 apply a post-attention norm before the residual add, and TL's
  ``hook_attn_out`` is *after* that norm, so kvprobe's site is ``blocks.{l}.attn.hook_out`` there
  (``mlp_out`` likewise: ``blocks.{l}.mlp.hook_out``). :func:`tl_hook_name` returns the exact one per family.
- a head's ``attn_out`` slice is TL's ``blocks.{l}.attn.hook_z[:, pos, head]`` (the o_proj input, per head);
- a ``kv`` site is two hooks: ``blocks.{l}.attn.hook_rot_k`` (keys after RoPE, and after q/k norm where the
  family has one: exactly what the cache stores) and ``blocks.{l}.attn.hook_v``. TL's ``hook_k`` is the key
  *before* RoPE; both are ``[batch, pos, kv_heads, d_head]`` (kv heads, not zero-padded to query heads).
- nnsight addresses modules: ``model.layers[l].self_attn.k_proj.output`` is the key before RoPE (and before
  k_norm); patching it with a donor's value at the *same position* gives the donor's cached key exactly,
  because RoPE and k_norm are fixed functions of (projection, position).
"""

from __future__ import annotations

import re
from typing import Any

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.patching.sites import Site

_POST_NORM_FAMILIES = ("gemma2", "gemma3", "gemma3_text")


def _post_norm(lm: HookableModel) -> bool:
    spec = getattr(lm, "spec", None)
    return spec is not None and spec.model_type in _POST_NORM_FAMILIES


def tl_hook_name(site: Site, lm: HookableModel | None = None) -> str | tuple[str, str]:
    """The TransformerBridge hook (a (keys, values) pair for ``kv`` sites) holding ``site``'s activation.

    Pass the model (``lm``) for Gemma-style families, whose block outputs go through a post-norm."""
    l = site.layer
    if site.kind == "resid_pre":
        return f"blocks.{l}.hook_resid_pre"
    if site.kind == "resid_post":
        return f"blocks.{l}.hook_resid_post"
    if site.kind == "attn_out":
        if site.head is not None:
            return f"blocks.{l}.attn.hook_z"
        return f"blocks.{l}.attn.hook_out" if _post_norm(lm) else f"blocks.{l}.hook_attn_out"
    if site.kind == "mlp_out":
        return f"blocks.{l}.mlp.hook_out" if _post_norm(lm) else f"blocks.{l}.hook_mlp_out"
    if site.kind == "kv":
        return f"blocks.{l}.attn.hook_rot_k", f"blocks.{l}.attn.hook_v"
    raise KVProbeError(f"no hook for site kind {site.kind}")


_TL = [
    (re.compile(r"blocks\.(\d+)\.hook_resid_pre"), "resid_pre"),
    (re.compile(r"blocks\.(\d+)\.hook_resid_post"), "resid_post"),
    (re.compile(r"blocks\.(\d+)\.(?:hook_attn_out|attn\.hook_out)"), "attn_out"),
    (re.compile(r"blocks\.(\d+)\.(?:hook_mlp_out|mlp\.hook_out)"), "mlp_out"),
    (re.compile(r"blocks\.(\d+)\.attn\.(?:hook_rot_k|hook_v)"), "kv"),
    (re.compile(r"blocks\.(\d+)\.attn\.hook_z"), "attn_out"),
]


def site_of_tl_hook(name: str, position: int | None = None, head: int | None = None, lm: HookableModel | None = None) -> Site:
    """The kvprobe site a TransformerBridge hook name addresses (``hook_z`` needs ``head``).

    On Gemma-style families TL's ``hook_attn_out`` / ``hook_mlp_out`` are after the post-norm, which no kvprobe
    site names: pass ``lm`` to get an error instead of a silently different site."""
    if name.endswith("attn.hook_k"):
        raise KVProbeError("hook_k is the key before RoPE; the cached key (a kv site) is hook_rot_k")
    for pattern, kind in _TL:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        if kind in ("attn_out", "mlp_out") and _post_norm(lm) and ".hook_" + kind in name:
            raise KVProbeError(f"{name} is after the post-norm on {lm.spec.model_type}; kvprobe's {kind} is "
                               f"{tl_hook_name(Site(kind, int(m.group(1))), lm)}")
        if name.endswith("hook_z"):
            if head is None:
                raise KVProbeError("hook_z is per head: pass head= to name a kvprobe site")
            return Site("attn_out", int(m.group(1)), position, head)
        return Site(kind, int(m.group(1)), position)
    raise KVProbeError(f"TransformerLens hook {name!r} has no kvprobe site (see docs/interop.md)")


def nnsight_path(site: Site, lm: HookableModel) -> str:
    """Module path (under the nnsight model) and attribute the site is read from, e.g.
    ``model.layers.3.output``; ``kv`` sites give the key projection (the value projection is ``v_proj``)."""
    spec = lm.spec
    layer = f"{spec.layers_path}.{site.layer}"
    if site.kind == "resid_pre":
        return f"{layer}.input"
    if site.kind == "resid_post":
        return f"{layer}.output"
    if site.kind == "attn_out":
        return f"{layer}.{spec.o_proj_name}.input" if site.head is not None else f"{layer}.{spec.attn_name}.output[0]"
    if site.kind == "mlp_out":
        return f"{layer}.{spec.mlp_name}.output"
    if site.kind == "kv":
        return f"{layer}.{spec.attn_name}.k_proj.output"
    raise KVProbeError(f"no nnsight path for site kind {site.kind}")


def envoy_at(root: Any, path: str) -> Any:
    """The nnsight Envoy at a dotted module path (digits index module lists)."""
    node = root
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node
