"""The claims table: each kind of claim tested from records' rows, BH across claims, honest verdicts; and the
summaries every record carries (clustered recovery CIs, exact rates, no zero-width intervals)."""

from __future__ import annotations

import numpy as np
import pytest

import json
import re

from kvprobe.claims import Claim, claims_rows, evaluate, headline, markdown, near, verdict
from kvprobe.probes.summary import ci_cell, gate_summary, recovery_summary


def declared(claim: Claim, paper: str, paper_value: float | None, **fields: str) -> Claim:
    """A test claim with its paper side given inline (a real experiment's comes from the registry)."""
    from dataclasses import replace

    return replace(claim, paper=paper, paper_value=paper_value, **fields)

RNG = np.random.default_rng(0)


def _rows(n: int, scenarios: int | None = None, **columns) -> list[dict]:
    scen = scenarios or n
    return [{"index": i, "scenario": f"s{i % scen}", "included": True,
             **{k: (v[i] if isinstance(v, (list, np.ndarray)) else v) for k, v in columns.items()}}
            for i in range(n)]


def _record(experiment: str, rows: list[dict], model: str = "m", template: str = "configs/tasks/gated.yaml",
            created: str = "2026-01-01", schema: int | None = 1) -> dict:
    return {"experiment": experiment, "rows": rows, "model": {"name": model},
            "config": {"task": {"template": template}},
            "created": created, "schema_version": schema, "summary": {}}


def test_equivalence_reproduced_not_reproduced_and_underpowered():
    claim = declared(near("z", "x ~ 0", "x", 0.0), "0.0", 0.0)
    tight = evaluate(claim, _record("e", _rows(40, x=RNG.normal(0.0, 0.02, 40))))
    tight["q"] = tight["p"]
    assert tight["p"] < 1e-6 and verdict(tight) == "reproduced"
    off = evaluate(claim, _record("e", _rows(40, x=RNG.normal(0.6, 0.05, 40))))
    off["q"] = off["p"]
    assert verdict(off) == "outside the paper's range"
    noisy = evaluate(claim, _record("e", _rows(6, x=RNG.normal(0.0, 0.3, 6))))
    noisy["q"] = noisy["p"]
    assert noisy["n_needed"] > 6 and verdict(noisy) == "not measurable (n 6 < 10)"
    wide = evaluate(claim, _record("e", _rows(12, x=RNG.normal(0.08, 0.1, 12))))
    wide["q"] = wide["p"]
    assert verdict(wide).startswith("inconclusive (CI straddles a bound") and "needed" in verdict(wide)
    assert wide["power_paper"] is not None and wide["power_ours"] is not None


def test_empty_inclusion_filter_and_identity_are_labelled_not_tested():
    rows = _rows(5, x=0.0, full=1.0)
    for r in rows:
        r["included"] = False
    empty = evaluate(declared(near("z", "x ~ 0", "x", 0.0), "0", 0.0), _record("e", rows))
    empty["q"] = None
    assert verdict(empty) == "not measurable (inclusion filter empty)" and empty["p"] is None
    subset = evaluate(Claim("s", "x ~ 0 where decided", "equivalent", "x", only="decides", bounds=(-0.1, 0.1), paper="0"),
                      _record("e", _rows(12, x=0.0, decides=False)))
    subset["q"] = None
    assert verdict(subset) == "not measurable (no row has decides)"
    absent = evaluate(declared(near("z", "y ~ 0", "y", 0.0), "0", 0.0), _record("e", _rows(12, x=0.0)))
    absent["q"] = None
    assert verdict(absent).startswith("not measurable (no rows carry this measure")
    ident = evaluate(Claim("f", "full = 1", "identity", "full", paper_value=1.0, paper="1.0"),
                     _record("e", _rows(5, full=1.0)))
    ident["q"] = None
    assert verdict(ident) == "identity (by construction)" and ident["p"] is None
    assert ident["max_abs_deviation"] == 0.0


