"""The competence screen: the verdict can fail (a constant answer is at chance, too few instances or clusters
give no verdict), the two-choice read is the teacher-forced log-probability, prefix reuse is a full prefill,
every application task runs end to end on a tiny model, and kvprobe.competence reads the verdict back."""

from __future__ import annotations

import json

import pytest
import torch

from kvprobe.competence import competence, gate_note
from kvprobe.errors import KVProbeError
from kvprobe.experiments.screen import Params, cell
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.probes.decision import ChainSpec, PrefixReuse, TwoChoice, read_decision
from kvprobe.tasks.memory import ANSWER_PREFIX, persona_instance, twohop_instance
from tests.test_locomo import _archive, load_locomo


def _row(i: int, scenario: str, old: str, new: str, correct: tuple[str, str], ld: tuple[float, float]) -> dict:
    """A screen row: decisions under the old and the new value (``correct``: the right action of each)."""
    read = {s: {"decision": d, "correct": d == c, "ld": v, "decided_by": "direct", "chain_tokens": 0,
                "chain_text": ""} for s, d, c, v in (("old", old, correct[0], ld[0]), ("new", new, correct[1], ld[1]))}
    return {"task": "memory", "scenario": scenario, "reads": {"direct": read}, "field_effect": {"direct": ld[1] - ld[0]},
            "follows_field": {"direct": old != new}}


def _labels(i: int) -> tuple[str, str]:
    return ("refuse", "allow") if i % 2 else ("allow", "refuse")


def test_a_constant_answer_is_at_chance_and_not_competent():
    rows = [_row(i, f"s{i % 6}", "allow", "allow", _labels(i), (1.0, 1.1)) for i in range(12)]
    c = cell(rows, "direct", Params())
    assert c["accuracy"]["mean"] == 0.5 and c["n_decisions"] == 24 and c["action_counts"] == {"allow": 24}
    assert not c["varies"] and c["follows_field"] == 0 and c["competent"] is False
    assert "not above chance" in c["verdict"]


def test_a_decider_is_competent_only_with_enough_instances_clusters_and_accuracy():
    decide = [_row(i, f"s{i % 6}", *_labels(i), _labels(i), (-2.0, 2.0)) for i in range(12)]
    c = cell(decide, "direct", Params())
    assert c["accuracy"]["mean"] == 1.0 and c["varies"] and c["competent"] is True
    assert c["field_effect"]["mean"] == pytest.approx(4.0)
    assert cell(decide[:9], "direct", Params())["competent"] is None  # 9 instances: no verdict
    few = [{**r, "scenario": f"s{i % 4}"} for i, r in enumerate(decide)]
    assert cell(few, "direct", Params())["competent"] is None  # 4 clusters: no verdict
    # 20 of 24 right: 0.83, above chance; passes the 0.80 gate, fails a gate of 0.9
    mixed = decide[:10] + [_row(i, f"s{i % 6}", "allow", "allow", _labels(i), (0.0, 0.0)) for i in (10, 11)]
    m = cell(mixed, "direct", Params())
    assert m["accuracy"]["mean"] == pytest.approx(22 / 24) and m["competent"] is True
    worse = decide[:8] + [_row(i, f"s{i % 6}", "allow", "allow", _labels(i), (0.0, 0.0)) for i in range(8, 12)]
    w = cell(worse, "direct", Params())
    assert w["accuracy"]["mean"] == pytest.approx(20 / 24) and w["competent"] is True
    assert cell(worse, "direct", Params(gate=0.9))["competent"] is False


