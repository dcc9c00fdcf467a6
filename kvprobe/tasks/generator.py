"""Procedural gated-decision scenarios: many families, six prompt formats, a controlled field distance.

The fixed template (``configs/tasks/gated.yaml``) holds 24 hand-written scenarios in one prompt shape. This
generator composes a *family* from word lists (``kvprobe/tasks/data/scenario_words.yaml``): a field name
(subject x attribute), a value pair, an action pair and a rule phrasing, with hundreds of thousands of
combinations. Per instance it draws the direction of the change (old -> new value), whether the rule is
counterfactual (the two values exchanged against their everyday sense), and optionally a late correction
(the field restated later with a new value; the latest value wins) or a reasoning answer prefix.

Prompt formats (where the field and the rules sit):

- ``system_user``: the policy in the system message, the field in the user turn (the shape on which the
  pretrained qwen2.5-coder-0.5b gates, issue #14 (b));
- ``user_turn``: one user message: policy, record, notes, question;
- ``document_qa``: a document holding the field, then a question that states the rule;
- ``few_shot``: a transcript of two decided cases, then the open case;
- ``tool_call``: the field arrives in a tool response (JSON), notes as log lines;
- ``gated_template``: today's template (session context, policy with >= 20 filler rules, tools,
  conversation, task).

The field-to-decision distance (tokens after the field's last token, up to the token the decision is read
after) is a parameter: neutral note lines fill the gap until the tokenizer's count is within a few tokens
of the target; the measured count is recorded in every instance (``distance_tokens``).

Splits: every word list is split by position (index mod 5: 0-2 train, 3 validation, 4 test), and the
formats are split too (:data:`FORMAT_SPLITS`), so a test family shares no subject, value pair, action pair
or rule phrasing with any training family, and two test formats are never seen in training.
:func:`check_splits` proves the disjointness. A word list may add rule phrasings that only the held-out
splits draw (``heldout_rules``; ``scenario_words_v2.yaml`` gives validation and test four more each, so both
hold negated and plain phrasings) without changing a single train draw, and phrasings that only the train
split draws (``train_rules``; ``scenario_words_v3.yaml`` adds negated ones) without changing a held-out draw.
Instances are
:class:`GeneratedInstance` (a :class:`~kvprobe.tasks.gated.GatedInstance` with an optional system message)
and tokenize with :func:`tokenize_generated`, which applies the existing equal-length and contiguity checks of
:func:`~kvprobe.tasks.gated.tokenize_pair`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator

from kvprobe.errors import KVProbeError
from kvprobe.tasks.gated import GatedInstance, TokenizedPair, tokenize_pair

WORDS_FILE = Path(__file__).parent / "data" / "scenario_words.yaml"
GATED_TEMPLATE = "configs/tasks/gated.yaml"
SPLITS = ("train", "validation", "test")
FORMATS = ("system_user", "user_turn", "document_qa", "few_shot", "tool_call", "gated_template", "email")
RULE_POSITIONS = ("format", "before_field", "after_field")
"""Where the rule sits: the format's own place, or moved before / after the field (the same-format test)."""
FORMAT_RULE_POSITION = {"system_user": "before_field", "user_turn": "before_field", "document_qa": "after_field",
                        "few_shot": "before_field", "tool_call": "before_field", "gated_template": "after_field",
                        "email": "before_field"}
RULE_MOVABLE = ("user_turn", "document_qa")
FORMAT_SPLITS: dict[str, tuple[str, ...]] = {"train": ("gated_template", "user_turn", "document_qa"),
                                             "validation": ("few_shot",),
                                             "test": ("system_user", "tool_call")}
