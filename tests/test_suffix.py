"""Suffix concentration on a tiny model: ranking, cumulative curve end point, CLI and figure."""

import json

from kvprobe.figures import render_all
from kvprobe.kv import read_logits
from kvprobe.metrics import logit_diff
from kvprobe.models.loading import load_model
from kvprobe.patching.pairs import measure, prefill_pair
from kvprobe.patching.ranking import rank_downstream
from kvprobe.runner.cli import main
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
    assert any(p.name == "fig3bc_suffix.png" for p in render_all(tmp_path, tmp_path / "figs"))


def test_specificity_cli_and_figure(tiny_text_dir, tmp_path):
    assert main(["run", "configs/specificity.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "params.ks=[1,4]",
                 "--set", "params.random_draws=2", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("specificity/*/*.json")).read_text())
    row = rec["rows"][0]
    assert {"top1", "rand4", "rand4_draws", "rand4_slots"} <= set(row)  # knockout/writability: own experiments
    assert any(p.name == "table4_specificity.png" for p in render_all(tmp_path, tmp_path / "figs"))
