"""Suffix concentration on a tiny model: ranking, cumulative curve end point, CLI and figure."""

import json

from kvprobe.figures import render_all
from kvprobe.kv import read_logits
from kvprobe.metrics import logit_diff
from kvprobe.models.loading import load_model
from kvprobe.patching.pairs import measure, prefill_pair
from kvprobe.patching.ranking import rank_downstream
from kvprobe.app.cli import main
from kvprobe.runner.experiment import get_experiment
from kvprobe.tasks.gated import generate_instances, tokenize_pair


def test_ranking_and_all_positions_match_reference(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir))
    pp = prefill_pair(lm, tokenize_pair(lm.tokenizer, generate_instances(template, 1, seed=0)[0], False))
    anchor, _, _ = measure(lm, pp, {})
    ranking = rank_downstream(lm, pp, anchor)
    assert sorted(ranking.positions) == pp.downstream_slots
    assert ranking.effects == sorted(ranking.effects, reverse=True)
    # The single best position's effect, recomputed through the reference (materialized) path.
    best = pp.old.mix(pp.new, [ranking.positions[0]])
    ld = logit_diff(read_logits(lm, best, pp.suffix), pp.pair.new_action_id, pp.pair.old_action_id)
    assert abs(float(anchor.recovery(ld.double())[0]) - ranking.effects[0]) < 1e-3


def test_suffix_cli_and_figure(tiny_text_dir, tmp_path):
    assert main(["run", "configs/suffix.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "params.layer_bands=2",
                 "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("suffix/*/*.json")).read_text())
    row = rec["rows"][0]
    assert len(row["layer_bands"]) == 2 and row["top_tokens"] and "all" in rec["summary"]["cumulative"]
    assert list(rec["summary"])[-2:] == ["row_measures", "crossfit"]  # the declared shape, cross-fitted or not
    get_experiment("suffix").summary_model.model_validate(rec["summary"])
    assert any(p.name == "fig3bc_suffix.png" for p in render_all(tmp_path, tmp_path / "figs"))


def test_specificity_cli_and_figure(tiny_text_dir, tmp_path):
    assert main(["run", "configs/specificity.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "params.ks=[1,4]",
                 "--set", "params.random_draws=2", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("specificity/*/*.json")).read_text())
    row = rec["rows"][0]
    assert {"top1", "rand4", "rand4_draws", "rand4_slots"} <= set(row)  # knockout/writability: own experiments
    assert any(p.name == "table4_specificity.png" for p in render_all(tmp_path, tmp_path / "figs"))


def test_atp_ranking_verifying_every_slot_reproduces_the_exact_ranking(tiny_text_dir, tmp_path):
    """Identity: with every slot re-measured exactly, AtP* only proposes and the exact sweep decides, so the
    specificity rows equal the exact ranking's; the record gets its own name (ranking is in the hash when set)."""
    common = ["--model", str(tiny_text_dir), "--set", "task.n_instances=1", "--set", "inclusion.min_flip=0",
              "--set", "params.ks=[1,4]", "--set", "params.random_draws=1", "--quiet"]
    assert main(["run", "configs/specificity.yaml", "--output-dir", str(tmp_path / "exact"), *common]) == 0
    assert main(["run", "configs/specificity.yaml", "--output-dir", str(tmp_path / "atp"), *common,
                 "--set", "params.ranking=atp", "--set", "params.atp_verify_top=100000"]) == 0
    exact = json.loads(next((tmp_path / "exact").glob("specificity/*/*.json")).read_text())
    atp = json.loads(next((tmp_path / "atp").glob("specificity/*/*.json")).read_text())
    assert exact["config_hash"] != atp["config_hash"] and atp["params_resolved"]["ranking"] == "atp"
    for key in ("top1", "top4"):
        assert abs(exact["rows"][0][key] - atp["rows"][0][key]) < 1e-5
    assert [t["slot"] for t in exact["rows"][0]["top"][:4]] == [t["slot"] for t in atp["rows"][0]["top"][:4]]
