import pytest

from kvprobe.errors import KVProbeError
from kvprobe.models.loading import load_model
from kvprobe.tasks.gated import build_instance, generate_instances, load_template, tokenize_pair
from tests.conftest import TEMPLATE


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


def _child(tmp_path, parent, scenarios, name="child.yaml"):
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump({"extends": str(parent), "name": "child", "scenarios": scenarios}))
    return path


def test_a_template_extends_its_parent_appends_scenarios_and_hashes_the_chain(tmp_path):
    """`extends:` reuses the parent's header and appends the child's scenarios; the run's template hash covers
    the parent too (an edited parent must not leave its children's records current)."""
    import shutil
    from types import SimpleNamespace

    from kvprobe.runner.experiment import task_template_sha

    parent = tmp_path / "parent.yaml"
    shutil.copy(TEMPLATE, parent)
    base = load_template(parent)
    extra = base.scenarios[0].model_dump() | {"name": "extra_one"}
    child = _child(tmp_path, parent, [extra])
    merged = load_template(child)
    assert merged.name == "child" and merged.filler_rules == base.filler_rules
    assert [s.name for s in merged.scenarios] == [s.name for s in base.scenarios] + ["extra_one"]

    def sha(path):
        return task_template_sha(SimpleNamespace(task=SimpleNamespace(generator=None, template=str(path))))

    import hashlib
    assert sha(parent) == hashlib.sha256(parent.read_bytes()).hexdigest()[:16]  # no extends: the file's own hash
    before = sha(child)
    parent.write_text(parent.read_text() + "\n# an edit\n")
    assert sha(child) != before


def test_extends_refuses_repeated_names_a_loop_and_a_missing_parent(tmp_path):
    import shutil

    parent = tmp_path / "parent.yaml"
    shutil.copy(TEMPLATE, parent)
    first = load_template(parent).scenarios[0].model_dump()
    with pytest.raises(KVProbeError, match=f"repeat across 'extends': {first['name']}"):
        load_template(_child(tmp_path, parent, [first]))
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"extends: {loop}\nname: loop\n")
    with pytest.raises(KVProbeError, match="loops back"):
        load_template(loop)
    with pytest.raises(KVProbeError, match="named by .*child.yaml's 'extends'"):
        load_template(_child(tmp_path, tmp_path / "absent.yaml", []))


def test_polarity_wide_holds_36_scenarios_whose_triggers_tokenize_alike(smollm):
    """The dissociation's wider template: 36 independent scenarios; every trigger pair has one token count in
    context on SmolLM2's tokenizer (the stricter of the two embedded families here), plain and chat."""
    from kvprobe.tasks.polarity import generate_polarity_instances

    wide = load_template("configs/tasks/polarity_wide.yaml")
    names = [s.name for s in wide.scenarios]
    assert len(names) == len(set(names)) == 36
    for inst in generate_polarity_instances(wide, 4 * len(names), seed=0):
        for chat in (False, True):
            tokenize_pair(smollm.tokenizer, inst, chat=chat)
