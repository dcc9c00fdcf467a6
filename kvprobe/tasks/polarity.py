"""The polarity 2x2 task (paper Appendix B "The dissociation pair", Appendix C (i), Appendix D).

A polarity rule names one trigger value: if the field equals the trigger the scenario's block_action is
correct, otherwise its allow_action. An instance holds the field value byte-identical and flips the
trigger token inside the rule, so only the conclusion changes. Templates use the gated schema
(``configs/tasks/polarity.yaml``) with ``{trigger}`` once in each rule.

Instances are :class:`GatedInstance` objects whose varying span is the trigger: ``before_field`` ends just
before the trigger (it contains the field value), ``old_value``/``new_value`` are the two triggers, so
:func:`kvprobe.tasks.gated.tokenize_pair` gives a pair whose ``field_slots`` are the trigger's slots (and
refuses triggers of unequal token counts). A 2x2 cell sets field value = (allow_value, block_value)[cell % 2]
and sends the conclusion to block (old trigger = the other value, new trigger = the field value) for cells
0/1, to allow for cells 2/3. Instance ``i`` of ``n_scenarios`` takes cell ``(i + i // n_scenarios) % 4``:
consecutive instances alternate cells, and each scenario meets all four cells over its first four
instances, so conclusion, field identity and scenario stay balanced against each other.
"""

from __future__ import annotations

from kvprobe.errors import KVProbeError
from kvprobe.tasks.gated import GatedInstance, GatedTemplate, Scenario, build_instance

TRIGGER = "{trigger}"


def is_polarity(template: GatedTemplate) -> bool:
    """Whether the template's rules name a ``{trigger}`` (its pairs must come from this module: the gated
    generator would leave the placeholder unfilled)."""
    return any(TRIGGER in s.rule for s in template.scenarios)


def build_polarity_instance(template: GatedTemplate, scenario: Scenario, index: int, seed: int,
                            n_filler: int, cell: int) -> GatedInstance:
    if scenario.rule.count(TRIGGER) != 1:
        raise KVProbeError(f"polarity scenario '{scenario.name}': its rule must contain {TRIGGER} exactly once "
                           f"(template '{template.name}'; see configs/tasks/polarity.yaml)")
    cell = cell % 4
    field_value = (scenario.allow_value, scenario.block_value)[cell % 2]
    other = scenario.block_value if field_value == scenario.allow_value else scenario.allow_value
    to_block = cell < 2
    old_trigger, new_trigger = (other, field_value) if to_block else (field_value, other)
    old_action, new_action = ((scenario.allow_action, scenario.block_action) if to_block
                              else (scenario.block_action, scenario.allow_action))
    # The gated renderer inserts the rule verbatim: cut the rendered body at the trigger placeholder.
    base = build_instance(template, scenario, index, seed, n_filler, direction="allow_to_block")
    head, tail = base.after_field.split(TRIGGER)
    meta = {k: v for k, v in base.meta.items() if k != "direction"}
    meta.update({"varied": "trigger", "cell": cell, "direction": "to_block" if to_block else "to_allow",
                 "field_value": field_value, "field_is_allow": field_value == scenario.allow_value,
                 "allow_value": scenario.allow_value, "block_action": scenario.block_action})
    return GatedInstance(index=index, scenario=scenario.name, family=scenario.family, field=scenario.field,
                         old_value=old_trigger, new_value=new_trigger, old_action=old_action, new_action=new_action,
                         before_field=base.before_field + field_value + head, after_field=tail,
                         answer_prefix=base.answer_prefix, meta=meta)


def generate_polarity_instances(template: GatedTemplate, n: int, seed: int, scenarios: list[str] | None = None,
                                n_filler: int = 24) -> list[GatedInstance]:
    """``n`` instances cycling over the chosen scenarios (all by default) and the four 2x2 cells."""
    chosen = [template.scenario(s) for s in scenarios] if scenarios else list(template.scenarios)
    n_s = len(chosen)
    return [build_polarity_instance(template, chosen[i % n_s], i, seed, n_filler, (i + i // n_s) % 4)
            for i in range(n)]


def prompt_labels(inst: GatedInstance) -> dict[str, tuple[int, int]]:
    """Per label, its value in the (old, new) prompt: the conclusion (1 = block action correct), the field
    identity (1 = field holds the scenario's allow_value) and the trigger identity (same coding)."""
    m = inst.meta
    field = int(m["field_is_allow"])
    return {"conclusion": (int(inst.old_action == m["block_action"]), int(inst.new_action == m["block_action"])),
            "field": (field, field),
            "trigger": (int(inst.old_value == m["allow_value"]), int(inst.new_value == m["allow_value"]))}
