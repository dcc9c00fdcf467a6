"""Figures and notebooks read records only: render them from a record the CLI just wrote."""

import json
from pathlib import Path

import pytest

from kvprobe.figures import render_all
from kvprobe.app.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tiny_text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    assert main(["run", "configs/locality.yaml", "--model", str(tiny_text_dir), "--output-dir", str(out),
                 "--set", "task.n_instances=3", "--set", "gate.min_flip=0", "--quiet"]) == 0
    return out


def test_figures_render_from_records(results, tmp_path):
    paths = render_all(results, tmp_path)
    # one 3-instance locality record: Fig. 3a; no claims forest, since the forest draws tested effects only and
    # none is testable on 3 instances (below kvprobe's 10)
    assert [p.name for p in paths] == ["fig3a_locality.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def test_locality_notebook_runs_on_records(results, tmp_path):
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(REPO / "notebooks" / "locality.ipynb", as_version=4)
    work = tmp_path / "nb"
    (work / "results").mkdir(parents=True)
    (work / "results" / "locality").symlink_to(results / "locality")
    ExecutePreprocessor(timeout=120, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(work)}})
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    assert json.dumps(outputs).count("full_downstream") >= 1


def test_results_notebook_runs_on_records(results, tmp_path):
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(REPO / "notebooks" / "results.ipynb", as_version=4)
    work = tmp_path / "nb"
    work.mkdir()
    (work / "results").symlink_to(results)
    ExecutePreprocessor(timeout=120, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(work)}})
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs), outputs
    text = json.dumps(outputs)
    assert "locality" in text and "no edit_frontier records yet" in text


def _fake_locality(name: str, template: str, field_only: float) -> dict:
    stat = {"all": {"mean": field_only, "ci_low": field_only, "ci_high": field_only}, "gated": {"mean": None}}
    rows = [{"index": i, "scenario": f"s{i}", "included": False, "field_only": field_only} for i in range(2)]
    return {"experiment": "locality", "model": {"name": name}, "config": {"task": {"template": template}}, "rows": rows,
            "summary": {"n_included": 0, "n_instances": 2, "oracle_flip": {"median": 0.1},
                        "recovery": {s: stat for s in ("stale", "field_only", "full_downstream", "oracle")}}}


def test_off_template_records_never_replace_the_main_bar(tmp_path):
    from kvprobe.figures.common import GATED_TEMPLATE, latest_per_model
    from kvprobe.figures.locality import fig3a_locality, figC_offtemplate

    main_rec = _fake_locality("m", GATED_TEMPLATE, 0.1)
    off_rec = _fake_locality("m", "configs/tasks/twohop.yaml", 0.9)
    assert latest_per_model([main_rec, off_rec], GATED_TEMPLATE)["m"] is main_rec
    assert latest_per_model([main_rec, off_rec])["m"] is off_rec
    from kvprobe.figures.common import main_per_model

    assert main_per_model([main_rec, off_rec])["m"]["_task"] == "gated"  # Fig. 3a's bar: the template, labelled
    assert main_per_model([off_rec])["m"]["_task"] == "twohop"  # a model measured off-template only: that, labelled
    fig3a_locality([main_rec, off_rec], tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 5000
    figC_offtemplate([main_rec, off_rec], tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 5000


def test_organisms_notebook_runs_on_the_committed_cards(tmp_path):
    """notebooks/organisms.ipynb reads the organism cards the package ships (no records needed)."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(REPO / "notebooks" / "organisms.ipynb", as_version=4)
    ExecutePreprocessor(timeout=120, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs), outputs
    text = json.dumps(outputs)
    assert "validation_large" in text and "smollm2-135m-gated-v3r" in text
    assert any(o.get("output_type") == "display_data" for o in outputs)  # the validation-against-test scatter


def test_fig3a_splits_each_model_by_the_rule_position_one_record_per_bar():
    from kvprobe.figures.locality import rule_split
    from kvprobe.app.report import published

    organism = "smollm2-135m-gated-v3n2-seed2"
    mine = [r for r in published(REPO / "results") if r["model"]["name"] == organism]
    split = rule_split(mine)[organism]
    before, after = split["before_field"], split["after_field"]
    assert before[0] is after[0] and before[0]["_task"] == "rule_position"  # the same-format test serves both
    assert {r["rule_at"] for r in before[1]} == {"before_field"} and len(before[1]) == len(after[1]) == 24
    locality_only = rule_split([r for r in mine if r["experiment"] == "locality"])[organism]
    assert locality_only["before_field"][0]["_task"].startswith("generated_test_system_user")
    assert locality_only["after_field"][0] is not locality_only["before_field"][0]
