"""Hook-based sites: identity patches reproduce the clean run; patches really change the run."""

import torch

from kvprobe.kv import prefill
from kvprobe.patching.hooks import capture, run_patched
from kvprobe.patching.sites import Site


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_identity_patch_equals_clean_run(tiny_lm):
    ids = _ids(16, 0)
    sites = [Site("resid_pre", 1, 5), Site("resid_post", 2, 7), Site("attn_out", 1, 3), Site("mlp_out", 0, 9),
             Site("attn_out", 2, 4, head=1)]
    acts = capture(tiny_lm, ids, sites)
    clean_state, clean_logits = run_patched(tiny_lm, ids, {})
    state, logits = run_patched(tiny_lm, ids, acts)
    assert (logits - clean_logits).abs().max() < 1e-5
    assert state.max_abs_diff(clean_state) < 1e-5


def test_resid_patch_from_donor_changes_only_downstream_kv(tiny_lm):
    clean, donor = _ids(16, 1), _ids(16, 2)
    site = Site("resid_post", 1, 6)
    act = capture(tiny_lm, donor, [site])[site]
    clean_state = prefill(tiny_lm, clean)
    patched, _ = run_patched(tiny_lm, clean, {site: act})
    # Layer 0 and 1 KV are computed before the patched residual is read: unchanged. Later layers differ at >= 6.
    assert patched.keys[1].sub(clean_state.keys[1]).abs().max() == 0
    later = patched.keys[2] - clean_state.keys[2]
    assert later[:, :, :6].abs().max() == 0 and later[:, :, 6:].abs().max() > 1e-4


def test_head_site_has_head_dim_width(tiny_lm):
    site = Site("attn_out", 0, 2, head=1)
    act = capture(tiny_lm, _ids(8, 3), [site])[site]
    assert act.shape[-1] == tiny_lm.spec.head_dim
