"""Directions at the note sites: identities of the interventions and peer checks of the patched decision."""

import pytest
import torch

from kvprobe.features.directions import (Example, NoteSite, RotatedSubspace, diff_of_means, directional_patch,
                                         examples_of, interchange, intervened_ld, kv_site_acts, patched_logits,
                                         read_gain, reader_matrix, site_acts, steer, subspace_cosine, train_das,
                                         unit, variance_ratio)
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.loading import load_model
from kvprobe.patching.hooks import run_patched
from kvprobe.patching.sites import Site
from kvprobe.probes import KV, Case, materialize, sweep_logits
from kvprobe.tasks.gated import generate_instances


@pytest.fixture(scope="module")
def case_lm(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir))
    inst = generate_instances(template, 1, seed=0)[0]
    case = Case.build(lm, inst)
    notes = case.pp.downstream_slots[3:6]
    return lm, case, notes


def _ref_logits(lm, state, case):
    return read_logits(lm, state, case.pp.suffix)[0]


@pytest.mark.parametrize("kind", ["v", "k"])
def test_full_rank_das_swap_is_the_vanilla_kv_patch(case_lm, kind):
    """A full-rank interchange at a V (or pre-RoPE K) site equals taking the oracle's V (K) at the notes."""
    lm, case, notes = case_lm
    site = NoteSite(kind, 1, 1)
    base, source = (site_acts(lm, case, site, notes, w) for w in ("stale", "oracle"))
    q, _ = torch.linalg.qr(torch.randn(site.dim(lm.spec), site.dim(lm.spec), generator=torch.Generator().manual_seed(0)))
    swapped = interchange(base, source, q.T)
    assert torch.allclose(swapped, source, atol=1e-5)
    got = patched_logits(lm, case, site, notes, swapped)[0]
    # reference: the sweep's own KV patch of that head at the notes on that layer, restricted to V (or K)
    pp = case.pp
    full = materialize(case, KV.of(notes, [1], [1]))
    keys = pp.old.keys if kind == "v" else full.keys
    values = full.values if kind == "v" else pp.old.values
    from kvprobe.kv.state import KVState
    ref = _ref_logits(lm, KVState(keys, values, pp.old.positions), case)
    assert torch.allclose(got, ref, atol=2e-4)
    if kind == "v":  # K and V of the head together: the probe layer's KV patch, through the sweep
        both = sweep_logits(lm, case, {"kv": KV.of(notes, [1], [1])})["kv"]
        assert torch.allclose(both, _ref_logits(lm, full, case), atol=2e-4)


def test_pre_rope_keys_round_trip(case_lm):
    """Setting the pre-RoPE keys to their own values leaves the decision exactly as stale."""
    lm, case, notes = case_lm
    site = NoteSite("k", 2, 0)
    base = kv_site_acts(lm, case.pp.old, site, notes)
    got = patched_logits(lm, case, site, notes, base)[0]
    assert torch.allclose(got, _ref_logits(lm, case.pp.old, case), atol=2e-4)


def test_resid_site_patches_the_note_columns(case_lm):
    """Residual patch at the notes: identity patch == stale; a full swap == re-running each note's column with
    its layer output replaced (checked against run_patched token by token)."""
    lm, case, notes = case_lm
    site = NoteSite("resid", 1)
    base, source = (site_acts(lm, case, site, notes, w) for w in ("stale", "oracle"))
    same = patched_logits(lm, case, site, notes, base)[0]
    assert torch.allclose(same, _ref_logits(lm, case.pp.old, case), atol=2e-4)
    got = patched_logits(lm, case, site, notes, source)[0]
    ids = case.pp.pair.ids_old[: case.pp.context_length]
    state = case.pp.old
    for i, s in enumerate(notes):
        col, _ = run_patched(lm, [ids[s]], {Site("resid_post", 1, 0): source[i]}, prior=state.slice(0, s))
        state = col.concat(state.slice(s + 1))
    assert torch.allclose(got, _ref_logits(lm, state, case), atol=2e-4)
    # a full-rank DAS swap of the residual is that same vanilla patch
    q, _ = torch.linalg.qr(torch.randn(site.dim(lm.spec), site.dim(lm.spec), generator=torch.Generator().manual_seed(1)))
    assert torch.allclose(patched_logits(lm, case, site, notes, interchange(base, source, q.T))[0], got, atol=2e-4)


