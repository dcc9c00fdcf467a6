"""Sparse autoencoders on the note layer, with sae-lens (paper App. D (3), Figure 15e).

- :func:`collect`: activations of one SAE site (``resid``: ``resid_post`` of a layer; ``v``: the layer's
  ``v_proj`` output, every KV head concatenated) over token sequences;
- :func:`train`: a sae-lens ``TopKTrainingSAE`` trained by ``SAETrainer`` on those activations (seeded, so
  the same config rebuilds the same weights);
- :func:`build`: the SAE of a :class:`SAESpec` from the kvprobe cache, or trained, saved with ``save_model``
  and loaded back with ``SAE.load_from_disk`` (what ``kvprobe sae train`` runs);
- :func:`reconstruction`: explained variance, dead features, and the change in next-token cross-entropy with
  the SAE spliced into the forward pass;
- :func:`feature_aucs` / :func:`top_tokens` / :func:`clamp_acts`: per-feature ROC AUC for a label, the
  top-activating tokens of a feature, and a residual with chosen features set to target values (the SAE's
  error term kept, so only the clamped features move).

Training text: gated-task prompts (a seed apart from the evaluated instances) and neutral English: the
Python documentation's help topics bundled with the interpreter (``pydoc_data``), a package resource.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from kvprobe.backends import HookableModel
from kvprobe.cache_dir import cache_root
from kvprobe.errors import KVProbeError
from kvprobe.patching.hooks import _get


@dataclass(frozen=True)
class SAESpec:
    """Everything that determines an SAE's weights (its cache key)."""

    site: Literal["resid", "v"]
    layer: int
    width: int = 4096
    k: int = 32
    steps: int = 400
    batch: int = 512
    lr: float = 5e-4
    seed: int = 0
    task_template: str = "configs/tasks/gated.yaml"
    n_task_prompts: int = 24
    n_neutral_tokens: int = 16000
    window: int = 256
    skip_first: int = 1  # leading tokens of every sequence left out (the attention sink's residual is ~100x larger)

    def key(self, model_fingerprint: str) -> str:
        blob = json.dumps({**asdict(self), "model": model_fingerprint}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# -- activations -----------------------------------------------------------------------------------------------

def site_module(lm: HookableModel, site: str, layer: int) -> torch.nn.Module:
    block = _get(lm.model, lm.spec.layers_path)[layer]
    if site == "resid":
        return block
    if site == "v":
        return _get(block, lm.spec.attn_name).v_proj
    raise KVProbeError(f"SAE site must be resid or v, not {site!r}")


def site_dim(lm: HookableModel, site: str) -> int:
    return lm.spec.d_model if site == "resid" else lm.spec.n_kv_heads * lm.spec.head_dim


@contextmanager
def on_site(lm: HookableModel, site: str, layer: int, fn: Any) -> Iterator[None]:
    """``fn(act [batch, seq, d]) -> act or None`` on the site's output during the block."""
    def hook(mod, args, output):
        act = output[0] if isinstance(output, tuple) else output
        new = fn(act)
        if new is None:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new
    handle = site_module(lm, site, layer).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def collect(lm: HookableModel, sequences: Sequence[Sequence[int]], site: str, layer: int, skip_first: int = 0
            ) -> list[torch.Tensor]:
    """The site's activations ``[seq - skip_first, d]`` (float32) for each token sequence, leaving out its
    first ``skip_first`` tokens."""
    out: list[torch.Tensor] = []
    got: dict[str, torch.Tensor] = {}

    def keep(act: torch.Tensor) -> None:
        got["a"] = act[0].detach().float().cpu().clone()

    device = next(lm.model.parameters()).device
    with on_site(lm, site, layer, keep):
        for ids in sequences:
            lm.model(input_ids=torch.as_tensor([list(ids)], device=device), use_cache=False, logits_to_keep=1)
            out.append(got.pop("a")[skip_first:])
    return out


def neutral_sequences(tokenizer: Any, n_tokens: int, window: int, skip_tokens: int = 0) -> list[list[int]]:
    """Windows of neutral English (Python's bundled help topics, in sorted topic order), ``n_tokens`` in all,
    starting ``skip_tokens`` in (so held-out text can follow the training text)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[skip_tokens: skip_tokens + n_tokens]
    if len(ids) < n_tokens:
        raise KVProbeError(f"only {len(ids)} neutral tokens after {skip_tokens}; ask for fewer")
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def task_instances(template_path: str, n: int, seed: int) -> list[Any]:
    """``n`` pairs of the template generated with ``seed``: its polarity 2x2 pairs when the rules name a
    ``{trigger}`` (which the gated generator would leave unfilled), else gated pairs."""
    from kvprobe.tasks.gated import generate_instances, load_template
    from kvprobe.tasks.polarity import generate_polarity_instances, is_polarity

    template = load_template(template_path)
    return (generate_polarity_instances if is_polarity(template) else generate_instances)(template, n, seed)


def task_sequences(lm: HookableModel, template_path: str, n: int, seed: int) -> list[list[int]]:
    """Both prompts of ``n`` task pairs (:func:`task_instances`; full prompts, up to the answer prefix)."""
    from kvprobe.tasks.gated import tokenize_pair

    seqs = []
    for inst in task_instances(template_path, n, seed):
        pair = tokenize_pair(lm.tokenizer, inst, lm.has_chat_template)
        seqs += [pair.ids_old, pair.ids_new]
    return seqs


# -- training and persistence ------------------------------------------------------------------------------------

def train(acts: torch.Tensor, width: int, k: int, steps: int, batch: int, lr: float, seed: int) -> Any:
    """A sae-lens TopK SAE trained on ``acts [n, d]`` by ``SAETrainer`` (no wandb, constant lr then decayed to
    a tenth; seeded initialization and batches)."""
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=acts.shape[1], d_sae=width, k=k, device="cpu"))
        gen = torch.Generator().manual_seed(seed + 1)

        def batches() -> Iterator[torch.Tensor]:
            while True:
                yield acts[torch.randint(0, acts.shape[0], (batch,), generator=gen)]

        cfg = SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch, lr=lr,
                               lr_end=lr / 10, lr_decay_steps=steps // 5, device="cpu",
                               dead_feature_window=max(1, steps // 4), feature_sampling_window=max(1, steps // 2),
                               n_batches_for_norm_estimate=10)
        SAETrainer(cfg=cfg, sae=sae, data_provider=batches()).fit()
    return sae


def cache_dir(lm: HookableModel, spec: SAESpec) -> Path:
    """``<kvprobe cache>/sae/<model>-<site>-L<layer>-<key of spec and model fingerprint>``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(str(lm.name)).name)
    return cache_root() / "sae" / f"{name}-{spec.site}-L{spec.layer}-{spec.key(lm.fingerprint)}"


