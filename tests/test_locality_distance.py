"""locality_distance end to end on a tiny model: cells per (format, distance), measured distances, paired
families, infeasible cells listed, the full-downstream identity, and the figure from the record."""

from __future__ import annotations

from kvprobe.runner.config import load_config
from kvprobe.runner.experiment import run_experiment
from kvprobe.tasks.generator import distance_tolerance
from tests.test_generator import tiny_generator_dir  # noqa: F401  (fixture)


def test_locality_distance_cells_and_figure(tiny_generator_dir, tmp_path):  # noqa: F811
    from kvprobe.figures.distance import fig_locality_distance

    cfg = load_config("configs/locality_distance.yaml", {
        "model": str(tiny_generator_dir), "output_dir": str(tmp_path),
        "params": {"distances": [30, 90], "formats": ["system_user", "gated_template"], "instances_per_cell": 2}})
    _, record = run_experiment(cfg, progress=False)
    rows, summary = record["rows"], record["summary"]
    assert len(rows) == 4 and set(summary["cells"]) == {"system_user"}
    assert {(x["format"], x["distance"]) for x in summary["infeasible"]} == {("gated_template", 30),
                                                                            ("gated_template", 90)}
    for r in rows:
        assert abs(r["distance_tokens"] - r["distance_target"]) <= distance_tolerance(r["distance_target"])
        assert abs(r["full_downstream_ld"] - r["oracle_ld"]) < 1e-4  # identity: same prefix before the field
    by_draw = {}
    for r in rows:  # draw j is the same family in every cell
        by_draw.setdefault(r["index"] % 2, set()).add(r["family"])
    assert all(len(f) == 1 for f in by_draw.values()) and len(set().union(*by_draw.values())) == 2
    cell = summary["cells"]["system_user"]["30"]
    assert cell["n"] == 2 and 0 <= cell["inclusion_rate"] <= 1 and "median" in cell["oracle_flip"]
    assert "inclusion_rule" in summary and "oracle flip" in summary["effect_size"]
    fig_locality_distance([record], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000


def test_rule_positions_split_cells_by_where_the_rule_sits_in_the_same_format(tiny_generator_dir, tmp_path):  # noqa: F811
    """The same-format test: document_qa and user_turn each measured with the rule before and after the
    field, on the same families; a format that cannot move its rule is measured once, at its own place."""
    cfg = load_config("configs/locality_distance.yaml", {
        "model": str(tiny_generator_dir), "output_dir": str(tmp_path),
        "params": {"distances": [120], "formats": ["document_qa", "user_turn", "system_user"],
                   "instances_per_cell": 2, "rule_positions": ["before_field", "after_field"]}})
    _, record = run_experiment(cfg, progress=False)
    cells = record["summary"]["cells"]
    assert set(cells) == {"document_qa, rule before field", "document_qa, rule after field",
                          "user_turn, rule before field", "user_turn, rule after field",
                          "system_user, rule before field"}
    rows = record["rows"]
    assert len(rows) == 10
    by_draw = {}
    for r in rows:
        by_draw.setdefault(r["index"] % 2, set()).add(r["family"])
    assert all(len(f) == 1 for f in by_draw.values())  # paired: one family per draw across all cells
    assert all(c["120"]["n"] == 2 for c in cells.values())
