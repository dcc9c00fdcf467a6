"""Capture and patch residual / attention / MLP sites with plain torch hooks, mapped through ArchSpec.

KV sites need no hook: a KV patch is a :meth:`KVState.mix`. Everything else is a forward (pre-)hook on
the module ArchSpec names. Hooks are removed when the call returns, even on error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager


import torch

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState
from kvprobe.patching.sites import Site


def _get(module: torch.nn.Module, path: str) -> torch.nn.Module:
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def site_module(lm: HookableModel, site: Site) -> tuple[torch.nn.Module, str]:
    """The module a site lives on and how to hook it: 'pre' (its input) or 'post' (its output)."""
    spec, model = lm.spec, lm.model
    layer = _get(model, spec.layers_path)[site.layer]
    if site.kind == "resid_pre":
        return layer, "pre"
    if site.kind == "resid_post":
        return layer, "post"
    if site.kind == "attn_out":
        return (_get(layer, spec.o_proj_name), "pre") if site.head is not None else (_get(layer, spec.attn_name), "post")
    if site.kind == "mlp_out":
        return _get(layer, spec.mlp_name), "post"
    raise KVProbeError(f"{site.kind} sites are patched by mixing KVStates, not by hooks")


def _head_slice(lm: HookableModel, head: int) -> slice:
    d = lm.spec.head_dim
    return slice(head * d, (head + 1) * d)


@contextmanager
def hooked(lm: HookableModel, sites: Sequence[Site], fn: Callable[[Site, torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """Call ``fn(site, activation[batch, seq, d])`` at every site; a returned tensor replaces the activation."""
    by_module: dict[tuple[int, str], list[Site]] = {}
    modules: dict[int, torch.nn.Module] = {}
    for site in sites:
        module, where = site_module(lm, site)
        by_module.setdefault((id(module), where), []).append(site)
        modules[id(module)] = module

    def apply(group: list[Site], act: torch.Tensor) -> torch.Tensor:
        for site in group:
            if site.head is not None:
                sl = _head_slice(lm, site.head)
                new = fn(site, act[..., sl])
                if new is not None:
                    act = act.clone()
                    act[..., sl] = new
            else:
                new = fn(site, act)
                if new is not None:
                    act = new
        return act

    with replace_activations([(modules[mid], where, lambda act, group=group: apply(group, act))
                              for (mid, where), group in by_module.items()]):
        yield


@contextmanager
def replace_activations(hooks: Sequence[tuple[torch.nn.Module, str, Callable[[torch.Tensor], torch.Tensor]]]
                        ) -> Iterator[None]:
    """For each ``(module, where, fn)``, replace the module's input (``where='pre'``, the first positional
    argument or ``hidden_states``) or output (``'post'``, the first element of a tuple) by ``fn(activation)``;
    the hooks are removed on exit."""
    handles = []
    for module, where, fn in hooks:
        if where == "pre":
            def pre(mod, args, kwargs, fn=fn):
                if args:
                    return (fn(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(mod, args, output, fn=fn):
                return (fn(output[0]), *output[1:]) if isinstance(output, tuple) else fn(output)
            handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _positions_of(site: Site, act: torch.Tensor) -> slice | int:
    return slice(None) if site.position is None else site.position


@torch.no_grad()
def capture(lm: HookableModel, ids: Sequence[int] | torch.Tensor, sites: Sequence[Site],
            prior: KVState | None = None) -> dict[Site, torch.Tensor]:
    """Activations ``[batch, d]`` (or ``[batch, seq, d]`` for position=None) at each site, from one forward."""
    from kvprobe.kv.readout import prefill

    got: dict[Site, torch.Tensor] = {}

    def record(site: Site, act: torch.Tensor) -> None:
        got[site] = act[:, _positions_of(site, act)].detach().clone()

    with hooked(lm, sites, record):
        prefill(lm, ids, prior=prior)
    return got


@torch.no_grad()
def run_patched(lm: HookableModel, ids: Sequence[int] | torch.Tensor, patches: Mapping[Site, torch.Tensor],
                prior: KVState | None = None, add: bool = False) -> tuple[KVState, torch.Tensor]:
    """One forward with each site's activation replaced by (or, with ``add``, shifted by) the given tensor.

    Returns the KVState the patched forward wrote and its last-position logits. A patch tensor broadcasts
    over the batch (``[d]`` or ``[batch, d]``; ``[batch, seq, d]`` for position=None sites).
    """
    from kvprobe.kv.readout import prefill

    def patch(site: Site, act: torch.Tensor) -> torch.Tensor:
        out = act.clone()
        where = _positions_of(site, act)
        value = patches[site].to(act.dtype).to(act.device)
        out[:, where] = out[:, where] + value if add else value.expand_as(out[:, where])
        return out

    with hooked(lm, list(patches), patch):
        state, logits = prefill(lm, ids, prior=prior, return_logits=True)
    return state, logits
