"""The probe layer: one Case, and the labelled sweep checked path by path against naive references."""

import pytest
import torch

from kvprobe.kv.readout import read_logits
from kvprobe.metrics import logit_diff
from kvprobe.models.loading import load_model
from kvprobe.patching.hooks import capture, run_patched
from kvprobe.patching.sites import Site
from kvprobe.probes import KV, BlockOut, Case, HeadOut, Joint, materialize, sweep, sweep_logits
from kvprobe.tasks.gated import generate_instances


@pytest.fixture(scope="module")
def case_lm(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir))
    inst = generate_instances(template, 1, seed=0)[0]
    return lm, inst, Case.build(lm, inst, lambda pp: {"field_only": pp.field_only()})


def _ld(case, logits):
    return logit_diff(logits, case.pair.new_action_id, case.pair.old_action_id).double()


def test_case_row_and_inclusion(case_lm):
    lm, inst, case = case_lm
    row = case.row(inst, min_flip=0.0)
    assert row["index"] == inst.index and row["field_slots"] == case.pair.field_slots
    assert row["n_downstream"] == len(case.pp.downstream_slots) and "field_only" in row and "field_only_ld" in row
    assert case.included(-1e9) and not case.included(abs(case.anchor.flip) + 1.0)
    assert row["included"] == case.included(0.0)


def test_kv_paths_match_materialized_reference(case_lm):
    lm, _, case = case_lm
    pp = case.pp
    down = pp.downstream_slots
    patches = {"field": KV.of(pp.field_slots), "notes_L1": KV.of(down[:3], [1]),
               "head1": KV.of(down[-4:], [0, 2], [1]), "head0_all": KV.of(down, None, [0]),
               "joint": Joint((KV.of(pp.field_slots, [0], [0]), KV.of(down[:2], [3], [1]))),
               "empty": KV.of([])}
    got = sweep_logits(lm, case, patches, batch_size=4)
    assert list(got) == list(patches)  # labels come back in the order asked
    for label, patch in patches.items():
        ref = read_logits(lm, materialize(case, patch), pp.suffix)[0]
        assert torch.allclose(got[label], ref, atol=2e-4), label
    assert torch.allclose(got["empty"], read_logits(lm, pp.old, pp.suffix)[0], atol=2e-4)
    # The recovery metric is the anchors' normalization of the logit difference.
    rec = sweep(lm, case, patches, batch_size=4)
    lds = sweep(lm, case, patches, metric="logit_diff", batch_size=4)
    for label in patches:
        assert rec[label] == pytest.approx((lds[label] - case.anchor.stale_ld) / case.anchor.flip, abs=1e-9)
    dec = sweep(lm, case, patches, metric="decision", batch_size=4)
    assert all(dec[k] == float((lds[k] > 0) == (case.anchor.oracle_ld > 0)) for k in patches)


def test_knockout_style_base_and_extra_source(case_lm):
    lm, _, case = case_lm
    pp = case.pp
    assert materialize(case, KV.of([]), base="oracle") is pp.new  # an empty patch is the base itself
    got = sweep_logits(lm, case, {"ko": KV.of(pp.downstream_slots[:2], source="donor")}, base="oracle",
                       sources={"donor": pp.old})
    ref = read_logits(lm, pp.new.mix(pp.old, pp.downstream_slots[:2]), pp.suffix)[0]
    assert torch.allclose(got["ko"], ref, atol=2e-4)
    with pytest.raises(ValueError, match="unknown source"):
        sweep(lm, case, {"x": KV.of([1], source="nope")})


def test_head_output_patch_matches_hooked_forward(case_lm):
    lm, _, case = case_lm
    pp, spec = case.pp, lm.spec
    last = len(pp.suffix) - 1
    heads = [(1, 2), (3, 0)]
    got = sweep_logits(lm, case, {"two": HeadOut.of(heads), "one": HeadOut.of(heads[:1]),
                                  "all": HeadOut.of([(a, b) for a in range(spec.n_layers) for b in range(spec.n_heads)])})
    sites = [Site("attn_out", a, last, b) for a, b in heads]
    donor = capture(lm, pp.suffix, sites, prior=pp.new)
    _, ref = run_patched(lm, pp.suffix, donor, prior=pp.old)
    assert torch.allclose(got["two"], ref[0], atol=2e-4)
    _, ref1 = run_patched(lm, pp.suffix, {sites[0]: donor[sites[0]]}, prior=pp.old)
    assert torch.allclose(got["one"], ref1[0], atol=2e-4)
    # Identity: every head's output from the oracle rebuilds the oracle's decision token.
    assert torch.allclose(got["all"], read_logits(lm, pp.new, pp.suffix)[0], atol=2e-4)


