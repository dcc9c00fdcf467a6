"""Causal scrubbing over KV slots (Chan et al. 2022), for the field -> notes -> decision hypothesis (App. D (4)).

A hypothesis names the KV slots (positions x layers) that carry the field's effect to the decision. The
scrubbed cache keeps the target's K/V on those slots and takes every other slot from a resampled input: a
position-aligned prefill of the same instance with what the hypothesis calls irrelevant changed (the order of
the filler rules), drawn over both field values so the resampled part carries either conclusion. Each
hypothesis is read over every donor in one labelled sweep (the donor is the shared base).

By construction (identities, not findings): the full hypothesis (every slot) rebuilds the target exactly, so
it recovers 1 up to float error; the empty hypothesis is the donor itself, the resampling baseline.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.kv.readout import prefill
from kvprobe.kv.state import KVState
from kvprobe.patching.pairs import PairPrefill
from kvprobe.probes.sweep import KV, Joint
from kvprobe.tasks.gated import TokenizedPair, tokenize_pair

_RULE = re.compile(r"^R(\d+)\. (.*)$", re.M)


def reorder_fillers(inst: Any, seed: Sequence[int]) -> Any:
    """The instance with its numbered filler rules in a seeded random order (the numbering stays in place)."""
    rules = [m.group(2) for m in _RULE.finditer(inst.after_field)]
    if len(rules) < 2:
        raise KVProbeError("scrubbing resamples the order of the template's numbered filler rules (R1. ... Rn.), and "
                           f"this instance ({getattr(inst, 'scenario', '?')}) has fewer than two: run it on "
                           "template-shaped prompts (task.template alone, or task.generator.formats: [gated_template])")
    order = np.random.default_rng(list(seed)).permutation(len(rules))
    it = iter([rules[i] for i in order])
    return dataclasses.replace(inst, after_field=_RULE.sub(lambda m: f"R{m.group(1)}. {next(it)}", inst.after_field))


def aligned(pair: TokenizedPair, other: TokenizedPair, context_length: int) -> bool:
    """Whether ``other`` can be transplanted slot by slot: same length, field, suffix and action tokens."""
    return (len(other) == len(pair) and other.field_slots == pair.field_slots
            and other.ids_old[context_length:] == pair.ids_old[context_length:]
            and (other.old_action_id, other.new_action_id) == (pair.old_action_id, pair.new_action_id))


def resampled_donors(lm: HookableModel, inst: Any, pp: PairPrefill, n_variants: int, seed: Sequence[int],
                     max_tries: int = 20) -> dict[str, KVState]:
    """``n_variants`` filler orders of ``inst`` that tokenize position-aligned with it, each prefilled with the
    target's (new) value -- ``v{i}.same``, the same conclusion -- and with the old value -- ``v{i}.opposite``."""
    out: dict[str, KVState] = {}
    seen = {tuple(pp.pair.ids_new)}
    for t in range(max_tries):
        if len(out) == 2 * n_variants:
            break
        var = reorder_fillers(inst, (*seed, t))
        try:
            pair = tokenize_pair(lm.tokenizer, var, lm.has_chat_template)
        except KVProbeError:
            continue
        if not aligned(pp.pair, pair, pp.context_length) or tuple(pair.ids_new) in seen:
            continue
        seen.add(tuple(pair.ids_new))
        i = len(out) // 2
        out[f"v{i}.same"] = prefill(lm, pair.ids_new[: pp.context_length])
        out[f"v{i}.opposite"] = prefill(lm, pair.ids_old[: pp.context_length])
    if not out:
        raise KVProbeError(f"instance {inst.index}: no filler order tokenizes position-aligned with the original")
    return out


def hypotheses(pp: PairPrefill, notes: Sequence[int], nested: Sequence[int], random_sets: Sequence[Sequence[int]],
               n_layers: int) -> dict[str, KV | Joint]:
    """The slots each hypothesis keeps from the target (all layers unless named).

    ``notes`` are the top-effect downstream slots, highest first. The prefix before the field is the same
    tokens in every donor, so its K/V is the target's whichever hypothesis keeps it."""
    field, ctx = list(pp.field_slots), range(pp.context_length)
    top = list(notes)
    half = n_layers // 2
    hyp: dict[str, KV | Joint] = {"full": KV.of(ctx), "empty": KV.of([]), "paper": KV.of(field + top)}
    hyp.update({f"nested:{k}": KV.of(field + top[:k]) for k in nested if k < len(top)})
    hyp.update({"notes_only": KV.of(top), "field_only": KV.of(field),
                "notes_late": Joint((KV.of(field), KV.of(top, range(half, n_layers)))),
                "notes_early": Joint((KV.of(field), KV.of(top, range(half)))),
                "all_but_notes": KV.of([s for s in ctx if s not in set(top)])})
    hyp.update({f"random:{j}": KV.of(field + list(s)) for j, s in enumerate(random_sets)})
    return hyp


def hypothesis_size(patch: KV | Joint, n_layers: int) -> int:
    """Slot x layer cells a hypothesis keeps (random controls match the paper hypothesis on this)."""
    parts = patch.parts if isinstance(patch, Joint) else (patch,)
    return sum(len(p.slots) * (n_layers if p.layers is None else len(p.layers)) for p in parts)
