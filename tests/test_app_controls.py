"""The decision-read API (kvprobe.probes.decision), the splice core (kvprobe.kv.compose.splice_spans), the graded
measures (kvprobe.probes.graded), and mutation tests: a deliberately broken splice (keys not re-rotated at a large
offset, a wrong chunk, a stale cache) run through each application experiment must change its graded measure or
fail its check. Tiny random-init models: their logit differences are hundredths of a nat, so the field-effect floor
is lowered where a test reads the retained field effect, and the checks compare against the correct run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvprobe.kv import compose as compose_core
from kvprobe.kv.compose import Live, Spliced, assemble, precompile, splice_spans
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.tiny import tiny_model, write_tiny_model_dir
from kvprobe.probes import decision as dec
from kvprobe.probes import graded
from kvprobe.runner.cli import main

from tests.conftest import as_lm


@pytest.fixture(scope="module")
def lm():
    return as_lm(tiny_model("llama-default"), name="tiny-llama-default")


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the API ---------------------------------------------------------------------------------------------------

def test_read_actions_and_read_named_match_single_reads(lm):
    a, b = _ids(20, 0), _ids(26, 1)
    sa, sb = prefill(lm, a), prefill(lm, b)
    far = prefill(lm, a, positions=list(range(3000, 3020)))
    suffix, tokens = [7, 8], (11, 12)
    r = dec.read_actions(lm, sa, suffix, tokens)
    lg = read_logits(lm, sa, suffix)[0]
    assert r.ld() == float(lg[11] - lg[12]) and r.choice() == (0 if lg[11] > lg[12] else 1)
    named = dec.read_named(lm, {"a": sa, "b": sb, "far": far, "a2": sa}, suffix, tokens)
    assert list(named) == ["a", "b", "far", "a2"]  # three shapes: three batches, order kept
    for name, st in (("a", sa), ("b", sb), ("far", far)):
        assert abs(named[name].ld() - dec.read_actions(lm, st, suffix, tokens).ld()) < 1e-5
    # RoPE reads relative positions only: the context moved far up reads as in place
    assert abs(named["far"].ld() - named["a"].ld()) < 1e-4
    with pytest.raises(Exception):
        dec.read_actions(lm, sa, suffix, (5, 5))


def test_decide_direct_and_chain(tiny_text_dir):
    from kvprobe.models.loading import load_model

    lm = load_model(str(tiny_text_dir), device="cpu", dtype="float32")
    st = prefill(lm, _ids(15, 2))
    d = dec.decide(lm, st, [4], (20, 21), ("yes", "no"))
    assert d.decided_by == "direct" and d.choice == (0 if d.ld > 0 else 1)
    chain = dec.ChainSpec(cue=(30, 31), answer_cue=(4,), max_tokens=3)
    c = dec.decide(lm, st, [4], (20, 21), ("yes", "no"), "chain", chain)
    assert c.decided_by in ("chain", "forced") and 0 < c.chain_tokens <= 3


def test_answer_logprob_is_teacher_forced(lm):
    """The log-prob read step by step over a cache equals the log-softmax of one forward over the whole text."""
    ctx, prefix, answer = _ids(12, 3), [40], [41, 42, 43]
    got = dec.answer_logprob(lm, prefill(lm, ctx), prefix, answer)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ctx + prefix + answer])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(ctx) + len(prefix)
    want = sum(float(lp[n - 1 + i, t]) for i, t in enumerate(answer))
    assert abs(got - want) < 1e-4
    assert abs(dec.candidate_ld(lm, prefill(lm, ctx), prefix, ([41, 42], [44, 45]))
               - (dec.answer_logprob(lm, prefill(lm, ctx), prefix, [41, 42])
                  - dec.answer_logprob(lm, prefill(lm, ctx), prefix, [44, 45]))) < 1e-5


def test_answer_prefix_len(tiny_text_dir):
    from kvprobe.models.loading import load_model

    tok = load_model(str(tiny_text_dir), device="cpu", dtype="float32").tokenizer
    text = "Decide the single next action"
    ids = tok(text + " Decision:", add_special_tokens=False)["input_ids"]
    assert dec.answer_prefix_len(tok, ids, text, False) == len(ids) - len(tok(text, add_special_tokens=False)["input_ids"])


def test_splice_spans_is_assemble_and_moves_rotate_and_reorder(lm):
    ids = _ids(40, 4)
    cuts, end = [6, 18, 30], 38
    old = assemble(lm, [Live(tuple(ids[:6])), Spliced(tuple(ids[6:18]), precompile(lm, ids[6:18]), seam=1),
                        Spliced(tuple(ids[18:30]), precompile(lm, ids[18:30])), Live(tuple(ids[30:38]))])
    compiled: dict = {}
    new = splice_spans(lm, ids, cuts, end, seam=1, compiled=compiled)
    assert new.max_abs_diff(old) == 0 and len(compiled) == 2
    q, tokens = ids[38:39], (5, 6)
    near = dec.read_actions(lm, new, q, tokens).ld()
    moved = splice_spans(lm, ids, cuts, end, seam=1, start=graded.FAR_OFFSET, compiled=compiled)
    assert int(moved.positions[0]) == graded.FAR_OFFSET and len(compiled) == 2  # reused by their tokens
    assert graded.far_check(dec.read_actions(lm, moved, q, tokens).ld(), near) < 1e-4
    unrotated = splice_spans(lm, ids, cuts, end, rotate=False, start=graded.FAR_OFFSET, compiled=compiled)
    assert graded.far_check(dec.read_actions(lm, unrotated, q, tokens).ld(), near) > 1e-4
    swapped = splice_spans(lm, ids, cuts, end, order=[1, 0], compiled=compiled)
    assert swapped.length == new.length and swapped.max_abs_diff(new) > 0
    with pytest.raises(ValueError):
        splice_spans(lm, ids, cuts, end, order=[0, 0])


def test_graded_arithmetic_and_summaries():
    assert graded.field_effect_retained(1.0, 0.0, 2.0, 0.0) == 0.5
    assert graded.field_effect_retained(1.0, 0.0, 0.1, 0.0) is None  # below kvprobe's floor: a ratio over noise
    assert graded.field_effect_retained(1.0, 0.0, 0.1, 0.0, floor=0.0) == pytest.approx(10.0)
    arms = {"t": graded.arm_entry(1.9, 2.0, 0.9, agree=True), "c": graded.arm_entry(0.0, 2.0, 0.0, agree=False)}
    c = graded.control_entry("t", arms, "c")
    assert c["separation"] == pytest.approx(2.0 - 0.1) and c["retained_separation"] == pytest.approx(0.9)
    rows = [(f"s{i}", {"c": {**c, "separation": c["separation"] + 0.01 * i}}) for i in range(6)]
    s = graded.controls_summary(rows)["c"]
    assert s["treatment"] == "t" and s["error"]["separation"]["mean"] > 1.8 and s["error"]["separation"]["ci_low"]
    assert s["retained"]["separation"]["mean"] == pytest.approx(0.9)
    assert "separation +1.9" in "\n".join(graded.graded_lines(None, {"c": s}))


# -- mutation tests: the application experiments ------------------------------------------------------------

def _no_rerotation(monkeypatch):
    """The broken splice: keys keep the rotation of their isolated positions wherever the chunk lands."""
    monkeypatch.setattr(compose_core, "rerotate", lambda st, target, lm: st.with_positions(
        torch.as_tensor(target, dtype=torch.long), st.keys))


def _wrong_chunk(monkeypatch):
    """The broken splice: every chunk is precompiled from its tokens reversed (the wrong KV content)."""
    real = compose_core.precompile
    monkeypatch.setattr(compose_core, "precompile", lambda lm, ids: real(lm, list(reversed(list(ids)))))


def _sharp(model_dir: Path) -> Path:
    """The tiny model with 10x the initialisation scale: sharper attention, so where keys sit matters more."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["initializer_range"] = 0.2
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


