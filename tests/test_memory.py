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


def test_e4_layout_is_crossed_with_the_label():
    """E4 compares contiguous with split relevant facts: each layout must meet both labels equally often, or the
    layout contrast is the label contrast (layouts[i % 2] gave contiguous = allow, split = refuse throughout)."""
    from collections import Counter
    from types import SimpleNamespace

    from kvprobe.experiments.memory import Params, make_instances

    ctx = SimpleNamespace(cfg=SimpleNamespace(seed=0, task=SimpleNamespace(n_instances=8)),
                          params=Params(n_lines=20))
    cells = Counter((i.meta["layout"], i.action) for i in make_instances(ctx))
    assert cells == {(lay, act): 2 for lay in ("contiguous", "split") for act in ("allow", "refuse")}


def test_e4_crossed_design_is_in_the_record_hash():
    """The crossed layout changed what a memory run computes: records of the confounded design (layouts[i % 2])
    must not share its name, so the period is resolved into the hash (not hash-neutral), and an odd one (which
    would unbalance the cells) is refused."""
    import pytest
    from pydantic import ValidationError

    from kvprobe.experiments.memory import Params
    from kvprobe.schema import hashed_params

    assert hashed_params(Params())["layout_period"] == 2
    with pytest.raises(ValidationError):
        Params(layout_period=3)


def test_persona_placement_and_length():
    """Early puts the memory before the conversation, late after it; the same user at every length."""
    late, early = persona_instance(3, 0, 20), persona_instance(3, 0, 40, placement="early")
    assert late.body().index("CONVERSATION") < late.body().index("USER MEMORY")
    assert early.body().index("USER MEMORY") < early.body().index("CONVERSATION") < early.body().index("REQUEST")
    assert (late.relevant, late.request, late.action) == (early.relevant, early.request, early.action)
    for inst in (late, early):
        body, chars = inst.body(), inst.line_chars()
        assert all(body[c:].startswith(f"- {line}\n") for c, line in zip(chars, inst.lines))
    with pytest.raises(Exception):
        persona_instance(0, 0, 20, placement="middle")


@pytest.fixture(scope="module")
def tiny_persona_dir(tmp_path_factory):
    from kvprobe.models.tiny import write_tiny_model_dir

    texts = []
    for i in range(4):
        inst = persona_instance(i, 0, 16, layout="contiguous" if i % 2 else "split")
        texts.append(inst.body(erratum="[MEMORY UPDATE] enabled disabled " + " ".join(inst.setting_line))
                     + " " + ANSWER_PREFIX + " allow refuse")
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("tinypersona"),
                                texts + [persona_instance(0, 0, 12, placement="early").body() + " check required"])


def test_memory_end_to_end(tiny_persona_dir, tmp_path):
    from kvprobe.figures.memory import fig_memory

    assert main(["run", "configs/memory.yaml", "--model", str(tiny_persona_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=4", "--set", "params.n_lines=16", "--set", "params.e1_lines=[12, 20]",
                 "--set", "params.chain_tokens=3", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("memory/*/*.json")).read_text())
    for row in rec["rows"]:
        assert row["blocks1_cosine"] == row["seam0_cosine"] and row["answer_prefix_tokens"] >= 1
        assert row["edit_cost"]["1"] == 1.0 and row["edit_cost"]["16"] < row["edit_cost"]["8"] < row["edit_cost"]["2"] < 1.0
        e = row["edit"]
        assert "skipped" not in e and e["stale"]["recompute_fraction"] == 0.0
        assert 0 < e["in_place"]["recompute_fraction"] < e["erratum"]["recompute_fraction"] + 1
        assert all(isinstance(e[m][mode], bool) for m in ("stale", "erratum") for mode in ("direct", "chain"))
        assert e["stale"]["chain_decided_by"] in ("chain", "forced")
        # E1: 2 lengths x 2 placements x 2 modes; the longer memory has more tokens in both placements
        assert len(row["e1"]) == 8 and {c["mode"] for c in row["e1"]} == {"direct", "chain"}
        tok = {(c["lines"], c["placement"]): c["memory_tokens"] for c in row["e1"]}
        assert tok[(20, "early")] > tok[(12, "early")] and abs(tok[(12, "early")] - tok[(12, "late")]) <= 1
        assert all(0 < c["n_tokens"] <= 3 for c in row["e1"] if c["mode"] == "chain")
    s = rec["summary"]
    assert s["label_balance"] == 0.5 and set(s["granularity"]) == {"contiguous", "split"}
    assert set(s["edit"]["methods"]) == {"stale", "in_place", "erratum", "field_erratum"}
    assert set(s["edit"]["erratum_vs_in_place"]) == {"direct", "chain"}
    e1 = s["e1"]
    assert set(e1["accuracy"]["chain"]) == {"early", "late"} and e1["accuracy"]["direct"]["late"]["20"]["n"] == 4
    g = e1["gee_placement"]["direct"]
    assert g["n"] == 16 and g["reference"] == "early" and g["n_clusters"] >= 1
    assert set(s["row_measures"]) == {"e1_direct", "e1_chain"}
    fig_memory([rec], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000