def training_activations(lm: HookableModel, spec: SAESpec) -> torch.Tensor:
    seqs = task_sequences(lm, spec.task_template, spec.n_task_prompts, spec.seed + 1000)
    seqs += neutral_sequences(lm.tokenizer, spec.n_neutral_tokens, spec.window)
    return torch.cat(collect(lm, seqs, spec.site, spec.layer, spec.skip_first))


def build(lm: HookableModel, spec: SAESpec, retrain: bool = False) -> tuple[Any, dict[str, Any]]:
    """The SAE of ``spec`` (sae-lens ``SAE.load_from_disk``) and its build info; trains and saves it with
    ``save_model`` when the cache lacks it (or ``retrain``)."""
    from sae_lens import SAE

    path = cache_dir(lm, spec)
    info_path = path / "kvprobe.json"
    if retrain or not info_path.exists():
        t0 = time.perf_counter()
        acts = training_activations(lm, spec)
        t1 = time.perf_counter()
        sae = train(acts, spec.width, spec.k, spec.steps, spec.batch, spec.lr, spec.seed)
        t2 = time.perf_counter()
        path.mkdir(parents=True, exist_ok=True)
        sae.save_model(str(path))
        info = {"spec": asdict(spec), "model": lm.name, "model_fingerprint": lm.fingerprint,
                "n_train_tokens": int(acts.shape[0]), "collect_seconds": round(t1 - t0, 2),
                "train_seconds": round(t2 - t1, 2),
                "weights_sha256": hashlib.sha256((path / "sae_weights.safetensors").read_bytes()).hexdigest()[:16]}
        info_path.write_text(json.dumps(info, indent=1))
    info = json.loads(info_path.read_text())
    sae = SAE.load_from_disk(str(path))
    sae.eval()
    return sae, {**info, "cached_at": path.name}


