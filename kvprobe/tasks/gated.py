"""The gated-decision task family (paper Section 3 Setup, Appendix B).

A context holds a mutable field upstream (SESSION CONTEXT), then a binding rule naming which value permits
which action, >= 20 neutral filler rules, the tools, a conversation and the decision prompt. An instance
is a pair of prompts that differ only in the field's value (old -> new), so the correct action flips.

Templates are YAML (``configs/tasks/gated.yaml``); any file of the same shape works. A template may start
with ``extends: <parent.yaml>``: it keeps the parent's keys unless it sets them, and its ``scenarios`` are
appended to the parent's (``configs/tasks/polarity_wide.yaml``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from kvprobe.errors import KVProbeError


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    family: str
    field: str
    allow_value: str
    block_value: str
    allow_action: str
    block_action: str
    rule: str
    request: str


class GatedTemplate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    preamble: str
    context_header: str
    policy_header: str
    tools_header: str
    conversation_header: str
    assistant_turn: str
    decision_prompt: str
    answer_prefix: str
    erratum: str
    tools: list[str]
    channels: list[str]
    customers: list[str]
    filler_rules: list[str] = Field(min_length=20)
    scenarios: list[Scenario] = Field(min_length=1)

    def scenario(self, name: str) -> Scenario:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KVProbeError(f"scenario '{name}' is not in template '{self.name}': "
                           f"choose from {', '.join(s.name for s in self.scenarios)}")


EXTENDS = "extends"  # a template key: the parent template whose header it reuses and whose scenarios it extends


def template_chain(path: str | Path) -> list[Path]:
    """The template file and, through ``extends:``, each parent it builds on (child first). A run's template
    hash covers the whole chain, so editing a parent invalidates its children's records too."""
    from kvprobe.cache_dir import project_path

    chain: list[Path] = []
    p = project_path(path)
    while True:
        if not p.exists():
            hint = f" (named by {chain[-1]}'s '{EXTENDS}')" if chain else ""
            raise KVProbeError(f"task template {p} does not exist{hint}: set task.template to a YAML file like "
                               "configs/tasks/gated.yaml")
        if p in chain:
            raise KVProbeError(f"task template {p}: '{EXTENDS}' loops back to itself")
        chain.append(p)
        data = yaml.safe_load(p.read_text())
        parent = data.get(EXTENDS) if isinstance(data, dict) else None
        if parent is None:
            return chain
        p = project_path(parent)


def _template_data(chain: list[Path]) -> dict[str, Any]:
    """Merge a chain root-first: a child's keys replace its parent's, except ``scenarios``, which it appends."""
    data: dict[str, Any] = {}
    for p in reversed(chain):
        child = dict(yaml.safe_load(p.read_text()) or {})
        child.pop(EXTENDS, None)
        scenarios = data.get("scenarios", []) + child.pop("scenarios", [])
        data.update(child)
        data["scenarios"] = scenarios
    names = [s.get("name") for s in data["scenarios"] if isinstance(s, dict)]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise KVProbeError(f"task template {chain[0]}: scenario names repeat across '{EXTENDS}': {', '.join(repeated)}; "
                           "rename the child's")
    return data


def load_template(path: str | Path) -> GatedTemplate:
    chain = template_chain(path)
    try:
        return GatedTemplate.model_validate(_template_data(chain))
    except KVProbeError:
        raise
    except Exception as exc:  # pydantic.ValidationError or YAML error
        from kvprobe.schema import format_validation_error

        raise KVProbeError(f"task template {chain[0]}: {format_validation_error(exc)}") from None


@dataclass(frozen=True)
class GatedInstance:
    """One old -> new pair. ``parts`` is the prompt body split around the field value."""

    index: int
    scenario: str
    family: str
    field: str
    old_value: str
    new_value: str
    old_action: str  # correct under old_value
    new_action: str  # correct under new_value
    before_field: str
    after_field: str
    answer_prefix: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def body(self, value: str) -> str:
        return self.before_field + value + self.after_field

    def row(self) -> dict[str, Any]:
        return {"index": self.index, "scenario": self.scenario, "family": self.family, "field": self.field,
                "old_value": self.old_value, "new_value": self.new_value, "old_action": self.old_action,
                "new_action": self.new_action, **self.meta}