def test_rank1_das_with_diff_of_means_is_the_directional_patch(case_lm):
    lm, case, notes = case_lm
    site = NoteSite("v", 2, 0)
    base, source = (site_acts(lm, case, site, notes, w) for w in ("stale", "oracle"))
    u = diff_of_means(source, base)
    das = RotatedSubspace(site.dim(lm.spec), rank=1)
    with torch.no_grad():
        das.rot.weight = u[None, :]  # the orthogonal parametrization accepts an orthonormal assignment
    assert torch.allclose(das.weight, u[None, :], atol=1e-5)
    a = das(base, source)
    b = directional_patch(base, source, u)
    assert torch.allclose(a, b, atol=1e-5)
    # closed form, and only the u-component moved
    assert torch.allclose(b - base, ((source - base) @ u)[:, None] * u, atol=1e-6)
    off = (b - base) - ((b - base) @ u)[:, None] * u
    assert off.abs().max() < 1e-6
    assert subspace_cosine(das.weight.detach(), u) == pytest.approx(1.0, abs=1e-5)
    assert torch.allclose(patched_logits(lm, case, site, notes, a), patched_logits(lm, case, site, notes, b), atol=1e-5)


def test_steer_and_diff_of_means():
    pos, neg = torch.tensor([[2.0, 0.0], [4.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(diff_of_means(pos, neg), torch.tensor([1.0, 0.0]))
    assert torch.allclose(steer(neg, torch.tensor([0.0, 3.0]), 2.0), torch.tensor([[0.0, 2.0], [0.0, 2.0]]))


def test_batched_patch_matches_single(case_lm):
    lm, case, notes = case_lm
    for site in (NoteSite("v", 1, 0), NoteSite("resid", 0)):
        base = site_acts(lm, case, site, notes, "stale")
        u = unit(torch.randn(base.shape[-1], generator=torch.Generator().manual_seed(2)))
        acts = [steer(base, u, a) for a in (0.0, 1.0, 3.0)]
        batched = patched_logits(lm, case, site, notes, torch.stack(acts))
        for i, x in enumerate(acts):
            assert torch.allclose(batched[i], patched_logits(lm, case, site, notes, x)[0], atol=2e-4), (site, i)


def test_das_training_moves_the_decision(case_lm):
    """A few DAS steps on one V site lower the interchange loss (the gradient reaches the rotation)."""
    lm, case, notes = case_lm
    site = NoteSite("v", 2, 1)
    exs = examples_of(lm, case, site, notes)
    res = train_das(lm, exs, rank=2, steps=12, batch=2, lr=0.05, seed=0)
    assert res.basis.shape == (2, site.dim(lm.spec))
    assert torch.allclose(res.basis @ res.basis.T, torch.eye(2), atol=1e-4)
    assert min(res.losses[-4:]) < res.losses[0]
    # training is deterministic
    again = train_das(lm, exs, rank=2, steps=12, batch=2, lr=0.05, seed=0)
    assert torch.allclose(res.basis, again.basis) and res.losses == again.losses


def test_boundless_mask_keeps_some_rows(case_lm):
    lm, case, notes = case_lm
    exs = examples_of(lm, case, NoteSite("v", 1, 0), notes)
    res = train_das(lm, exs, steps=4, batch=2, boundless=True, seed=0)
    assert 1 <= res.rank <= lm.spec.head_dim
    assert torch.allclose(res.basis @ res.basis.T, torch.eye(res.rank), atol=1e-4)


def test_boundless_sparsity_shrinks_the_subspace(case_lm):
    """The mask-size penalty is what makes boundless DAS pick a small subspace: a heavy one keeps fewer rows."""
    lm, case, notes = case_lm
    exs = examples_of(lm, case, NoteSite("v", 1, 0), notes)
    light = train_das(lm, exs, steps=8, batch=2, lr=0.05, boundless=True, sparsity=0.0, seed=0)
    heavy = train_das(lm, exs, steps=8, batch=2, lr=0.05, boundless=True, sparsity=1.0, seed=0)
    assert heavy.rank < light.rank


def test_reader_overlap(case_lm):
    lm, _, _ = case_lm
    for site in (NoteSite("resid", 0), NoteSite("v", 1, 0), NoteSite("k", 1, 1)):
        w = reader_matrix(lm, site)
        assert w.shape[1] == site.dim(lm.spec)
        # a direction in the reader's null space reads as zero, the top right-singular vector above typical
        _, _, vh = torch.linalg.svd(w, full_matrices=True)
        assert read_gain(w, vh[0]) > 1.0
        if w.shape[0] < w.shape[1]:
            assert read_gain(w, vh[-1]) == pytest.approx(0.0, abs=1e-4)
    x = torch.randn(500, 4, generator=torch.Generator().manual_seed(0)) * torch.tensor([3.0, 1.0, 1.0, 0.01])
    assert variance_ratio(x, torch.tensor([1.0, 0, 0, 0])) > 2.0 > 0.01 > variance_ratio(x, torch.tensor([0, 0, 0, 1.0]))


def test_find_notes_coarse_to_fine(case_lm):
    """Keeping every band is the exhaustive single-slot ranking; fewer bands pick notes inside the strongest."""
    from kvprobe.features.directions import find_notes
    from kvprobe.patching.ranking import rank_downstream

    lm, case, _ = case_lm
    exhaustive = sorted(rank_downstream(lm, case.pp, case.anchor).top(2))
    assert find_notes(lm, case, 2, n_bands=4, keep_bands=4) == exhaustive
    notes = find_notes(lm, case, 2, n_bands=4, keep_bands=1)
    assert len(notes) == 2 and set(notes) <= set(case.pp.downstream_slots)


def test_case_with_resid_keeps_the_prefill_residuals(case_lm, template):
    from types import SimpleNamespace

    from kvprobe.features.directions import case_with_resid
    from kvprobe.patching.residuals import resid_stack
    from kvprobe.runner.config import RunConfig

    lm, case, notes = case_lm
    inst = generate_instances(template, 1, seed=0)[0]
    ctx = SimpleNamespace(lm=lm, cfg=RunConfig(experiment="directions"))
    got_case, resid = case_with_resid(ctx, inst, [0, 2])
    ids = case.pp.pair.ids_new[: case.pp.context_length]
    ref = resid_stack(lm, ids, notes, layers=[0, 2])
    assert torch.allclose(resid["oracle"][:, notes], ref, atol=1e-5)
    assert got_case.anchor == case.anchor


def test_eval_families_are_checked_against_the_task():
    """A held-out family the task lacks, or a split with an empty side, is refused with the key to fix."""
    from types import SimpleNamespace

    from kvprobe.errors import KVProbeError
    from kvprobe.features.directions import check_eval_families

    insts = [SimpleNamespace(family=f) for f in ("orders", "accounts", "refunds", "accounts")]

    def ctx(families):
        return SimpleNamespace(params=SimpleNamespace(eval_families=families))

    check_eval_families(ctx(["accounts"]), insts)
    for families, words in ((["accounts", "travel"], "travel not among"), (["shipping"], "shipping not among"),
                            (["orders", "accounts", "refunds"], "no training")):
        with pytest.raises(KVProbeError, match=words) as err:
            check_eval_families(ctx(families), insts)
        assert "eval_families" in str(err.value)


def test_polarity_template_gives_trigger_pairs_with_their_conclusion():
    """With the polarity template the note-site experiments take the 2x2 pairs (field byte-identical, the
    trigger flips) and label the old prompt's conclusion from the pair's direction."""
    from types import SimpleNamespace

    from kvprobe.features.directions import note_instances
    from kvprobe.runner.config import RunConfig

    cfg = RunConfig(experiment="directions", task={"template": "configs/tasks/polarity.yaml", "n_instances": 8},
                    params={"eval_families": ["accounts"]})
    ctx = SimpleNamespace(cfg=cfg, params=SimpleNamespace(eval_families=["accounts"]), scratch={}, template=None)
    insts = note_instances(ctx)
    assert len(insts) == 8 and all(i.meta["varied"] == "trigger" for i in insts)
    assert {i.meta["direction"] for i in insts} == {"to_block", "to_allow"}
    for inst in insts:  # the field line is the same text in both prompts: only the trigger differs
        assert inst.meta["field_value"] in inst.before_field


def test_direction_figure_keeps_the_widest_run_per_model_and_task():
    """A narrower follow-up run (one site) does not replace the main run's row; another task gets its own row."""
    from kvprobe.figures.features import widest_per_model_and_task

    def rec(model, template, n_sites, tag):
        return {"model": {"name": model}, "config": {"task": {"template": template}},
                "summary": {"sites": [{}] * n_sites}, "tag": tag}

    rows = widest_per_model_and_task([rec("m", "configs/tasks/gated.yaml", 6, "main"),
                                      rec("m", "configs/tasks/gated.yaml", 1, "boundless"),
                                      rec("m", "configs/tasks/polarity.yaml", 2, "polarity"),
                                      rec("m", "configs/tasks/gated.yaml", 6, "main2")])
    assert {k: v["tag"] for k, v in rows.items()} == {"m": "main2", "m (polarity)": "polarity"}