def test_block_output_patch_matches_full_context_forward(case_lm):
    lm, _, case = case_lm
    pp = case.pp
    notes = pp.downstream_slots[2:5]
    ctx_old = pp.pair.ids_old[: pp.context_length]
    ctx_new = pp.pair.ids_new[: pp.context_length]
    patches = {f"{kind}:{layer}": BlockOut(kind, layer, tuple(notes)) for kind in ("attn_out", "mlp_out")
               for layer in (0, 2)}
    got = sweep_logits(lm, case, patches, batch_size=3)
    for label, p in patches.items():
        donor = capture(lm, ctx_new, [Site(p.kind, p.layer)])[Site(p.kind, p.layer)]
        state, _ = run_patched(lm, ctx_old, {Site(p.kind, p.layer, s): donor[:, s] for s in notes})
        ref = read_logits(lm, state, pp.suffix)[0]
        assert torch.allclose(got[label], ref, atol=2e-4), label
    # Identity: a block patched from the base itself changes nothing.
    same = sweep_logits(lm, case, {"self": BlockOut("attn_out", 1, tuple(notes), source="stale")})
    assert torch.allclose(same["self"], read_logits(lm, pp.old, pp.suffix)[0], atol=2e-4)


def test_actions_only_matches_full_logits_on_every_path(case_lm):
    lm, _, case = case_lm
    pp = case.pp
    down = pp.downstream_slots
    patches = {"kv": KV.of(down[:3]), "head": KV.of(down[:3], [1], [0]),
               "joint": Joint((KV.of(pp.field_slots, [0]), KV.of(down[:2], [2], [1]))),
               "read": HeadOut.of([(2, 1), (3, 3)]), "block": BlockOut("mlp_out", 1, tuple(down[:2]))}
    full = sweep(lm, case, patches, metric="logit_diff")
    fast = sweep(lm, case, patches, metric="logit_diff", actions_only=True)
    for label in patches:
        assert fast[label] == pytest.approx(full[label], abs=1e-4), label


def test_directional_patch_matches_its_references(case_lm):
    from kvprobe.features.directions import NoteSite, site_acts
    from kvprobe.kv.state import KVState
    from kvprobe.probes import Directional

    lm, _, case = case_lm
    pp = case.pp
    slot = pp.downstream_slots[3]
    v, k, resid = NoteSite("v", 2, 1), NoteSite("k", 1, 0), NoteSite("resid", 2)
    diff = {s: (site_acts(lm, case, s, [slot], "oracle") - site_acts(lm, case, s, [slot], "stale"))[0]
            for s in (v, k, resid)}
    other = torch.zeros_like(diff[v])
    other[0], other[1] = diff[v][1], -diff[v][0]  # orthogonal to the V difference
    patches = {f"{s.kind}:along": Directional(s, (slot,), diff[s]) for s in (v, k, resid)}
    patches["v:orthogonal"] = Directional(v, (slot,), other)
    got = sweep_logits(lm, case, patches, batch_size=2)
    # Along the source-minus-base difference the component carries the whole difference: the V (or K)
    # entry of that head at that slot becomes the oracle's, i.e. a per-head KV patch of V (or K) alone.
    old, new = pp.old, pp.new
    values = list(old.values)
    values[2] = values[2].clone()
    values[2][:, 1, slot] = new.values[2][:, 1, slot]
    keys = list(old.keys)
    keys[1] = keys[1].clone()
    keys[1][:, 0, slot] = new.keys[1][:, 0, slot]
    refs = {"v:along": KVState(old.keys, tuple(values), old.positions),
            "k:along": KVState(tuple(keys), old.values, old.positions)}
    for label, state in refs.items():
        assert torch.allclose(got[label], read_logits(lm, state, pp.suffix)[0], atol=2e-4), label
    # The residual along its own difference is the full residual patch at that slot (one layer).
    donor = capture(lm, pp.pair.ids_new[: pp.context_length], [Site("resid_post", 2)])[Site("resid_post", 2)]
    state, _ = run_patched(lm, pp.pair.ids_old[: pp.context_length], {Site("resid_post", 2, slot): donor[:, slot]})
    assert torch.allclose(got["resid:along"], read_logits(lm, state, pp.suffix)[0], atol=2e-4)
    # A direction orthogonal to the difference changes nothing.
    assert torch.allclose(got["v:orthogonal"], read_logits(lm, old, pp.suffix)[0], atol=2e-4)
    with pytest.raises(ValueError, match="stale or oracle"):
        sweep_logits(lm, case, {"x": Directional(v, (slot,), diff[v], source="field_only")},
                     sources={"field_only": pp.field_only()})