def test_paired_greater_uses_mcnemar_for_booleans_and_t_for_values():
    a = [True] * 10 + [False] * 2
    b = [False] * 10 + [False] * 2
    rows = _rows(12, methods=[{"e": {"correct": u}, "i": {"correct": v}} for u, v in zip(a, b)])
    res = evaluate(Claim("g", "e > i", "greater", "methods.e.correct", "methods.i.correct", paper_value=1.0, paper="1 vs 0"), _record("edit", rows))
    assert res["test"].startswith("McNemar") and res["p"] == pytest.approx(2 * 0.5 ** 10)
    assert res["n_needed"] == 6  # the paper's 1.00 vs 0.00: every pair discordant; 2 * 0.5**6 < 0.05
    top, rand = RNG.normal(0.8, 0.1, 10), RNG.normal(0.0, 0.1, 10)
    res = evaluate(Claim("t", "top > rand", "greater", "top8", "rand8", paper_value=0.75, paper="0.78 vs 0.01"),
                   _record("spec", _rows(10, top8=top, rand8=rand)))
    assert res["test"].startswith("paired t") and res["p"] < 1e-6 and res["ours"]["mean"] == pytest.approx(
        np.mean(top - rand))
    res["q"] = res["p"]
    assert verdict(res) == "reproduced"
    wrong = evaluate(Claim("t", "rand > top", "greater", "rand8", "top8", paper_value=0.75, paper=""),
                     _record("spec", _rows(10, top8=top, rand8=rand)))
    wrong["q"] = wrong["p"]
    assert not verdict(wrong).startswith("reproduced")


def test_rate_claims_are_exact_and_a_bound_no_n_here_can_pass_is_a_description():
    claim = Claim("a", "erratum = reprefill", "agrees", "m.e.correct", "m.r.correct", paper_value=1.0, bound=0.9,
                  paper="1.00 vs 1.00")
    # 0.9 needs 29 units even at 29 of 29: with 30 it is a test, and 0 of 30 is not reproduced
    res = evaluate(claim, _record("edit", _rows(30, m={"e": {"correct": False}, "r": {"correct": True}})))
    res["q"] = res["p"]
    assert res["ours"]["mean"] == 0.0 and res["ours"]["ci_high"] == pytest.approx(0.1157, abs=1e-3)
    assert verdict(res) == "not reproduced (CI below the bound)" and res["n_needed"] == 29
    # with 12 units not even 12 of 12 could pass: described, never counted as a test
    few = evaluate(claim, _record("edit", _rows(12, m={"e": {"correct": True}, "r": {"correct": True}})))
    assert few["status"] == "describe" and few["p"] is None and verdict(few).startswith("described only (no n here")
    agree = evaluate(Claim("s", "agree", "at_least", "agree", paper_value=1.0, bound=0.97, gated=False, paper="1.00"),
                     _record("t", _rows(12, agree=1.0)))  # stored as floats 0/1
    assert agree["ours"]["k"] == 12 and agree["status"] == "describe" and "needs >= 99" in agree["test"]
    from kvprobe.claims import units_to_pass

    assert units_to_pass(0.97) == 99 and units_to_pass(0.9) == 29 and units_to_pass(0.5) == 5


def test_a_greater_than_a_constant_claim_is_judged_against_the_constant():
    """Row 739's bug: 0.866 [0.831, 0.899] against 0.9 read "inconclusive"; its interval lies below the constant."""
    claim = Claim("c", "cosine above 0.90", "greater", "cos", 0.9, paper_value=0.95, paper="0.90-0.999")
    rows = _rows(24, cos=RNG.normal(0.866, 0.04, 24))
    res = evaluate(claim, _record("t", rows))
    res["q"] = res["p"]
    assert res["ours"]["ci_high"] < 0.9 and verdict(res).startswith("not reproduced (CI at or below the threshold 0.9")
    above = evaluate(claim, _record("t", _rows(24, cos=RNG.normal(0.95, 0.01, 24))))
    above["q"] = above["p"]
    assert above["ours"]["ci_low"] > 0.9 and verdict(above) == "reproduced"
    between = evaluate(claim, _record("t", _rows(24, cos=RNG.normal(0.45, 0.01, 24))))
    between["q"] = between["p"]  # ci above 0 but below 0.9: the old rule compared with 0
    assert not verdict(between).startswith("reproduced")


