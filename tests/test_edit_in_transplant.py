"""edit_in_transplant end to end on a tiny model: both caches per method, the identities that must hold
(full reprefill is the same state on both sides; the composed stale cache differs from the normal one only
inside the chunk and after it), the control, the claims' paths and the figure."""

from __future__ import annotations

import json

from kvprobe.runner.cli import main


def test_edit_in_transplant_end_to_end(tiny_text_dir, tmp_path, monkeypatch):
    from kvprobe.claims import get
    from kvprobe.figures.edit_in_transplant import fig7a_edit_in_transplant
    from kvprobe.runner.experiment import get_experiment

    # a random-init model's flips are hundredths of a nat: no floor, so the retained field effect is defined
    monkeypatch.setattr("kvprobe.probes.graded.MIN_FIELD_EFFECT", 0.0)
    assert main(["run", "configs/edit_in_transplant.yaml", "--model", str(tiny_text_dir), "--output-dir",
                 str(tmp_path), "--set", "task.n_instances=2", "--set", "params.selective_k=[2,32]",
                 "--set", "inclusion.require_oracle_correct=false", "--set", "inclusion.min_flip=0",
                 "--set", "params.controls=[no_rotation_far]", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("edit_in_transplant/*/*.json")).read_text())
    for row in rec["rows"]:
        assert set(row["normal"]) == set(row["composed"]) and "selective@2" in row["normal"]
        c0, c1 = row["chunk"]
        assert c0 <= row["field_slots"][0] and row["field_slots"][-1] < c1 < row["n_tokens"]
        assert row["checks"]["full_reprefill_ld_gap"] < 1e-4
        assert row["checks"]["stale_composed_vs_normal_max_abs"] > 0  # the splice is not a full prefill
        assert abs(row["normal"]["stale"]["ld"] - row["stale_ld"]) < 1e-4
        for path in ("normal", "composed"):  # the same edit costs the same on both caches
            assert row[path]["in_place"]["recomputed_tokens"] == len(row["field_slots"])
        assert row["normal"]["erratum"]["reused_tokens"] == row["composed"]["erratum"]["reused_tokens"]
        # graded: the composed stale cache retains 0 by construction; the chunk re-rotated far up reads as in place
        assert row["graded"]["arms"]["composed_stale"]["retained"] == 0.0
        assert row["far_check"] < 1e-4 and row["far_distance"] >= 2000
    s = rec["summary"]
    assert s["methods"]["full_reprefill"]["agreement"]["mean"] == 1.0
    assert {"agreement", "p_correct"} <= set(s["no_rotation_erratum"])
    for claim in get_experiment("edit_in_transplant").claims:
        assert all(get(r, claim.a) is not None for r in rec["rows"]), claim.key
        assert not isinstance(claim.b, str) or all(get(r, claim.b) is not None for r in rec["rows"]), claim.key
    fig7a_edit_in_transplant([rec], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000


def test_without_a_gated_instance_the_headline_and_table_report_agreement_not_recovery():
    """Recovery divides by the oracle's flip; with no instance past the gate it is undefined (once printed as
    +322.55), so only agreement is reported."""
    from experiments.edit_in_transplant import headline, table
    stat = {"mean": 300.0, "ci_low": 1.0, "ci_high": 600.0, "n": 10, "n_clusters": 10}
    agree = {"mean": 1.0, "ci_low": 0.69, "ci_high": 1.0, "n": 10, "n_clusters": 10}
    block = {"normal": {"recovery": stat, "p_correct": agree}, "composed": {"recovery": stat, "p_correct": agree},
             "agreement": agree}
    summary = {"n_instances": 10, "n_included": 0, "methods": {"in_place": block, "full_reprefill": block},
               "no_rotation_erratum": {"agreement": agree, "p_correct": agree}, "checks_max": {"gap": 0.0}}
    line, text = headline(summary), table(summary)
    assert "recovery undefined" in line and "300" not in line and "in_place 1.00" in line
    assert "300" not in text and "n/a (no gate)" in text
    summary["n_included"] = 10
    assert "rec +300.00/+300.00" in headline(summary) and "over gated (n 10)" in headline(summary)