def _run(config, model, out, *sets):
    args = ["run", config, "--model", str(model), "--output-dir", str(out), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return json.loads(next(Path(out).glob("*/*/*.json")).read_text())


def _claim_paths_resolve(name, rec, keys):
    from kvprobe.claims import claim_rows, get
    from kvprobe.runner.experiment import get_experiment

    for c in get_experiment(name).claims:
        if c.key in keys:
            assert any(get(r, c.a) is not None for r in claim_rows(rec)), (name, c.key)


@pytest.fixture(scope="module")
def persona_dir(tmp_path_factory):
    from kvprobe.tasks.memory import ANSWER_PREFIX, persona_instance, twohop_instance

    texts = []
    for i in range(4):
        for seed in (0, 1):
            inst = persona_instance(i, seed, 12, layout="contiguous" if i % 2 else "split")
            texts.append(inst.body(erratum="[MEMORY UPDATE] enabled disabled") + " " + ANSWER_PREFIX + " allow refuse")
            for cond in ("twohop", "independent"):
                texts.append(twohop_instance(i, seed, cond, 10, 3).body() + " enabled disabled allow refuse")
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("tinyapp"), texts)


MEMORY = ["task.n_instances=2", "params.n_lines=12", "params.e1_lines=[]", "params.edit=false", "params.blocks=[1,4]",
          "params.modes=[direct]", "params.field_effect=true",
          "params.controls=[no_rotation_far,shuffled,wrong_memory,no_memory,ablated,stale]"]


