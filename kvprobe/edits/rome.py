"""ROME: a rank-one edit of one MLP's output projection (Meng et al. 2022; paper Table 1, Appendix I).

The MLP of layer ``l`` is read as a key-value memory: its ``down_proj`` maps a key ``k`` (the MLP's hidden
activation, the input of ``down_proj``) to a value ``v`` written into the residual stream. To make the subject
recall a new object, ROME

1. estimates the uncentered key covariance ``C = E[k k^T]`` at that input over a text sample
   (:func:`key_covariance`, a one-time pass per model and layer; :func:`cached_key_covariance` keeps it in the
   kvprobe cache);
2. takes the subject's key ``k*``: the ``down_proj`` input at the subject's last token, averaged over the
   request prompts;
3. finds ``v*`` by optimisation: a vector ``delta`` added to the ``down_proj`` output at the subject's last token
   so that the model predicts the new object, with a KL term that keeps the model's distribution on an
   "essence" prompt (``"{subject} is a"``) close to the original's, and a penalty on ``||delta||``
   (:func:`optimize_value`);
4. writes the closed-form rank-one update ``W <- W + (v* - W k*) (C^-1 k*)^T / ((C^-1 k*)^T k*)``, the
   least-squares solution that maps ``k*`` exactly to ``v*`` while changing the outputs of keys distributed
   as ``C`` the least (:func:`rank_one_update`).

Where our setting differs from the reference code: the request prompt is used as it is (no sampled context
prefixes), and ``C`` gets a ridge ``ridge * tr(C)/d * I`` because the stated text sample can hold fewer tokens
than the key dimension (the ridge is recorded with the edit).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError


@dataclass(frozen=True)
class SubjectPrompt:
    """Token ids of one prompt and the index of the subject's last token in it."""

    ids: tuple[int, ...]
    subject_pos: int

    def __post_init__(self) -> None:
        if not 0 <= self.subject_pos < len(self.ids):
            raise KVProbeError(f"subject position {self.subject_pos} outside a {len(self.ids)}-token prompt")


@dataclass(frozen=True)
class KeyCovariance:
    layer: int
    matrix: torch.Tensor  # [d_ff, d_ff], float64
    n_tokens: int
    seconds: float


@dataclass
class RomeEdit:
    """An applied (or computed) rank-one edit: ``W += outer(left, right)``; undone by :meth:`rollback`."""

    layer: int
    left: torch.Tensor  # [d_model]: v* - W k*
    right: torch.Tensor  # [d_ff]: C^-1 k* / (k*^T C^-1 k*)
    detail: dict[str, Any] = field(default_factory=dict)
    original_weight: torch.Tensor | None = None  # kept so a rollback restores the bytes exactly

    def rollback(self, lm: HookableModel) -> None:
        if self.original_weight is None:
            raise KVProbeError("this ROME edit was not applied (no saved weight to restore)")
        with torch.no_grad():
            down_proj(lm, self.layer).weight.copy_(self.original_weight)
        self.original_weight = None


def _model(lm: HookableModel) -> torch.nn.Module:
    return lm.model if hasattr(lm, "model") and not isinstance(lm, torch.nn.Module) else lm


def down_proj(lm: HookableModel, layer: int) -> torch.nn.Linear:
    layers = _model(lm).get_submodule(lm.spec.layers_path)
    if not 0 <= layer < len(layers):
        raise KVProbeError(f"ROME layer {layer} outside [0, {len(layers)})")
    proj = getattr(getattr(layers[layer], "mlp", None), "down_proj", None)
    if not isinstance(proj, torch.nn.Linear):
        raise KVProbeError(f"layer {layer} has no mlp.down_proj Linear (ROME edits a gated MLP's output projection)")
    return proj


def _device(lm: HookableModel) -> torch.device:
    return next(_model(lm).parameters()).device


@torch.no_grad()
def key_covariance(lm: HookableModel, layer: int, token_ids: Sequence[Sequence[int]]) -> KeyCovariance:
    """``E[k k^T]`` (uncentered) of the ``down_proj`` input over every token of the given sequences."""
    proj = down_proj(lm, layer)
    total = torch.zeros(proj.in_features, proj.in_features, dtype=torch.float64)
    count = 0

    def hook(_: Any, args: tuple[torch.Tensor, ...]) -> None:
        nonlocal total, count
        k = args[0].reshape(-1, args[0].shape[-1]).double().cpu()
        total += k.T @ k
        count += k.shape[0]

    t0 = time.perf_counter()
    handle = proj.register_forward_pre_hook(hook)
    try:
        for ids in token_ids:
            _model(lm)(input_ids=torch.as_tensor([list(ids)], device=_device(lm)), use_cache=False)
    finally:
        handle.remove()
    if count == 0:
        raise KVProbeError("key_covariance got no tokens")
    return KeyCovariance(layer, total / count, count, time.perf_counter() - t0)


