"""memory (E2/E3/E4) on a tiny model, and the persona generator: AND labels balanced, the toggle flips the
decision, the irrelevant setting does not, layouts place the relevant facts as asked."""

from __future__ import annotations

import json

import pytest

from kvprobe.runner.cli import main
from kvprobe.tasks.memory import ANSWER_PREFIX, persona_instance


def test_persona_generator():
    insts = [persona_instance(i, 0, 20, layout="contiguous" if i % 2 else "split") for i in range(8)]
    assert sum(i.action == "allow" for i in insts) == 4
    for i in insts:
        flip = "enabled" if i.value_of(i.toggle) == "disabled" else "disabled"
        assert i.with_value(i.toggle, flip).action != i.action
        other = "enabled" if i.value_of(i.irrelevant) == "disabled" else "disabled"
        assert i.with_value(i.irrelevant, other).action == i.action and i.irrelevant not in i.relevant
        rel = sorted(i.setting_line[s] for s in i.relevant)
        assert (rel[1] - rel[0] == 1) == (i.meta["layout"] == "contiguous")


@pytest.fixture(scope="module")
def tiny_persona_dir(tmp_path_factory):
    from kvprobe.models.tiny import write_tiny_model_dir

    texts = []
    for i in range(4):
        inst = persona_instance(i, 0, 16, layout="contiguous" if i % 2 else "split")
        texts.append(inst.body(erratum="[MEMORY UPDATE] enabled disabled " + " ".join(inst.setting_line))
                     + " " + ANSWER_PREFIX + " allow refuse")
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("tinypersona"), texts)


def test_memory_end_to_end(tiny_persona_dir, tmp_path):
    from kvprobe.figures.memory import fig_memory

    assert main(["run", "configs/memory.yaml", "--model", str(tiny_persona_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=4", "--set", "params.n_lines=16", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("memory/*/*.json")).read_text())
    for row in rec["rows"]:
        assert row["blocks1_cosine"] == row["seam0_cosine"]
        assert row["edit_cost"]["1"] == 1.0 and row["edit_cost"]["8"] < row["edit_cost"]["2"] < 1.0
        e = row["edit"]
        assert "skipped" not in e and e["stale"]["recompute_fraction"] == 0.0
        assert 0 < e["in_place"]["recompute_fraction"] < e["erratum"]["recompute_fraction"] + 1
    s = rec["summary"]
    assert s["label_balance"] == 0.5 and set(s["granularity"]) == {"contiguous", "split"}
    assert set(s["edit"]["methods"]) == {"stale", "in_place", "erratum", "field_erratum"}
    fig_memory([rec], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000