# Held-out formats drawn only on request, never in a card's own cells, so every draw made before they were
# added stays what it was. email is a second validation format beside few_shot, as the test split has two:
# few_shot alone rewarded recipes the unseen test formats did not (RESULTS, the decision table). It carries
# no marker of another split's format (no "Case", "Rule:", "Policy" label, tool tags, "log:" or system
# message).
EXTRA_HELDOUT_FORMATS: dict[str, tuple[str, ...]] = {"validation": ("email",)}
# Surface variants of the two free-form train formats: the framing text around the record (opening line,
# labels, record header, field separator, note bullet) is re-drawn, the content is not. Why: an organism
# trained on three fixed framings can learn the framings instead of the habit of reading the field through
# the rule (issue #14 (d)); trained as smollm2-135m-gated-v3s it did not help on validation. No variant
# uses a marker of a held-out format ("Case", "Rule:", tool tags, "log:", a system message), so the
# validation and test formats stay unseen.
SURFACE_VARIED = ("user_turn", "document_qa")
# Earlier decided records in the two free-form train formats: two past records of the same field, one per
# value, each with the action this rule gives it, ahead of the open record. Why: few_shot (validation) fails
# because of its two decided cases (without them the test families score 0.81-1.00), and no train format
# shows the field's other value with an answer before the decision. Rendered without few_shot's markers
# ("Case", "Rule:", "Decide each case", the answer prefix), so few_shot stays an unseen format.
PRIOR_CASES_FORMATS = ("user_turn", "document_qa")
SURFACE_VARIANTS: dict[str, tuple[str, ...]] = {
    "opening": ("You are an operations assistant. Apply the policy to the record below.",
                "Apply the policy to the record that follows.", "Check the record against the policy, then decide.",
                "You work on the operations desk. Use the policy below on this record.",
                "Instructions: decide by the policy for the record below."),
    "policy_label": ("Policy:", "POLICY:", "Guideline:", "Standing instruction:", "Policy -"),
    "record_header": ("Record {ref}", "Entry {ref}", "File {ref}", "Ticket {ref}", "== record {ref} =="),
    "separator": (": ", " = ", " -> ", " is "),
    "bullet": ("- ", "* ", "", "> ", "note: "),
    "doc_opening": ("Read the document, then answer the question.", "Below is a document. Answer the question after it.",
                    "Use the document to answer.", "A document follows, then one question about it."),
    "doc_frame": ("DOCUMENT {ref}|END OF DOCUMENT", "BEGIN FILE {ref}|END FILE", "<doc id={ref}>|</doc>",
                  "--- {ref} ---|---"),
}
_PLAIN_SURFACE = {k: v[0] for k, v in SURFACE_VARIANTS.items()}


def known_formats(formats: list[str]) -> list[str]:
    """Config validator: every name is a generator format (``ValueError`` names the unknown ones)."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"unknown formats {unknown}; choose from {list(FORMATS)}")
    return formats


def known_split(split: str) -> str:
    """Config validator: ``split`` is one of :data:`SPLITS`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}")
    return split


def known_rule_position(position: str) -> str:
    """Config validator: ``position`` is one of :data:`RULE_POSITIONS`."""
    if position not in RULE_POSITIONS:
        raise ValueError(f"rule position must be one of {list(RULE_POSITIONS)}")
    return position


def rule_position(fmt: str, rule_at: str) -> str:
    """The rule's resolved position in ``fmt`` ('before_field' / 'after_field'); only the formats in
    :data:`RULE_MOVABLE` can move it."""
    if rule_at not in RULE_POSITIONS:
        raise KVProbeError(f"rule_at must be one of {list(RULE_POSITIONS)}, got '{rule_at}'")
    own = FORMAT_RULE_POSITION[fmt]
    if rule_at in ("format", own):
        return own
    if fmt not in RULE_MOVABLE:
        raise KVProbeError(f"format '{fmt}' keeps its rule {own.replace('_', ' ')}; rule_at='{rule_at}' needs one "
                           f"of {list(RULE_MOVABLE)} (or rule_at='format')")
    return rule_at


GeneratorFormats = Annotated[list[str], AfterValidator(known_formats)]
RulePosition = Annotated[str, AfterValidator(known_rule_position)]
GeneratorSplit = Annotated[str, AfterValidator(known_split)]


ANSWER_PREFIX = "Decision:"
REASONING_PREFIX = "Reasoning:"
DEFAULT_NOTES = 25  # note lines when no distance is asked for (the chat prompt had ~25)
CORRECTION = "Correction: {field} has changed to {new_value}; the latest value applies."
"""The late-correction line of the training data, and the default erratum of generated instances."""
_VALUE = "\x00VALUE\x00"  # where the field's value goes while a body is assembled


class InfeasibleDistance(KVProbeError):
    """The format's fixed text after the field is already longer than the asked distance."""