def test_an_agreement_claim_on_a_model_that_decides_at_chance_is_not_measurable():
    """A constant answer makes agreement with full recompute vacuous: the competence gate says so."""
    claim = Claim("g", "spliced agrees with full", "at_least", "agree", bound=0.5, gated=False, paper="1.0",
                  paper_value=1.0, competence=("full_correct",))
    chance = _rows(24, agree=1.0, full_correct=[i % 2 == 0 for i in range(24)])  # right on half: a constant answer
    res = evaluate(claim, _record("t", chance))
    assert res["status"] == "empty" and "below the competence gate" in res["notes"][0]
    assert verdict({**res, "q": None}).startswith("not measurable (below the competence gate")
    competent = _rows(24, agree=1.0, full_correct=[i != 3 for i in range(24)])
    res = evaluate(claim, _record("t", competent))
    assert res["status"] == "tested" and res["competence"]["competent"]
    cosine = Claim("c", "cosine", "greater", "cosine", "norot_cosine", paper="x", competence=("full_correct",))
    assert evaluate(cosine, _record("t", _rows(24, cosine=RNG.normal(0.9, 0.01, 24), norot_cosine=0.8, full_correct=False)))["status"] == "tested"


def test_rows_outside_the_papers_condition_leave_no_claim_row(monkeypatch):
    from kvprobe.runner import experiment as experiment_module
    from kvprobe.claims import RULE_BEFORE_FIELD

    class Fake:
        claims = (declared(near("z", "x ~ 0", "x", 0.0, role="effect", exclude=RULE_BEFORE_FIELD), "0", 0.0),)

    monkeypatch.setattr(experiment_module, "available_experiments", lambda: {"fake": "fake"})
    monkeypatch.setattr(experiment_module, "get_experiment", lambda name: Fake())
    before = _record("fake", _rows(12, x=0.8, rule_at="before_field"))
    assert claims_rows([before]) == []
    mixed = _record("fake", _rows(12, x=0.0, rule_at=["before_field", "after_field"] * 6))
    (row,) = claims_rows([mixed])
    assert row["n"] == 6


def test_claims_rows_apply_bh_across_claims_and_read_the_newest_record(monkeypatch):
    from kvprobe.runner import experiment as experiment_module

    claims = (declared(near("z", "x ~ 0", "x", 0.0), "0", 0.0), declared(near("y", "y ~ 0", "y", 0.0), "0", 0.0),
              Claim("t", "twohop only", "identity", "x", paper_value=0.0, template="twohop", paper="0"))

    class Fake:
        pass

    fake = Fake()
    fake.claims = claims
    monkeypatch.setattr(experiment_module, "available_experiments", lambda: {"fake": "fake"})
    monkeypatch.setattr(experiment_module, "get_experiment", lambda name: fake)
    old = _record("fake", _rows(30, x=RNG.normal(0.5, 0.02, 30), y=0.0), created="2026-01-01")
    new = _record("fake", _rows(30, x=RNG.normal(0.0, 0.02, 30), y=RNG.normal(0.08, 0.05, 30)),
                  created="2026-02-01", schema=2)
    rows = claims_rows([new, old])
    assert [r["key"] for r in rows] == ["z", "y"]  # the twohop claim does not apply to a gated record
    from statsmodels.stats.multitest import multipletests

    q = multipletests([r["p"] for r in rows], method="fdr_bh")[1]
    assert [r["q"] for r in rows] == pytest.approx(q)
    assert rows[0]["verdict"] == "reproduced" and rows[0]["schema_version"] == 2
    table = markdown(rows)
    assert table.count("\n| ") == 3 and "BH q" in table and "Controls" in table  # role None: not an effect


