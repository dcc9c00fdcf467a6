"""AtP* (attribution patching with the QK fix) against the exact engine, and the exact engine's new options."""

import pytest
import torch

from kvprobe.kv import prefill
from kvprobe.models.tiny import tiny_model
from kvprobe.patching.atp import _layer_estimates, _Record, atp_kv, compare, rank_then_verify
from kvprobe.patching.shared_engine import shared_kv_sweep
from kvprobe.patching.sweep import KVPatch, kv_sweep
from tests.conftest import as_lm


def _instance(lm, n=30, ctx=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 512, (n,), generator=g)
    new = old.clone()
    new[4:9] = torch.randint(0, 512, (5,), generator=g)
    return old, prefill(lm, old[:ctx]), prefill(lm, new[:ctx]), old[ctx:].tolist()


def test_token_ids_and_layer_sharing_give_the_reference_numbers(tiny_lm):
    old, base, donor, suffix = _instance(tiny_lm)
    cells = [KVPatch.of([]), KVPatch.of([5], [3]), KVPatch.of([4, 20], [1, 2]), KVPatch.of([7]), KVPatch.of([6], [0])]
    ref = kv_sweep(tiny_lm, base, donor, cells, suffix, engine="mix")
    cols = [3, 11]
    assert (kv_sweep(tiny_lm, base, donor, cells, suffix, token_ids=cols) - ref[:, cols]).abs().max() < 1e-4
    no_share = shared_kv_sweep(tiny_lm, base, donor, cells, suffix, batch_size=2, share_layers=False)
    assert (no_share - ref).abs().max() < 1e-4
    shared = shared_kv_sweep(tiny_lm, base, donor, cells, suffix, batch_size=2)  # groups by first layer, chunked
    assert (shared - ref).abs().max() < 1e-4


def _exact_dz_sum(q, k, v, kd, vd, grad, p, scaling):
    """sum_{h,t} grad . (z' - z) by recomputing attention with slot p's key and value replaced."""
    def attend(keys, values):
        probs = torch.softmax(torch.einsum("htd,hsd->hts", q, keys) * scaling, dim=-1)
        return torch.einsum("hts,hsd->htd", probs, values)
    k2, v2 = k.clone(), v.clone()
    k2[:, p], v2[:, p] = kd[:, p], vd[:, p]
    return float((grad * (attend(k2, v2) - attend(k, v))).sum())


@pytest.mark.parametrize("key_scale", [1.0, 30.0])  # 30: the patched key saturates the softmax
def test_qk_fix_is_the_exact_attention_change(key_scale):
    g = torch.Generator().manual_seed(1)
    h, t, s, d = 4, 2, 9, 8
    q, k, v = (torch.randn(h, x, d, generator=g, dtype=torch.float64) for x in (t, s + t, s + t))
    kd = torch.randn(h, s, d, generator=g, dtype=torch.float64) * key_scale
    vd = torch.randn(h, s, d, generator=g, dtype=torch.float64)
    grad = torch.randn(h, t, d, generator=g, dtype=torch.float64)
    scaling = d ** -0.5
    scores = torch.einsum("htd,hsd->hts", q, k) * scaling
    out = torch.einsum("hts,hsd->htd", torch.softmax(scores, -1), v)
    rec = _Record(q, scores, torch.zeros(t, s + t, dtype=torch.float64), out, None, scaling, None)
    est = _layer_estimates(rec, grad, v, kd, vd, s)
    exact = torch.tensor([_exact_dz_sum(q, k, v, torch.cat([kd, k[:, s:]], 1), torch.cat([vd, v[:, s:]], 1), grad, p,
                                        scaling) for p in range(s)], dtype=torch.float64)
    assert (est - exact).abs().max() < 1e-10


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_atp_ranks_cells_like_the_exact_engine(family):
    lm = as_lm(tiny_model(family))
    old, base, donor, suffix = _instance(lm)
    cells = [KVPatch.of([p], [layer]) for layer in range(lm.spec.n_layers) for p in range(base.length)]
    logits = kv_sweep(lm, base, donor, [KVPatch.of([])] + cells, suffix, token_ids=[5, 7]).double()
    ld = logits[:, 0] - logits[:, 1]
    scores = atp_kv(lm, base, donor, suffix, 5, 7)
    assert abs(scores.base_metric - float(ld[0])) < 1e-4
    est = scores.cells(cells)
    exact = ld[1:] - ld[0]
    agree = compare(est, exact, k=20)
    assert agree["spearman"] > 0.9 and agree["recall_at_k"] >= 0.8
    assert (est - exact).abs().max() < 0.1 * exact.abs().max()  # first order: small against the largest effect
    # slots where base and donor agree (before the edit) have no effect, estimated or exact
    assert est[[i for i, c in enumerate(cells) if c.positions[0] < 4]].abs().max() < 1e-6
    same = atp_kv(lm, base, base, suffix, 5, 7)
    assert same.estimates.abs().max() < 1e-6  # recomputed fp32 scores: float error only


def test_rank_then_verify_measures_the_atp_top_cells_exactly():
    lm = as_lm(tiny_model("llama"))
    old, base, donor, suffix = _instance(lm)
    cells = [KVPatch.of([p], [layer]) for layer in range(lm.spec.n_layers) for p in range(base.length)]
    got = rank_then_verify(lm, base, donor, cells, suffix, 5, 7, top=6)
    assert len(got.top) == 6 and len(got.exact) == 6
    ref = kv_sweep(lm, base, donor, [KVPatch.of([])] + [cells[i] for i in got.top], suffix, engine="mix").double()
    ref_ld = ref[:, 5] - ref[:, 7]
    assert (got.exact - (ref_ld[1:] - ref_ld[0])).abs().max() < 1e-4
    assert got.estimates[got.top].abs().tolist() == sorted(got.estimates[got.top].abs().tolist(), reverse=True)


def test_compare_lists_false_negatives():
    exact = torch.tensor([5.0, -4.0, 3.0, 0.1, 0.0])
    est = torch.tensor([4.0, 0.0, 2.5, 0.2, 0.05])
    got = compare(est, exact, k=2, labels=list("abcde"))
    assert got["recall_at_k"] == 0.5
    assert got["false_negatives"] == [{"cell": "b", "exact_rank": 2, "exact": -4.0, "atp": 0.0, "atp_rank": 5}]


def test_atp_position_ranking_matches_the_exact_ranking_at_the_top(tiny_text_dir, template):
    from kvprobe.models.loading import load_model
    from kvprobe.patching.atp import atp_position_ranking
    from kvprobe.patching.pairs import measure, prefill_pair
    from kvprobe.patching.ranking import rank_downstream
    from kvprobe.tasks.gated import generate_instances, tokenize_pair

    lm = load_model(str(tiny_text_dir), device="cpu", dtype="float32")
    inst = generate_instances(template, 1, seed=0)[0]
    pp = prefill_pair(lm, tokenize_pair(lm.tokenizer, inst, False))
    anchor, _, _ = measure(lm, pp, {})
    exact = rank_downstream(lm, pp, anchor)
    fast = atp_position_ranking(lm, pp, anchor, verify_top=8)
    assert sorted(fast.positions) == sorted(exact.positions)
    by_slot = exact.effect_by_slot()
    for slot, effect in zip(fast.positions[:8], fast.effects[:8]):  # verified: exact recoveries
        assert abs(effect - by_slot[slot]) < 1e-4
    assert fast.positions[0] == exact.positions[0]
