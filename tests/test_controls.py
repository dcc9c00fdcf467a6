"""Discriminating controls: paired effect-minus-control contrasts, cross-fitted rankings, per-instance write
depth, and the experiments' use of them (tiny models or synthetic rows)."""

import json

import numpy as np
import pytest

from kvprobe.probes.controls import (crossfit_scores, crossfit_slots, crossfit_top, paired_contrast, scenario_folds,
                                     slot_key)
from kvprobe.app.cli import main
from kvprobe.runner.experiment import get_experiment
from kvprobe.stats.probe import group_cv_accuracy, group_cv_margins, settle_layer


def _rows(n, n_scen):
    return [{"index": i, "scenario": f"s{i % n_scen}", "included": True} for i in range(n)]


def test_paired_contrast_binary_and_continuous():
    rows = _rows(12, 6)
    eff = [True] * 10 + [False] * 2
    ctl = [False] * 9 + [True] * 3
    c = paired_contrast(rows, eff, ctl)
    assert c["difference"]["mean"] == pytest.approx((10 - 3) / 12)
    assert c["mcnemar"]["effect_only"] == 9 and c["mcnemar"]["control_only"] == 2
    assert c["effect"]["k"] == 10 and c["control"]["k"] == 3
    same = paired_contrast(rows, [0.5] * 12, [0.5] * 12)
    assert same["difference"]["mean"] == 0 and same["cluster_t"]["p"] is None  # a control that ties cannot pass
    up = paired_contrast(rows, [1.0 + 0.01 * i for i in range(12)], [0.0] * 12)
    assert up["cluster_t"]["n_clusters"] == 6 and up["cluster_t"]["p"] < 1e-6 and "mcnemar" not in up


def test_scenario_folds_keep_scenarios_together_and_crossfit_uses_the_other_fold():
    rows = _rows(12, 6)
    folds = scenario_folds(rows)
    by_scen = {}
    for r in rows:
        by_scen.setdefault(r["scenario"], set()).add(folds[r["index"]])
    assert all(len(v) == 1 for v in by_scen.values()) and set(folds.values()) == {0, 1}
    # unit "a" is strong only in fold 0, unit "b" only in fold 1: each fold must rank by the other's effects
    scores = crossfit_scores(rows, lambda r: {"a": 1.0 if folds[r["index"]] == 0 else 0.0,
                                              "b": 1.0 if folds[r["index"]] == 1 else 0.0})
    for r in rows:
        top = crossfit_top(["a", "b"], scores[r["index"]], 1)
        assert top == (["b"] if folds[r["index"]] == 0 else ["a"])
    with pytest.raises(ValueError, match="two scenarios"):
        scenario_folds(_rows(3, 1))


def test_slot_keys_abstract_instance_words_and_rank_by_the_other_fold():
    roles = {"new_action": "deny", "old_action": "cancel", "old_value": "pending", "new_value": "shipped"}
    assert slot_key(" deny", roles, 10, 100) == ("<new_action>", 0)
    assert slot_key(" the", roles, 99, 100) == (" the", 7)
    keys = [(" the", 0), ("<new_action>", 0), (" NOT", 3), (" x", 5)]
    score = {("<new_action>", 0): 0.9, (" NOT", 1): 0.3}  # " NOT" seen in another bin: the token's mean
    assert crossfit_slots(keys, [10, 11, 12, 13], score, 2) == [11, 12]


def test_group_cv_margins_agree_with_accuracy_and_settle_layer():
    rng = np.random.default_rng(0)
    y = np.array([0, 1] * 20)
    groups = np.repeat(np.arange(10), 4)
    x = rng.standard_normal((40, 5)) + 2.0 * y[:, None]
    m = group_cv_margins(x, y, groups, 5)
    acc = group_cv_accuracy(x, y, groups, 5)["acc"]
    assert np.mean(m > 0) == pytest.approx(acc)
    assert settle_layer([-1, 2, -0.5, 1, 3]) == 3 and settle_layer([1, 2, -1]) is None
    assert settle_layer([0.1, 0.2]) == 0 and settle_layer([1.0, float("nan")]) is None


def test_transplant_contrast_is_rotated_minus_unrotated():
    rotation_contrasts = get_experiment("transplant").summarize.__globals__["rotation_contrasts"]
    rows = [{**r, "seam0_agree": 1.0, "no_rotation_agree": float(i % 2), "seam0_cosine": 0.99,
             "no_rotation_cosine": 0.9, "facts_seam0_cosine": 0.95, "facts_seam0_agree": 1.0,
             "facts_no_rotation_cosine": 0.95, "facts_no_rotation_agree": 1.0} for i, r in enumerate(_rows(10, 5))]
    c = rotation_contrasts(rows)
    assert c["policy"]["agree"]["difference"]["mean"] == pytest.approx(0.5)
    assert c["policy"]["cosine"]["difference"]["mean"] == pytest.approx(0.09)
    assert c["facts"]["agree"]["difference"]["mean"] == 0  # the control ties: no gain to claim