def test_every_declared_claim_names_a_kind_and_identities_are_labelled():
    from kvprobe.runner.experiment import available_experiments, get_experiment

    from kvprobe.claims import declared_claims

    locality = declared_claims("locality")
    kinds = {c.key: c.kind for c in locality if c.template == "gated"}
    assert kinds == {"field_only_zero": "equivalent", "field_only_under_1pct": "equivalent",
                     "full_downstream_one": "identity", "oracle_one": "identity"}
    for name in available_experiments():
        # the declarations type no paper number: the paper's side comes from the registry (kvprobe.paper)
        assert all(not c.paper and c.paper_value is None and not c.location and c.paper_n is None
                   for c in get_experiment(name).claims), name
        claims = declared_claims(name)
        # one row per (claim, template, model) in the table: a key is declared once per template
        assert len({(c.key, c.template) for c in claims}) == len(claims), name
        for c in claims:
            assert c.kind in ("equivalent", "greater", "at_least", "agrees", "identity", "describe") and c.paper
            # every claim names its role and where in the paper it comes from; every effect the paper's n
            assert c.role in ("effect", "control"), (name, c.key)
            assert re.search(r"(Sec\.|App\.|Fig\.|Tab\.|Abstract|construction|definition)", c.location), (name, c.key)
            assert c.role != "effect" or c.paper_n, (name, c.key)
            assert c.kind != "identity" or c.role == "control", (name, c.key)
            # kvprobe's own margins are named as kvprobe's, never attributed to the paper
            assert "TOST margin 0.03" not in c.paper, (name, c.key)
            assert c.kind != "equivalent" or c.bounds[0] < c.bounds[1]
            assert c.kind not in ("at_least", "agrees") or (c.bound is not None and 0 < c.bound < 1)
            assert c.kind not in ("greater", "agrees") or c.b is not None, (name, c.key)
            assert c.kind != "identity" or c.paper_value is not None


# Experiments whose claims must be checkable on committed records (each has records for its claims' templates).
WITH_RECORDS = ("locality", "suffix", "specificity", "knockout", "dissociation", "edit_frontier", "transplant",
                "edit_cot", "edit_wording", "writability", "timing", "heads", "scrubbing", "long_horizon", "directions",
                "sae", "write_share", "locomo")


# Claims on the graded must-fail controls (issue #56): measures the committed records predate, written by a rerun
# with the controls on (tests/test_app_controls.py checks their paths on the experiments' own rows). Each is
# checked here as soon as a committed record carries it.
AWAITING_RERUN = {("transplant", "far_rotation_separation"), ("transplant", "stale_retained_separation"),
                  ("locomo", "locomo_wrong_memory_separation"), ("locomo", "locomo_far_rotation_separation"),
                  ("locomo", "locomo_cosine_beats_wrong_memory")}


@pytest.mark.parametrize("name", WITH_RECORDS)
def test_declared_claim_paths_resolve_on_committed_records(name):
    """A typo in a claim's dotted path would silently read None on every row ("no rows carry this measure"):
    each path must resolve on some row of a committed record of the claim's template."""
    from pathlib import Path

    from kvprobe.claims import _template_stem, claim_rows, get
    from kvprobe.runner.experiment import get_experiment
    from kvprobe.runner.records import load_records

    from kvprobe.claims import _applies, resolve

    records = load_records(Path(__file__).parents[1] / "results", name)
    claims = get_experiment(name).claims
    assert claims, f"{name} declares no claims"
    checked = 0
    for c in claims:
        recs = [r for r in records if (_template_stem(r).startswith("generated_") and c.template == "gated"
                                       or _template_stem(r) == c.template) and _applies(c, r)]
        if not recs:  # no committed record of this template or variant (e.g. long_horizon's erratum scheme)
            continue
        if (name, c.key) in AWAITING_RERUN and not any(get(row, c.a) is not None for r in recs
                                                       for row in claim_rows(r)):
            continue
        for path in (c.a, c.b) if isinstance(c.b, str) else (c.a,):
            if path.startswith("summary."):
                assert any(get(r.get("summary") or {}, path[len("summary."):]) is not None for r in recs), path
                continue
            assert any(get(row, resolve(path, r)) is not None for r in recs for row in claim_rows(r)), \
                f"{name}.{c.key}: '{path}' resolves on no row"
        checked += 1
    assert checked, f"no committed {name} record of any claim's template"