def covariance_cache_path(lm: HookableModel, layer: int, token_ids: Sequence[Sequence[int]]) -> Path | None:
    """``<kvprobe cache>/rome_cov/<model>-L<layer>-<key>.pt``, the key a hash of the model's fingerprint, the
    layer and the token ids; None for a model without a fingerprint (nothing is cached then)."""
    from kvprobe.cache_dir import cache_root

    fingerprint = getattr(lm, "fingerprint", None)
    if not fingerprint:
        return None
    h = hashlib.sha256(f"rome-cov:{fingerprint}:{layer}".encode())
    for ids in token_ids:
        h.update((",".join(map(str, ids)) + ";").encode())
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(str(getattr(lm, "name", "model"))).name)
    return cache_root() / "rome_cov" / f"{name}-L{layer}-{h.hexdigest()[:16]}.pt"


def cached_key_covariance(lm: HookableModel, layer: int, token_ids: Sequence[Sequence[int]]
                          ) -> tuple[KeyCovariance, bool]:
    """:func:`key_covariance`, read from the kvprobe cache when this model, layer and sample were computed before
    (``seconds`` is then the original pass's time), else computed and cached; and whether it was cached."""
    path = covariance_cache_path(lm, layer, token_ids)
    if path is not None and path.exists():
        d = torch.load(path, map_location="cpu")
        return KeyCovariance(layer, d["matrix"], int(d["n_tokens"]), float(d["seconds"])), True
    cov = key_covariance(lm, layer, token_ids)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"matrix": cov.matrix, "n_tokens": cov.n_tokens, "seconds": cov.seconds}, tmp)
        tmp.replace(path)
    return cov, False


@torch.no_grad()
def subject_key(lm: HookableModel, layer: int, prompts: Sequence[SubjectPrompt]) -> torch.Tensor:
    """``k*``: the ``down_proj`` input at the subject's last token, averaged over ``prompts``."""
    proj, keys = down_proj(lm, layer), []

    for p in prompts:
        seen: list[torch.Tensor] = []
        handle = proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0][0, p.subject_pos].detach().float()))
        try:
            _model(lm)(input_ids=torch.as_tensor([list(p.ids)], device=_device(lm)), use_cache=False)
        finally:
            handle.remove()
        keys.append(seen[0].cpu())
    return torch.stack(keys).mean(0)


def _target_log_prob(logits: torch.Tensor, n_prompt: int, target_ids: Sequence[int]) -> torch.Tensor:
    """Sum of log p(target token j | prompt, target[:j]) from teacher-forced logits ``[T, V]``."""
    logp = F.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(n_prompt - 1, n_prompt - 1 + len(target_ids), device=logits.device)
    return logp[rows, torch.as_tensor(list(target_ids), device=logits.device)].sum()