# -- evaluation ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def encode(sae: Any, acts: torch.Tensor) -> torch.Tensor:
    """Feature activations, on the SAE's device (the CPU, where it was trained), whatever device ``acts`` is on."""
    return sae.encode(acts.float().to(sae.W_dec.device))


@torch.no_grad()
def reconstruction(lm: HookableModel, sae: Any, site: str, layer: int, sequences: Sequence[Sequence[int]],
                   skip_first: int = 0) -> dict[str, Any]:
    """Explained variance and dead features over the sequences' activations, and mean next-token
    cross-entropy clean vs. with the site replaced by the SAE's reconstruction (and vs. zero-ablated, the
    scale a splice is judged against); the first ``skip_first`` tokens of each sequence are left out of the
    statistics and never replaced."""
    acts = torch.cat(collect(lm, sequences, site, layer, skip_first))
    z = encode(sae, acts)
    rec = sae.decode(z)
    ev = 1.0 - float(((acts - rec) ** 2).sum() / ((acts - acts.mean(0)) ** 2).sum())
    alive = (z > 0).any(0)

    device = next(lm.model.parameters()).device

    def ce(fn: Any) -> float:
        total, n = 0.0, 0
        with on_site(lm, site, layer, fn):
            for ids in sequences:
                x = torch.as_tensor([list(ids)], device=device)
                logits = lm.model(input_ids=x, use_cache=False).logits[0, :-1].float()
                total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
                n += x.shape[1] - 1
        return total / n

    def keep_first(new: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.cat([a[:, :skip_first], new[:, skip_first:].to(device=a.device, dtype=a.dtype)], dim=1)

    clean = ce(lambda a: None)
    spliced = ce(lambda a: keep_first(sae.decode(encode(sae, a)), a))
    zeroed = ce(lambda a: keep_first(torch.zeros_like(a), a))
    return {"explained_variance": ev, "fvu": 1.0 - ev, "n_tokens": int(acts.shape[0]),
            "dead_features": int((~alive).sum()), "dead_fraction": float((~alive).float().mean()),
            "l0": float((z > 0).float().sum(-1).mean()), "ce_clean": clean, "ce_spliced": spliced,
            "delta_ce": spliced - clean, "ce_zero_ablated": zeroed}


class _Stop(Exception):
    """Raised by a hook once the site's activations are read: the layers above are not needed."""


@torch.no_grad()
def count_alive(lm: HookableModel, sae: Any, site: str, layer: int, sequences: Sequence[Sequence[int]], skip_first: int = 0,
                batch: int = 8, progress: bool = False) -> dict[str, Any]:
    """Features that fire at least once over the sequences' tokens (the first ``skip_first`` of each left out),
    streamed in batches of equal-length sequences (nothing kept but the running mask); the forward pass stops
    at the site's layer."""
    alive = torch.zeros(int(sae.cfg.d_sae), dtype=torch.bool)
    device = next(lm.model.parameters()).device
    got: dict[str, torch.Tensor] = {}

    def keep(act: torch.Tensor) -> None:
        got["a"] = act.detach().float().cpu()
        raise _Stop

    from tqdm.auto import tqdm

    n = 0
    starts = tqdm(range(0, len(sequences), batch), desc=f"dead features ({site}, {sum(map(len, sequences))} tokens)",
                  unit="batch", disable=not progress, leave=False)
    with on_site(lm, site, layer, keep):
        for i in starts:
            chunk = [list(x) for x in sequences[i:i + batch]]
            groups: dict[int, list[list[int]]] = {}
            for ids in chunk:
                groups.setdefault(len(ids), []).append(ids)
            for ids in groups.values():
                try:
                    lm.model(input_ids=torch.as_tensor(ids, device=device), use_cache=False)
                except _Stop:
                    pass
                a = got.pop("a")[:, skip_first:].reshape(-1, site_dim(lm, site))
                alive |= (encode(sae, a) > 0).any(0)
                n += a.shape[0]
    return {"n_tokens": n, "dead_features": int((~alive).sum()), "dead_fraction": float((~alive).float().mean())}


@torch.no_grad()
def norm_matched_clamp(sae: Any, acts: torch.Tensor, features: Sequence[int], targets: torch.Tensor,
                       norms: torch.Tensor, seed: Sequence[int]) -> torch.Tensor:
    """``acts [n, d]`` moved along the listed features' decoder directions by exactly ``norms [n]`` (L2, per
    row): each feature's activation changes by the same amount, signed toward its ``targets`` (a random sign
    where it already sits there), and the amount is set so the decoded change has the given norm. The control
    of a top-k clamp: other features, the same perturbation size (a plain clamp of unrelated features to a
    conclusion mean barely moves them)."""
    idx = torch.as_tensor(list(features), dtype=torch.long)
    z = encode(sae, acts)[:, idx]
    sign = torch.sign(targets.to(z.dtype)[None, :] - z)
    rnd = torch.as_tensor(np.random.default_rng(list(seed)).choice([-1.0, 1.0], size=tuple(sign.shape)),
                          dtype=sign.dtype)
    sign = torch.where(sign == 0, rnd, sign)
    direction = sign @ sae.W_dec[idx].float()  # [n, d]
    scale = norms.to(direction.dtype) / direction.norm(dim=-1).clamp_min(1e-12)
    return acts + (direction * scale[:, None]).to(device=acts.device, dtype=acts.dtype)


def feature_aucs(feats: torch.Tensor, labels: Sequence[int]) -> np.ndarray:
    """ROC AUC of each feature column of ``feats [n, width]`` for binary ``labels`` (NaN where a feature is
    constant over the samples); sklearn's ``roc_auc_score``."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels)
    x = feats.numpy()
    out = np.full(x.shape[1], np.nan)
    varying = np.flatnonzero(x.max(0) > x.min(0))
    for j in varying:
        out[j] = roc_auc_score(y, x[:, j])
    return out


def top_tokens(tokenizer: Any, sequences: Sequence[Sequence[int]], acts: Sequence[torch.Tensor], sae: Any,
               features: Sequence[int], n: int = 5) -> dict[int, list[dict[str, Any]]]:
    """The ``n`` tokens where each feature fires hardest over the sequences (token, activation, 4 tokens of
    context before it)."""
    from kvprobe.patching.ranking import decode_token

    idx = torch.as_tensor(list(features), dtype=torch.long)
    vals, where = [], []
    for s, a in enumerate(acts):
        z = encode(sae, a)[:, idx]  # [seq, f]
        vals.append(z)
        where += [(s, t) for t in range(a.shape[0])]
    z = torch.cat(vals)
    out: dict[int, list[dict[str, Any]]] = {}
    for j, f in enumerate(features):
        top = torch.topk(z[:, j], min(n, z.shape[0]))
        out[int(f)] = [{"token": decode_token(tokenizer, sequences[where[i][0]][where[i][1]]),
                        "context": tokenizer.decode(list(sequences[where[i][0]][max(0, where[i][1] - 4):where[i][1]])),
                        "activation": round(float(v), 4)}
                       for v, i in zip(top.values.tolist(), top.indices.tolist()) if v > 0]
    return out


@torch.no_grad()
def clamp_acts(sae: Any, acts: torch.Tensor, features: Sequence[int], targets: torch.Tensor) -> torch.Tensor:
    """``acts [n, d]`` with the listed features' activations set to ``targets`` (one per feature): the
    decoder's change is added to the original activations, so the SAE's error term stays in place."""
    if not len(features):
        return acts.clone()
    idx = torch.as_tensor(list(features), dtype=torch.long)
    z = encode(sae, acts)[:, idx]
    delta = (targets.to(z.dtype)[None, :] - z) @ sae.W_dec[idx].float()
    return acts + delta.to(device=acts.device, dtype=acts.dtype)