def test_summaries_cluster_by_scenario_and_give_exact_rates():
    class Gate:
        min_flip, require_oracle_correct = 1.0, True

    vals = np.repeat(RNG.normal(0, 1, 4), 6)
    rows = _rows(24, scenarios=4, rec=vals, flag=[bool(i % 3) for i in range(24)], flip=2.0,
                 oracle_correct=True, stale_correct=False)
    for i, r in enumerate(rows):
        r["scenario"] = f"s{i // 6}"
    s = recovery_summary(rows, ["rec", "flag"])
    assert s["rec"]["gated"]["n_clusters"] == 4 and "cluster" in s["rec"]["gated"]["ci_method"]
    assert s["flag"]["all"]["ci_method"].startswith("clopper") and s["flag"]["all"]["k"] == 16
    g = gate_summary(rows, Gate())
    # 24 of 24: the exact lower bound solves p ** 24 = 0.025
    assert g["oracle_accuracy"] == 1.0 and g["oracle_accuracy_ci"]["ci_low"] == pytest.approx(0.025 ** (1 / 24))
    one = recovery_summary(rows[:6], ["rec"])["rec"]["all"]  # one scenario: no interval, and it says so
    assert one["ci_low"] is None and "no interval" in ci_cell(one)
    four = s["rec"]["gated"]  # 4 scenarios: the bootstrap interval exists, but none is printed below 5 clusters
    assert ci_cell(four).endswith("(4 clusters: no interval)")
    assert ci_cell({"mean": 0.0, "ci_low": 0.0, "ci_high": 0.26, "n": 12}) == "0.00 [0.00, 0.26]"  # schema 1