def test_competence_reads_the_record_back():
    decide = [_row(i, f"s{i % 6}", *_labels(i), _labels(i), (-2.0, 2.0)) for i in range(12)]
    const = [_row(i, f"s{i % 6}", "allow", "allow", _labels(i), (1.0, 1.0)) for i in range(12)]
    rec = {"experiment": "screen", "config_hash": "abc", "config": {"model": "m"}, "model": {"name": "m"},
           "summary": {"cells": {"memory": {"direct": cell(decide, "direct", Params()),
                                            "chain": cell(const, "direct", Params())}}}}
    acc, ci, varies, ok = competence("m", "memory", "direct", records=[rec])
    assert acc == 1.0 and ci[0] > 0.5 and varies and ok is True
    assert gate_note("m", "memory", "direct", records=[rec]) is None
    acc, ci, varies, ok = competence("m", "memory", "chain", records=[rec])
    assert acc == 0.5 and ci[0] < 0.5 < ci[1] and not varies and ok is False
    assert "below the competence gate" in gate_note("m", "memory", "chain", records=[rec])
    assert competence("m", "memory", "direct", records=[rec], gate=1.01).competent is False
    with pytest.raises(KVProbeError, match="was not screened"):
        competence("m", "tau2", records=[rec])
    with pytest.raises(KVProbeError, match="configs/screen.yaml"):
        competence("other", "memory", records=[rec])
    assert gate_note("other", "memory", records=[rec]).startswith("not measurable: competence not screened")


@pytest.fixture(scope="module")
def tiny_screen(tmp_path_factory, template):
    """A tiny Llama whose word-level tokenizer covers every application task's prompts."""
    from kvprobe.models.tiny import write_tiny_model_dir
    from kvprobe.tasks.gated import generate_instances

    root = tmp_path_factory.mktemp("tinyscreen")
    zpath = _archive(root / "locomo10.zip")
    texts = [i.body(i.old_value) + " " + i.body(i.new_value) + " " + i.answer_prefix + " " + i.old_action + " "
             + i.new_action for i in generate_instances(template, 24, seed=0)]
    texts += [persona_instance(i, 0, 16).body() + " " + twohop_instance(i, 0, "twohop").body() for i in range(4)]
    texts += [ANSWER_PREFIX + " allow refuse enabled disabled cancel deny pending processed step think Let me"]
    for conv in load_locomo(zpath):
        texts.append(conv.system() + "".join(s.render() for s in conv.sessions) + " ".join(
            f"{q.render()} {q.answer}" for q in conv.qa))
    return write_tiny_model_dir("llama-default", root / "model", texts), zpath


def test_two_choice_read_is_the_teacher_forced_log_probability(tiny_screen):
    from kvprobe.models.loading import load_model

    lm = load_model(str(tiny_screen[0]), device="cpu", dtype="float32")
    ids = lm.tokenizer("the user prefers tea allow refuse cancel deny", add_special_tokens=False)["input_ids"]
    ctx, prefix, a, b = ids[:4], ids[4:5], tuple(ids[5:7]), tuple(ids[7:9])
    state = prefill(lm, ctx)
    tc = TwoChoice(tuple(ctx), tuple(prefix), (a, b), ("a", "b"), 0)
    d = read_decision(lm, state, tc, "direct")

    def logprob(cand):  # a plain forward over the whole sequence
        with torch.no_grad():
            out = lm.model(torch.tensor([ctx + prefix + list(cand)])).logits[0].log_softmax(-1)
        at = len(ctx) + len(prefix) - 1
        return sum(float(out[at + k, t]) for k, t in enumerate(cand))

    assert d.ld == pytest.approx(logprob(a) - logprob(b), abs=1e-4) and d.choice == (0 if d.ld > 0 else 1)
    one = TwoChoice(tuple(ctx), tuple(prefix), ((a[0],), (b[0],)), ("a", "b"), 1)
    lg = read_logits(lm, state, prefix)[0]
    assert read_decision(lm, state, one, "direct").ld == pytest.approx(float(lg[a[0]] - lg[b[0]]), abs=1e-5)
    ch = read_decision(lm, state, tc, "chain", ChainSpec(tuple(ids[:2]), tuple(prefix), 3))
    assert ch.decided_by in ("chain", "forced") and 1 <= ch.chain_tokens <= 3
    with pytest.raises(KVProbeError, match="ChainSpec"):
        read_decision(lm, state, tc, "chain")
    # prefix reuse gives the full prefill's cache
    reuse = PrefixReuse(lm, min_shared=2)
    reuse.state(ids[:6])
    again = reuse.state(ids[:4] + ids[6:8])
    assert reuse.prefilled == 6 + 2 and again.max_abs_diff(prefill(lm, ids[:4] + ids[6:8])) < 1e-4


