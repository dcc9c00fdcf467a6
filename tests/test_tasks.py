import pytest

from kvprobe.errors import KVProbeError
from kvprobe.models.loading import load_model
from kvprobe.tasks.gated import build_instance, generate_instances, tokenize_pair


def test_instances_are_deterministic_and_keep_the_paper_geometry(template):
    a = generate_instances(template, 10, seed=3)
    b = generate_instances(template, 10, seed=3)
    c = generate_instances(template, 10, seed=4)
    assert [i.body(i.old_value) for i in a] == [i.body(i.old_value) for i in b]
    assert [i.body(i.old_value) for i in a] != [i.body(i.old_value) for i in c]
    assert len({i.scenario for i in generate_instances(template, 24, seed=0)}) >= 8
    for inst in a:
        body = inst.body(inst.old_value)
        field_at = body.index(f"{inst.field}: {inst.old_value}")
        assert field_at < body.index("POLICY DOCUMENT") < body.index("CONVERSATION SO FAR") < body.index("TASK")
        assert body.count("\nR") >= 20  # >= 20 filler rules between the rule and the decision
        assert inst.old_action != inst.new_action


def test_pair_differs_only_on_the_field(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir), device="cpu", dtype="float32")
    for inst in generate_instances(template, 12, seed=0):
        pair = tokenize_pair(lm.tokenizer, inst, chat=False)
        assert len(pair.ids_old) == len(pair.ids_new)
        diff = [i for i, (x, y) in enumerate(zip(pair.ids_old, pair.ids_new)) if x != y]
        assert set(diff) <= set(pair.field_slots)
        assert pair.old_action_id != pair.new_action_id


def test_token_count_mismatch_names_values_and_counts(tiny_text_dir, template):
    lm = load_model(str(tiny_text_dir), device="cpu", dtype="float32")
    sc = template.scenarios[0].model_copy(update={"block_value": "pending pending"})
    inst = build_instance(template, sc, 0, 0, 20, direction="allow_to_block")
    with pytest.raises(KVProbeError) as err:
        tokenize_pair(lm.tokenizer, inst, chat=False)
    msg = str(err.value)
    assert "'pending' (1 tokens)" in msg and "'pending pending' (2 tokens)" in msg


def test_unknown_scenario_and_short_filler_are_clear_errors(template):
    with pytest.raises(KVProbeError, match="choose from"):
        generate_instances(template, 2, seed=0, scenarios=["nope"])
    with pytest.raises(KVProbeError, match="n_filler"):
        generate_instances(template, 2, seed=0, n_filler=999)
