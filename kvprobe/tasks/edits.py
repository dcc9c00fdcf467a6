"""Prompt texts of the editing experiments (paper Section 4, Appendix B): errata, wordings, hoist-to-end.

All variants are built from a :class:`GatedInstance`'s body, so they stay byte-identical to the original
prompt everywhere the edit does not touch:

- the erratum goes ahead of the decision prompt, after the conversation (Appendix B: "appends one salient
  line ahead of the decision prompt"): ``...assistant: ...\\n\\n<erratum>\\n\\nTASK ...``; with no lines the
  body is the original one, so a cached prefix up to the conversation's end is shared token for token;
- hoist-to-end is prompt surgery: the field line leaves SESSION CONTEXT and sits just before the decision
  prompt, so everything before it is value-independent and can be cached once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvprobe.errors import KVProbeError
from kvprobe.tasks.gated import GatedInstance, GatedTemplate, render
from kvprobe.tasks.generator import CORRECTION, GeneratedInstance

# Figure 3d wording ablation: bare restatement of the value .. aggressive re-evaluation. ``None`` means the
# template's own erratum string (the verbatim Appendix B line, an explicit override).
WORDINGS: dict[str, str | None] = {
    "bare_value": "{field}: {new_value}",
    "tagged_update": "[STATE UPDATE] {field}: {new_value}",
    "explicit_override": None,
    "aggressive": "[STATE UPDATE] {field} has just changed to {new_value}. Disregard your earlier conclusion "
                  "and re-evaluate.",
}


def _generated(inst: GatedInstance) -> bool:
    return isinstance(inst, GeneratedInstance)


def erratum_line(template: GatedTemplate | None, inst: GatedInstance, value: str, wording: str | None = None) -> str:
    """The erratum for ``value``: ``wording`` (a format string over field, new_value, old_value) or, when
    None, the template's erratum string (for a generated instance: the generator's correction line, the
    wording its late corrections use)."""
    if wording is None and template is None and not _generated(inst):
        raise KVProbeError("a template instance needs its template for the default erratum wording")
    fmt = wording if wording is not None else CORRECTION if _generated(inst) else template.erratum
    try:
        return fmt.format(field=inst.field, new_value=value, old_value=inst.old_value)
    except (KeyError, IndexError) as exc:
        raise KVProbeError(f"erratum wording {fmt!r} uses an unknown placeholder {exc}; "
                           "use {field}, {new_value}, {old_value}") from None


def decision_offset(template: GatedTemplate | None, inst: GatedInstance) -> int:
    """Character offset in ``inst.after_field`` where the decision prompt begins (a generated instance
    records its own; a template instance finds the template's decision prompt)."""
    if _generated(inst):
        return inst.decision_at
    if template is None:
        raise KVProbeError("a template instance needs its template to find the decision prompt")
    return decision_char(template, inst.after_field)


def decision_char(template: GatedTemplate, prompt: str) -> int:
    """Character offset in a rendered prompt where the (last) decision prompt begins."""
    head = template.decision_prompt.split("{", 1)[0]
    at = prompt.rfind(head)
    if not head or at < 0:
        raise KVProbeError(f"the decision prompt {head!r} does not occur in the prompt")
    return at


def erratum_body(template: GatedTemplate | None, inst: GatedInstance, field_value: str, lines: Sequence[str]) -> str:
    """The body with ``field_value`` in the field and each line of ``lines`` ahead of the decision prompt."""
    at = decision_offset(template, inst)
    inserted = "".join(line + "\n\n" for line in lines)
    return inst.before_field + field_value + inst.after_field[:at] + inserted + inst.after_field[at:]


def hoisted_body(template: GatedTemplate | None, inst: GatedInstance, value: str) -> str:
    """Prompt surgery: the field line moved from SESSION CONTEXT to just before the decision prompt."""
    lead = f"{inst.field}: "
    if not inst.before_field.endswith(lead) or not inst.after_field.startswith("\n"):
        raise KVProbeError(f"instance {inst.index}: the field is not a '{lead}<value>' line; cannot hoist it")
    at = decision_offset(template, inst)
    return (inst.before_field[: -len(lead)] + inst.after_field[1:at] + f"{lead}{value}\n\n"
            + inst.after_field[at:])


def prompt_text(tokenizer: Any, inst: GatedInstance, body: str, chat: bool) -> tuple[str, bool]:
    """Full prompt string (chat-wrapped when the model has a template, answer prefix appended) and whether
    the tokenizer adds its own special tokens, exactly as :func:`tokenize_pair` renders the originals."""
    text, special = render(tokenizer, body, chat, getattr(inst, "system", ""))
    return text + inst.answer_prefix, special


def prompt_ids(tokenizer: Any, inst: GatedInstance, body: str, chat: bool) -> list[int]:
    text, special = prompt_text(tokenizer, inst, body, chat)
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def answer_prefix_tokens(tokenizer: Any, inst: GatedInstance, chat: bool) -> int:
    """How many trailing tokens of the prompt are the answer prefix (the rest is the rendered body)."""
    full = prompt_ids(tokenizer, inst, inst.body(inst.old_value), chat)
    text, special = render(tokenizer, inst.body(inst.old_value), chat, getattr(inst, "system", ""))
    bare = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    shared = common_prefix_len(full, bare)
    if shared == len(full):
        raise KVProbeError("the answer prefix adds no token to the prompt")
    return len(full) - shared


def split_prompt_at(tokenizer: Any, text: str, special: bool, char: int) -> tuple[list[int], str]:
    """Token ids of ``text`` before character ``char`` and the text from there on.

    Refuses when a token straddles ``char`` (the tokenizer merges across the cut), because then no cached
    token sequence can end exactly there."""
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    k = next((i for i, (a, b) in enumerate(offsets) if b > char and (a, b) != (0, 0)), len(ids))
    if k < len(ids) and offsets[k][0] < char:
        raise KVProbeError(f"a token ({text[offsets[k][0]:offsets[k][1]]!r}) straddles the cut at character {char}; "
                           "this tokenizer merges across the erratum insertion point")
    return ids[:k], text[char:]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
