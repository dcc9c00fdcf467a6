"""The shared-base sweep engine gives the reference (materialized mix) numbers on every family."""

import torch

from kvprobe.kv import prefill
from kvprobe.patching.sweep import KVPatch, kv_sweep


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_shared_engine_matches_reference(tiny_lm):
    old = _ids(30, 0)
    new = old.clone()
    new[5:7] = _ids(2, 1)
    base, donor = prefill(tiny_lm, old[:-2]), prefill(tiny_lm, new[:-2])
    cells = [KVPatch.of([]), KVPatch.of([9]), KVPatch.of([5, 6], [1]), KVPatch.of(range(5, 28)),
             KVPatch.of([3, 20, 21], [0, 3]), KVPatch.of([27], [2])]
    ref = kv_sweep(tiny_lm, base, donor, cells, old[-2:].tolist(), engine="mix")
    fast = kv_sweep(tiny_lm, base, donor, cells, old[-2:].tolist(), engine="shared", batch_size=4)
    assert (ref - fast).abs().max() < 1e-4
    # The sweep really patches: the full-downstream cell differs from the empty cell.
    assert (ref[3] - ref[0]).abs().max() > 1e-3


def test_shared_engine_across_chunks_and_batch_one_donors(tiny_lm):
    import pytest

    old = _ids(20, 2)
    new = old.clone()
    new[3:5] = _ids(2, 3)
    base, donor = prefill(tiny_lm, old[:-2]), prefill(tiny_lm, new[:-2])
    # More cells than one chunk of the shared engine (64): later chunks must read the same donor.
    cells = [KVPatch.of([i % 18], [i % 4]) for i in range(70)]
    ref = kv_sweep(tiny_lm, base, donor, cells, old[-2:].tolist(), engine="mix")
    fast = kv_sweep(tiny_lm, base, donor, cells, old[-2:].tolist(), engine="shared")
    assert (ref - fast).abs().max() < 1e-4
    two = prefill(tiny_lm, torch.stack([new[:-2], old[:-2]]))
    with pytest.raises(ValueError, match="batch-1 base and donor"):
        kv_sweep(tiny_lm, base, two, cells[:2], old[-2:].tolist())


def test_shared_engine_applies_gemma2_softcapping():
    from tests.conftest import as_lm
    from kvprobe.models.tiny import tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("gemma2")
    cfg.attn_logit_softcapping = 0.5  # strong enough that ignoring it changes the logits
    torch.manual_seed(0)
    lm = as_lm(AutoModelForCausalLM.from_config(cfg).eval())
    ids = _ids(20, 3)
    base, donor = prefill(lm, ids[:-1]), prefill(lm, _ids(19, 4))
    cells = [KVPatch.of([2, 7]), KVPatch.of([10], [1])]
    ref = kv_sweep(lm, base, donor, cells, ids[-1:].tolist(), engine="mix")
    fast = kv_sweep(lm, base, donor, cells, ids[-1:].tolist(), engine="shared")
    assert (ref - fast).abs().max() < 1e-4
