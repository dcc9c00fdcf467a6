"""Trends across model size (kvprobe.trends): the GEE slope, the verdicts, and the cell verdicts, on synthetic
records whose answer is known (a rising, a falling, a flat and an unmeasurable curve)."""

from __future__ import annotations

import math
import random

import pytest

from kvprobe.trends import Trend, cell_verdict, evaluate_trend

SIZES = {"small": 0.135, "mid": 0.494, "large": 1.54}


def _records(gate_rate: dict[str, float], field_only: dict[str, float], n: int = 24, noise: float = 0.05,
             seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for model, size in SIZES.items():
        rows = []
        for i in range(n):
            included = rng.random() < gate_rate[model]
            rows.append({"scenario": f"s{i % 12}", "format": "user_turn", "distance_target": 150 if i % 2 else 1000,
                         "rule_at": "before_field", "included": included,
                         "field_only": field_only[model] + rng.gauss(0, noise) if included else 0.0})
        out.append({"experiment": "locality_distance", "model": {"name": model}, "_params_b": size, "rows": rows})
    return out


def test_rising_gate_rate_is_supported_and_its_opposite_contradicted() -> None:
    recs = _records({"small": 0.0, "mid": 0.4, "large": 0.9}, {"small": 0.5, "mid": 0.5, "large": 0.5})
    up = evaluate_trend(Trend("t", "", "gate", "rises"), recs)
    assert up["verdict"] == "supported" and up["slope_per_decade"] > 0.5, up
    down = evaluate_trend(Trend("t", "", "gate", "falls"), recs)
    assert down["verdict"] == "contradicted"


def test_falling_field_only_and_a_flat_one() -> None:
    recs = _records({m: 1.0 for m in SIZES}, {"small": 0.9, "mid": 0.5, "large": 0.1})
    assert evaluate_trend(Trend("t", "", "field_only", "falls"), recs)["verdict"] == "supported"
    assert evaluate_trend(Trend("t", "", "field_only", "flat", margin=0.1), recs)["verdict"] == "contradicted"
    flat = _records({m: 1.0 for m in SIZES}, {m: 0.02 for m in SIZES}, noise=0.01)
    row = evaluate_trend(Trend("t", "", "field_only", "flat", margin=0.1), flat)
    assert row["verdict"] == "supported" and abs(row["slope_per_decade"]) < 0.05
    # a constant outcome with noise gives no direction
    assert evaluate_trend(Trend("t", "", "field_only", "rises"), flat)["verdict"] == "inconclusive"


def test_a_trend_needs_two_sizes_with_enough_units() -> None:
    recs = _records({"small": 0.0, "mid": 0.1, "large": 0.9}, {m: 0.3 for m in SIZES}, n=12)
    row = evaluate_trend(Trend("t", "", "field_only", "falls"), recs)
    assert row["verdict"].startswith("not measurable"), row  # only the largest model gates >= 5 times
    assert evaluate_trend(Trend("t", "", "gate", "rises", (("rule_at", "after_field"),)), recs)[
        "verdict"].startswith("not measurable")  # no row matches


def test_where_takes_one_of_several_values() -> None:
    recs = _records({m: 1.0 for m in SIZES}, {m: 0.5 for m in SIZES})
    row = evaluate_trend(Trend("t", "", "gate", "rises", (("format", ("user_turn", "document_qa")),)), recs)
    assert sum(row["units_per_model"].values()) == 72
    row = evaluate_trend(Trend("t", "", "gate", "rises", (("format", ("document_qa",)),)), recs)
    assert row["units_per_model"] == {}


def test_flat_needs_a_margin() -> None:
    with pytest.raises(ValueError, match="margin"):
        Trend("t", "", "field_only", "flat")
    with pytest.raises(ValueError, match="margin"):
        Trend("t", "", "field_only", "rises", margin=0.1)


@pytest.mark.parametrize("stat, verdict", [
    ({"n": 12, "n_clusters": 12, "mean": 0.01, "ci_low": -0.03, "ci_high": 0.05}, "near 0"),
    ({"n": 12, "n_clusters": 12, "mean": 0.8, "ci_low": 0.7, "ci_high": 0.9}, "above 0"),
    ({"n": 12, "n_clusters": 12, "mean": 0.1, "ci_low": 0.0, "ci_high": 0.2}, "inconclusive"),
    ({"n": 9, "n_clusters": 9, "mean": 0.0, "ci_low": -0.01, "ci_high": 0.01}, "not measurable: 9 gated in 9 clusters"),
    ({"n": 12, "n_clusters": 4, "mean": 0.0, "ci_low": None, "ci_high": None}, "not measurable: 12 gated in 4 clusters"),
    (None, "not measurable: none gated"),
])
def test_cell_verdicts(stat: dict | None, verdict: str) -> None:
    assert cell_verdict(stat) == verdict


def test_declared_trends_are_well_formed() -> None:
    from kvprobe.trends import declared_trends

    trends = declared_trends()
    assert len(trends) >= 5 and len({t.key for _, t in trends}) == len(trends)
    assert all(t.text and (t.margin is None or math.isfinite(t.margin)) for _, t in trends)


def test_dtype_check_matches_instances_and_reports_the_largest_difference() -> None:
    from kvprobe.trends import dtype_check_markdown

    def rec(task: str, dtype: str, shift: float) -> dict:
        rows = [{"index": i, "scenario": f"s{i}", "flip": 2.0 + shift, "included": True, "field_only": 0.3 + shift * i}
                for i in range(4)]
        return {"experiment": "locality_distance", "model": {"name": "m", "dtype": dtype}, "_task": task, "rows": rows}

    text = dtype_check_markdown([rec("sizes", "torch.bfloat16", 0.01), rec("dtype_check", "torch.float32", 0.0)],
                                "m")
    assert text.startswith("4 instances, float32 / bfloat16: largest flip difference 0.010 nats, largest field-only "
                           "difference 0.030"), text
    assert "no sizes" in dtype_check_markdown([rec("sizes", "torch.bfloat16", 0.0)], "m")