@dataclass(frozen=True)
class Words:
    subjects: tuple[str, ...]
    attributes: tuple[str, ...]
    value_pairs: tuple[tuple[str, str], ...]
    action_pairs: tuple[tuple[str, str], ...]
    rules: tuple[str, ...]
    requests: tuple[str, ...]
    note_people: tuple[str, ...]
    note_verbs: tuple[str, ...]
    note_objects: tuple[str, ...]
    note_times: tuple[str, ...]
    note_extras: tuple[str, ...]
    heldout_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Optional rule phrasings only held-out splits draw from, as (split, phrasings): a later word list adds
    them without changing the train split's draws (``scenario_words_v2.yaml``)."""
    train_rules: tuple[str, ...] = ()
    """Optional rule phrasings only the train split draws from: a later word list adds them without changing
    a single validation or test draw (``scenario_words_v3.yaml``: negated phrasings)."""


@lru_cache(maxsize=4)
def load_words(path: str | Path = WORDS_FILE) -> Words:
    """The word lists (YAML, the shape of ``kvprobe/tasks/data/scenario_words.yaml``); every entry a string.
    ``heldout_rules`` (optional) maps ``validation`` / ``test`` to extra rule phrasings of that split;
    ``train_rules`` (optional) lists extra rule phrasings of the train split."""
    raw = yaml.safe_load(Path(path).read_text())
    optional = ("heldout_rules", "train_rules")
    names = [f.name for f in dataclasses.fields(Words) if f.name not in optional]
    if not isinstance(raw, dict) or not set(names) <= set(raw) <= {*names, *optional}:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise KVProbeError(f"{Path(path).name} is not a scenario word list: it needs exactly the keys {names} "
                           f"(and optionally {' / '.join(optional)}), got {got}")
    out: dict[str, Any] = {}
    for name in names:
        entries = [tuple(v) if isinstance(v, list) else v for v in raw[name]]
        flat = [w for e in entries for w in (e if isinstance(e, tuple) else (e,))]
        if not all(isinstance(w, str) for w in flat):  # YAML reads yes/no/on/off as booleans
            raise KVProbeError(f"{Path(path).name}: '{name}' holds a non-string entry; quote it")
        out[name] = tuple(entries)
    extra = raw.get("heldout_rules") or {}
    if not isinstance(extra, dict) or not set(extra) <= {"validation", "test"} or not all(
            isinstance(v, list) and all(isinstance(r, str) for r in v) for v in extra.values()):
        raise KVProbeError(f"{Path(path).name}: heldout_rules maps 'validation' and/or 'test' to lists of rule "
                           "phrasings (train-only phrasings go under train_rules)")
    out["heldout_rules"] = tuple((split, tuple(extra[split])) for split in ("validation", "test") if split in extra)
    train_extra = raw.get("train_rules") or []
    if not isinstance(train_extra, list) or not all(isinstance(r, str) for r in train_extra):
        raise KVProbeError(f"{Path(path).name}: train_rules is a list of rule phrasings (quoted strings)")
    out["train_rules"] = tuple(train_extra)
    return Words(**out)


def is_default_words(path: str | Path | None) -> bool:
    """Whether ``path`` names the default word list (:data:`WORDS_FILE`; None counts as it)."""
    from kvprobe.cache_dir import project_path

    return path is None or project_path(path).resolve() == WORDS_FILE.resolve()


def split_of_position(index: int) -> str:
    """The split a word-list entry belongs to: position mod 5 -> 0-2 train, 3 validation, 4 test."""
    return ("train", "train", "train", "validation", "test")[index % 5]


def split_list(items: Sequence[Any], split: str) -> list[Any]:
    if split not in SPLITS:
        raise KVProbeError(f"split '{split}' is not one of {', '.join(SPLITS)}")
    return [x for i, x in enumerate(items) if split_of_position(i) == split]


def split_words(words: Words, kind: str, split: str) -> list[Any]:
    """The entries of word list ``kind`` in ``split``: its positional share, and for ``rules`` the split's
    own added phrasings after them (:attr:`Words.heldout_rules`, :attr:`Words.train_rules`)."""
    items = split_list(getattr(words, kind), split)
    if kind == "rules":
        items += list(words.train_rules) if split == "train" else list(dict(words.heldout_rules).get(split, ()))
    return items


def _words_of(entry: Any) -> set[str]:
    return set(entry) if isinstance(entry, tuple) else {entry}


