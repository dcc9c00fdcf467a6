"""The cross-size locality grid (configs/locality_sizes.yaml): the rule before vs after the field in the same
formats, run on a tiny model; its cells ordered by model size, the report's table and the figure."""

from __future__ import annotations

import copy

from kvprobe.runner.config import load_config
from kvprobe.runner.experiment import run_experiment
from tests.test_generator import tiny_generator_dir  # noqa: F401  (fixture)


def _as_published(record, model, task="sizes"):
    rec = copy.deepcopy(record)
    rec["model"]["name"] = model
    return {**rec, "_task": task}


def test_locality_sizes_cells_by_size_table_and_figure(tiny_generator_dir, tmp_path, monkeypatch):  # noqa: F811
    from kvprobe import trends
    from kvprobe.figures.distance import fig_locality_sizes
    from kvprobe.app import report

    # generated families: the tiny tokenizer covers the generator's words, not the template's scenarios
    cfg = load_config("configs/locality_sizes.yaml", {
        "model": str(tiny_generator_dir), "output_dir": str(tmp_path), "task": {"scenarios": None},
        "params": {"distances": [40, 120], "instances_per_cell": 2, "formats": ["user_turn", "document_qa"]}})
    _, record = run_experiment(cfg, progress=False)
    assert set(record["summary"]["cells"]) == {"user_turn, rule before field", "user_turn, rule after field",
                                               "document_qa, rule before field", "document_qa, rule after field"}
    assert len(record["rows"]) == 16
    # three sizes given in the wrong order, one record of another task (not part of the grid), one organism
    records = [_as_published(record, "qwen2.5-coder-1.5b"), _as_published(record, "smollm2-135m"),
               _as_published(record, "qwen2.5-coder-0.5b", task="dtype_check"),
               _as_published(record, "qwen2.5-coder-0.5b", task="distance"),
               _as_published(record, "smollm2-135m-gated-v3n2-seed2")]
    sized = trends.size_records(records)
    assert [r["model"]["name"] for r in sized] == ["smollm2-135m", "qwen2.5-coder-1.5b"]
    assert [r["model"]["name"] for r in trends.size_records(records, kinds=("organism",))] == [
        "smollm2-135m-gated-v3n2-seed2"]
    cells = trends.size_cells(sized)
    assert len(cells) == 2 * 4 * 2
    assert [c["params_b"] for c in cells[::8]] == [0.135, 1.54]
    assert {c["rule"] for c in cells} == {"before field", "after field"}
    assert {c["distance"] for c in cells} == {40, 120}
    assert record["model"]["n_params"] > 0

    table = trends.sizes_markdown(records)
    lines = [line for line in table.splitlines() if line.startswith("| qwen2.5-coder-1.5b")]
    assert len(lines) == 8 and all("1.54 B" in line for line in lines)
    assert len([line for line in table.splitlines() if line.startswith("| smollm2-135m-gated")]) == 8
    one = cells[0]["cell"]
    assert f"| {one['n_included']}/{one['n']}" in table.splitlines()[2]
    assert "kvprobe:locality_sizes" not in table and "locality_sizes" in report.GENERATORS
    rows = trends.trend_rows(records)
    assert {r["key"] for r in rows} >= {"gate_rises_rule_first", "field_only_falls_rule_first"}

    fig_locality_sizes(records, tmp_path / "sizes.png")
    assert (tmp_path / "sizes.png").stat().st_size > 1000
    fig_locality_sizes([_as_published(record, "qwen2.5-coder-0.5b", task="distance")], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()  # no cell of the grid: no figure