def test_claims_figure_renders(tmp_path, monkeypatch):
    from kvprobe.figures.claims import fig_claims
    from kvprobe.runner import experiment as experiment_module

    class Fake:
        section, section_order = "sec3", 0
        claims = (declared(near("z", "x ~ 0", "x", 0.0, role="effect"), "0", 0.0), declared(near("y", "y ~ 0", "y", 0.0, role="control"), "0", 0.0))

    monkeypatch.setattr(experiment_module, "available_experiments", lambda: {"fake": "fake"})
    monkeypatch.setattr(experiment_module, "get_experiment", lambda name: Fake())
    fig_claims([_record("fake", _rows(10, x=RNG.normal(0, 0.02, 10), y=RNG.normal(0.5, 0.02, 10)))],
               tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 5000


def test_no_verdict_below_ten_instances_or_five_clusters_and_the_shown_interval_decides():
    row = {"status": "tested", "q": 0.001, "n": 3, "n_clusters": 3, "n_units": 3, "kind": "equivalent",
           "bounds": (-0.1, 0.1), "ours": {"ci_low": -0.05, "ci_high": 0.08}, "notes": []}
    assert verdict(row) == "not measurable (n 3 < 10)"
    assert verdict({**row, "n": 40, "n_clusters": 4}) == "not measurable (too few clusters: 4 < 5)"
    ok = {**row, "n": 40, "n_clusters": 8, "n_units": 8}
    assert verdict(ok) == "reproduced"
    # significant TOST but the shown 95% interval crosses a bound: not reproduced, inconclusive
    assert verdict({**ok, "ours": {"ci_low": 0.05, "ci_high": 0.12}}).startswith("inconclusive (CI straddles")
    assert verdict({**ok, "q": 0.2}).startswith("inconclusive (CI inside the bounds")
    assert verdict({**ok, "ours": {"ci_low": 0.15, "ci_high": 0.3}}) == "outside the paper's range"
    greater = {**ok, "kind": "greater", "mean_diff": 0.3, "ours": {"ci_low": -0.01, "ci_high": 0.6},
               "power_paper": 0.95, "n_needed_paper": 6}
    assert verdict(greater).startswith("not reproduced (CI includes zero although power 0.95")
    assert verdict({**greater, "n_needed_paper": 60}).startswith("inconclusive (CI includes zero")
    assert verdict({**greater, "ours": {"ci_low": 0.1, "ci_high": 0.6}}) == "reproduced"


def test_clustered_instances_are_tested_on_cluster_means():
    """24 instances in 6 scenarios: the TOST, t and McNemar run with the scenario as the unit."""
    vals = np.repeat(RNG.normal(0.0, 0.03, 6), 4) + RNG.normal(0, 0.01, 24)
    rows = _rows(24, scenarios=6, x=vals, top=vals + 0.5 + RNG.normal(0, 0.05, 24), rand=vals,
                 e=[bool(i % 6 < 5) for i in range(24)], i=False)
    rec = _record("e", rows)
    tost = evaluate(declared(near("z", "x ~ 0", "x", 0.0), "0", 0.0), rec)
    assert tost["unit"] == "cluster" and tost["n_units"] == 6 and "cluster means" in tost["test"]
    from kvprobe.stats import cluster_means, tost_paired

    _, means = cluster_means(vals, [r["scenario"] for r in rows])
    assert tost["p"] == pytest.approx(tost_paired(means, [0.0] * 6, -0.1, 0.1)["p"])
    t = evaluate(Claim("g", "top > rand", "greater", "top", "rand", paper_value=0.5, paper="0.5"), rec)
    assert "cluster means" in t["test"] and t["n_units"] == 6
    sign = evaluate(Claim("m", "e > i", "greater", "e", "i", paper_value=1.0, paper="1 vs 0"), rec)
    assert sign["test"].startswith("exact sign test over clusters") and sign["p"] == pytest.approx(2 * 0.5 ** 5)
    rate = evaluate(Claim("r", "e", "at_least", "e", paper_value=1.0, bound=0.5, paper="1"), rec)
    assert rate["k_units"] == 5 and "over clusters" in rate["test"]  # 5 clusters all true, 1 all false
    few = evaluate(declared(near("z", "x ~ 0", "x", 0.0), "0", 0.0), _record("e", _rows(24, scenarios=3, x=vals)))
    assert few["ours"]["ci_low"] is None and "too few clusters" in few["ours"]["ci_note"]
    few["q"] = few["p"]
    assert verdict(few) == "not measurable (too few clusters: 3 < 5)"


def test_star_step_averages_a_list_per_instance():
    from kvprobe.claims import get

    row = {"turns": [{"cosine": 0.9, "agree": True}, {"cosine": 1.0, "agree": False}, {"x": 1}]}
    assert abs(get(row, "turns.*.cosine") - 0.95) < 1e-12 and get(row, "turns.*.agree") == 0.5
    assert get(row, "turns.*.missing") is None and get({"turns": 3}, "turns.*.cosine") is None


def test_summary_row_measures_reach_the_claims_by_index():
    """A measure a summary computes per instance after every row exists (a direction fit on training families,
    read on one held-out pair) joins its row by index; rows without one are left out of that claim."""
    from kvprobe.claims import claim_rows

    rows = _rows(24, scenarios=6)
    rec = _record("e", rows)
    held = {str(i): {"dom": 0.3 + 0.01 * (i % 3), "random": 0.01 * (i % 2)} for i in range(12, 24)}
    rec["summary"] = {"row_measures": {"site": {"what": "x", "rows": held}}}
    merged = claim_rows(rec)
    assert [r.get("site") for r in merged[:12]] == [None] * 12 and merged[12]["site"] == held["12"]
    assert "site" not in rows[12]  # the record's own rows are not modified
    res = evaluate(Claim("g", "dom > random", "greater", "site.dom", "site.random", paper_value=0.21, paper="0.22 vs 0.01"), rec)
    assert res["n"] == 12 and res["status"] == "tested" and res["p"] < 1e-6
    assert abs(res["ours"]["mean"] - np.mean([v["dom"] - v["random"] for v in held.values()])) < 1e-12


def test_headline_counts_effects_only_and_bh_runs_within_each_role(monkeypatch):
    from kvprobe.runner import experiment as experiment_module

    class Fake:
        section, section_order = "sec3", 0
        claims = (declared(near("z", "x ~ 0", "x", 0.0, role="effect"), "0", 0.0, location="Sec. 3", paper_n="12"),
                  declared(near("y", "y ~ 0", "y", 0.0, role="control"), "0", 0.0, location="App. D"),
                  Claim("d", "described", "describe", "x", role="effect", location="Fig. 3d", paper_n="36", paper="no number"))

    monkeypatch.setattr(experiment_module, "available_experiments", lambda: {"fake": "fake"})
    monkeypatch.setattr(experiment_module, "get_experiment", lambda name: Fake())
    rec = _record("fake", _rows(30, x=RNG.normal(0.0, 0.02, 30), y=RNG.normal(0.0, 0.02, 30)), model="smollm2-135m")
    rows = claims_rows([rec])
    assert [r["role"] for r in rows] == ["effect", "control", "effect"]
    assert rows[0]["q"] == pytest.approx(rows[0]["p"]) and rows[1]["q"] == pytest.approx(rows[1]["p"])  # own family
    assert rows[2]["verdict"] == "described only (the paper has no number for this condition)" and rows[2]["q"] is None
    h = headline(rows)["smollm2-135m"]
    assert h["effects"] == 1 and h["reproduced"] == 1 and h["text"].endswith("1 of 1 testable paper effects reproduced")
    assert rows[0]["lineage"] == "smollm2-135m" and rows[0]["lineage_root"] == "smollm2-135m"
    table = markdown(rows)
    assert table.index("Paper effects") < table.index("Controls")


def test_lineage_follows_the_cards_init_from_chain():
    from kvprobe.models.lineage import lineage, lineage_root

    chain = lineage("smollm2-135m-gated-v3n2-seed2")
    assert chain[0] == "smollm2-135m" and chain[-1] == "smollm2-135m-gated-v3n2-seed2"
    assert "smollm2-135m-gated-v2" in chain and "smollm2-135m-gated-v3n-seed2" in chain
    assert lineage_root("smollm2-135m-gated-v3n2-seed2") == "smollm2-135m-gated"
    assert lineage("qwen2.5-coder-0.5b-gated-v3-cal2")[-2] == "qwen2.5-coder-0.5b-gated-v3-cal"
    assert lineage("smollm2-135m") == ["smollm2-135m"] and lineage_root("smollm2-135m") == "smollm2-135m"


def test_claims_file_is_byte_identical_when_regenerated(tmp_path):
    """``make claims`` on a clean tree rewrites claims.json byte for byte (fixed seeds, stable float digits)."""
    import shutil
    from pathlib import Path

    from kvprobe.claims import write_claims

    results = Path(__file__).parents[1] / "results"
    for exp in ("locality", "timing", "knockout"):
        for rec in sorted((results / exp).glob("smollm2-135m-gated-v3n2-seed2/*.json"))[:2]:
            dest = tmp_path / "results" / exp / rec.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(rec, dest / rec.name)
    first, rows = write_claims(tmp_path / "results", tmp_path / "a.json")
    second, _ = write_claims(tmp_path / "results", tmp_path / "b.json")
    assert rows and first.read_bytes() == second.read_bytes()
    doc = json.loads(first.read_text())
    assert set(doc) >= {"headline", "lineage", "lineages", "declarations", "claims"}
    assert all("role" in r and r["model"] in doc["lineages"] and r["id"] in doc["declarations"] for r in doc["claims"])
    assert all("n" in r["ours"] and "n_clusters" in r["ours"] for r in doc["claims"] if r["ours"])


def test_float_agreement_pairs_are_tested_as_booleans_and_summary_constants_as_differences():
    rows = _rows(12, rot=1.0, norot=1.0, commit=RNG.normal(0.75, 0.05, 12))
    same = evaluate(Claim("r", "rotated > unrotated", "greater", "rot", "norot", paper_value=0.6, paper="0.78 vs 0.18"),
                    _record("t", rows))
    same["q"] = same["p"]
    assert same["test"].startswith("McNemar") and same["p"] == 1.0
    assert verdict(same) == "not reproduced (CI at or below zero)"  # no instance differs although n = 12
    rec = _record("timing", rows)
    rec["summary"] = {"write_depth": 0.35}
    gap = evaluate(Claim("w", "write before commit", "greater", "commit", "summary.write_depth", paper_value=0.22, paper="0.38"), rec)
    assert gap["b_value"] == 0.35 and gap["ours"]["mean"] == pytest.approx(np.mean([r["commit"] for r in rows]) - 0.35)
    gap["q"] = gap["p"]
    assert verdict(gap) == "reproduced"
    rec["summary"] = {}
    assert evaluate(Claim("w", "x", "greater", "commit", "summary.write_depth", paper="x"), rec)["status"] == "empty"