def test_memory_controls_and_broken_splices(persona_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(graded, "MIN_FIELD_EFFECT", 0.0)
    good = _run("configs/memory.yaml", persona_dir, tmp_path / "good", *MEMORY)
    for r in good["rows"]:
        a, c = r["graded"]["arms"], r["controls"]
        assert r["far_check"] < 1e-4 and r["far_distance"] >= 2000
        assert c["stale"]["retained"] == 0.0 and c["stale"]["treatment"] == "seam0"
        assert c["no_rotation_far"]["treatment"] == "seam0_far" and c["shuffled"]["treatment"] == "blocks4"
        assert set(a) >= {"seam0", "no_rotation", "blocks4", "seam0_far", "no_rotation_far", "shuffled",
                          "wrong_memory", "no_memory", "ablated"} and "retained" in a["seam0"]
    assert good["summary"]["far_check_max"] < 1e-4 and "must-fail controls" in get_table("memory")(good["summary"])
    _claim_paths_resolve("memory", good, {"memory_far_rotation_separation", "memory_wrong_memory_separation",
                                          "memory_stale_retained_separation"})
    _no_rerotation(monkeypatch)
    bad = _run("configs/memory.yaml", persona_dir, tmp_path / "bad", *MEMORY)
    for g, b in zip(good["rows"], bad["rows"]):
        assert b["far_check"] > 10 * max(g["far_check"], 1e-6)  # the check fails
        assert abs(b["controls"]["no_rotation_far"]["separation"]) < 1e-6  # treatment = control: no separation left
        assert g["controls"]["no_rotation_far"]["separation"] != 0.0


def test_memory_wrong_chunk_moves_the_graded_measure(persona_dir, tmp_path, monkeypatch):
    sets = ["task.n_instances=2", "params.n_lines=12", "params.e1_lines=[]", "params.edit=false",
            "params.blocks=[1]", "params.modes=[direct]"]
    good = _run("configs/memory.yaml", persona_dir, tmp_path / "good", *sets)
    _wrong_chunk(monkeypatch)
    bad = _run("configs/memory.yaml", persona_dir, tmp_path / "bad", *sets)
    for g, b in zip(good["rows"], bad["rows"]):
        assert g["full_ld"] == b["full_ld"]  # full recompute untouched
        assert abs(b["graded"]["arms"]["seam0"]["ld_error"] - g["graded"]["arms"]["seam0"]["ld_error"]) > 1e-4


def test_twohop_controls_and_broken_splices(persona_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(graded, "MIN_FIELD_EFFECT", 0.0)
    sets = ["task.n_instances=2", "params.n_lines=10", "params.field_effect=true",
            "params.controls=[no_rotation_far,shuffled,wrong_memory,ablated,stale]"]
    good = _run("configs/twohop_blocks.yaml", persona_dir, tmp_path / "good", *sets)
    for r in good["rows"]:
        t = r["twohop"]
        assert t["far_check"] < 1e-4 and t["controls"]["stale"]["retained"] == 0.0
        assert {"shuffled", "wrong_memory", "ablated"} <= set(t["controls"])
    assert "must-fail controls" in get_table("twohop_blocks")(good["summary"])
    _claim_paths_resolve("twohop_blocks", good, {"twohop_far_rotation_separation", "twohop_stale_retained_separation"})
    _no_rerotation(monkeypatch)
    bad = _run("configs/twohop_blocks.yaml", persona_dir, tmp_path / "bad", *sets)
    for g, b in zip(good["rows"], bad["rows"]):
        assert b["twohop"]["far_check"] > 10 * max(g["twohop"]["far_check"], 1e-6)
        assert abs(b["twohop"]["controls"]["no_rotation_far"]["separation"]) < 1e-6


def get_table(name):
    from kvprobe.runner.experiment import get_experiment

    return get_experiment(name).table


def test_transplant_controls_and_broken_splices(tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(graded, "MIN_FIELD_EFFECT", 0.0)
    sets = ["task.n_instances=3", "params.seam_repair=[0,1]", "params.n_blocks=[1]", "params.other_chunks=[]",
            "params.field_effect=true", "params.controls=[no_rotation_far,shuffled,wrong_chunk,stale]"]
    good = _run("configs/transplant.yaml", tiny_text_dir, tmp_path / "good", *sets)
    for r in good["rows"]:
        assert r["far_check"] < 1e-4 and r["controls"]["stale"]["retained"] == 0.0
        assert {"shuffled", "wrong_chunk", "no_rotation_far"} <= set(r["controls"])
        assert "retained" in r["graded"]["arms"]["seam0"] and r["seam0_ld"] == r["graded"]["arms"]["seam0"]["ld"]
    assert "must-fail controls" in get_table("transplant")(good["summary"])
    _claim_paths_resolve("transplant", good, {"far_rotation_separation", "stale_retained_separation"})
    _no_rerotation(monkeypatch)
    bad = _run("configs/transplant.yaml", tiny_text_dir, tmp_path / "bad", *sets)
    for g, b in zip(good["rows"], bad["rows"]):
        assert b["far_check"] > 10 * max(g["far_check"], 1e-6)
        assert abs(b["controls"]["no_rotation_far"]["separation"]) < 1e-6 < abs(g["controls"]["no_rotation_far"]["separation"])


def test_agent_frozen_control_and_a_stale_cache_bug(tiny_text_dir, tmp_path, monkeypatch):
    """The stale-cache bug (later turns reuse the previous cache without its errata) reads as the frozen control."""
    monkeypatch.setattr(graded, "MIN_FIELD_EFFECT", 0.0)
    sets = ["task.n_instances=2", "params.turns=3", "params.baselines=[front]", "params.controls=[no_rotation_far]"]
    good = _run("configs/agent.yaml", tiny_text_dir, tmp_path / "good", *sets)
    for r in good["rows"]:
        assert "controls" not in r["turns"][0]
        for t in r["turns"][1:]:
            assert t["controls"]["frozen"]["retained"] == 0.0 and t["far_check"] < 1e-4
            assert t["controls"]["frozen"]["retained_separation"] != 0.0
    _claim_paths_resolve("agent", good, {"agent_frozen_retained_separation", "agent_far_rotation_separation"})
    from kvprobe.experiments import agent
    from kvprobe.kv.edit import EditResult

    monkeypatch.setattr(agent, "append_edit", lambda lm, cached, cached_ids, ids, r: EditResult(
        cached, list(ids[-r:]), 0, len(ids) - r))
    bad = _run("configs/agent.yaml", tiny_text_dir, tmp_path / "bad", *sets)
    for r in bad["rows"]:
        for t in r["turns"][1:]:
            assert t["controls"]["frozen"]["retained_separation"] == 0.0  # the unified cache is the frozen one
            assert t["controls"]["frozen"]["separation"] == 0.0


def test_long_horizon_frozen_control_and_a_field_that_never_refreshes(tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(graded, "MIN_FIELD_EFFECT", 0.0)
    sets = ["task.n_instances=2", "params.turns=3", "params.n_boot=100", "inclusion.min_flip=0"]
    good = _run("configs/long_horizon.yaml", tiny_text_dir, tmp_path / "good", *sets, "params.scheme=erratum")
    for r in good["rows"]:
        for t in r["turns"][1:]:
            assert t["graded"]["cache"]["ld_error"] < 1e-4  # the erratum scheme: the same tokens as the reprefill
            assert t["controls"]["frozen"]["retained"] == 0.0 and t["controls"]["frozen"]["separation"] > 0
    _claim_paths_resolve("long_horizon", good, {"frozen_retained_separation"})
    refreshed = _run("configs/long_horizon.yaml", tiny_text_dir, tmp_path / "fe", *sets)
    from kvprobe.experiments import long_horizon

    monkeypatch.setattr(long_horizon, "recompute_slots", lambda lm, state, ids, slots: state)  # the stale-field bug
    bad = _run("configs/long_horizon.yaml", tiny_text_dir, tmp_path / "bad", *sets)
    moved = [abs(b["graded"]["cache"]["ld_error"] - g["graded"]["cache"]["ld_error"])
             for rg, rb in zip(refreshed["rows"], bad["rows"]) for g, b in zip(rg["turns"], rb["turns"])]
    assert max(moved) > 1e-5  # the graded measure sees the field that never refreshed
    assert all(abs(g["reference_ld"] - b["reference_ld"]) < 1e-6 for rg, rb in zip(refreshed["rows"], bad["rows"])
               for g, b in zip(rg["turns"], rb["turns"]))  # the reprefill is untouched


def test_edit_in_transplant_far_control_and_broken_splice(tiny_text_dir, tmp_path, monkeypatch):
    sets = ["task.n_instances=2", "params.selective_k=[]", "inclusion.require_oracle_correct=false",
            "inclusion.min_flip=0", "params.controls=[no_rotation_far]"]
    good = _run("configs/edit_in_transplant.yaml", tiny_text_dir, tmp_path / "good", *sets)
    assert all(r["far_check"] < 1e-4 for r in good["rows"])
    _no_rerotation(monkeypatch)
    bad = _run("configs/edit_in_transplant.yaml", tiny_text_dir, tmp_path / "bad", *sets)
    for g, b in zip(good["rows"], bad["rows"]):
        assert b["far_check"] > 10 * max(g["far_check"], 1e-6)
        assert abs(b["controls"]["no_rotation_far"]["separation"]) < 1e-6


def test_tau2_stale_control_and_a_stale_edit(tiny_text_dir, tmp_path, monkeypatch):
    pytest.importorskip("tau2", reason="the τ²-bench package: `make install` installs it (--no-deps)")
    monkeypatch.setattr(graded, "MIN_FIELD_EFFECT", 0.0)
    sets = ["task.n_instances=2", "params.controls=[no_rotation_far,shuffled]"]
    good = _run("configs/tau2.yaml", tiny_text_dir, tmp_path / "good", *sets)
    for r in good["rows"]:
        c = r["controls"]
        assert c["stale"]["retained"] == 0.0 and c["stale"]["retained_separation"] != 0.0
        assert r["graded"]["arm_b"]["full_reprefill"]["retained"] == pytest.approx(1.0) and r["far_check"] < 1e-4
    _claim_paths_resolve("tau2", good, {"tau2_stale_retained_separation", "tau2_far_rotation_separation"})
    from kvprobe.kv import edit

    monkeypatch.setattr(edit, "field_erratum", lambda lm, e, prompt, r: edit.stale(e))  # the edit never lands
    _no_rerotation(monkeypatch)
    bad = _run("configs/tau2.yaml", tiny_text_dir, tmp_path / "bad", *sets)
    for g, b in zip(good["rows"], bad["rows"]):
        assert b["controls"]["stale"]["retained_separation"] == 0.0
        assert b["far_check"] > 10 * max(g["far_check"], 1e-6)


def test_locomo_controls_and_broken_splices(tmp_path, monkeypatch):
    from tests.test_locomo import _archive
    from kvprobe.tasks.locomo import load_locomo

    zpath = _archive(tmp_path / "locomo10.zip")
    texts = []
    for conv in load_locomo(zpath):
        texts.append(conv.system() + "".join(s.render() for s in conv.sessions))
        texts += [q.render() + " " + (q.answer or "") for q in conv.qa]
    model = _sharp(write_tiny_model_dir("llama-default", tmp_path / "model", texts))
    sets = ["task.n_instances=4", f"params.data={zpath}", "params.memory_tokens=120", "params.max_answer_tokens=2",
            "params.categories=[1,4]", "params.controls=[wrong_memory,no_memory,shuffled,no_rotation_far]"]
    good = _run("configs/locomo.yaml", model, tmp_path / "good", *sets)
    for r in good["rows"]:
        a = r["graded"]["arms"]
        assert r["gold_tokens"] >= 1 and a["full"]["gold_logprob_error"] == 0.0 and r["far_check"] < 1e-4
        assert {"wrong_memory", "no_memory", "no_rotation_far"} <= set(r["controls"])
        assert a["spliced"]["gold_logprob"] < 0 and "cosine" in a["wrong_memory"]
    assert "cosine calibrated in this record" in get_table("locomo")(good["summary"])
    _claim_paths_resolve("locomo", good, {"locomo_wrong_memory_separation", "locomo_far_rotation_separation",
                                          "locomo_cosine_beats_wrong_memory"})
    _no_rerotation(monkeypatch)
    bad = _run("configs/locomo.yaml", model, tmp_path / "bad", *sets)
    for g, b in zip(good["rows"], bad["rows"]):
        assert b["far_check"] > 10 * max(g["far_check"], 1e-6)
        assert abs(b["controls"]["no_rotation_far"]["separation"]) < 1e-6


APPS = ("memory", "tau2", "twohop_blocks", "agent", "locomo", "edit_in_transplant", "long_horizon", "transplant")


@pytest.mark.parametrize("name", APPS)
def test_committed_records_still_render(name):
    """Records written before the graded measures render their table and headline unchanged in shape."""
    from kvprobe.runner.experiment import get_experiment
    from kvprobe.runner.records import load_records

    exp = get_experiment(name)
    records = load_records(Path(__file__).parents[1] / "results", name)
    assert records, name
    for rec in records:
        assert exp.table(rec["summary"]) and exp.headline(rec["summary"])
