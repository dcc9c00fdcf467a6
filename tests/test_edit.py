"""KV edit operations on tiny models: exact identities, exact counts, erratum texts, the four edit CLIs."""

import json

import pytest
import torch

from kvprobe.figures import render_all
from kvprobe.kv import edit
from kvprobe.kv.decode import greedy_chain
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.state import KVState
from kvprobe.models.loading import load_model
from kvprobe.patching.pairs import prefill_pair
from kvprobe.app.cli import main
from kvprobe.app.report import report_rows
from kvprobe.tasks.edits import WORDINGS, answer_prefix_tokens, erratum_body, erratum_line, hoisted_body, prompt_ids
from kvprobe.tasks.gated import generate_instances, tokenize_pair
from tests.test_generator import tiny_generator_dir  # noqa: F401  (fixture)

TOL = 1e-5


def _random_edit(lm, n=24, field=(8, 10), seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(3, lm.spec.vocab_size, (n,), generator=g).tolist()
    new = list(old)
    new[field[0]:field[1]] = [(t + 1) % lm.spec.vocab_size for t in old[field[0]:field[1]]]
    return old, new, edit.FieldEdit(prefill(lm, old), old, new, list(range(*field)), [5])


def _naive_recompute(lm, state, ids, slots):
    """Reference: one token at a time in position order, each prefilled over the slots before it."""
    for s in sorted(slots):
        p = int(state.positions[s])
        one = prefill(lm, [ids[s]], positions=[p], prior=state.select([i for i in range(state.length)
                                                                        if int(state.positions[i]) < p]))
        last = one.slice(one.length - 1)
        donor = KVState(tuple(k.expand(-1, -1, state.length, -1) for k in last.keys),
                        tuple(v.expand(-1, -1, state.length, -1) for v in last.values), state.positions)
        state = state.mix(donor, [s])
    return state


def test_recompute_identities(tiny_lm):
    old, new, e = _random_edit(tiny_lm)
    fresh = prefill(tiny_lm, new)
    # recomputing every slot from the field on is the full-downstream state; the field alone is field-only
    assert edit.full_downstream(tiny_lm, e).state.max_abs_diff(e.stale.mix(fresh, range(8, 24))) < TOL
    assert edit.in_place(tiny_lm, e).state.max_abs_diff(e.stale.mix(fresh, [8, 9])) < TOL
    # a scattered set (past the sliding window too) matches token-by-token recompute; no change is a no-op
    slots = [8, 9, 12, 17, 18, 23]
    assert edit.recompute_slots(tiny_lm, e.stale, new, slots).max_abs_diff(
        _naive_recompute(tiny_lm, e.stale, new, slots)) < TOL
    assert edit.recompute_slots(tiny_lm, e.stale, old, [2, 11, 20]).max_abs_diff(e.stale) < TOL


def test_recompute_counts_are_exact(tiny_lm):
    _, _, e = _random_edit(tiny_lm)
    ranked = list(range(23, 9, -1))
    cases = {"stale": (edit.stale(e), 0), "in_place": (edit.in_place(tiny_lm, e), 2),
             "sel3": (edit.field_selective(tiny_lm, e, ranked, 3), 5),
             "cacheblend": (edit.cacheblend(tiny_lm, e, 0.25), 6),
             "full_downstream": (edit.full_downstream(tiny_lm, e), 16), "full": (edit.full_reprefill(tiny_lm, e), 24)}
    for name, (res, n) in cases.items():
        assert (res.recomputed_tokens, res.total_tokens, res.needs_prompt_surgery) == (n, 24, False), name
        assert res.state.length == 24 and torch.equal(res.state.positions, e.stale.positions)
    # CacheBlend's deviation pass runs the 16 tokens from the field on through layers 0..1 of 4: 8 token-layers'
    # worth, counted in its recompute beside the 6 full-depth tokens; no other method has a partial pass
    blend = cases["cacheblend"][0]
    assert blend.partial_pass_tokens == 16 * 2 / tiny_lm.spec.n_layers
    assert blend.recompute_fraction == (6 + blend.partial_pass_tokens) / 24
    assert all(res.partial_pass_tokens == 0 for name, (res, _) in cases.items() if name != "cacheblend")
    field = blend.state.select([8, 9])  # the field is always among CacheBlend's tokens
    assert field.max_abs_diff(cases["in_place"][0].state.select([8, 9])) < TOL
    with pytest.raises(Exception):
        edit.field_selective(tiny_lm, e, [3], 1)  # not downstream


def test_selective_recomputes_not_copies(tiny_lm):
    _, new, e = _random_edit(tiny_lm)
    res = edit.field_selective(tiny_lm, e, [20, 15], 2)
    assert res.state.max_abs_diff(edit.recompute_slots(tiny_lm, e.stale, new, [8, 9, 15, 20])) < TOL
    # slots not chosen keep the stale K/V exactly
    kept = [s for s in range(24) if s not in (8, 9, 15, 20)]
    assert res.state.select(kept).max_abs_diff(e.stale.select(kept)) == 0


@pytest.fixture(scope="module")
def text_case(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir))
    inst = generate_instances(template, 1, seed=0)[0]
    pair = tokenize_pair(lm.tokenizer, inst, False)
    return lm, inst, pair, prefill_pair(lm, pair)


