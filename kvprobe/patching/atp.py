"""Attribution patching of KV cells with the AtP* QK fix: every (layer, slot) cell from one forward + backward.

Method (Kramár et al. 2024, "AtP*: An efficient and scalable method for localizing LLM behaviour to
components", Sections 2-3.1): the effect of a patch on a metric m is estimated by a first-order expansion
around the base run. Plain AtP linearizes through the attention softmax, which fails badly when a patched key
saturates or empties a query's attention. AtP*'s QK fix computes the attention pattern *exactly* with the
patched key and linearizes only after the attention output. For a KV cell (slot p, layer l) and each query
token t of the suffix and query head h (reading kv head h // group):

    p'      = softmax of the base scores with score p replaced by q_t . k'_p (same scale, soft-cap and mask)
    dz_t,h  = sum_s (p'_s - p_s) v_s + p'_p (v'_p - v_p)           (exact change of that head's output)
    dm      ~ sum_{t,h} dm/dz_t,h . dz_t,h                          (linear after the attention output)

where the gradients dm/dz come from one backward pass of the suffix over the base cache. Here m is the
decision's logit difference (``target_id`` minus ``other_id`` at the last suffix token). A cell patching
several slots or layers is scored as the sum of its (layer, slot) terms: interactions between patched slots
are not modelled. Not implemented: AtP*'s GradDrop (the paper's fix for cancellation across layers), which
matters for patches of the residual stream, not for one layer's K/V read by the suffix alone.

Where our setting differs from the paper: the paper's nodes are attention heads' and MLP neurons' outputs
over a whole prompt; ours are the cached K/V of one context slot at one layer, read by the query suffix
(kvprobe's exact engine computes the same cells exactly, which is what :func:`compare` checks against).

Use: :func:`rank_then_verify` ranks all cells with AtP* and re-measures the top ones exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvprobe.backends import HookableModel
from kvprobe.kv.state import KVState

ATP_ATTENTION = "kvprobe_atp"


@dataclass
class _Record:
    query: torch.Tensor  # [Hq, T, D] (post-RoPE)
    scores: torch.Tensor  # [Hq, T, S+T] masked, soft-capped
    mask: torch.Tensor  # [T, S+T] additive (0 or -inf)
    output: torch.Tensor  # [Hq, T, D] attention output per head (before o_proj)
    probe: torch.Tensor  # zero leaf added to the output: its gradient is dm/dz
    scaling: float
    softcap: float | None


_RECORDS: dict[int, _Record] = {}


def _atp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Eager attention that keeps what AtP* needs and adds a zero leaf to the output for its gradient."""
    n, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    scaling = d ** -0.5 if scaling is None else scaling
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    scores = torch.matmul(query, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    add = torch.zeros(t, k.shape[-2], dtype=scores.dtype, device=scores.device)
    if attention_mask is not None:
        m = attention_mask[0, 0, :, : k.shape[-2]]
        add = torch.where(m, 0.0, float("-inf")).to(scores.dtype) if m.dtype == torch.bool else \
            torch.where(m > torch.finfo(m.dtype).min / 2, 0.0, float("-inf")).to(scores.dtype)
    scores = scores + add
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.matmul(probs, v)
    probe = torch.zeros_like(out, requires_grad=True)
    out = out + probe
    _RECORDS[module.layer_idx] = _Record(query[0].detach(), scores[0].detach(), add, out[0].detach(), probe,
                                         float(scaling), softcap)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def _recording(model: Any):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvprobe.patching.shared_engine import _attention_implementation

    ALL_ATTENTION_FUNCTIONS.register(ATP_ATTENTION, _atp_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATP_ATTENTION, sdpa_mask)
    _RECORDS.clear()
    try:
        with _attention_implementation(model, ATP_ATTENTION):
            yield _RECORDS
    finally:
        _RECORDS.clear()


@dataclass
class AtPScores:
    """AtP* estimates of the metric change for every (layer, context slot) KV cell, plus the base metric."""

    estimates: torch.Tensor  # [n_layers, slots] float64
    base_metric: float

    def cell(self, positions: Sequence[int], layers: Sequence[int] | None = None) -> float:
        rows = self.estimates if layers is None else self.estimates[list(layers)]
        return float(rows[:, list(positions)].sum()) if len(positions) else 0.0

    def cells(self, cells: Sequence[Any]) -> torch.Tensor:
        """Estimates for kvprobe :class:`KVPatch` cells (sum of their (layer, slot) terms), float64."""
        return torch.tensor([self.cell(c.positions, c.layers) for c in cells], dtype=torch.float64)


def atp_kv(lm: HookableModel, base: KVState, donor: KVState, suffix: Sequence[int], target_id: int,
           other_id: int) -> AtPScores:
    """AtP* estimates of patching the donor's K/V into ``base`` at each (layer, slot): one forward and one
    backward of ``suffix`` over the base cache; the metric is ``logit[target_id] - logit[other_id]``."""
    from kvprobe.backends.hf import _ids_tensor

    if base.batch != 1 or donor.batch != 1:
        raise ValueError("atp_kv takes batch-1 base and donor states")
    model = lm.model
    device = next(model.parameters()).device
    ids = _ids_tensor(list(suffix), device)
    pos = torch.arange(base.next_position, base.next_position + ids.shape[1]).unsqueeze(0).to(device)
    with torch.enable_grad(), _recording(model) as rec:
        out = model(input_ids=ids, position_ids=pos, cache=base.to_cache(), use_cache=True, logits_to_keep=1)
        metric = out.logits[0, -1, target_id] - out.logits[0, -1, other_id]
        layers = sorted(rec)
        grads = torch.autograd.grad(metric, [rec[l].probe for l in layers])
        records = [rec[l] for l in layers]
    s = base.length
    est = torch.zeros(base.n_layers, s, dtype=torch.float64)
    for layer, r, grad in zip(layers, records, grads):
        est[layer] = _layer_estimates(r, grad[0].double(), base.values[layer][0], donor.keys[layer][0],
                                      donor.values[layer][0], s)
    return AtPScores(est, float(metric.detach()))


def _layer_estimates(r: _Record, grad: torch.Tensor, base_v: torch.Tensor, donor_k: torch.Tensor,
                     donor_v: torch.Tensor, s: int) -> torch.Tensor:
    """sum_{t,h} grad . dz for every context slot of one layer (float64)."""
    hq = r.query.shape[0]
    g = hq // base_v.shape[0]
    q = r.query.double()
    vb = base_v.double().repeat_interleave(g, dim=0)  # [Hq, S(+T), D]
    kd = donor_k.double().repeat_interleave(g, dim=0)[:, :s]
    vd = donor_v.double().repeat_interleave(g, dim=0)[:, :s]
    scores = r.scores.double()  # [Hq, T, S+T]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [Hq, T, 1]
    a = torch.exp(scores[..., :s] - lse)  # base attention to each context slot
    new = torch.einsum("htd,hsd->hts", q, kd) * r.scaling
    if r.softcap is not None:
        new = torch.tanh(new / r.softcap) * r.softcap
    new = new + r.mask[:, :s].double()
    e_new = torch.exp(new - lse)
    # log of the new normalizer relative to the old: log(1 - a_p + exp(s'_p - L)), in float64.
    ratio = 1.0 / (1.0 - a + e_new)  # exp(L - L'): how every other slot's weight scales
    a_new = e_new * ratio
    gz = torch.einsum("htd,htd->ht", grad, r.output.double())[..., None]  # grad . z
    g_vb = torch.einsum("htd,hsd->hts", grad, vb[:, :s])
    g_vd = torch.einsum("htd,hsd->hts", grad, vd)
    # dz = (z - a v_p)(ratio - 1) + a' v'_p - a v_p
    terms = (gz - a * g_vb) * (ratio - 1.0) + a_new * g_vd - a * g_vb
    return terms.sum(dim=(0, 1))


# -- validation against the exact engine, and rank-then-verify ---------------------------------------------------

def compare(estimates: torch.Tensor, exact: torch.Tensor, k: int = 20,
            labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Agreement of AtP* estimates with exact cell effects: Spearman rho, and top-``k`` recall by |effect|
    with the exact top-``k`` cells AtP* missed (false negatives: label, exact rank and value, AtP* rank)."""
    from scipy.stats import spearmanr

    est, ex = estimates.double().numpy(), exact.double().numpy()
    rho = float(spearmanr(est, ex).statistic)
    k = min(k, len(ex))
    exact_order = np.argsort(-np.abs(ex), kind="stable")
    atp_order = np.argsort(-np.abs(est), kind="stable")
    atp_rank = np.empty(len(est), dtype=np.int64)
    atp_rank[atp_order] = np.arange(len(est))
    top_exact, top_atp = set(exact_order[:k].tolist()), set(atp_order[:k].tolist())
    missed = [i for i in exact_order[:k].tolist() if i not in top_atp]
    name = (lambda i: labels[i]) if labels is not None else str
    return {"spearman": rho, "k": k, "recall_at_k": len(top_exact & top_atp) / k if k else float("nan"),
            "false_negatives": [{"cell": name(i), "exact_rank": int(np.where(exact_order == i)[0][0]) + 1,
                                 "exact": float(ex[i]), "atp": float(est[i]), "atp_rank": int(atp_rank[i]) + 1}
                                for i in missed]}


@dataclass
class Verified:
    """AtP* estimates of every cell, and the exact effects of the ``top`` cells AtP* ranked highest."""

    estimates: torch.Tensor  # [len(cells)] AtP* change of the metric
    top: list[int]  # indices of cells, highest |estimate| first
    exact: torch.Tensor  # [len(top)] exact change of the metric of those cells
    base_metric: float


def rank_then_verify(lm: HookableModel, base: KVState, donor: KVState, cells: Sequence[Any], suffix: Sequence[int],
                     target_id: int, other_id: int, top: int = 20, batch_size: int = 64) -> Verified:
    """Rank ``cells`` by AtP* (one forward + backward) and measure the ``top`` of them exactly (one shared-base
    sweep): the cheap way for suffix / specificity probes to find their strongest cells in a large grid."""
    from kvprobe.patching.sweep import kv_sweep

    scores = atp_kv(lm, base, donor, suffix, target_id, other_id)
    est = scores.cells(cells)
    order = torch.argsort(est.abs(), descending=True, stable=True)[:top].tolist()
    from kvprobe.patching.sweep import KVPatch

    logits = kv_sweep(lm, base, donor, [KVPatch.of([])] + [cells[i] for i in order], suffix,
                      batch_size=batch_size, token_ids=[target_id, other_id]).double()
    ld = logits[:, 0] - logits[:, 1]
    return Verified(est, order, ld[1:] - ld[0], float(ld[0]))


def atp_position_ranking(lm: HookableModel, pp: Any, anchor: Any, verify_top: int = 16, batch_size: int = 64,
                         candidates: Sequence[int] | None = None) -> Any:
    """A drop-in for :func:`kvprobe.patching.ranking.rank_downstream` (oracle K/V into the stale cache, one slot on
    every layer): candidates ordered by AtP* (the sum of a slot's per-layer terms), the ``verify_top`` of them
    re-measured exactly and re-ordered by their exact recovery. Effects beyond ``verify_top`` are AtP* estimates
    (as recovery). For the suffix / specificity probes on long contexts: one backward pass plus one small exact
    sweep instead of a sweep over every slot."""
    from kvprobe.patching.ranking import PositionRanking
    from kvprobe.patching.sweep import KVPatch

    slots = list(pp.downstream_slots if candidates is None else candidates)
    cells = [KVPatch.of([p]) for p in slots]
    got = rank_then_verify(lm, pp.old, pp.new, cells, pp.suffix, pp.pair.new_action_id, pp.pair.old_action_id,
                           top=verify_top, batch_size=batch_size)
    flip = anchor.flip
    exact = {got.top[i]: float(got.exact[i]) / flip for i in range(len(got.top))}
    verified = sorted(exact, key=lambda i: exact[i], reverse=True)
    rest = [i for i in torch.argsort(got.estimates, descending=True, stable=True).tolist() if i not in exact]
    return PositionRanking([slots[i] for i in verified + rest],
                           [exact[i] for i in verified] + [float(got.estimates[i]) / flip for i in rest])
