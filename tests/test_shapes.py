"""Typed summaries and rows (kvprobe.runner.shapes): every committed record of an experiment that declares them
validates and carries the current shape; every dotted path a claim reads names a declared field, so a field
renamed in the code and not in a claim fails here; the migration writes only the missing keys, as null."""

from __future__ import annotations

import difflib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvprobe.claims import Claim, claim_paths, claim_rows
from kvprobe.runner.experiment import available_experiments, get_experiment
from kvprobe.runner.records import load_records
from kvprobe.runner.shapes import Shape, complete, declares

RESULTS = Path(__file__).parents[1] / "results"
TYPED = ("heads", "knockout", "specificity", "suffix")  # the experiments whose records are typed (issue #53)


def _typed() -> list[str]:
    return sorted(n for n in available_experiments() if get_experiment(n).summary_model is not None)


def test_the_typed_experiments_declare_both_models():
    assert set(TYPED) <= set(_typed())
    for name in TYPED:
        exp = get_experiment(name)
        assert exp.row_model is not None, name
        # the readers test crossfit for None: it is declared, optional, and the runner writes it as null
        assert exp.summary_model.model_fields["crossfit"].default is None, name


@pytest.mark.parametrize("name", TYPED)
def test_committed_records_have_the_current_shape(name):
    """Each committed record's summary (migrated once by tools/migrate_records.py) holds every declared field and
    validates; each row as the claims read it validates against the row model."""
    exp = get_experiment(name)
    records = load_records(RESULTS, name)
    assert records
    for rec in records:
        s = rec["summary"]
        assert complete(exp.summary_model, s) is s, f"{rec['config_hash']}: run tools/migrate_records.py"
        exp.summary_model.model_validate(s)
        for row in claim_rows(rec):
            exp.row_model.model_validate(row)
        # the headline and table read through the model, on records with and without cross-fitting alike
        assert exp.headline(s) and exp.table(s)


@pytest.mark.parametrize("name", sorted(set(TYPED) | set(_typed())))
def test_every_claim_path_names_a_declared_field(name):
    exp = get_experiment(name)
    assert exp.claims
    for c in exp.claims:
        rows, summary = claim_paths(c)
        for path in rows:
            assert declares(exp.row_model, path), f"{name}.{c.key}: row path '{path}' is not in {exp.row_model}"
        for path in summary:
            assert declares(exp.summary_model, path), f"{name}.{c.key}: summary path '{path}' is not declared"


class _Inner(Shape):
    top8: float | None = None


class _Row(Shape):
    index: int
    cumulative: dict[str, float | None]
    turns: list[dict[str, float]] = []
    crossfit: _Inner | None = None


def test_declares_reads_paths_as_the_claims_do():
    assert declares(_Row, "cumulative.8") and declares(_Row, "crossfit.top8") and declares(_Row, "index")
    assert declares(_Row, "turns.*.cosine") and declares(_Row, "turns.@slope.x") and declares(_Row, "turns.0.x")
    assert declares(_Row, "cumulative.8 / cumulative.all")
    assert not declares(_Row, "cumulativ.8")  # a renamed field
    assert not declares(_Row, "crossfit.top16")  # an undeclared key of a model (extra fields pass, but not here)
    assert not declares(_Row, "index.x") and not declares(_Row, "cumulative.8 / nope")
    # a claim renamed in the code but not in its declaration fails the check
    claim = Claim("k", "t", "greater", "crossfit.top8", "cumulative.8", only="included", exclude=(("turns.0.x", 1),))
    assert claim_paths(claim) == (["crossfit.top8", "cumulative.8", "included", "turns.0.x"], [])
    assert claim_paths(Claim("k", "t", "greater", "x", "summary.depth")) == (["x"], ["depth"])


def test_complete_adds_only_missing_optional_fields_at_the_end():
    exp = get_experiment("knockout")
    s = {"a": 1, "crossfit": {"n": 1}}
    out = complete(exp.summary_model, s)
    assert out == {"a": 1, "crossfit": {"n": 1}, "row_measures": None} and list(out)[-1] == "row_measures"
    assert complete(exp.summary_model, out) is out
    assert complete(None, s) is s


def test_migration_writes_the_missing_keys_as_null_and_nothing_else(tmp_path):
    from tools.migrate_records import main

    src = next(p for p in sorted((RESULTS / "knockout").glob("*/*.json"))
               if json.loads(p.read_text())["summary"].get("crossfit") is not None)
    dest = tmp_path / "knockout" / src.parent.name / src.name
    dest.parent.mkdir(parents=True)
    record = json.loads(src.read_text())
    old: dict[str, Any] = {**record, "summary": {k: v for k, v in record["summary"].items()
                                                 if k not in ("crossfit", "row_measures")}}
    dest.write_text(json.dumps(old, indent=1) + "\n")
    odd = tmp_path / "knockout" / src.parent.name / "000000000000.json"
    odd.write_text(json.dumps(old))  # not the runner's formatting: left alone, and named
    before = dest.read_text()
    assert main(["--results", str(tmp_path), "--experiment", "knockout", "--check"]) == 1
    assert dest.read_text() == before
    odd.unlink()
    assert main(["--results", str(tmp_path), "--experiment", "knockout"]) == 0
    after = dest.read_text()
    new = json.loads(after)
    assert new["summary"]["crossfit"] is None and new["summary"]["row_measures"] is None
    assert {**new, "summary": {k: v for k, v in new["summary"].items() if k not in ("crossfit", "row_measures")}} == old
    # only the two added keys (and the comma they need) differ, line by line
    diff = [d for d in difflib.ndiff(before.splitlines(), after.splitlines()) if d[0] in "+-"]
    assert diff == ["-   }", "+   },", '+   "row_measures": null,', '+   "crossfit": null'], diff
    assert main(["--results", str(tmp_path), "--experiment", "knockout", "--check"]) == 0  # idempotent
    shutil.copy(dest, tmp_path / "copy.json")
    assert main(["--results", str(tmp_path), "--experiment", "knockout"]) == 0
    assert dest.read_bytes() == (tmp_path / "copy.json").read_bytes()