def check_splits(words: Words | None = None) -> dict[str, dict[str, int]]:
    """Raise unless every word list and the formats are disjoint across splits; returns the sizes.

    Disjointness is checked on the words themselves (a value that appeared in two pairs in two splits
    would leak), not only on list positions."""
    words = words or load_words()
    sizes: dict[str, dict[str, int]] = {}
    for kind in ("subjects", "attributes", "value_pairs", "action_pairs", "rules"):
        seen: dict[str, str] = {}
        for split in SPLITS:
            part = split_words(words, kind, split)
            if not part:
                raise KVProbeError(f"word list '{kind}' has no entry in split '{split}'")
            sizes.setdefault(split, {})[kind] = len(part)
            for entry in part:
                for w in _words_of(entry):
                    if seen.setdefault(w, split) != split:
                        raise KVProbeError(f"'{w}' of word list '{kind}' is in both the {seen[w]} and {split} splits")
    fmt_seen: dict[str, str] = {}
    for split in SPLITS:
        for f in FORMAT_SPLITS[split] + EXTRA_HELDOUT_FORMATS.get(split, ()):
            if fmt_seen.setdefault(f, split) != split:
                raise KVProbeError(f"format '{f}' is in both the {fmt_seen[f]} and {split} splits")
    if set(fmt_seen) != set(FORMATS):
        raise KVProbeError(f"formats {sorted(set(FORMATS) - set(fmt_seen))} are in no split")
    return sizes


def family_space(split: str, words: Words | None = None) -> int:
    """How many families a split can compose (before collision rejection)."""
    words = words or load_words()
    n = 1
    for kind in ("subjects", "attributes", "value_pairs", "action_pairs", "rules"):
        n *= len(split_words(words, kind, split))
    return n


@dataclass(frozen=True)
class Family:
    """One composed scenario family. ``values``: (permitting, blocking) in their everyday sense."""

    subject: str
    attribute: str
    values: tuple[str, str]
    actions: tuple[str, str]  # (permitting, blocking)
    rule: str
    split: str

    @property
    def field(self) -> str:
        return f"{self.subject}_{self.attribute}"

    @property
    def name(self) -> str:
        rule_id = hashlib.sha256(self.rule.encode()).hexdigest()[:6]
        return f"{self.field}:{'/'.join(self.values)}->{'/'.join(self.actions)}#{rule_id}"

    def words(self) -> set[str]:
        return {self.subject, self.attribute, *self.values, *self.actions}


def _stem_clash(a: str, b: str) -> bool:
    a, b = a.lower(), b.lower()
    return a.startswith(b) or b.startswith(a)


def _collides(fam: Family) -> bool:
    """Whether an action shares a stem with the field's words or values (e.g. 'flag' / 'flagged')."""
    return any(_stem_clash(act, w) for act in fam.actions for w in (fam.subject, fam.attribute, *fam.values))


def sample_family(rng: random.Random, split: str, words: Words | None = None) -> Family:
    words = words or load_words()
    parts = {k: split_words(words, k, split)
             for k in ("subjects", "attributes", "value_pairs", "action_pairs", "rules")}
    for _ in range(100):
        fam = Family(rng.choice(parts["subjects"]), rng.choice(parts["attributes"]),
                     tuple(rng.choice(parts["value_pairs"])), tuple(rng.choice(parts["action_pairs"])),
                     rng.choice(parts["rules"]), split)
        if not _collides(fam):
            return fam
    raise KVProbeError(f"no collision-free family in split '{split}' after 100 draws: widen the word lists")


def template_family(scenario: Any) -> Family:
    """A hand-written scenario of the fixed template (``configs/tasks/gated.yaml``) as a family: its field,
    values, actions and its own rule text (values as written, so never counterfactual)."""
    subject, _, attribute = scenario.field.rpartition("_")
    rule = scenario.rule.replace("{", "{{").replace("}", "}}")  # literal: no placeholders to fill
    return Family(subject or scenario.field, attribute, (scenario.allow_value, scenario.block_value),
                  (scenario.allow_action, scenario.block_action), rule, "template")


def template_families(names: Sequence[str] | None) -> list[Family] | None:
    """The named hand-written scenarios of ``configs/tasks/gated.yaml`` as families (None: none named), so
    the generator's formats can render the scenarios a pretrained model gates on (``task.scenarios``)."""
    if not names:
        return None
    from kvprobe.tasks.gated import load_template

    template = load_template(GATED_TEMPLATE)
    return [template_family(template.scenario(name)) for name in names]


