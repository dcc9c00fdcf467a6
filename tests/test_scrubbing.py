"""Causal scrubbing: aligned donors, the two identities, hypothesis sizes; scrubbing and write_share CLI runs."""

import json

import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.figures import render_all
from kvprobe.kv.readout import read_logits
from kvprobe.metrics import logit_diff
from kvprobe.models.loading import load_model
from kvprobe.patching.ranking import rank_downstream
from kvprobe.probes import Case, materialize, sweep
from kvprobe.probes.scrub import hypotheses, hypothesis_size, reorder_fillers, resampled_donors
from kvprobe.app.cli import main
from kvprobe.tasks.gated import generate_instances, tokenize_pair


@pytest.fixture(scope="module")
def scrub_setup(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir))
    inst = generate_instances(template, 1, seed=0)[0]
    case = Case.build(lm, inst)
    notes = rank_downstream(lm, case.pp, case.anchor).top(3)
    donors = resampled_donors(lm, inst, case.pp, 2, (0, inst.index))
    return lm, inst, case, notes, donors


def test_filler_reordering_keeps_everything_but_the_order(template):
    inst = generate_instances(template, 1, seed=0)[0]
    var = reorder_fillers(inst, (0, 1))
    assert var.after_field != inst.after_field and var.before_field == inst.before_field
    assert sorted(var.after_field.splitlines()) != [] and len(var.after_field) == len(inst.after_field)
    assert sorted(line.split(". ", 1)[-1] for line in var.after_field.splitlines()) == \
        sorted(line.split(". ", 1)[-1] for line in inst.after_field.splitlines())


def test_filler_reordering_refuses_prompts_without_filler_rules_and_names_the_fix():
    from kvprobe.tasks.generator import build_generated

    chat = build_generated(0, 0, "test", "system_user")
    with pytest.raises(KVProbeError, match=r"fewer than two: .*formats: \[gated_template\]"):
        reorder_fillers(chat, [0, 1])
    shaped = build_generated(0, 0, "test", "gated_template")
    assert reorder_fillers(shaped, [0, 1]).after_field != shaped.after_field  # the template shape has them


def test_donors_are_position_aligned_other_inputs(scrub_setup):
    lm, inst, case, _, donors = scrub_setup
    pp = case.pp
    assert set(donors) == {"v0.same", "v0.opposite", "v1.same", "v1.opposite"}
    for name, state in donors.items():
        assert state.length == pp.context_length and torch.equal(state.positions, pp.new.positions)
        # The prefix up to and including the field is the same tokens: the same K/V as the target's prefill.
        ref = pp.new if name.endswith(".same") else pp.old
        assert state.slice(0, pp.field_slots[-1] + 1).max_abs_diff(ref.slice(0, pp.field_slots[-1] + 1)) < 1e-5
        assert state.max_abs_diff(ref) > 1e-3  # and a different input after it


def test_full_hypothesis_recovers_one_and_empty_is_the_donor(scrub_setup):
    lm, inst, case, notes, donors = scrub_setup
    pp = case.pp
    hyp = hypotheses(pp, notes, [1], [pp.downstream_slots[:3]], lm.spec.n_layers)
    for d, state in donors.items():
        rec = sweep(lm, case, hyp, base=d, sources=donors)
        assert rec["full"] == pytest.approx(1.0, abs=1e-4)  # identity: every slot kept from the target
        ld = logit_diff(read_logits(lm, state, pp.suffix), pp.pair.new_action_id, pp.pair.old_action_id).double()
        assert rec["empty"] == pytest.approx(float(case.anchor.recovery(ld)[0]), abs=1e-4)  # identity: the donor
        # Any hypothesis through the sweep equals the cache it names, built by hand.
        ref = read_logits(lm, materialize(case, hyp["notes_late"], base=d, sources=donors), pp.suffix)
        ld = logit_diff(ref, pp.pair.new_action_id, pp.pair.old_action_id).double()
        assert rec["notes_late"] == pytest.approx(float(case.anchor.recovery(ld)[0]), abs=1e-4)
    n = lm.spec.n_layers
    assert hypothesis_size(hyp["paper"], n) == hypothesis_size(hyp["random:0"], n) == (len(pp.field_slots) + 3) * n
    assert hypothesis_size(hyp["notes_late"], n) == len(pp.field_slots) * n + 3 * (n - n // 2)


def test_scrubbing_cli_record_and_figure(tiny_text_dir, tmp_path):
    assert main(["run", "configs/scrubbing.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "params.top_notes=3",
                 "--set", "params.random_draws=2", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("scrubbing/*/*.json")).read_text())
    row = rec["rows"][0]
    assert row["identity"]["full"] == pytest.approx(1.0, abs=1e-4)
    base = row["identity"]["baseline_empty"]
    assert row["fraction"]["paper"] == pytest.approx((row["scrub"]["paper"] - base) / (1 - base))
    assert row["paper_metrics"]["drift"] == pytest.approx(1 - row["identity"]["baseline_same"])
    assert {"paper", "random", "notes_only", "all_but_notes"} <= set(row["scrub"])
    assert any(p.name == "fig15d_scrubbing.png" for p in render_all(tmp_path, tmp_path / "figs"))


def test_write_share_cli_record_and_figure(tiny_text_dir, tmp_path):
    assert main(["run", "configs/write_share.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "params.top_notes=2",
                 "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("write_share/*/*.json")).read_text())
    row, s = rec["rows"][0], rec["summary"]
    assert len(row["attn_out"]) == len(row["mlp_out"]) == 4
    assert row["decomposition_residual"] < 1e-4  # identity: attention + MLP differences sum to the residual's
    assert 0 <= s["causal_layer"]["layer"] < 4 and s["cells_per_second"] > 0
    assert any(p.name == "fig15c_write_share.png" for p in render_all(tmp_path, tmp_path / "figs"))