def test_long_horizon_and_timing_carry_paired_row_measures(tiny_text_dir, tmp_path):
    from kvprobe.claims import claim_rows

    args = ["--model", str(tiny_text_dir), "--output-dir", str(tmp_path), "--set", "task.n_instances=3",
            "--set", "gate.min_flip=0", "--set", "task.n_filler=20", "--quiet"]
    assert main(["run", "configs/long_horizon.yaml", *args, "--set", "params.turns=3"]) == 0
    rec = json.loads(next(tmp_path.glob("long_horizon/*/*.json")).read_text())
    s = rec["summary"]
    rows = claim_rows(rec)
    measured = [r for r in rows if "decision_by_turn" in r]  # the summary's rows: gated ones when any passed
    assert len(measured) == s["agreement"]["n"] == s["agreement_last_minus_first"]["difference"]["n"] >= 1
    assert all(0 <= r["decision_by_turn"]["agreement"] <= 1 for r in measured) and len(s["agreement_per_turn"]) == 3


def test_span_direction_lies_in_the_span_of_the_training_differences():
    import torch
    from types import SimpleNamespace

    from kvprobe.features.directions import span_direction

    exs = [SimpleNamespace(base_acts=torch.zeros(2, 4), source_acts=torch.tensor([[1.0, 2.0, 0, 0], [0, 1.0, 0, 0]]))
           for _ in range(3)]
    u = span_direction(exs, (0, 1))
    assert float(u.norm()) == pytest.approx(1.0, abs=1e-6) and float(u[2:].abs().max()) == 0
    assert not torch.allclose(u, span_direction(exs, (0, 2)))


def test_norm_matched_clamp_moves_by_the_given_norm_along_the_features():
    import torch

    from kvprobe.features.sae import norm_matched_clamp

    class FakeSAE:  # encode = relu(x @ W_enc); decoder rows = features
        W_dec = torch.eye(4, 6)
        W_enc = torch.eye(6, 4)

        def encode(self, x):
            return torch.relu(x @ self.W_enc)

    x = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 0, 2.0, 0, 0, 0]])
    norms = torch.tensor([0.5, 3.0])
    out = norm_matched_clamp(FakeSAE(), x, [1, 2], torch.tensor([1.0, 0.0]), norms, (0,))
    delta = out - x
    assert torch.allclose(delta.norm(dim=-1), norms) and float(delta[:, [0, 3, 4, 5]].abs().max()) == 0
    assert float(delta[1, 2]) < 0 and float(delta[0, 1]) > 0  # toward the targets


def test_specificity_crossfit_reaches_the_claims(tiny_text_dir, tmp_path):
    from kvprobe.claims import claim_rows, evaluate

    args = ["--model", str(tiny_text_dir), "--output-dir", str(tmp_path), "--set", "task.n_instances=4",
            "--set", "gate.min_flip=0", "--set", "task.n_filler=20", "--set", "params.ks=[2]",
            "--set", "params.random_draws=2", "--quiet"]
    assert main(["run", "configs/specificity.yaml", *args]) == 0
    rec = json.loads(next(tmp_path.glob("specificity/*/*.json")).read_text())
    cf = rec["summary"]["row_measures"]["crossfit"]
    assert set(cf["rows"]) == {str(r["index"]) for r in rec["rows"]} and set(cf["folds"].values()) == {0, 1}
    assert all(0 <= v["overlap_in_sample"]["2"] <= 1 for v in cf["rows"].values())
    rows = claim_rows(rec)
    assert all("top2" in r["crossfit"] for r in rows)
    c = rec["summary"]["crossfit"]["2"]["crossfit_vs_random"]
    assert c["difference"]["n"] == (rec["summary"]["n_included"] or 4)  # gated rows when any passed
    claim = next(cl for cl in get_experiment("specificity").claims if cl.key == "crossfit_top8_vs_rand8")
    assert evaluate(claim, rec)["n"] == 0  # k=8 was not run: nothing to test, not a silent pass


@pytest.mark.parametrize("name,extra,key", [
    ("suffix", ["params.top_k=[1,2]", "params.layer_bands=2", "params.per_layer=false"], "top2"),
    ("knockout", ["params.ks=[2]", "params.random_draws=1", "params.position_bands=2"], "top2"),
    ("heads", ["params.ks=[1,2]", "params.random_draws=1", "params.top_notes=1"], "read_top2"),
])
def test_crossfit_rows_in_suffix_knockout_and_heads(name, extra, key, tiny_text_dir, tmp_path):
    from kvprobe.claims import claim_rows

    sets = ["task.n_instances=4", "gate.min_flip=0", "task.n_filler=20", *extra]
    args = ["run", f"configs/{name}.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
            *[x for s in sets for x in ("--set", s)], "--quiet"]
    assert main(args) == 0
    rec = json.loads(next(tmp_path.glob(f"{name}/*/*.json")).read_text())
    rows = claim_rows(rec)
    assert len(rows) == 4 and all(np.isfinite(r["crossfit"][key]) for r in rows)
    assert rec["summary"]["crossfit"]
