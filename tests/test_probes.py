"""Mechanism probes on tiny models: exact identities of each probe's cache states, the polarity task, the
probe/lens helpers, and every experiment end to end through the CLI with its figure."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvprobe.figures import render_all
from kvprobe.figures.mechanism import fig_offtemplate
from kvprobe.kv import prefill, read_logits
from kvprobe.metrics import logit_diff
from kvprobe.models.loading import load_model
from kvprobe.models.tiny import write_tiny_model_dir
from kvprobe.patching.ablation import ablation_donor
from kvprobe.patching.pairs import measure, prefill_pair
from kvprobe.patching.ranking import (count_grid, layer_bands, position_bands, random_positions, rank_downstream,
                                      sweep_recovery)
from kvprobe.patching.residuals import commit_layer, logit_lens, resid_stack
from kvprobe.patching.sweep import KVPatch
from kvprobe.app.cli import main
from kvprobe.runner.config import load_config, validate_params
from kvprobe.runner.experiment import Context, get_experiment
from kvprobe.probes.common import binned_profile, curve_summary
from kvprobe.runner.records import load_records
from kvprobe.app.report import report_rows
from kvprobe.stats.probe import first_layer_at, group_cv_accuracy
from kvprobe.tasks.gated import generate_instances, load_template, tokenize_pair
from kvprobe.tasks.polarity import generate_polarity_instances, prompt_labels

TEMPLATES = ("gated", "polarity", "twohop", "attribute", "conversational")
SMALL = ["--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "task.n_filler=20", "--quiet"]


def _instances(name, n, seed=0, n_filler=24):
    t = load_template(f"configs/tasks/{name}.yaml")
    gen = generate_polarity_instances if name == "polarity" else generate_instances
    return gen(t, n, seed, n_filler=n_filler)


@pytest.fixture(scope="module")
def probe_text_dir(tmp_path_factory) -> Path:
    """A config-only Llama directory whose word-level tokenizer covers every task template here."""
    texts = []
    for name in TEMPLATES:
        for i in _instances(name, 24):
            texts.append(" ".join([i.body(i.old_value), i.body(i.new_value), i.answer_prefix, i.old_action,
                                   i.new_action]))
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("probetext"), texts)


@pytest.fixture(scope="module")
def lm(probe_text_dir):
    return load_model(str(probe_text_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def pp(lm):
    inst = _instances("gated", 1, n_filler=20)[0]
    return prefill_pair(lm, tokenize_pair(lm.tokenizer, inst, False))


def _ld(lm, pp, state):
    return float(logit_diff(read_logits(lm, state, pp.suffix), pp.pair.new_action_id, pp.pair.old_action_id)[0])


def _ctx(lm, config, **params):
    cfg = load_config(config, {"params": params, "gate": {"min_flip": 0.0}})
    exp = get_experiment(cfg.experiment)
    return exp, Context(cfg=cfg, params=validate_params(exp.params, cfg.params, config), lm=lm)


def _run(model_dir, tmp_path, config, *extra):
    assert main(["run", config, "--model", str(model_dir), "--output-dir", str(tmp_path), *SMALL, *extra]) == 0
    name = load_config(config).experiment
    return json.loads(next(tmp_path.glob(f"{name}/*/*.json")).read_text())


# -- library helpers ------------------------------------------------------------------------------------

def test_position_sets_are_reproducible_partitions():
    pool = list(range(10, 60))
    a = random_positions(pool, 8, 3, (0, 5, 8))
    assert a == random_positions(pool, 8, 3, (0, 5, 8)) and a != random_positions(pool, 8, 3, (1, 5, 8))
    assert all(len(set(d)) == 8 and set(d) <= set(pool) and d == sorted(d) for d in a)
    assert not set(random_positions(pool, 8, 1, 0, exclude=range(10, 50))[0]) & set(range(10, 50))
    assert count_grid([0, 64, 1, 4], 10) == [("0", 0), ("1", 1), ("4", 4), ("all", 10)]
    assert sum(layer_bands(30, 4), []) == list(range(30)) and len(layer_bands(3, 6)) == 3
    assert sum(position_bands(pool, 4), []) == pool


def test_ranking_orders_and_knockout_ranking_is_ascending(lm, pp):
    anchor, _, _ = measure(lm, pp, {})
    up = rank_downstream(lm, pp, anchor, candidates=pp.downstream_slots[:12])
    assert up.effects == sorted(up.effects, reverse=True) and up.top(3) == up.positions[:3]
    down = rank_downstream(lm, pp, anchor, base=pp.new, donor=pp.old, descending=False,
                           candidates=pp.downstream_slots[:12])
    assert down.effects == sorted(down.effects)
    ref = anchor.recovery(torch.tensor(_ld(lm, pp, pp.new.mix(pp.old, [down.positions[0]])), dtype=torch.float64))
    assert abs(float(ref) - down.effects[0]) < 1e-4


def test_ablation_donors(pp):
    mean = ablation_donor("mean", pp.new, pp.old)
    assert torch.allclose(mean.keys[1], (pp.new.keys[1] + pp.old.keys[1]) / 2)
    assert ablation_donor("zero", pp.new, pp.old).values[0].abs().max() == 0
    assert ablation_donor("stale", pp.new, pp.old) is pp.old


def test_logit_lens_last_layer_is_the_model_and_commit_layer(lm, pp):
    resid = resid_stack(lm, pp.suffix, [len(pp.suffix) - 1], prior=pp.old)
    assert resid.shape == (lm.spec.n_layers, 1, lm.spec.d_model)
    assert (logit_lens(lm, resid[-1]) - read_logits(lm, pp.old, pp.suffix)).abs().max() < 1e-4
    # resid_stack over the context equals a prefill's hidden state read another way: the last slot's
    # final-layer lens is the model's next-token logits after the context.
    ctx_ids = pp.pair.ids_old[: pp.context_length]
    _, logits = prefill(lm, ctx_ids, return_logits=True)
    assert (logit_lens(lm, resid_stack(lm, ctx_ids, [len(ctx_ids) - 1])[-1]) - logits).abs().max() < 1e-4
    assert commit_layer([-1, 2, -3, 4, 5]) == 3 and commit_layer([1, 1, 1]) == 0 and commit_layer([1, -1]) == 1
    assert commit_layer([1, 0, 2]) == 2


def test_group_cv_probe():
    rng = np.random.default_rng(0)
    y = np.tile([0, 1], 20)
    x = rng.normal(size=(40, 5)) + 3 * y[:, None]
    groups = np.repeat(np.arange(5), 8)
    res = group_cv_accuracy(x, y, groups, n_splits=5)
    assert res["acc"] == 1.0 and res["folds"] == 5 and res["chance"] == 0.5
    assert group_cv_accuracy(x, y, np.zeros(40), 5)["acc"] is None  # one group: nothing to hold out
    assert first_layer_at([None, 0.6, 0.85, 0.9], 0.8) == 2 and first_layer_at([0.5], 0.8) is None


def test_curve_summaries():
    rows = [{"included": True, "c": {"0": 0.0, "all": 1.0}, "b": [True, None]},
            {"included": False, "c": {"0": 0.5, "all": 1.0}, "b": [False, None]}]
    s = curve_summary(rows, "c")
    assert s["0"]["gated"]["mean"] == 0.0 and s["0"]["all"]["mean"] == 0.25 and s["all"]["all"]["n"] == 2
    b = curve_summary(rows, "b")
    assert b["0"]["all"]["mean"] == 0.5 and b["1"]["all"]["n"] == 0
    assert binned_profile([1, 3, None, 5], 2) == [2.0, 5.0]


# -- the polarity task ----------------------------------------------------------------------------------

def test_polarity_pairs_hold_the_field_and_flip_one_trigger(lm):
    insts = _instances("polarity", 8)
    cells = {(i.meta["field_is_allow"], prompt_labels(i)["conclusion"]) for i in insts}
    assert len(cells) == 4  # field identity x conclusion direction: the 2x2 is covered
    for inst in insts:
        lab = prompt_labels(inst)
        assert lab["conclusion"][0] != lab["conclusion"][1] and lab["field"][0] == lab["field"][1]
        # conclusion = field equals trigger
        for k in (0, 1):
            assert lab["conclusion"][k] == int(lab["field"][k] == lab["trigger"][k])
        body_old, body_new = inst.body(inst.old_value), inst.body(inst.new_value)
        field_line = f"{inst.field}: {inst.meta['field_value']}\n"
        assert field_line in body_old and field_line in body_new
        pair = tokenize_pair(lm.tokenizer, inst, False)
        diff = [i for i, (a, b) in enumerate(zip(pair.ids_old, pair.ids_new)) if a != b]
        assert diff == pair.field_slots and len(diff) == 1  # exactly the trigger token differs
        assert lm.tokenizer.decode([pair.ids_old[diff[0]]]) == inst.old_value
        assert body_old.index(field_line) < body_old.index(inst.old_value + ", you MUST NOT")


def test_polarity_rule_needs_one_trigger():
    from kvprobe.errors import KVProbeError

    with pytest.raises(KVProbeError, match="exactly once"):
        generate_polarity_instances(load_template("configs/tasks/gated.yaml"), 1, 0)


# -- experiment identities ------------------------------------------------------------------------------

def test_suffix_with_field_spans_field_only_to_full_downstream(lm):
    exp, ctx = _ctx(lm, "configs/suffix.yaml", include_field=True, top_k=[2, 8], layer_bands=2)
    row = exp.run_instance(ctx, _instances("gated", 1, n_filler=20)[0])
    cum = row["cumulative"]
    assert list(cum) == ["0", "2", "8", "all"]
    assert abs(cum["0"] - row["field_only"]) < 1e-4 and abs(cum["all"] - row["full_downstream"]) < 1e-4
    assert abs(cum["all"] - 1) < 1e-4
    assert len(row["per_layer"]) == lm.spec.n_layers and len(row["position_effect"]) == row["n_downstream"]
    assert row["top"][0]["effect"] == pytest.approx(max(row["position_effect"]), abs=1e-5)
    assert row["top"][0]["offset"] == row["top"][0]["slot"] - row["field_slots"][-1] > 0


def test_knockout_and_writability_end_points(lm, pp):
    anchor, _, _ = measure(lm, pp, {})
    down = pp.downstream_slots
    exp, ctx = _ctx(lm, "configs/knockout.yaml", ks=[4], random_draws=2, position_bands=2)
    inst = _instances("gated", 1, n_filler=20)[0]
    row = exp.run_instance(ctx, inst)
    assert row["knockout_top"]["0"] == pytest.approx(0, abs=1e-3)  # nothing ablated: the oracle
    peer = anchor.recovery(torch.tensor(_ld(lm, pp, pp.new.mix(pp.old, down)), dtype=torch.float64))
    assert row["knockout_top"]["all"] == pytest.approx(1 - float(peer), abs=1e-3)
    assert set(row["knockout_band"]) == {"B0", "B1"} and set(row["knockout_random"]) == {"4"}
    exp, ctx = _ctx(lm, "configs/knockout.yaml", ks=[4], ablation="zero", rank_by="knockout", random_draws=1)
    assert exp.run_instance(ctx, inst)["knockout_top"]["0"] == pytest.approx(0, abs=1e-3)

    exp, ctx = _ctx(lm, "configs/writability.yaml", ks=[4])
    row = exp.run_instance(ctx, inst)
    assert row["inject"]["0"] == pytest.approx(0, abs=1e-3)  # nothing injected: the stale cache
    peer = anchor.recovery(torch.tensor(_ld(lm, pp, pp.old.mix(pp.new, down)), dtype=torch.float64))
    assert row["inject"]["all"] == pytest.approx(float(peer), abs=1e-3)
    # All notes plus the field would be the oracle itself.
    full = sweep_recovery(lm, pp, anchor, [KVPatch.of(pp.field_slots + down)])
    assert float(full[0]) == pytest.approx(1, abs=1e-3)


def test_specificity_draws_are_seeded(lm):
    exp, ctx = _ctx(lm, "configs/specificity.yaml", ks=[4], random_draws=3)
    inst = _instances("gated", 2, n_filler=20)[1]
    row = exp.run_instance(ctx, inst)
    down = list(range(row["field_slots"][-1] + 1, row["n_tokens"] - 1))
    assert row["rand4_slots"] == random_positions(down, 4, 3, (0, inst.index, 4))
    assert row["rand4"] == pytest.approx(sum(row["rand4_draws"]) / 3)
    assert exp.run_instance(ctx, inst) == row


# -- CLI end to end, with figures -----------------------------------------------------------------------

FIGURE_OF = {"suffix": "fig3bc_suffix.png", "specificity": "table4_specificity.png", "knockout": "fig3_knockout.png",
             "writability": "appC_writability.png", "dissociation": "table4_dissociation.png",
             "probes": "fig3_probes.png", "timing": "appC_timing.png"}


def _check_gate(rec):
    s = rec["summary"]
    assert s["n_instances"] == 2 and "oracle_flip" in s and s["gate"]["min_flip"] == 0
    for row in rec["rows"]:
        assert {"stale_ld", "oracle_ld", "flip", "included", "oracle_correct"} <= set(row)


@pytest.mark.parametrize("name,extra", [
    ("suffix", ["--set", "params.top_k=[1,4]", "--set", "params.layer_bands=2"]),
    ("specificity", ["--set", "params.ks=[2]", "--set", "params.random_draws=2"]),
    ("knockout", ["--set", "params.ks=[2]", "--set", "params.random_draws=1", "--set", "params.ablation=mean"]),
    ("writability", ["--set", "params.ks=[2]"]),
    ("dissociation", []),
    ("probes", ["--set", "params.n_splits=2"]),
    ("timing", ["--set", "params.aggregator=last_context"]),
])
def test_cli_and_figure(name, extra, probe_text_dir, tmp_path):
    rec = _run(probe_text_dir, tmp_path, f"configs/{name}.yaml", *extra)
    _check_gate(rec)
    s, row = rec["summary"], rec["rows"][0]
    if name == "dissociation":
        # an identity up to fp32 rounding of the logit difference (1e-4 nats: batched and single forwards sum
        # in another order); a tiny random model's small flip divides it, so the tolerance scales with 1 / |flip|
        tol = max(1e-4, 1e-4 / abs(row["flip"]))
        assert row["trigger_and_notes"] == pytest.approx(1, abs=tol) and row["stale"] == pytest.approx(0, abs=1e-6)
        assert row["varied"] == "trigger" and len(row["trigger_tokens"]) == 1
    if name == "probes":
        assert set(s["probes"]) == {"last_context", "top_effect", "decision"}
        assert len(s["probes"]["top_effect"]["conclusion"]["acc"]) == rec["model"]["n_layers"]
        assert row["probe_slots"]["decision"] is None and row["probe_slots"]["top_effect"] > row["field_slots"][-1]
    if name == "timing":
        assert len(row["lens_ld_old"]) == rec["model"]["n_layers"] and 0 < row["commit_depth"] <= 1
        assert abs(row["lens_ld_old"][-1] - row["stale_ld"]) < 1e-3 and abs(row["lens_ld_new"][-1] - row["oracle_ld"]) < 1e-3
    if name == "suffix":
        assert "all" in s["cumulative"] and len(s["position_profile"]) == 20 and s["most_frequent_top_tokens"]
    paths = [p.name for p in render_all(tmp_path, tmp_path / "figs")]
    assert FIGURE_OF[name] in paths
    (line,) = report_rows(tmp_path)
    assert line[0] == name and line[3] == f"{s['n_included']} / 2" and line[5] and line[6], line


def test_off_template_locality_and_figure(probe_text_dir, tmp_path):
    records = []
    for t in ("twohop", "conversational", "attribute"):
        rec = _run(probe_text_dir, tmp_path / t, f"configs/locality_{t}.yaml")
        assert rec["config"]["task"]["template"] == f"configs/tasks/{t}.yaml"
        for row in rec["rows"]:
            assert abs(row["full_downstream"] - 1) < 1e-3 and row["field_slots"]
        records += load_records(tmp_path / t, "locality")
    fig_offtemplate(records, tmp_path / "off.png")
    assert (tmp_path / "off.png").stat().st_size > 5000


def test_probe_features_are_recomputed_for_resumed_rows(lm):
    exp, ctx = _ctx(lm, "configs/timing.yaml", n_splits=2)
    cfg = load_config("configs/timing.yaml", {"task": {"n_instances": 4, "n_filler": 20}, "gate": {"min_flip": 0.0},
                                              "params": {"n_splits": 2}})
    ctx = Context(cfg=cfg, params=ctx.params, lm=lm)
    insts = exp.make_instances(ctx)
    rows = [{"index": i.index, **exp.run_instance(ctx, i)} for i in insts]
    fresh = exp.summarize(ctx, rows)
    ctx.scratch["features"].clear()  # as after a resume: rows from disk, no features in memory
    assert exp.summarize(ctx, rows)["write_probe"] == fresh["write_probe"]