def test_erratum_paths_equal_full_forward_of_the_same_text(text_case, template):
    lm, inst, pair, pp = text_case
    tok, e = lm.tokenizer, edit.FieldEdit.from_pair(pp)
    line = erratum_line(template, inst, inst.new_value)
    err_old, err_new = (prompt_ids(tok, inst, erratum_body(template, inst, v, [line]), False)
                        for v in (inst.old_value, inst.new_value))
    hoist_old, hoist_new = (prompt_ids(tok, inst, hoisted_body(template, inst, v), False)
                            for v in (inst.old_value, inst.new_value))
    cases = {"erratum": (edit.erratum(lm, e, err_old, 1), err_old),
             "field_erratum": (edit.field_erratum(lm, e, err_new, 1), err_new),
             "hoist": (edit.hoist_to_end(lm, hoist_old, hoist_new, 1), hoist_new)}
    n_line = len(tok(line)["input_ids"])
    for name, (res, ids) in cases.items():
        if name != "field_erratum":  # its downstream stays stale, so it is compared with a reprefill, not equal
            full = read_logits(lm, prefill(lm, ids[:-1]), ids[-1:])
            assert (read_logits(lm, res.state, res.suffix_ids) - full).abs().max() < 1e-4, name
        assert res.total_tokens == len(ids) - 1 and res.suffix_ids == ids[-1:]
        assert res.detail["reused_tokens"] + res.detail["appended_tokens"] == len(ids) - 1
    decision_tokens = len(pair) - 1 - cases["erratum"][0].detail["reused_tokens"]  # decision prompt, re-run
    assert cases["erratum"][0].recomputed_tokens == n_line + decision_tokens
    assert cases["field_erratum"][0].recomputed_tokens == n_line + decision_tokens + len(pair.field_slots)
    fe = cases["field_erratum"][0]
    reused = fe.detail["reused_tokens"]
    assert fe.state.slice(0, reused).max_abs_diff(edit.in_place(lm, e).state.slice(0, reused)) == 0
    assert cases["hoist"][0].needs_prompt_surgery and not cases["erratum"][0].needs_prompt_surgery
    # the erratum keeps the cache up to the end of the conversation: the first token not reused is "TASK"
    reused = cases["erratum"][0].detail["reused_tokens"]
    assert tok.decode(pair.ids_old[reused:reused + 1]) == "TASK" and reused > pair.field_slots[-1]