def test_screen_end_to_end_on_every_task(tiny_screen, tmp_path):
    from kvprobe.app.cli import main

    model, zpath = tiny_screen
    assert main(["run", "configs/screen.yaml", "--model", str(model), "--output-dir", str(tmp_path), "--set",
                 "task.n_instances=2", "--set", "params.chain_tokens=2", "--set", f"params.task_params.locomo.data={zpath}",
                 "--set", "params.task_params.locomo.memory_tokens=400", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("screen/*/*.json")).read_text())
    s = rec["summary"]
    assert s["tasks"] == ["memory", "tau2", "twohop_blocks", "agent", "locomo", "edit_in_transplant"]
    for task, by_mode in s["cells"].items():
        assert set(by_mode) == {"direct", "chain"}
        for c in by_mode.values():
            assert c["n_instances"] == 2 and c["n_decisions"] == 4 and c["competent"] is None  # 2 < 10: no verdict
            assert sum(c["action_counts"].values()) == 4 and c["chance"] == 0.5
    for row in rec["rows"]:
        for mode in ("direct", "chain"):
            old, new = row["reads"][mode]["old"], row["reads"][mode]["new"]
            assert row["field_effect"][mode] == pytest.approx(new["ld"] - old["ld"])
            assert old["correct"] != new["correct"] or old["decision"] != new["decision"]  # opposite right answers
    mem = [r for r in rec["rows"] if r["task"] == "memory"]
    assert [r["meta"]["layout"] for r in mem] == ["contiguous", "contiguous"]  # E4's crossed draw: i // 2
    assert all(r["meta"]["partner_qa_index"] != r["meta"]["qa_index"] for r in rec["rows"] if r["task"] == "locomo")


def test_a_model_screened_in_parts_reads_each_cell_from_its_record():
    from kvprobe.competence import _cell

    decide = [_row(i, f"s{i % 6}", *_labels(i), _labels(i), (-2.0, 2.0)) for i in range(12)]
    direct = {"config_hash": "a", "summary": {"cells": {"memory": {"direct": cell(decide, "direct", Params())}}}}
    chain = {"config_hash": "b", "summary": {"cells": {"memory": {"chain": cell(decide, "direct", Params())}}}}
    assert _cell([direct, chain], "memory", "chain")["competent"] is True
    with pytest.raises(KVProbeError, match="hold 'memory' x 'direct'"):
        _cell([direct, direct], "memory", "direct")
    with pytest.raises(KVProbeError, match="memory/direct, memory/chain|was not screened"):
        _cell([direct, chain], "tau2", "direct")


def test_one_competence_measure_for_the_screen_and_the_claims():
    """kvprobe.competence.measure is the one competence measure: the claims' row reader (kvprobe.claims.competence)
    gives its accuracy, interval and verdict, and a screen cell's verdict is its is_competent on the cell."""
    from kvprobe.claims import Claim, competence as claim_competence
    from kvprobe.competence import COMPETENCE_GATE, is_competent, measure

    correct = [i != 3 for i in range(24)]
    m = measure([float(c) for c in correct])
    rows = [{"index": i, "scenario": f"s{i}", "full_correct": c} for i, c in enumerate(correct)]
    got = claim_competence(Claim("g", "t", "at_least", "agree", bound=0.5, competence=("full_correct",)), rows)
    assert (got["accuracy"], (got["ci_low"], got["ci_high"]), got["competent"]) == (m.accuracy, m.ci, m.competent)
    assert m.competent and got["n"] == 24 and measure([]) is None
    assert not measure([1.0, 0.0] * 12).competent  # at chance
    assert is_competent(0.9, 0.6) and not is_competent(0.9, 0.4) and not is_competent(0.7, 0.6)
    assert not is_competent(0.9, None) and COMPETENCE_GATE == Params().gate
    decide = [_row(i, f"s{i % 6}", *_labels(i), _labels(i), (-2.0, 2.0)) for i in range(12)]
    c = cell(decide, "direct", Params())
    assert c["competent"] is is_competent(c["accuracy"]["mean"], c["accuracy"]["ci_low"], Params().gate)
