"""directions and sae end to end on a tiny model: the per-pair effects their summaries compute after every row
exists (row_measures) cover exactly the held-out pairs and feed the claims table."""

from __future__ import annotations

import json

import pytest

from kvprobe.claims import claim_rows, evaluate
from kvprobe.app.cli import main
from kvprobe.runner.experiment import get_experiment

CASES = {
    "directions": ("held_out_site", ["params.layers=[1,2]", "params.das.layers=[2]", "params.das.steps=3",
                                     "params.fit_on=all", "params.n_random=1", "params.alphas=[0.0,1.0]"],
                   {"full", "dom", "random", "span", "shuffled", "das"}),
    "sae": ("held_out_clamp", ["params.layer=1", "params.sites=[resid]", "params.width=16", "params.k=2",
                               "params.steps=5", "params.batch=32", "params.n_task_prompts=1",
                               "params.n_neutral_tokens=128", "params.clamp_k=[1,10]", "params.n_random=1",
                               "params.n_dead_tokens=512", "params.n_task_eval_pairs=1"],
            {"top1", "random1", "matched1", "top10", "random10", "matched10"}),
}


@pytest.mark.parametrize("exp", list(CASES))
def test_held_out_pair_effects_reach_the_claims(exp, tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    name, extra, keys = CASES[exp]
    sets = ["task.n_instances=8", "params.eval_families=[orders]", *extra]
    args = ["run", f"configs/{exp}.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path / "out"),
            *[x for s in sets for x in ("--set", s)], "--quiet"]
    assert main(args) == 0
    record = json.loads(next((tmp_path / "out").rglob("*.json")).read_text())
    measures = record["summary"]["row_measures"][name]["rows"]
    held = {str(r["index"]) for r in record["rows"] if r["held_out"]}
    assert held and set(measures) == held  # every held-out pair, and only those
    assert all(set(v) == keys for v in measures.values())
    merged = [r for r in claim_rows(record) if name in r]
    assert len(merged) == len(held)
    for claim in get_experiment(exp).claims:
        if claim.template == "gated":
            res = evaluate(claim, {**record, "rows": [{**r, "included": True} for r in record["rows"]]})
            if " / " in claim.a:  # a share is undefined where the denominator is ~0 (a tiny random model's patch)
                assert res["n"] <= len(held), (claim.key, res)
                continue
            if claim.control_draws:  # this tiny run uses fewer random draws than a control needs: not tested...
                assert res["status"] == "empty" and claim.control_draws in res["notes"][0], (claim.key, res)
                params = {**record["config"]["params"], claim.control_draws: 20}  # ...but its rows reach the claim
                res = evaluate(claim, {**record, "config": {**record["config"], "params": params},
                                       "rows": [{**r, "included": True} for r in record["rows"]]})
            assert res["n"] == len(held) and res["status"] == ("describe" if claim.kind == "describe" else "tested"), \
                (claim.key, res)