def test_wording_and_layout_texts(template):
    inst = generate_instances(template, 1, seed=0)[0]
    f, v = inst.field, inst.new_value
    lines = {w: erratum_line(template, inst, v, fmt) for w, fmt in WORDINGS.items()}
    assert lines == {
        "bare_value": f"{f}: {v}",
        "tagged_update": f"[STATE UPDATE] {f}: {v}",
        "explicit_override": f"[STATE UPDATE] {f} has just changed to {v}; this overrides any earlier value. "
                             "Apply the current value.",
        "aggressive": f"[STATE UPDATE] {f} has just changed to {v}. Disregard your earlier conclusion and re-evaluate.",
    }
    assert erratum_body(template, inst, inst.old_value, []) == inst.body(inst.old_value)
    body = erratum_body(template, inst, inst.old_value, [lines["bare_value"], "second"])
    assert f"{template.assistant_turn}\n\n{f}: {v}\n\nsecond\n\nTASK\n" in body
    hoisted = hoisted_body(template, inst, v)
    context = hoisted.split(template.policy_header)[0]
    assert f"{f}:" not in context and f"\n\n{f}: {v}\n\nTASK\n" in hoisted
    assert hoisted.replace(f"{f}: {v}\n\n", "", 1) == inst.body(v).replace(f"{f}: {v}\n", "", 1)  # only moved


def test_greedy_chain_state_is_a_prefill(text_case):
    lm, inst, pair, pp = text_case
    cue = pair.ids_old[-3:]
    state, chain = greedy_chain(lm, pp.old, cue, 3)
    assert len(chain) == 3 and state.length == pp.context_length + 3 + 3
    ref = prefill(lm, pair.ids_old[:-1] + cue + chain)
    assert state.max_abs_diff(ref) < 1e-4
    assert answer_prefix_tokens(lm.tokenizer, inst, False) == 2  # "Decision" ":" in the word-level tokenizer


RUNS = {
    "edit_frontier": ["--set", "params.selective_k=[1,4]"],
    "edit_wording": ["--set", "params.arms=[erratum,field_erratum]"],
    "edit_cot": ["--set", "params.chain_tokens=3"],
    "long_horizon": ["--set", "params.turns=3"],
}


