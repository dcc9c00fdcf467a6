"""Exact identities of the KV core on tiny random models of every family."""

import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv import KVState, prefill, read_logits

TOL = 1e-4


def _ids(n, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


def test_readout_over_prefill_equals_full_forward(tiny_lm):
    ids = _ids(40)  # longer than the tiny Gemma sliding window (8): the mask, not the cache, enforces it
    full = tiny_lm.model(ids[None]).logits[0, -1]
    state = prefill(tiny_lm, ids[:-1])
    got = read_logits(tiny_lm, state, ids[-1:])[0]
    assert (got - full).abs().max() < TOL


def test_incremental_prefill_equals_one_prefill(tiny_lm):
    ids = _ids(30, 1)
    whole = prefill(tiny_lm, ids)
    parts = prefill(tiny_lm, ids[12:], prior=prefill(tiny_lm, ids[:12]))
    assert torch.equal(whole.positions, parts.positions)
    assert whole.max_abs_diff(parts) < TOL


def test_full_downstream_mix_equals_oracle_and_empty_mix_is_stale(tiny_lm):
    old, new = _ids(36, 2), _ids(36, 2).clone()
    new[10:12] = _ids(2, 3)  # the "field"
    s_old, s_new = prefill(tiny_lm, old[:-1]), prefill(tiny_lm, new[:-1])
    # Slots before the field are identical in both prefills (deviation exactly zero).
    assert s_old.slice(0, 10).max_abs_diff(s_new.slice(0, 10)) == 0.0
    full_down = s_old.mix(s_new, range(10, s_old.length))
    lg = read_logits(tiny_lm, [full_down, s_new, s_old.mix(s_new, []), s_old], old[-1:])
    assert (lg[0] - lg[1]).abs().max() < TOL
    assert (lg[2] - lg[3]).abs().max() == 0.0


def test_batched_readout_equals_one_by_one(tiny_lm):
    ids = _ids(24, 4)
    base = prefill(tiny_lm, ids[:-1])
    donor = prefill(tiny_lm, _ids(23, 5))
    states = [base.mix(donor, [p]) for p in range(0, 20, 3)]
    batched = read_logits(tiny_lm, states, ids[-1:], batch_size=4)
    single = torch.cat([read_logits(tiny_lm, s, ids[-1:]) for s in states])
    assert (batched - single).abs().max() < TOL


def test_mix_is_write_once_and_shares_untouched_layers(tiny_lm):
    a, b = prefill(tiny_lm, _ids(12, 6)), prefill(tiny_lm, _ids(12, 7))
    before = a.clone()
    mixed = a.mix(b, [3, 4], layers=[1])
    assert a.max_abs_diff(before) == 0.0
    assert mixed.keys[0] is a.keys[0] and mixed.keys[1] is not a.keys[1]
    assert torch.equal(mixed.keys[1][:, :, 3:5], b.keys[1][:, :, 3:5])
    assert torch.equal(mixed.keys[1][:, :, :3], a.keys[1][:, :, :3])


def test_mix_refuses_mismatched_states(tiny_lm):
    a, b = prefill(tiny_lm, _ids(12, 6)), prefill(tiny_lm, _ids(10, 7))
    with pytest.raises(KVProbeError, match="differ in shape"):
        a.mix(b, [1])
    shifted = prefill(tiny_lm, _ids(12, 7), positions=range(5, 17))
    with pytest.raises(KVProbeError, match="different positions"):
        a.mix(shifted, [1])
    with pytest.raises(KVProbeError, match="slot indices"):
        a.mix(a, [99])


def test_from_cache_refuses_truncated_sliding_cache():
    from transformers.cache_utils import DynamicCache

    from kvprobe.models.tiny import tiny_model

    model = tiny_model("gemma3")
    out = model(_ids(20)[None], cache=DynamicCache(config=model.config), use_cache=True)
    with pytest.raises(KVProbeError, match="window-truncated"):
        KVState.from_cache(out.cache)
