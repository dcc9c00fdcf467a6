"""A rerun of a recorded config goes to runs/ and is checked against the committed record (first contact)."""

import copy
import json

from kvprobe.runner.config import load_config
from kvprobe.runner.experiment import run_experiment
from kvprobe.runner.reproduce import compare_records, reproduction_table

ROW = {"index": 0, "scenario": "s", "included": False, "stale_ld": 3.68, "oracle_ld": 3.71, "flip": 0.03,
       "field_only_ld": 3.69, "stale": 0.0, "field_only": 0.3333, "oracle": 1.0, "curve": [0.1, 0.2], "seconds": 9.0}


def record(*rows):
    return {"rows": [dict(r) for r in rows]}


def test_equal_rows_reproduce_and_timings_are_ignored():
    new = copy.deepcopy(ROW) | {"seconds": 1.0}
    check = compare_records(record(ROW), record(new))
    assert check.verdict == "reproduced" and check.nats["flip"] == 0.0 and not check.mismatches


def test_tiny_flip_noise_in_recovery_is_reported_not_judged():
    # 2e-5 nats of fp32 noise over a 0.03-nat flip moves the recovery ratio by ~7e-4: still reproduced
    new = copy.deepcopy(ROW) | {"field_only_ld": 3.69002, "field_only": 0.3340}
    check = compare_records(record(ROW), record(new))
    assert check.verdict == "reproduced"
    assert abs(check.recovery_all["field_only"] - 7e-4) < 1e-6 and "field_only" not in check.recovery_included


def test_a_logit_difference_beyond_tolerance_differs():
    new = copy.deepcopy(ROW) | {"oracle_ld": 3.71 + 2e-3}
    check = compare_records(record(ROW), record(new))
    assert check.verdict == "differs" and abs(check.nats["oracle_ld"] - 2e-3) < 1e-9
    assert compare_records(record(ROW), record(new), tol_nats=5e-3).verdict == "reproduced"


def test_discrete_changes_and_missing_instances_differ():
    assert compare_records(record(ROW), record(ROW | {"included": True})).verdict == "differs"
    assert compare_records(record(ROW), record(ROW | {"curve": [0.1, 0.5]})).verdict == "differs"
    removed = {k: v for k, v in ROW.items() if k != "field_only_ld"}
    assert compare_records(record(ROW), record(removed)).verdict == "differs"
    added = compare_records(record(ROW), record(ROW | {"n_downstream": 600}))
    assert added.verdict == "reproduced" and added.added_fields == {"n_downstream"}
    check = compare_records(record(ROW, ROW | {"index": 1}), record(ROW))
    assert check.verdict == "differs" and "instance 1" in check.mismatches[0]
    table = reproduction_table(check.to_dict())
    assert "verdict: differs" in table and "1 of 2 instances" in table


def test_rerun_of_a_recorded_config_goes_to_runs_and_reproduces(tiny_text_dir, tmp_path):
    cfg = load_config("configs/locality.yaml", {"model": str(tiny_text_dir), "task": {"n_instances": 2},
                                                "output_dir": str(tmp_path / "results")})
    first, rec1 = run_experiment(cfg, progress=False)
    assert first.parent.parent.parent == tmp_path / "results" and "reproduction" not in rec1
    committed = first.read_bytes()
    second, rec2 = run_experiment(cfg, progress=False)
    assert second == tmp_path / "runs" / first.relative_to(tmp_path / "results")
    assert first.read_bytes() == committed  # the committed record is untouched
    rep = rec2["reproduction"]
    assert rep["verdict"] == "reproduced" and rep["max_abs_diff_nats"]["oracle_ld"] == 0.0
    assert json.loads(second.read_text())["reproduction"]["reference"] == str(first)
    third, _ = run_experiment(cfg, progress=False)  # a second reproduction replaces the untracked copy
    assert third == second
    replaced, rec4 = run_experiment(cfg, progress=False, overwrite=True)  # the explicit way to replace
    assert replaced == first and "reproduction" not in rec4


def test_the_tolerance_is_the_stated_factor_over_the_measured_thread_spread():
    from kvprobe.runner.reproduce import DEFAULT_TOL_NATS, THREAD_SPREAD_NATS, TOLERANCE_FACTOR

    assert TOLERANCE_FACTOR * THREAD_SPREAD_NATS <= DEFAULT_TOL_NATS < 2 * TOLERANCE_FACTOR * THREAD_SPREAD_NATS
    at_one_thread = copy.deepcopy(ROW) | {"oracle_ld": 3.71 + THREAD_SPREAD_NATS}  # the measured 1-thread rerun
    assert compare_records(record(ROW), record(at_one_thread)).verdict == "reproduced"
    real_change = copy.deepcopy(ROW) | {"oracle_ld": 3.71 + 2 * DEFAULT_TOL_NATS}
    assert compare_records(record(ROW), record(real_change)).verdict == "differs"


def test_no_recovery_is_printed_when_no_instance_is_included():
    """A recovery over a flip of noise is noise: with nothing included the table shows nats only."""
    noisy = copy.deepcopy(ROW) | {"field_only": 17.3}
    table = reproduction_table({"reference": "r", **compare_records(record(ROW), record(noisy)).to_dict()})
    assert "max |d recovery|" not in table and "1.70e+01" not in table
    assert "recoveries not compared: no instance passed the inclusion rule" in table
    included = [ROW | {"included": True}]
    table = reproduction_table({"reference": "r", **compare_records(record(*included), record(*included)).to_dict()})
    assert "max |d recovery|" in table


def test_the_locality_table_prints_no_ratio_when_nothing_is_included():
    from kvprobe.probes.summary import format_recovery_table

    stat = {"mean": 7.56, "ci_low": 0.64, "ci_high": 19.5, "n": 48}
    summary = {"n_instances": 48, "n_included": 0, "gate": {"min_flip": 0.5}, "oracle_flip": {"median": 0.03},
               "recovery": {s: {"gated": {"mean": None, "n": 0}, "all": stat} for s in ("stale", "field_only")}}
    table = format_recovery_table(summary, ("stale", "field_only"))
    assert "7.56" not in table and "+7.560" not in table and "recoveries not shown" in table
