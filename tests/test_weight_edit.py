"""ROME, LoRA and the weight_edit experiment on a tiny model; ROME's canonical factual edit on smollm2 (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from kvprobe.edits import lora, rome
from kvprobe.edits.weights import weights_checksum
from tests.conftest import as_lm
from kvprobe.models.tiny import tiny_model


@pytest.fixture()
def lm():
    return as_lm(tiny_model("llama-default"))


def test_rank_one_update_maps_the_key_to_the_value_and_rolls_back_exactly(lm):
    layer = 1
    cov = rome.key_covariance(lm, layer, [list(range(5, 60)), list(range(100, 180))])
    prompt = rome.SubjectPrompt(tuple(range(20, 32)), 5)
    k = rome.subject_key(lm, layer, [prompt])
    v = torch.randn(lm.model.config.hidden_size)
    before = weights_checksum(lm)
    e = rome.apply(lm, rome.rank_one_update(lm, layer, k, v, cov))
    w = rome.down_proj(lm, layer).weight.detach()
    assert torch.allclose(w @ k, v, atol=1e-3)  # the closed form hits v* exactly at k*
    assert weights_checksum(lm) != before
    e.rollback(lm)
    assert weights_checksum(lm) == before


def test_rome_and_lora_raise_the_target_on_a_tiny_model(lm):
    ids = list(range(30, 50))
    target, other = 7, 9

    def gap():
        with torch.no_grad():
            lo = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
        return float(lo[target] - lo[other])

    g0, before = gap(), weights_checksum(lm)
    cov = rome.key_covariance(lm, 1, [list(range(60, 200))])
    e = rome.rome_edit(lm, 1, [rome.SubjectPrompt(tuple(ids), 10)], [target], cov, steps=15, lr=0.5)
    assert gap() > g0 + 0.05  # the edited weights favour the target after the prompt
    e.rollback(lm)
    le = lora.lora_edit(lm, [ids], target, other, lr=1e-2, max_steps=30, margin=0.5)
    assert le.detail["flipped"] and gap() >= 0.5
    le.rollback()
    assert weights_checksum(lm) == before and abs(gap() - g0) < 1e-5


def test_weight_edit_experiment_end_to_end(tiny_text_dir, tmp_path):
    from kvprobe.app.cli import main

    args = ["run", "configs/weight_edit.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
            "--set", "task.n_instances=2", "--set", "params.format=null", "--set", "params.n_heldout=2",
            "--set", "params.n_collateral=2", "--set", "params.rome_steps=2", "--set", "params.lora_max_steps=2",
            "--set", "inclusion.min_flip=0", "--set", "inclusion.require_oracle_correct=false", "--quiet"]
    main(args)
    rec = json.loads(next(tmp_path.rglob("*.json")).read_text())
    m = rec["summary"]["methods"]
    assert set(m) == {"in_place", "erratum", "field_erratum", "rome", "lora"}
    for name in ("in_place", "erratum", "field_erratum"):
        assert m[name]["weights_unchanged"] and m[name]["identity"] and m[name]["contamination"]["mean"] == 0
    for name in ("rome", "lora"):
        assert m[name]["rollback_exact"] and not m[name]["weights_unchanged"]
        assert 0 <= m[name]["contamination"]["mean"] <= 1 and 0 <= m[name]["collateral"]["mean"] <= 1
    # the earlier design, as its records have it: one scenario, ROME keyed on the value (now stated in every row)
    assert "design" not in rec["summary"] and len({r["scenario"] for r in rec["rows"]}) == 1
    assert all(r["methods"]["rome"]["subject"]["kind"] == "value" for r in rec["rows"])
    from kvprobe.figures import FIGURES

    FIGURES["table1_weight_edit"][1]([rec], tmp_path / "t1.png")
    assert (tmp_path / "t1.png").stat().st_size > 0


@pytest.mark.slow
def test_rome_moves_the_eiffel_tower_to_rome_with_locality_intact(smollm):
    """The canonical factual edit (paper App. I) on pretrained smollm2-135m: Paris -> Rome, paraphrase moved,
    unrelated landmarks unchanged. Can fail: a wrong key, covariance or update leaves Paris or breaks Berlin."""
    from pathlib import Path

    tok = smollm.tokenizer

    def top(text):
        with torch.no_grad():
            lo = smollm.model(input_ids=tok(text, return_tensors="pt")["input_ids"]).logits[0, -1]
        return tok.decode(int(lo.argmax()))

    prompt = "The Eiffel Tower is located in the city of"
    others = {"The Colosseum is located in the city of": " Rome", "The capital of Germany is": " Berlin",
              "The Brandenburg Gate is located in the city of": " Berlin"}
    assert top(prompt) == " Paris" and all(top(p) == a for p, a in others.items())
    text = (Path(__file__).resolve().parents[1] / "kvprobe/organism/data/neutral.txt").read_text()
    cov = rome.key_covariance(smollm, 8, [tok(text)["input_ids"]])
    e = rome.rome_edit(smollm, 8, [rome.subject_prompt(tok, prompt, "Eiffel Tower")],
                       tok(" Rome", add_special_tokens=False)["input_ids"], cov,
                       [rome.subject_prompt(tok, "The Eiffel Tower is a", "Eiffel Tower")])
    try:
        assert top(prompt) == " Rome"
        assert top("The Eiffel Tower, in the city of") == " Rome"  # generalises to a paraphrase
        assert all(top(p) == a for p, a in others.items())  # locality
    finally:
        e.rollback(smollm)
    assert top(prompt) == " Paris"


# -- the issue #56 §4 design (configs/weight_edit_v2.yaml) on a tiny model -----------------------------------

V2_N = 5


@pytest.fixture(scope="module")
def v2(tiny_formats_dir, tmp_path_factory):
    """One run of configs/weight_edit_v2.yaml on the tiny model (its own kvprobe cache): its record."""
    from kvprobe.app.cli import main

    out = tmp_path_factory.mktemp("wev2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPROBE_CACHE", str(out / "cache"))
        main(["run", "configs/weight_edit_v2.yaml", "--model", str(tiny_formats_dir), "--output-dir", str(out / "res"),
              "--set", f"task.n_instances={V2_N}", "--set", "params.n_heldout=3", "--set", "params.n_collateral=2",
              "--set", "params.rome_steps=2", "--set", "params.lora_max_steps=2", "--set", "inclusion.min_flip=0",
              "--set", "inclusion.require_oracle_correct=false", "--quiet"])
    return json.loads(next((out / "res").rglob("*.json")).read_text())


@pytest.fixture(scope="module")
def tiny_tok(tiny_formats_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_formats_dir)


def _generated_ids(tok, scenario, index, fmt, n_notes, surface=False):
    from kvprobe.tasks.gated import load_template, tokenize_pair
    from kvprobe.tasks.generator import build_generated, template_family

    fam = template_family(load_template("configs/tasks/gated.yaml").scenario(scenario))
    inst = build_generated(index, 0, "test", fmt, counterfactual=0.0, family=fam, n_notes=n_notes, surface=surface)
    return inst, tokenize_pair(tok, inst, False)


def _near_copies(target, heldouts, limit=0.8):
    """(i, j, ratio) of every pair among the target (i = -1) and the held-outs more alike than ``limit``, by an
    independent difflib ratio over the token ids."""
    from difflib import SequenceMatcher

    seqs = [target, *heldouts]
    return [(i - 1, j - 1, r) for i in range(len(seqs)) for j in range(i + 1, len(seqs))
            if (r := SequenceMatcher(None, seqs[i], seqs[j], autojunk=False).ratio()) > limit]


def test_v2_targets_come_from_five_or_more_scenario_clusters(v2):
    from experiments.weight_edit import summarize_rows
    from kvprobe.claims import declared_claims, evaluate
    from kvprobe.runner.config import load_config, validate_params
    from kvprobe.runner.experiment import Context, get_experiment

    rows, s = v2["rows"], v2["summary"]
    assert len(rows) == V2_N and len({r["target_scenario"] for r in rows}) == V2_N >= 5
    assert len({r["scenario"] for r in rows}) == V2_N and len({r["index"] for r in rows}) == V2_N
    assert s["design"]["n_target_clusters"] == V2_N and s["design"]["target_scenarios"] == [r["target_scenario"]
                                                                                          for r in rows]
    assert all(r["field"] not in r["collateral_scenarios"] for r in rows)  # each battery leaves its scenario out
    # inference by scenario cluster: every column and claim counts the targets' scenarios. The random tiny model
    # passes the gate on only some targets, so the summary is recomputed with all of them included, twice over
    # (a second target per scenario, as 10 targets from 5 scenarios would give): 10 instances, 5 clusters.
    cfg = load_config("configs/weight_edit_v2.yaml")
    ctx = Context(cfg=cfg, params=validate_params(get_experiment("weight_edit").params, cfg.params, "v2"), lm=None)
    ok = [{**r, "index": r["index"] + k * 1000, "included": True, "oracle_correct": True} for k in (0, 1) for r in rows]
    summary = summarize_rows(ctx, ok)
    assert summary["design"]["n_clusters"] == V2_N and summary["design"]["verdict_possible"]
    for name in ("rome", "rome_entity", "lora", "field_erratum"):
        assert summary["methods"][name]["efficacy"]["n_clusters"] == V2_N
        assert summary["methods"][name]["contamination"]["n_clusters"] == V2_N
    for claim in declared_claims("weight_edit"):
        out = evaluate(claim, {**v2, "rows": ok, "summary": summary})
        assert out["n"] == 2 * V2_N and out["n_clusters"] == V2_N and out["unit"] == "cluster", (claim.key, out)
        assert not any("too few" in n for n in out["notes"]), (claim.key, out["notes"])
    one = [{**r, "scenario": "one"} for r in ok]  # the earlier design: one cluster, no verdict
    out = evaluate(declared_claims("weight_edit")[0], {**v2, "rows": one, "summary": summary})
    assert out["n_clusters"] == 1


def test_v2_heldouts_are_not_near_copies_of_the_target_or_each_other(v2, tiny_tok):
    assert "varied" in v2["summary"]["design"]["heldout_rule"] and "0.8" in v2["summary"]["design"]["heldout_rule"]
    for r in v2["rows"]:
        target, tp = _generated_ids(tiny_tok, r["target_scenario"], r["index"], "document_qa", 0)
        assert len(tp) == r["n_tokens"] and tp.field_slots == r["field_slots"]  # the row's own target
        held = []
        assert len(r["heldout"]) == 3
        for h in r["heldout"]:
            inst, hp = _generated_ids(tiny_tok, r["target_scenario"], h["index"], h["format"], h["n_notes"], True)
            assert h["format"] != "document_qa" and inst.field == target.field
            assert inst.old_value == target.old_value and inst.old_action == target.old_action  # still at the old value
            assert h["entity"] != r["methods"]["rome_entity"]["subject"]["text"]  # another request
            assert h["similarity_to_target"] <= 0.8
            held.append(hp.ids_old)
        assert _near_copies(tp.ids_old, held) == []
    # the check bites: the earlier rule's held-outs (the next draws in the target's format) are near-copies
    r = v2["rows"][0]
    _, tp = _generated_ids(tiny_tok, r["target_scenario"], r["index"], "document_qa", 0)
    same = [_generated_ids(tiny_tok, r["target_scenario"], i, "document_qa", 0)[1].ids_old
            for i in range(r["index"] + 1, r["index"] + 4)]
    assert _near_copies(tp.ids_old, same)


def test_pick_distinct_drops_a_near_copy_of_the_target_and_of_a_kept_candidate():
    from kvprobe.tasks.heldout import pick_distinct, token_similarity

    target = list(range(100))
    near = target[:50] + [999] + target[51:]  # one token changed
    other = list(range(200, 300))
    other_near = other[:-1] + [7]
    third = list(range(400, 460)) + target[:10]
    kept = pick_distinct(target, [("near", near), ("other", other), ("other_near", other_near), ("third", third)], 3,
                         0.8)
    assert token_similarity(target, near) > 0.8 and [k[0] for k in kept] == ["other", "third"]
    assert all(k[2] <= 0.8 for k in kept)


def test_v2_states_the_rome_subject_and_runs_the_entity_keyed_variant(v2, tiny_tok):
    from kvprobe.tasks.heldout import entity_of

    assert v2["summary"]["design"]["rome_subjects"] == {"rome": "value", "rome_entity": "entity"}
    assert v2["summary"]["methods"]["rome"]["subject"] == "value"
    assert v2["summary"]["methods"]["rome_entity"]["subject"] == "entity"
    for r in v2["rows"]:
        inst, tp = _generated_ids(tiny_tok, r["target_scenario"], r["index"], "document_qa", 0)
        value, entity = r["methods"]["rome"]["subject"], r["methods"]["rome_entity"]["subject"]
        assert value["kind"] == "value" and value["text"] == r["old_value"]
        assert value["position"] == r["field_slots"][-1]
        assert entity["kind"] == "entity" and entity["text"] == entity_of(inst) != r["old_value"]
        pos = entity["position"]
        assert pos > r["field_slots"][-1]  # the id's last occurrence: the question after the field
        assert entity["token"] == entity["text"][-1] == tiny_tok.decode([tp.ids_old[pos]])  # its last digit
        assert "".join(tiny_tok.decode(tp.ids_old[pos - 4: pos + 1]).split()) == entity["text"]
        for name in ("rome", "rome_entity"):
            m = r["methods"][name]
            assert m["rollback_exact"] and not m["weights_unchanged"] and 0 <= m["contamination"] <= 1


def test_v2_covariance_sample_holds_ten_thousand_tokens_of_a_stated_text(v2):
    cov = v2["summary"]["covariance"]
    assert cov["tokens"] >= 10_000 and cov["tokens"] == 16_384 and "pydoc_data" in cov["text"]
    assert cov["cached"] is False  # the fixture's own empty cache
    assert all(r["methods"]["rome"]["detail"]["cov_tokens"] == cov["tokens"] for r in v2["rows"])


def test_key_covariance_is_cached_per_model_layer_and_sample(lm, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path))
    seqs = [list(range(5, 60)), list(range(100, 180))]
    first, hit = rome.cached_key_covariance(lm, 1, seqs)
    assert not hit and first.n_tokens == 55 + 80
    again, hit = rome.cached_key_covariance(lm, 1, seqs)
    assert hit and torch.equal(again.matrix, first.matrix) and again.n_tokens == first.n_tokens
    assert not rome.cached_key_covariance(lm, 2, seqs)[1]  # another layer: computed
    assert not rome.cached_key_covariance(lm, 1, seqs[:1])[1]  # another sample: computed
    assert len(list((tmp_path / "rome_cov").glob("*.pt"))) == 3


def test_v2_entity_keyed_edit_moves_unrelated_decisions_less_than_its_target(v2):
    """The battery of unrelated decisions (other scenarios) may move under a weight edit, but an entity-keyed ROME
    edit must move them, on average, by at most half of what it moves its own target's decision (LD, nats; on this
    random-init model a quarter is too tight: order_status moves its battery 0.024 for a 0.093 target move);
    the graded measures are recorded beside the decisions and summarized by scenario cluster."""
    for r in v2["rows"]:
        m = r["methods"]["rome_entity"]
        target_move = abs(m["ld"] - r["stale_ld"])  # the edited target against the un-edited model, nats
        assert m["collateral_ld_abs_shift"] <= 0.5 * target_move, (r["target_scenario"], m["collateral_ld_abs_shift"],
                                                                    target_move)
        for name in ("in_place", "erratum", "field_erratum"):  # identity: the weights never changed
            assert r["methods"][name]["heldout_ld_shift"] == 0 == r["methods"][name]["collateral_ld_abs_shift"]
    for name in ("rome", "rome_entity", "lora"):
        s = v2["summary"]["methods"][name]
        assert s["heldout_ld_shift"]["n_clusters"] == s["contamination"]["n_clusters"] >= 1
        assert s["collateral_ld_abs_shift"]["mean"] >= 0


def test_keying_rome_on_the_wrong_token_changes_its_contamination(v2, tiny_formats_dir, tmp_path, monkeypatch):
    """Mutation: the entity-keyed edit re-keyed on the field value's token (the wrong subject for it). Same target,
    held-outs, covariance and optimisation; only the key moves, and the contamination measured on the held-outs
    (their LD moves, hence the graded contamination) must move with it, so the measure reads the key."""
    import importlib

    from kvprobe.app.cli import main

    we = importlib.import_module("kvprobe.experiments.weight_edit")  # the module the runner loads
    real = we.rome_subject

    def keyed_on_the_value(tokenizer, inst, pair, chat, kind):
        prompt, statement = real(tokenizer, inst, pair, chat, kind)
        if kind != "entity":
            return prompt, statement
        pos = pair.field_slots[-1]
        return rome.SubjectPrompt(prompt.ids, pos), {**statement, "position": pos,
                                                     "token": tokenizer.decode([pair.ids_old[pos]])}

    monkeypatch.setattr(we, "rome_subject", keyed_on_the_value)
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    main(["run", "configs/weight_edit_v2.yaml", "--model", str(tiny_formats_dir), "--output-dir", str(tmp_path / "res"),
          "--set", "task.n_instances=1", "--set", "params.n_heldout=3", "--set", "params.n_collateral=2",
          "--set", "params.rome_steps=2", "--set", "params.lora_max_steps=2", "--set", "inclusion.min_flip=0",
          "--set", "inclusion.require_oracle_correct=false", "--quiet"])
    mutated = json.loads(next((tmp_path / "res").rglob("*.json")).read_text())["rows"][0]
    right = v2["rows"][0]
    assert mutated["index"] == right["index"] and mutated["heldout"] == right["heldout"]  # the same target and held-outs
    wrong_m, right_m = mutated["methods"]["rome_entity"], right["methods"]["rome_entity"]
    assert wrong_m["subject"]["position"] == right["field_slots"][-1] != right_m["subject"]["position"]
    # the un-mutated methods reproduce exactly: what differs below is the key's doing
    assert mutated["methods"]["rome"]["heldout_ld_shift"] == right["methods"]["rome"]["heldout_ld_shift"]
    assert abs(wrong_m["heldout_ld_shift"] - right_m["heldout_ld_shift"]) > 1e-4, (wrong_m, right_m)