@dataclass(frozen=True)
class GeneratedInstance(GatedInstance):
    """A gated instance from the generator. ``system`` (possibly empty) is the system message of chat
    formats; the body (``before_field + value + after_field``) is the user turn. Tokenize with
    :func:`tokenize_generated` (or :meth:`tokenize`), which puts the system message in place."""

    system: str = ""
    decision_at: int = -1  # character offset in after_field where the decision prompt begins

    def tokenize(self, tokenizer: Any, chat: bool) -> TokenizedPair:
        return tokenize_generated(tokenizer, self, chat)

    def chain(self, value: str) -> str:
        """The reasoning chain that follows :data:`REASONING_PREFIX`: it restates the field, then the
        decision word follows (`` <action>``)."""
        return f" {self.field} is {value}, so the decision is"


def tokenize_generated(tokenizer: Any, inst: GatedInstance, chat: bool) -> TokenizedPair:
    """:func:`~kvprobe.tasks.gated.tokenize_pair`, which puts the instance's system message (if any) in the chat
    template. Without a chat template the generator has already put the system text into the body."""
    return tokenize_pair(tokenizer, inst, chat)


def field_to_decision_tokens(pair: TokenizedPair) -> int:
    """Tokens after the field's last token, through the token the decision is read after."""
    return len(pair) - 1 - pair.field_slots[-1]


# -- prompt formats --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Draw:
    """The value-independent random choices of one instance."""

    family: Family
    rule_text: str
    ref: str
    request: str
    question: str
    shots: tuple[tuple[str, str, str], ...]  # few-shot (ref, value, action)
    extra: dict[str, Any]
    rule_at: str = "format"  # resolved by rule_position(); moves the rule only in RULE_MOVABLE formats


def _note_line(fmt: str, note: str, bullet: str = "- ") -> str:
    return f"log: {note}" if fmt == "tool_call" else f"{bullet}{note}"


def _surface(d: _Draw) -> dict[str, str]:
    return d.extra.get("surface", _PLAIN_SURFACE)


def _prior_block(d: _Draw, separator: str) -> str:
    prior = d.extra.get("prior_cases")
    if not prior:
        return ""
    lines = "".join(f"{r}: {d.family.field}{separator}{v}; resolved as {a}\n" for r, v, a in prior)
    return f"Earlier {d.family.subject} records, already resolved by this policy:\n{lines}\n"


def _body(fmt: str, d: _Draw, field_text: str, notes: list[str]) -> tuple[str, str]:
    """(system message, body) of a format with ``field_text`` as the field's value and the note lines."""
    f = d.family.field
    sv = _surface(d)
    prior = _prior_block(d, sv["separator"])
    note_block = "\n".join(_note_line(fmt, n, sv["bullet"]) for n in notes)
    note_block = note_block + "\n" if note_block else ""
    if fmt == "system_user":
        system = f"You are an operations assistant. Follow this policy exactly.\nPolicy: {d.rule_text}"
        return system, f"{f}: {field_text}\nreference: {d.ref}\n{note_block}\n{d.request} {d.question}"
    field_line = f"{f}{sv['separator']}{field_text}"
    policy = f"{sv['policy_label']} {d.rule_text}"
    if fmt == "user_turn":
        record = sv["record_header"].format(ref=d.ref)
        if d.rule_at == "after_field":  # same format, the rule moved after the record (field first)
            return "", (f"{sv['opening']}\n\n{prior}{record}\n{field_line}\n{note_block}{policy}\n\n"
                        f"{d.request} {d.question}")
        return "", (f"{sv['opening']}\n{policy}\n\n{prior}{record}\n{field_line}\n{note_block}\n"
                    f"{d.request} {d.question}")
    if fmt == "document_qa":
        head, tail = sv["doc_frame"].format(ref=d.ref).split("|")
        opening = f"{sv['doc_opening']}\n\n{prior}{head}\nTitle: {d.family.subject} file\n"
        if d.rule_at == "before_field":  # same format, the rule moved into the document ahead of the field
            return "", (f"{opening}{policy}\n{field_line}\n{note_block}{tail}\n\n"
                        f"Question: {d.request} {d.question}")
        return "", (f"{opening}{field_line}\n{note_block}{tail}\n\n"
                    f"Question: {d.rule_text} {d.request} {d.question}")
    if fmt == "few_shot":
        shots = "".join(f"Case {r}\n{f}: {v}\n{ANSWER_PREFIX} {a}\n\n" for r, v, a in d.shots)
        return "", (f"Decide each case by the rule.\nRule: {d.rule_text}\n\n{shots}Case {d.ref}\n{f}: {field_text}\n"
                    f"{note_block}{d.request} {d.question}")
    if fmt == "tool_call":
        call = json.dumps({"name": f"lookup_{d.family.subject}", "arguments": {"id": d.ref}})
        # The response is key: value lines, not JSON: a closing quote merges with some values' last token.
        return "", (f"You are an agent with tools. Policy: {d.rule_text}\n\n<tool_call>{call}</tool_call>\n"
                    f"<tool_response>\nid: {d.ref}\n{f}: {field_text}\n</tool_response>\n{note_block}\n"
                    f"{d.request} {d.question}")
    if fmt == "email":
        return "", (f"From: {d.family.subject} coordination\nSubject: {d.family.subject} {d.ref} needs a decision\n\n"
                    f"Hi,\n\nAs agreed, we handle these as follows. {d.rule_text}\n\nThe {d.family.subject} "
                    f"{d.ref} came in with these details:\n{f}: {field_text}\n{note_block}\nThanks.\n\n"
                    f"{d.request} {d.question}")
    if fmt == "gated_template":
        t = d.extra["template"]
        rules = "\n".join(f"R{i}. {r}" for i, r in enumerate(d.extra["filler_rules"], start=1))
        tools = "\n".join(f"- {x}" for x in t.tools)
        notes_section = f"INTERNAL NOTES\n{note_block}\n" if note_block else ""
        return "", (f"{t.preamble}\n\n{t.context_header}\n{f}: {field_text}\ncustomer: {d.extra['customer']}\n"
                    f"channel: {d.extra['channel']}\nagent_id: agent-{d.extra['agent']}\n\n"
                    f"{t.policy_header}\n{d.rule_text}\n{rules}\n\n{t.tools_header}\n{tools}\n\n"
                    f"{t.conversation_header}\nuser: {d.request}\n{t.assistant_turn}\n\n{notes_section}"
                    f"TASK\nDecide the single next action. {d.question}")
    raise KVProbeError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")