def optimize_value(lm: HookableModel, layer: int, prompts: Sequence[SubjectPrompt], target_ids: Sequence[int],
                   essence: Sequence[SubjectPrompt] = (), steps: int = 25, lr: float = 0.5, kl_weight: float = 0.0625,
                   weight_decay: float = 0.5, clamp_norm: float = 4.0, stop_prob: float = 0.95
                   ) -> tuple[torch.Tensor, dict[str, Any]]:
    """``v* = W k* + delta``: ``delta`` added to the ``down_proj`` output at the subject's last token of every
    prompt, optimised (Adam) to maximise the target's log-probability after each prompt, plus ``kl_weight`` x
    KL(original || edited) of the next-token distribution after each essence prompt, plus ``weight_decay`` x
    ||delta||^2 / ||W k*||^2; ``||delta||`` is clamped to ``clamp_norm`` x ||W k*|| (the reference
    hyper-parameters' roles). Stops early once the mean target probability reaches ``stop_prob``."""
    model, proj = _model(lm), down_proj(lm, layer)
    device = _device(lm)
    k_star = subject_key(lm, layer, prompts).to(device)
    v0 = (proj.weight.float() @ k_star).detach()
    delta = torch.zeros_like(v0, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=lr)
    target = list(target_ids)
    runs = [(list(p.ids) + target[:-1], p.subject_pos, len(p.ids), "target") for p in prompts]
    runs += [(list(p.ids), p.subject_pos, len(p.ids), "essence") for p in essence]
    active: dict[str, int] = {}

    def hook(_: Any, __: Any, out: torch.Tensor) -> torch.Tensor:
        pos = active.get("pos")
        if pos is None:
            return out
        out = out.clone()
        out[0, pos] = out[0, pos] + delta.to(out.dtype)
        return out

    with torch.no_grad():  # the essence prompts' original next-token distributions
        ref = [F.log_softmax(model(input_ids=torch.as_tensor([ids], device=device), use_cache=False)
                             .logits[0, -1].float(), -1) for ids, _, _, kind in runs if kind == "essence"]
    requires = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    handle = proj.register_forward_hook(hook)
    history: list[float] = []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            opt.zero_grad()
            nll, kl, probs, e = 0.0, 0.0, [], 0
            for ids, pos, n_prompt, kind in runs:
                active["pos"] = pos
                logits = model(input_ids=torch.as_tensor([ids], device=device), use_cache=False).logits[0]
                if kind == "target":
                    lp = _target_log_prob(logits, n_prompt, target)
                    nll = nll - lp / len(prompts)
                    probs.append(float(lp.detach().exp()))
                else:
                    logp = F.log_softmax(logits[-1].float(), -1)
                    kl = kl + F.kl_div(logp, ref[e], log_target=True, reduction="sum") / len(essence)
                    e += 1
            mean_prob = sum(probs) / len(probs)
            history.append(mean_prob)
            if mean_prob >= stop_prob:
                break
            loss = nll + kl_weight * kl + weight_decay * delta.pow(2).sum() / v0.pow(2).sum()
            loss.backward()
            opt.step()
            with torch.no_grad():  # clamp ||delta|| as the reference implementation does
                limit = clamp_norm * v0.norm()
                if delta.norm() > limit:
                    delta.mul_(limit / delta.norm())
    finally:
        handle.remove()
        active.clear()
        for p, r in zip(model.parameters(), requires):
            p.requires_grad_(r)
    detail = {"steps": len(history), "target_prob_start": history[0], "target_prob_end": history[-1],
              "delta_norm_over_v0": float(delta.detach().norm() / v0.norm()), "optimize_s": time.perf_counter() - t0}
    return (v0 + delta.detach()), detail


def rank_one_update(lm: HookableModel, layer: int, k_star: torch.Tensor, v_star: torch.Tensor, cov: KeyCovariance,
                    ridge: float = 1e-4) -> RomeEdit:
    """The closed form: ``right = C^-1 k* / (k*^T C^-1 k*)``, ``left = v* - W k*`` (not yet applied)."""
    if cov.layer != layer:
        raise KVProbeError(f"covariance of layer {cov.layer} used for an edit of layer {layer}")
    proj = down_proj(lm, layer)
    c = cov.matrix
    c = c + ridge * torch.trace(c) / c.shape[0] * torch.eye(c.shape[0], dtype=c.dtype)
    k = k_star.double().cpu()
    u = torch.linalg.solve(c, k)
    right = (u / (u @ k)).float()
    left = (v_star.float().cpu() - proj.weight.detach().float().cpu() @ k_star.float().cpu())
    return RomeEdit(layer, left, right, {"ridge": ridge, "cov_tokens": cov.n_tokens})


@torch.no_grad()
def apply(lm: HookableModel, edit: RomeEdit) -> RomeEdit:
    proj = down_proj(lm, edit.layer)
    edit.original_weight = proj.weight.detach().clone()
    proj.weight.add_(torch.outer(edit.left, edit.right).to(proj.weight.dtype).to(proj.weight.device))
    return edit


def rome_edit(lm: HookableModel, layer: int, prompts: Sequence[SubjectPrompt], target_ids: Sequence[int],
              cov: KeyCovariance, essence: Sequence[SubjectPrompt] = (), ridge: float = 1e-4,
              **optimize: Any) -> RomeEdit:
    """Compute and apply a ROME edit (k*, v* by optimisation, the rank-one update); returns it for rollback."""
    t0 = time.perf_counter()
    k_star = subject_key(lm, layer, prompts)
    v_star, detail = optimize_value(lm, layer, prompts, target_ids, essence, **optimize)
    edit = apply(lm, rank_one_update(lm, layer, k_star, v_star, cov, ridge))
    edit.detail.update(detail, edit_s=time.perf_counter() - t0)
    return edit


def subject_prompt(tokenizer: Any, text: str, subject: str, special: bool = True) -> SubjectPrompt:
    """``text`` tokenized, with the subject's last token found from the offsets of its last occurrence."""
    at = text.rfind(subject)
    if at < 0:
        raise KVProbeError(f"subject {subject!r} not in the prompt {text!r}")
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    end = at + len(subject)
    last = max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > at)
    return SubjectPrompt(tuple(enc["input_ids"]), last)