@pytest.fixture(scope="module")
def records(tiny_text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("edit_records")
    for name, extra in RUNS.items():
        assert main(["run", f"configs/{name}.yaml", "--model", str(tiny_text_dir), "--output-dir", str(out),
                     "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--quiet", *extra]) == 0
    assert main(["run", "configs/long_horizon.yaml", "--model", str(tiny_text_dir), "--output-dir", str(out),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--quiet", "--set", "params.turns=3",
                 "--set", "params.scheme=erratum"]) == 0
    recs = {}
    for path in out.glob("*/*/*.json"):
        rec = json.loads(path.read_text())
        recs.setdefault(rec["experiment"], []).append(rec)
    return out, recs


def test_edit_records(records):
    _, recs = records
    for name in RUNS:
        s = recs[name][0]["summary"]
        assert s["n_instances"] == 2 and "gate" in s and s["effect_size"]["oracle_flip_nats"]["n"] == 2, name
    frontier = recs["edit_frontier"][0]
    for row in frontier["rows"]:
        m = row["methods"]
        assert abs(m["full_reprefill"]["recovery"] - 1) < 1e-3 and abs(m["stale"]["recovery"]) < 1e-3
        assert abs(m["full_downstream"]["recovery"] - 1) < 1e-3
        assert m["full_reprefill"]["recompute_fraction"] == 1 and m["stale"]["recompute_fraction"] == 0
        assert m["hoist_to_end"]["needs_prompt_surgery"] and not m["field_erratum"]["needs_prompt_surgery"]
        assert abs(m["erratum"]["ld"] - m["erratum"]["reference_ld"]) < 1e-3  # same tokens, same function
        assert "reference_ld" in m["field_erratum"]
        assert max(row["checks"].values()) < 1e-4
        assert m["in_place"]["correct"] == (m["in_place"]["ld"] > 0)
    assert [s["k"] for s in frontier["summary"]["selective_k"]] == [1, 4]
    # the erratum's agreement with the reprefill of its own text holds by construction: the table says so
    from kvprobe.runner.experiment import get_experiment

    rows = get_experiment("edit_frontier").table(frontier["summary"]).splitlines()
    assert next(r for r in rows if r.startswith("erratum ")).endswith("(identity)")
    assert not next(r for r in rows if r.startswith("field_erratum ")).endswith("(identity)")
    wording = recs["edit_wording"][0]
    assert set(wording["summary"]["methods"]) == {f"{a}/{w}" for a in ("erratum", "field_erratum") for w in WORDINGS}
    cot = recs["edit_cot"][0]
    assert cot["summary"]["modes"]["cot"]["chain_tokens"] == 3
    assert all(r["methods"]["cot/in_place"]["chain_tokens"] <= 3 for r in cot["rows"])
    by_scheme = {r["summary"]["scheme"]: r for r in recs["long_horizon"]}
    control = by_scheme["erratum"]["summary"]
    assert control["agreement"]["mean"] == 1 and min(t["cosine"] for t in control["per_turn"]) > 1 - 1e-6
    lh = by_scheme["field_erratum"]
    assert len(lh["rows"][0]["turns"]) == 3 and "agreement_slope_per_turn" in lh["summary"]
    assert [t["value"] for t in lh["rows"][0]["turns"]] == [lh["rows"][0]["new_value"], lh["rows"][0]["old_value"],
                                                           lh["rows"][0]["new_value"]]


def test_edit_figures_render(records, tmp_path):
    out, _ = records
    names = {p.name for p in render_all(out, tmp_path)}
    assert {"fig16_edit_frontier.png", "fig17_selective_k.png", "fig3d_edit_wording.png", "fig2c_edit_cot.png",
            "fig23_long_horizon.png"} <= names


def test_edit_report_rows(records):
    out, _ = records
    rows = report_rows(out)
    assert sorted(r[0] for r in rows) == sorted(RUNS)  # the two long_horizon schemes: newest record only
    for row in rows:
        assert row[5].strip() and row[6].strip(), row
    frontier = next(r for r in rows if r[0] == "edit_frontier")
    assert "full_reprefill " in frontier[5] and "@100.0%" in frontier[5] and "@0.0%" in frontier[5]


@pytest.mark.parametrize("fmt", ["system_user", "user_turn", "document_qa", "few_shot", "tool_call", "gated_template"])
def test_generated_instances_take_the_erratum_ahead_of_their_decision_prompt(fmt):
    from kvprobe.tasks.generator import CORRECTION, build_generated

    inst = build_generated(2, 0, "test", fmt, n_notes=3)
    head = inst.after_field[inst.decision_at:]
    assert head.startswith(("Question: ", "TASK\n")) or head.startswith(inst.after_field.rsplit("\n", 1)[-1])
    line = erratum_line(None, inst, inst.new_value)
    assert line == CORRECTION.format(field=inst.field, new_value=inst.new_value)
    assert erratum_body(None, inst, inst.old_value, []) == inst.body(inst.old_value)
    body = erratum_body(None, inst, inst.old_value, [line])
    assert body == inst.body(inst.old_value).replace(head, f"{line}\n\n{head}")
    hoisted = hoisted_body(None, inst, inst.new_value)
    assert f"{inst.field}: {inst.new_value}\n\n{head}" in hoisted
    assert hoisted.count(f"{inst.field}:") == inst.body(inst.new_value).count(f"{inst.field}:")  # moved, not added
    template_inst = generate_instances(_template(), 1, seed=0)[0]
    with pytest.raises(Exception, match="needs its template"):
        erratum_line(None, template_inst, template_inst.new_value)


def _template():
    from kvprobe.tasks.gated import load_template

    return load_template("configs/tasks/gated.yaml")


def test_generated_erratum_paths_equal_full_forward_of_the_same_text(tiny_generator_dir):
    from kvprobe.tasks.generator import build_generated

    lm = load_model(str(tiny_generator_dir))
    inst = build_generated(0, 0, "test", "document_qa", tokenizer=lm.tokenizer, chat=False, n_notes=4)
    pp = prefill_pair(lm, tokenize_pair(lm.tokenizer, inst, False))
    e = edit.FieldEdit.from_pair(pp)
    ids = prompt_ids(lm.tokenizer, inst, erratum_body(None, inst, inst.old_value,
                                                      [erratum_line(None, inst, inst.new_value)]), False)
    res = edit.erratum(lm, e, ids, 1)
    full = read_logits(lm, prefill(lm, ids[:-1]), ids[-1:])
    assert (read_logits(lm, res.state, res.suffix_ids) - full).abs().max() < 1e-4
    assert res.detail["reused_tokens"] > pp.pair.field_slots[-1]
