"""Persona user memories built from a catalogue of on/off settings (paper Section 7, Appendix G).

A memory is a list of note lines about one user: setting lines (``<setting>: enabled|disabled``) and neutral
filler notes. A request is governed by a setting; the decision is ``allow`` when it is enabled and ``refuse``
when it is disabled. Every prompt renders as ``[preamble][MEMORY lines][request + decision prompt]`` and
records the character span of each memory line, so experiments can cut the memory into independently
precompiled blocks at line boundaries (:func:`line_token_starts`).

Two-hop instances (Appendix G): a DEFINITION line A names which setting governs the request; that setting's
value B lives further down; the other settings take both values, so the decision needs A -> B. Their control
(the independent pair) keeps the layout and replaces A by an independent fact while the request names its
setting directly, so the decision needs B alone.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from kvprobe.errors import KVProbeError
from kvprobe.tasks.gated import render

# setting -> (the request it governs, as the assistant would do it)
SETTINGS: dict[str, str] = {
    "marketing_emails": "send the user a promotional email about the spring sale",
    "location_sharing": "share the user's current location with the delivery driver",
    "auto_renewal": "renew the user's annual subscription automatically",
    "cloud_backup": "upload the user's new photos to the cloud archive",
    "contact_sync": "import the user's phone contacts into the address book",
    "voice_recording": "keep a recording of the user's last support call",
    "third_party_apps": "connect the user's account to the fitness tracker app",
    "purchase_alerts": "text the user an alert about the large card payment",
    "read_receipts": "tell the sender that the user has read the message",
    "family_sharing": "show the user's purchases to the other family members",
    "ad_personalization": "tailor the ads the user sees to the user's browsing history",
    "data_export": "send the user's full activity archive to the user's email",
    "public_profile": "list the user's profile in the public member directory",
    "calendar_access": "add the dentist appointment to the user's calendar",
    "biometric_login": "let the user sign in with a fingerprint on the new phone",
    "usage_analytics": "report the user's app usage statistics to the product team",
}
VALUES = ("enabled", "disabled")
ACTIONS = {"enabled": "allow", "disabled": "refuse"}
FILLER_NOTES = (
    "The user prefers short replies.", "The user's name is Sam.", "The user lives in Lisbon.",
    "The user works as a nurse on night shifts.", "The user has a dog called Pepper.",
    "The user is learning to play the cello.", "The user prefers tea to coffee.",
    "The user's preferred language is English.", "The user travels to Berlin every spring.",
    "The user's birthday is in October.", "The user follows a vegetarian diet.",
    "The user reads mystery novels before bed.", "The user rides a bicycle to work.",
    "The user has two children in primary school.", "The user supports a local football club.",
    "The user keeps a vegetable garden.", "The user's phone is an older Android model.",
    "The user volunteers at the library on Saturdays.", "The user dislikes phone calls.",
    "The user saves receipts for tax season.", "The user is allergic to peanuts.",
    "The user is planning a kitchen renovation.", "The user takes the train on weekends.",
    "The user studies Spanish in the evenings.",
)
PREAMBLE = "You are a personal assistant. The notes below are what you remember about the user."
MEMORY_HEADER = "USER MEMORY"
DECISION = "Answer with exactly one word: allow or refuse."
ANSWER_PREFIX = "Decision:"
PLACEMENTS = ("late", "early")  # [sys][traj][MEM][query] / [sys][MEM][traj][query]


@dataclass(frozen=True)
class MemoryInstance:
    """One memory prompt: its lines, the request text after them, the correct action and the line indices
    the experiment cuts at (``marks``)."""

    index: int
    scenario: str  # the cluster: the governing setting
    lines: tuple[str, ...]
    request: str
    action: str  # correct under full recompute
    other_action: str
    marks: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def body(self) -> str:
        return f"{PREAMBLE}\n\n{MEMORY_HEADER}\n" + "".join(f"- {line}\n" for line in self.lines) + \
            f"\n{self.request}\n{DECISION}"

    def line_chars(self) -> list[int]:
        """Character offset in :meth:`body` where each memory line begins, and where the request begins."""
        at, out = len(f"{PREAMBLE}\n\n{MEMORY_HEADER}\n"), []
        for line in self.lines:
            out.append(at)
            at += len(f"- {line}\n")
        return [*out, at]

    def row(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "action": self.action, "n_lines": len(self.lines), **self.marks,
                **self.meta}


def _rng(kind: str, seed: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"memory:{kind}:{seed}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def twohop_instance(index: int, seed: int, condition: str, n_lines: int = 14, gap: int = 3) -> MemoryInstance:
    """A two-hop memory (``condition`` 'twohop') or its independent-pair control ('independent'), same layout.

    Line A (the DEFINITION, or the control's independent fact) sits at ``marks['a']``, the governing
    setting's value B ``gap`` lines later at ``marks['b']``; the other setting lines take both values.
    ``index`` fixes the draw (the same index gives the same user, setting and value in both conditions);
    the value alternates with the index, so labels are balanced."""
    if condition not in ("twohop", "independent"):
        raise KVProbeError(f"two-hop condition must be 'twohop' or 'independent'; got {condition!r}")
    if n_lines < gap + 6:
        raise KVProbeError(f"n_lines={n_lines} leaves no room for gap={gap} and the distractor settings")
    rng = _rng("twohop", seed, index)
    names = rng.sample(sorted(SETTINGS), 4)
    governing, distractors = names[0], names[1:]
    value = VALUES[index % 2]
    other = VALUES[1 - index % 2]
    dvalues = [other, value, other]  # both values among the distractors: no shortcut by majority
    fillers = rng.sample(FILLER_NOTES, n_lines - 5)
    a = rng.randint(1, n_lines - gap - 3)
    b = a + gap
    lines: list[str | None] = [None] * n_lines
    if condition == "twohop":
        lines[a] = f"DEFINITION: whether the assistant may {SETTINGS[governing]} is governed by the setting {governing}."
        request = f"REQUEST: {SETTINGS[governing][0].upper()}{SETTINGS[governing][1:]}? Look up the setting " \
                  "that governs this request: allow if it is enabled, refuse if it is disabled."
    else:
        lines[a] = rng.choice([f for f in FILLER_NOTES if f not in fillers])
        request = f"REQUEST: {SETTINGS[governing][0].upper()}{SETTINGS[governing][1:]}? This request is governed " \
                  f"by the setting {governing}: allow if it is enabled, refuse if it is disabled."
    lines[b] = f"{governing}: {value}"
    free = [i for i in range(n_lines) if lines[i] is None]
    spots = rng.sample(free, len(distractors))
    for i, name, v in zip(spots, distractors, dvalues):
        lines[i] = f"{name}: {v}"
    it = iter(fillers)
    lines = [ln if ln is not None else next(it) for ln in lines]
    return MemoryInstance(index, governing, tuple(lines), request, ACTIONS[value], ACTIONS[other],
                          {"a": a, "b": b}, {"condition": condition, "value": value})


def toggle_twohop(inst: MemoryInstance) -> MemoryInstance:
    """The same two-hop (or independent-pair) draw with the governing setting's value B flipped: the line at
    ``marks['b']`` takes the other value and the decision flips; everything else is kept."""
    from dataclasses import replace

    value = inst.meta["value"]
    other = VALUES[1 - VALUES.index(value)]
    b = inst.marks["b"]
    if inst.lines[b] != f"{inst.scenario}: {value}":
        raise KVProbeError(f"instance {inst.index}: line {b} is not the governing setting's value")
    lines = inst.lines[:b] + (f"{inst.scenario}: {other}",) + inst.lines[b + 1:]
    return replace(inst, lines=lines, action=ACTIONS[other], other_action=ACTIONS[value],
                   meta={**inst.meta, "value": other})


def render_ids(tokenizer: Any, inst: MemoryInstance, chat: bool) -> tuple[list[int], list[int], str, bool]:
    """Token ids of the full prompt (answer prefix included), the token index where each memory line and the
    request begin (a token straddling a line start goes with the line), the prompt text and whether the
    tokenizer adds its special tokens."""
    text, special = render(tokenizer, inst.body(), chat)
    body_at = text.index(inst.body())
    prompt = text + ANSWER_PREFIX
    enc = tokenizer(prompt, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    starts = []
    for ch in inst.line_chars():
        at = body_at + ch
        starts.append(next(i for i, (a, b) in enumerate(offsets) if b > at and (a, b) != (0, 0)))
    return ids, starts, prompt, special


def action_ids(tokenizer: Any, prompt: str, ids: list[int], special: bool, actions: tuple[str, str]) -> list[int]:
    """The first token of each action after the prompt (space-prefixed)."""
    from kvprobe.tasks.gated import action_token

    out = [action_token(tokenizer, ids, prompt, a, special) for a in actions]
    if out[0] == out[1]:
        raise KVProbeError(f"actions {actions} start with the same token")
    return out


TRAJECTORY = ("user: Hi, can you help me sort out a few things on my account today?\n"
              "assistant: Of course. Tell me what you need and I will check your settings first.\n"
              "user: Thanks. I have one request for you.")


@dataclass(frozen=True)
class PersonaInstance:
    """A persona memory with an AND decision over ``relevant`` settings, placed late,
    ``[preamble][trajectory][USER MEMORY lines][request]`` (the paper's [sys][traj][MEM][query]), or early
    (``placement='early'``), ``[preamble][USER MEMORY lines][trajectory][request]`` ([sys][MEM][traj][query]).

    ``toggle`` is the relevant setting whose flip flips the decision (E3); ``irrelevant`` a setting the
    request does not read (the negative control). ``value_of`` gives each setting's stored value."""

    index: int
    scenario: str
    lines: tuple[str, ...]
    relevant: tuple[str, ...]
    setting_line: dict[str, int]
    toggle: str
    irrelevant: str
    request: str
    action: str
    other_action: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    placement: str = "late"

    def with_value(self, setting: str, value: str) -> "PersonaInstance":
        lines = list(self.lines)
        lines[self.setting_line[setting]] = f"{setting}: {value}"
        return replace_lines(self, tuple(lines))

    def value_of(self, setting: str) -> str:
        return self.lines[self.setting_line[setting]].split(": ", 1)[1]

    def decides(self) -> str:
        return "allow" if all(self.value_of(s) == "enabled" for s in self.relevant) else "refuse"

    def _head(self) -> str:
        """The text before the first memory line."""
        late = f"CONVERSATION\n{TRAJECTORY}\n\n" if self.placement == "late" else ""
        return f"{PREAMBLE}\n\n{late}{MEMORY_HEADER}\n"

    def body(self, erratum: str | None = None) -> str:
        extra = f"{erratum}\n" if erratum else ""
        early = f"\nCONVERSATION\n{TRAJECTORY}\n" if self.placement == "early" else ""
        return (self._head() + "".join(f"- {line}\n" for line in self.lines) + early
                + f"\n{extra}{self.request}\n{DECISION}")

    def line_chars(self) -> list[int]:
        at, out = len(self._head()), []
        for line in self.lines:
            out.append(at)
            at += len(f"- {line}\n")
        return [*out, at]

    def row(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "action": self.action, "n_lines": len(self.lines),
                "toggle": self.toggle, "irrelevant": self.irrelevant, "placement": self.placement, **self.meta}


def replace_lines(inst: "PersonaInstance", lines: tuple[str, ...]) -> "PersonaInstance":
    from dataclasses import replace

    new = replace(inst, lines=lines)
    action = new.decides()
    return replace(new, action=action, other_action="refuse" if action == "allow" else "allow")


def persona_instance(index: int, seed: int, n_lines: int = 40, n_settings: int = 8, n_relevant: int = 2,
                     layout: str = "contiguous", placement: str = "late") -> PersonaInstance:
    """A persona with ``n_settings`` settings (``n_relevant`` of them gate the request: AND) among filler notes.

    Labels alternate with ``index`` (allow: every relevant setting enabled; refuse: exactly one disabled).
    ``layout`` 'contiguous' puts the relevant setting lines next to each other, 'split' spreads them over the
    memory. Filler notes repeat (cycled) when the memory is longer than the note list. The settings, their
    values and the request depend on ``index`` and ``seed`` only, not on ``n_lines`` or ``placement`` (the
    same user at every memory length)."""
    if layout not in ("contiguous", "split"):
        raise KVProbeError(f"layout must be 'contiguous' or 'split'; got {layout!r}")
    if placement not in PLACEMENTS:
        raise KVProbeError(f"placement must be one of {PLACEMENTS}; got {placement!r}")
    if not 1 <= n_relevant < n_settings <= len(SETTINGS) or n_lines < n_settings + 2:
        raise KVProbeError(f"need 1 <= n_relevant < n_settings <= {len(SETTINGS)} and n_lines >= n_settings + 2")
    rng = _rng("persona", seed, index)
    names = rng.sample(sorted(SETTINGS), n_settings)
    relevant, others = names[:n_relevant], names[n_relevant:]
    allow = index % 2 == 0
    values = {s: "enabled" for s in relevant}
    off = rng.choice(relevant)
    if not allow:
        values[off] = "disabled"
    for s in others:
        values[s] = rng.choice(VALUES)
    n_fill = n_lines - n_settings
    fillers = [FILLER_NOTES[(rng.randrange(len(FILLER_NOTES)) + i) % len(FILLER_NOTES)] for i in range(n_fill)]
    slots = list(range(n_lines))
    if layout == "contiguous":
        start = rng.randint(0, n_lines - n_relevant)
        rel_slots = list(range(start, start + n_relevant))
    else:
        rel_slots = [round((i + 0.5) * n_lines / n_relevant) for i in range(n_relevant)]
    rest = rng.sample([i for i in slots if i not in rel_slots], len(others))
    lines: list[str | None] = [None] * n_lines
    where = {}
    for s, i in [*zip(relevant, rel_slots), *zip(others, rest)]:
        lines[i] = f"{s}: {values[s]}"
        where[s] = i
    it = iter(fillers)
    lines = [ln if ln is not None else next(it) for ln in lines]
    lead = relevant[0]
    request = (f"REQUEST: {SETTINGS[lead][0].upper()}{SETTINGS[lead][1:]}? This is allowed only if "
               + " and ".join(relevant) + " are all enabled in the user memory: allow if so, refuse otherwise.")
    toggle = off if not allow else rng.choice(relevant)  # flipping it flips the AND
    inst = PersonaInstance(index, lead, tuple(lines), tuple(relevant), where, toggle, rng.choice(others), request,
                           "allow" if allow else "refuse", "refuse" if allow else "allow", {"layout": layout},
                           placement)
    assert inst.decides() == inst.action
    return inst