def _decision_head(fmt: str, d: _Draw) -> str:
    """Where a format's decision prompt begins (the erratum goes just ahead of it, Appendix B)."""
    return {"document_qa": "Question: ", "gated_template": "TASK\n"}.get(fmt, f"{d.request} {d.question}")


def _clean_line(text: str, fam: Family) -> bool:
    """A filler line may not mention any word of the family (nor a stem of one)."""
    tokens = re.findall(r"[a-z]+", text.lower())
    return not any(_stem_clash(t, w) for t in tokens if len(t) >= 3 for w in fam.words())


def _note_stream(rng: random.Random, words: Words, fam: Family):
    while True:
        if rng.random() < 0.2:
            note = rng.choice(words.note_extras)
        else:
            note = (f"{rng.choice(words.note_people)} {rng.choice(words.note_verbs)} "
                    f"{rng.choice(words.note_objects)} {rng.choice(words.note_times)}.")
        if _clean_line(note, fam):
            yield note


def _rng(*key: Any) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(":".join(map(str, key)).encode()).digest()[:8], "big"))


@lru_cache(maxsize=1)
def _gated_template() -> Any:
    from kvprobe.tasks.gated import load_template

    return load_template(GATED_TEMPLATE)


def build_generated(index: int, seed: int, split: str, fmt: str, *, tokenizer: Any = None, chat: bool = False,
                    distance: int | None = None, counterfactual: float = 0.5, correction: float = 0.0,
                    reasoning: float = 0.0, family: Family | None = None, words: Words | None = None,
                    draw: int | None = None, n_notes: int | None = None, rule_at: str = "format",
                    surface: bool = False, n_shots: int | None = None, prior_cases: bool = False
                    ) -> GeneratedInstance:
    """Render one instance of ``fmt`` from a family of ``split`` (drawn from ``seed`` and ``index``).

    ``distance``: target field-to-decision tokens (needs ``tokenizer``); None = ``n_notes`` note lines
    (default :data:`DEFAULT_NOTES`). ``counterfactual`` / ``correction`` / ``reasoning``: probabilities
    that the rule's values are exchanged, that the decisive value is a late correction of an earlier one,
    and that the answer prefix asks for a reasoning chain before the decision word. ``draw`` (default
    ``index``) keys the random choices: instances with the same ``draw`` share family, values, direction,
    rule and notes, so the cells of a format x distance grid can be paired. ``rule_at``: 'format' (the
    format's own place) or 'before_field' / 'after_field', which moves only the rule (user_turn and
    document_qa; the rest of the prompt is unchanged). ``surface``: re-draw the framing text of a format in
    :data:`SURFACE_VARIED` from :data:`SURFACE_VARIANTS` (training augmentation; other formats ignore it). The
    variants have their own random stream, so every other choice is that of the same draw without them.
    ``n_shots``: keep only the first ``n_shots`` of few_shot's two decided cases (None: both; 0: none), a
    diagnostic that removes the cases, which name the same field with both values; every other choice is
    the same draw's. ``prior_cases``: put two earlier records of the same field, one per value, each with
    the action this rule gives it, ahead of the open record (:data:`PRIOR_CASES_FORMATS` only; training
    augmentation). They have their own random stream, so every other choice is the same draw's.
    """
    if fmt not in FORMATS:
        raise KVProbeError(f"format '{fmt}' is not one of {', '.join(FORMATS)}")
    if n_shots is not None and not 0 <= n_shots <= 2:
        raise KVProbeError(f"n_shots must be 0, 1 or 2 (few_shot has two decided cases), got {n_shots}")
    position = rule_position(fmt, rule_at)
    if distance is not None and tokenizer is None:
        raise KVProbeError("a target distance needs the tokenizer that will read the prompt")
    words = words or load_words()
    key = index if draw is None else draw
    rng = _rng("generator", seed, split, key)
    fam = family or sample_family(rng, split, words)
    is_cf = rng.random() < counterfactual
    if is_cf and fam.split == "template":
        raise KVProbeError("a template scenario's rule names its values literally: use counterfactual=0")
    pos, neg = fam.values
    permit_value, block_value = (neg, pos) if is_cf else (pos, neg)
    x, y = fam.actions
    rule_text = fam.rule.format(field=fam.field, a=permit_value, b=block_value, x=x, y=y)
    old_value, new_value = (permit_value, block_value) if rng.random() < 0.5 else (block_value, permit_value)
    act = {permit_value: x, block_value: y}
    options = [x, y]
    rng.shuffle(options)
    ref = f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randint(1000, 9999)}"
    request = rng.choice(words.requests).format(subject=fam.subject, ref=ref)
    question = f"Respond with exactly one word: {options[0]} or {options[1]}."
    shot_values = [permit_value, block_value]
    rng.shuffle(shot_values)
    shots = tuple((f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randint(1000, 9999)}", v, act[v])
                  for v in shot_values)[:n_shots]
    extra: dict[str, Any] = {}
    if fmt == "gated_template":
        t = _gated_template()
        clean = [r for r in t.filler_rules if _clean_line(r, fam)]
        extra = {"template": t, "filler_rules": rng.sample(clean, min(20, len(clean))),
                 "customer": rng.choice(t.customers), "channel": rng.choice(t.channels), "agent": rng.randint(2, 9)}
    varied = surface and fmt in SURFACE_VARIED
    if varied:
        srng = _rng("surface", seed, split, key)
        extra = {**extra, "surface": {k: srng.choice(v) for k, v in SURFACE_VARIANTS.items()}}
    with_prior = prior_cases and fmt in PRIOR_CASES_FORMATS
    if with_prior:
        prng = _rng("prior", seed, split, key)
        prior_values = [permit_value, block_value]
        prng.shuffle(prior_values)
        prior_refs = [f"{prng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{prng.randint(1000, 9999)}" for _ in prior_values]
        extra = {**extra, "prior_cases": tuple((r, v, act[v]) for r, v in zip(prior_refs, prior_values))}
    draw = _Draw(fam, rule_text, ref, request, question, shots, extra, position)
    is_correction = rng.random() < correction
    early_value = rng.choice([permit_value, block_value])
    is_reasoning = rng.random() < reasoning
    notes_rng = _rng("notes", seed, split, key)
    stream = _note_stream(notes_rng, words, fam)

    def assemble(n_notes: int) -> GeneratedInstance:
        notes = [next(stream) for _ in range(n_notes - len(pool))] if n_notes > len(pool) else []
        pool.extend(notes)
        lines = list(pool[:n_notes])
        field_text = _VALUE
        if is_correction:
            # The record states an earlier value; a later line corrects it (the pair varies the correction).
            field_text = early_value
            at = len(lines) // 2
            lines.insert(at, CORRECTION.format(field=fam.field, new_value=_VALUE))
        system, body = _body(fmt, draw, field_text, lines)
        if system and not chat:
            body, system = f"{system}\n\n{body}", ""
        if body.count(_VALUE) != 1:
            raise KVProbeError(f"format '{fmt}' placed the field {body.count(_VALUE)} times")
        before, after = body.split(_VALUE)
        decision_at = after.rfind(_decision_head(fmt, draw))
        if decision_at < 0:
            raise KVProbeError(f"format '{fmt}': the decision prompt does not follow the field")
        meta = {"format": fmt, "split": split, "counterfactual": is_cf, "correction": is_correction,
                "reasoning": is_reasoning, "n_notes": n_notes, "distance_target": distance, "rule_at": position,
                "value_pair": list(fam.values), "action_pair": list(fam.actions)}
        if varied:  # only then, so the rows of every earlier instance are unchanged
            meta["surface"] = True
        if with_prior:
            meta["prior_cases"] = True
        if n_shots is not None and fmt == "few_shot":
            meta["n_shots"] = n_shots
        if is_correction:
            meta["early_value"] = early_value
        return GeneratedInstance(index=index, scenario=fam.name, family=fam.name, field=fam.field,
                                 old_value=old_value, new_value=new_value, old_action=act[old_value],
                                 new_action=act[new_value], before_field=before, after_field=after,
                                 answer_prefix=REASONING_PREFIX if is_reasoning else ANSWER_PREFIX, meta=meta,
                                 system=system, decision_at=decision_at)

    pool: list[str] = []
    if tokenizer is None or distance is None:
        inst = assemble(DEFAULT_NOTES if n_notes is None else n_notes)
        if tokenizer is None:
            return inst
        return _with_distance(inst, tokenizer, chat)
    return _fit_distance(assemble, tokenizer, chat, distance, pool, fmt)