def _rng(seed: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"gated:{seed}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def build_instance(template: GatedTemplate, scenario: Scenario, index: int, seed: int, n_filler: int,
                   direction: str | None = None) -> GatedInstance:
    """Render one instance. ``direction`` 'allow_to_block' / 'block_to_allow' (default: chosen by the seed)."""
    rng = _rng(seed, index)
    if n_filler > len(template.filler_rules):
        raise KVProbeError(f"task.n_filler={n_filler} exceeds the template's {len(template.filler_rules)} filler rules")
    fillers = rng.sample(template.filler_rules, n_filler)
    order_id = f"A{rng.randint(1000, 9999)}"
    amount = f"{rng.randint(12, 180)}.{rng.choice(['00', '50', '99'])}"
    customer = rng.choice(template.customers)
    channel = rng.choice(template.channels)
    agent = rng.randint(2, 9)
    direction = direction or rng.choice(["allow_to_block", "block_to_allow"])
    allow = (scenario.allow_value, scenario.allow_action)
    block = (scenario.block_value, scenario.block_action)
    (old_value, old_action), (new_value, new_action) = (allow, block) if direction == "allow_to_block" else (block, allow)
    options = [scenario.allow_action, scenario.block_action]
    rng.shuffle(options)
    rules = "\n".join(f"R{i}. {r}" for i, r in enumerate(fillers, start=1))
    tools = "\n".join(f"- {t}" for t in template.tools)
    request = scenario.request.format(order_id=order_id, amount=amount)
    before = (f"{template.preamble}\n\n{template.context_header}\n{scenario.field}: ")
    after = (f"\ncustomer: {customer}\nchannel: {channel}\nagent_id: agent-{agent}\n\n"
             f"{template.policy_header}\n{scenario.rule}\n{rules}\n\n"
             f"{template.tools_header}\n{tools}\n\n"
             f"{template.conversation_header}\nuser: {request}\n{template.assistant_turn}\n\n"
             + template.decision_prompt.format(option_a=options[0], option_b=options[1]))
    return GatedInstance(index=index, scenario=scenario.name, family=scenario.family, field=scenario.field,
                         old_value=old_value, new_value=new_value, old_action=old_action, new_action=new_action,
                         before_field=before, after_field=after, answer_prefix=template.answer_prefix,
                         meta={"direction": direction, "order_id": order_id, "n_filler": n_filler})


def generate_instances(template: GatedTemplate, n: int, seed: int, scenarios: list[str] | None = None,
                       n_filler: int = 24) -> list[GatedInstance]:
    """``n`` instances cycling over the chosen scenarios (all by default), varied by ``seed``."""
    chosen = [template.scenario(s) for s in scenarios] if scenarios else list(template.scenarios)
    return [build_instance(template, chosen[i % len(chosen)], i, seed, n_filler) for i in range(n)]


@dataclass(frozen=True)
class TokenizedPair:
    """Token ids of the old and new prompt (same length), the field's slots, and the two action tokens."""

    ids_old: list[int]
    ids_new: list[int]
    field_slots: list[int]
    old_action_id: int
    new_action_id: int

    @property
    def field_start(self) -> int:
        return self.field_slots[0]

    def __len__(self) -> int:
        return len(self.ids_old)


def render(tokenizer: Any, text: str, chat: bool, system: str = "") -> tuple[str, bool]:
    """The full prompt string for a body (chat-wrapped when the model has a template, after ``system`` as a
    system message if given) and whether the tokenizer should add its own special tokens (raw prompts: yes;
    chat templates carry them as text). A system message without a chat template is refused: the caller must
    put the system text into the body (the scenario generator does so for raw models)."""
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    if system:
        raise KVProbeError("this prompt has a system message but the model has no chat template; generate the "
                           "instance for a raw model (chat=False) so the system text goes into the prompt body")
    return text + "\n", True


def instance_prompt(tokenizer: Any, inst: Any, value: str, chat: bool) -> tuple[str, bool]:
    """An instance's prompt with ``value`` in the field, through its answer prefix (its system message, if the
    instance has one, included)."""
    prompt, special = render(tokenizer, inst.body(value), chat, getattr(inst, "system", ""))
    return prompt + inst.answer_prefix, special


def _encode(tokenizer: Any, text: str, special: bool) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def action_token(tokenizer: Any, prompt_ids: list[int], prompt: str, action: str, special: bool) -> int:
    """The first token the model emits for `` action`` after the prompt (space-prefixed, tokenizer-robust)."""
    ids = tokenizer(prompt + " " + action, add_special_tokens=special)["input_ids"]
    if ids[: len(prompt_ids)] != prompt_ids or len(ids) <= len(prompt_ids):
        raise KVProbeError(f"action '{action}' merges with the end of the prompt in this tokenizer; "
                           "end the answer_prefix with punctuation")
    return int(ids[len(prompt_ids)])


