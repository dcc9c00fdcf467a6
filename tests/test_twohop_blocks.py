"""twohop_blocks on a tiny model, and the memory generator's two-hop draws: same user and layout in both
conditions, balanced labels, both values among the distractors, block boundaries where the layout says."""

from __future__ import annotations

import json

import pytest

from kvprobe.runner.cli import main
from kvprobe.tasks.memory import ANSWER_PREFIX, twohop_instance


@pytest.fixture(scope="module")
def tiny_memory_dir(tmp_path_factory):
    """A tiny Llama whose word-level tokenizer covers the memory prompts."""
    from kvprobe.models.tiny import write_tiny_model_dir

    texts = [twohop_instance(i, 0, c).body() + " " + ANSWER_PREFIX + " allow refuse" for i in range(8)
             for c in ("twohop", "independent")]
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("tinymem"), texts)


def test_twohop_draws_pair_the_conditions_and_balance_labels():
    insts = [twohop_instance(i, 0, "twohop") for i in range(8)]
    assert sum(i.action == "allow" for i in insts) == 4
    for i in insts:
        ctrl = twohop_instance(i.index, 0, "independent")
        a, b = i.marks["a"], i.marks["b"]
        assert ctrl.marks == i.marks and ctrl.lines[b] == i.lines[b] == f"{i.scenario}: {i.meta['value']}"
        assert i.lines[a].startswith("DEFINITION") and i.scenario in i.lines[a] and i.scenario not in i.request
        assert not ctrl.lines[a].startswith("DEFINITION") and i.scenario in ctrl.request
        values = {ln.split(": ")[1] for ln in i.lines if ln.count(":") == 1 and ln.split(": ")[1] in
                  ("enabled", "disabled") and not ln.startswith(i.scenario)}
        assert values == {"enabled", "disabled"}  # distractor settings take both values


def test_twohop_blocks_end_to_end(tiny_memory_dir, tmp_path):
    from kvprobe.figures.twohop_blocks import figG_twohop_blocks

    assert main(["run", "configs/twohop_blocks.yaml", "--model", str(tiny_memory_dir), "--output-dir",
                 str(tmp_path), "--set", "task.n_instances=4", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("twohop_blocks/*/*.json")).read_text())
    for row in rec["rows"]:
        for cond in ("twohop", "independent"):
            r = row[cond]
            assert r["boundaries"]["split"] < r["boundaries"]["together"] < r["n_tokens"]
            assert all(0 <= r[f"{lay}_cosine"] <= 1.0001 for lay in ("split", "together", "one_block"))
    s = rec["summary"]
    assert s["label_balance"] == 0.5 and s["twohop"]["full_accuracy"]["n"] == 4
    # a random-init model is at chance: every row says so, and the claims count only rows where the model decides
    assert not s["informative"] and len(s["row_measures"]["informative"]["rows"]) == 4
    assert not any(m["model_decides"] for m in s["row_measures"]["informative"]["rows"].values())
    from kvprobe.claims import evaluate
    from kvprobe.runner.experiment import get_experiment

    assert all(evaluate(c, rec)["n"] == 0 for c in get_experiment("twohop_blocks").claims)
    assert "uninformative" in s["verdict_note"]
    figG_twohop_blocks([rec], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000