def _measure(inst: GeneratedInstance, tokenizer: Any, chat: bool) -> int:
    return field_to_decision_tokens(tokenize_generated(tokenizer, inst, chat))


def _with_distance(inst: GeneratedInstance, tokenizer: Any, chat: bool, measured: int | None = None
                   ) -> GeneratedInstance:
    d = _measure(inst, tokenizer, chat) if measured is None else measured
    return dataclasses.replace(inst, meta={**inst.meta, "distance_tokens": d})


def distance_tolerance(target: int) -> int:
    """How far the measured distance may sit from the target: about half a note line."""
    return max(8, round(0.03 * target))


def _fit_distance(assemble: Any, tokenizer: Any, chat: bool, target: int, pool: list[str], fmt: str
                  ) -> GeneratedInstance:
    """The number of note lines whose measured distance is closest to ``target``."""
    base = assemble(0)
    d0 = _measure(base, tokenizer, chat)
    if d0 > target + distance_tolerance(target):
        raise InfeasibleDistance(f"format '{fmt}' has {d0} tokens after the field without any note; "
                                 f"a distance of {target} cannot be reached")
    measured = {0: d0}
    # Estimate from the note lines' own token counts, then correct on exact measurements.
    k, est = 0, d0
    while est < target:
        k += 1
        assemble(k)  # grows the pool
        est += len(tokenizer(_note_line(fmt, pool[k - 1]) + "\n", add_special_tokens=False)["input_ids"])
    for _ in range(8):
        if k not in measured:
            measured[k] = _measure(assemble(k), tokenizer, chat)
        if measured[k] < target:
            k += 1
        elif k > 0 and k - 1 not in measured:
            k -= 1
        else:
            break
    best = min(measured, key=lambda n: (abs(measured[n] - target), n))
    return _with_distance(assemble(best), tokenizer, chat, measured[best])


def generate(n: int, seed: int, split: str, formats: Sequence[str] | None = None, *, tokenizer: Any = None,
             chat: bool = False, distance: int | None = None, counterfactual: float = 0.5,
             correction: float = 0.0, reasoning: float = 0.0, start: int = 0,
             words: Words | None = None, rule_at: str = "format") -> list[GeneratedInstance]:
    """``n`` instances (indices ``start``..) of families from ``split``, cycling over ``formats``
    (default: the split's own formats, :data:`FORMAT_SPLITS`). Deterministic given the arguments."""
    fmts = tuple(formats) if formats else FORMAT_SPLITS[split]
    return [build_generated(i, seed, split, fmts[i % len(fmts)], tokenizer=tokenizer, chat=chat, distance=distance,
                            counterfactual=counterfactual, correction=correction, reasoning=reasoning, words=words,
                            rule_at=rule_at)
            for i in range(start, start + n)]