def _field_start(prompt_old: str, prompt_new: str, inst: GatedInstance) -> int:
    """Character index of the field's value: the occurrence of ``before_field`` followed by the old value in
    one prompt and the new value in the other. Why not the first occurrence: a rule may quote the field the
    way the record writes it ("booking_flag: renewed leads to ...")."""
    at = prompt_old.find(inst.before_field)
    while at >= 0:
        start = at + len(inst.before_field)
        if prompt_old.startswith(inst.old_value, start) and prompt_new.startswith(inst.new_value, start) \
                and prompt_old[:start] == prompt_new[:start]:
            return start
        at = prompt_old.find(inst.before_field, at + 1)
    raise KVProbeError(f"scenario '{inst.scenario}': no place where the two prompts differ by the field's value "
                       f"after {inst.before_field!r}")


def tokenize_pair(tokenizer: Any, inst: GatedInstance, chat: bool) -> TokenizedPair:
    """Tokenize both prompts; refuse if the two values do not take the same number of tokens in context."""
    if tokenizer is None:
        raise KVProbeError("this model has no tokenizer; text tasks need one (add tokenizer files to the model directory)")
    texts, encs = {}, {}
    prompts = {key: instance_prompt(tokenizer, inst, value, chat)
               for key, value in (("old", inst.old_value), ("new", inst.new_value))}
    start = _field_start(prompts["old"][0], prompts["new"][0], inst)
    for key, value in (("old", inst.old_value), ("new", inst.new_value)):
        prompt, special = prompts[key]
        texts[key] = (prompt, special, start, start + len(value))
        encs[key] = _encode(tokenizer, prompt, special)
    (ids_old, off_old), (ids_new, off_new) = encs["old"], encs["new"]
    if len(ids_old) != len(ids_new):
        n_old = sum(1 for a, b in off_old if b > texts["old"][2] and a < texts["old"][3])
        n_new = sum(1 for a, b in off_new if b > texts["new"][2] and a < texts["new"][3])
        raise KVProbeError(
            f"field values '{inst.old_value}' ({n_old} tokens) and '{inst.new_value}' ({n_new} tokens) of scenario "
            f"'{inst.scenario}' tokenize to different lengths in context ({len(ids_old)} vs {len(ids_new)} tokens); "
            "choose values with equal token counts for this tokenizer")
    slots = {i for i, (a, b) in enumerate(off_old) if b > texts["old"][2] and a < texts["old"][3]}
    slots |= {i for i, (a, b) in enumerate(off_new) if b > texts["new"][2] and a < texts["new"][3]}
    slots |= {i for i, (a, b) in enumerate(zip(ids_old, ids_new)) if a != b}
    field_slots = sorted(slots)
    if field_slots != list(range(field_slots[0], field_slots[-1] + 1)):
        raise KVProbeError(f"scenario '{inst.scenario}': the two prompts differ outside one contiguous field span")
    old_id = action_token(tokenizer, ids_old, texts["old"][0], inst.old_action, texts["old"][1])
    new_id = action_token(tokenizer, ids_new, texts["new"][0], inst.new_action, texts["new"][1])
    if old_id == new_id:
        raise KVProbeError(f"actions '{inst.old_action}' and '{inst.new_action}' start with the same token; "
                           "pick actions whose first tokens differ")
    return TokenizedPair(ids_old, ids_new, field_slots, old_id, new_id)


def segment_prompt(tokenizer: Any, inst: GatedInstance, value: str, chat: bool,
                   markers: list[str]) -> tuple[list[int], list[int]]:
    """Token ids of the prompt with ``value`` in the field, and the token index where each marker's text
    begins (a token straddling the boundary goes with the text after it). Used to cut a prompt into chunks
    without re-tokenizing the pieces (which could merge tokens differently at the cuts)."""
    prompt, special = instance_prompt(tokenizer, inst, value, chat)
    ids, offsets = _encode(tokenizer, prompt, special)
    cuts = []
    for marker in markers:
        at = prompt.index(marker)
        cuts.append(next(i for i, (a, b) in enumerate(offsets) if b > at and (a, b) != (0, 0)))
    return ids, cuts
