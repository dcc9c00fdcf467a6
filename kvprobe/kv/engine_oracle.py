"""The llama.cpp engine's cache operations checked against kvprobe's HF oracle on the same GGUF weights.

For one gated instance (stale context with the old field value; the field changes to the new value) each
operation runs twice, in HF (``kvprobe.kv.edit`` / ``kvprobe.kv.compose`` over the dequantised fp32 weights)
and in the engine (its own KV cache, quantised matmuls), and is compared three ways:

- ``vs_hf``: the engine's operation against HF's same operation (logit cosine, decision agreement);
- ``vs_self``: the engine's operation against the engine's own full reprefill of the prompt it answers
  (isolates the cache operation from the quantisation: both sides run the same quantised weights);
- ``hf_vs_hf``: HF's operation against HF's full reprefill of that prompt (how far the operation itself
  moves the answer; the engine should move it the same way).

The decision is the sign of the action logit difference (new-correct action minus old-correct action).

These three comparisons describe how close the engine stays to the oracle; they cannot detect a broken edit
(a no-op edit passes them on a model whose decision barely depends on the field). The check that can fail is
:func:`edit_effect` with :class:`EffectCheck` below: the edit's effect on the decision, engine vs oracle, on
instances where it exceeds the engine's own noise, with mutants (:data:`MUTANTS`) that must fail it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvprobe.backends import HookableModel
from kvprobe.backends.llamacpp import LlamaCppEngine
from kvprobe.errors import KVProbeError
from kvprobe.kv import edit
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.edit import FieldEdit
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.tasks.edits import erratum_body, erratum_line, prompt_ids
from kvprobe.tasks.gated import tokenize_pair

OPERATIONS = ("full_reprefill", "in_place", "erratum", "field_erratum", "transplant")
TRANSPLANT_HEAD = 4  # tokens before the transplanted chunk (the chunk runs from there to the field)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _hf(lm: HookableModel, state, suffix) -> np.ndarray:
    return read_logits(lm, state, list(suffix))[0].double().numpy()


@torch.no_grad()
def compare_instance(lm: HookableModel, engine: LlamaCppEngine, template: Any, inst: Any) -> dict[str, Any]:
    """One instance: per operation, the engine vs HF and vs its own reprefill (cosine, decisions, lds)."""
    tok, chat, r = lm.tokenizer, lm.has_chat_template, 1
    pair = tokenize_pair(tok, inst, chat)
    ctx_old, ctx_new, suffix = pair.ids_old[:-r], pair.ids_new[:-r], pair.ids_new[-r:]
    slots = list(pair.field_slots)
    if slots != list(range(slots[0], slots[-1] + 1)):
        raise KVProbeError(f"field slots {slots} are not contiguous; the engine refreshes one span")
    line = erratum_line(template, inst, inst.new_value)
    prompts = {"full_reprefill": pair.ids_new, "in_place": pair.ids_new, "transplant": pair.ids_new,
               "erratum": prompt_ids(tok, inst, erratum_body(template, inst, inst.old_value, [line]), chat),
               "field_erratum": prompt_ids(tok, inst, erratum_body(template, inst, inst.new_value, [line]), chat)}
    head, chunk = ctx_new[:TRANSPLANT_HEAD], ctx_new[TRANSPLANT_HEAD:slots[0]]
    tail = ctx_new[slots[0]:] + suffix
    if len(chunk) < 2:
        raise KVProbeError("the field sits too close to the start for a transplanted chunk before it")

    # HF oracle
    e = FieldEdit(prefill(lm, ctx_old), ctx_old, ctx_new, slots, suffix)
    hf: dict[str, np.ndarray] = {}
    for name, res in (("full_reprefill", edit.full_reprefill(lm, e)), ("in_place", edit.in_place(lm, e)),
                      ("erratum", edit.erratum(lm, e, prompts["erratum"], r)),
                      ("field_erratum", edit.field_erratum(lm, e, prompts["field_erratum"], r))):
        hf[name] = _hf(lm, res.state, res.suffix_ids)
    spliced = assemble(lm, [Live(tuple(head)), Spliced(tuple(chunk), precompile(lm, chunk), seam=1),
                            Live(tuple(tail[:-1]))])
    hf["transplant"] = _hf(lm, spliced, tail[-1:])
    hf_ref = {name: hf["full_reprefill"] if p == pair.ids_new else _hf(lm, prefill(lm, p[:-1]), p[-1:])
              for name, p in prompts.items()}

    # the engine, on its own cache. Start from an empty cell buffer: llama.cpp's numbers depend on where cells
    # sit in its buffer (cells out of position order after earlier requests' holes change the attention
    # numerics slightly), so a comparison must not depend on what the engine ran before.
    engine.clear()
    eng: dict[str, Any] = {"full_reprefill": engine.full_reprefill(pair.ids_new)}
    engine.cache_context(ctx_old)
    eng["in_place"] = engine.in_place(ctx_new, slots, suffix)
    engine.cache_context(ctx_old)
    eng["erratum"] = engine.erratum(ctx_old, prompts["erratum"])
    engine.cache_context(ctx_old)
    eng["field_erratum"] = engine.field_erratum(ctx_new, slots, prompts["field_erratum"])
    seq = engine.precompile(chunk)
    eng["transplant"] = engine.transplant(head, seq, len(chunk), chunk[0], tail)
    eng_ref = {name: eng["full_reprefill"].logits if p == pair.ids_new else engine.full_reprefill(p).logits
               for name, p in prompts.items()}

    def ld(x: np.ndarray) -> float:
        return float(x[pair.new_action_id] - x[pair.old_action_id])

    ops = {}
    for name in OPERATIONS:
        le = eng[name].logits
        ops[name] = {"engine_ld": ld(le), "hf_ld": ld(hf[name]), "engine_ref_ld": ld(eng_ref[name]),
                     "hf_ref_ld": ld(hf_ref[name]),
                     "cos_vs_hf": _cos(le, hf[name]), "agree_vs_hf": (ld(le) > 0) == (ld(hf[name]) > 0),
                     "cos_vs_self": _cos(le, eng_ref[name]), "agree_vs_self": (ld(le) > 0) == (ld(eng_ref[name]) > 0),
                     "cos_hf_vs_hf": _cos(hf[name], hf_ref[name]),
                     "engine_decoded": eng[name].decoded_tokens, "total_tokens": eng[name].total_tokens}
    return {"scenario": inst.scenario, "n_tokens": len(pair.ids_new), "field_slots": slots, "operations": ops}


# -- the edit-effect check: can fail ------------------------------------------------------------------------
#
# The comparisons above (logit cosine, decision agreement) cannot tell a correct in-place edit from a broken one:
# on a model whose decision barely depends on the field, a no-op edit and an edit whose field keys sit 40
# positions off both pass them. What the engine must reproduce is the edit's *effect*: how far the edit moves
# the action logit difference away from the stale cache's. That is compared here, on instances where the
# effect is larger than the engine's own noise, with every engine decode on one side of llama.cpp's kernel
# switch at 64 tokens per batch.

ENGINE_BATCH = 32  # tokens per llama_decode call in the check: context prefill, field refresh and readout alike
NOISE_BATCHES = (16, 64, 512)  # other splits of the same context: below and across the switch
SHIFT = 40  # the position-shifted mutant moves the refreshed field's cells by this many positions


@dataclass(frozen=True)
class EffectCheck:
    """When the engine's edit effect counts as the oracle's. ``noise`` is the engine's own on that instance: the
    largest change of the stale cache's action logit difference over other batch splits of the same context
    (the kernel switch at 64 tokens per batch included). The tolerance is ``max(min_tol, k_noise * noise,
    rel_tol * |oracle effect|)``. An instance is judged only if the oracle's effect is at least ``min_effect``
    and at least twice the tolerance (so a no-op edit, effect 0, cannot pass it). A judged instance passes when
    the engine's effect is within the tolerance of the oracle's. The check passes when at least ``min_judged``
    instances are judged and every judged one passes.

    The defaults are for an F32 GGUF (the oracle's exact weights), where the engine's noise is ~0.01 nats;
    with quantised weights the engine multiplies quantised activations and ``rel_tol`` must absorb that."""

    min_effect: float = 0.05
    k_noise: float = 3.0
    min_tol: float = 0.01
    rel_tol: float = 0.0
    min_judged: int = 1

    def tolerance(self, hf_effect: float, noise: float) -> float:
        return max(self.min_tol, self.k_noise * noise, self.rel_tol * abs(hf_effect))

    def judged(self, hf_effect: float, noise: float) -> bool:
        return abs(hf_effect) >= max(self.min_effect, 2 * self.tolerance(hf_effect, noise))

    def passes(self, hf_effect: float, engine_effect: float, noise: float) -> bool:
        return abs(engine_effect - hf_effect) <= self.tolerance(hf_effect, noise)


OPS = ("in_place", "field_erratum")  # the edits checked: the field refreshed in place; the same + an erratum
VARIANTS = ("correct", "noop", f"shift{SHIFT}")  # the edit as specified, and two broken versions of it
MUTANTS = VARIANTS[1:]


def _engine_edit(engine: LlamaCppEngine, op: str, variant: str, ctx_new: list[int], slots: list[int],
                 suffix: list[int], erratum_prompt: list[int]) -> np.ndarray:
    """The engine's logits after ``op`` over the stale cache it holds, done right (``correct``) or broken:
    ``noop`` changes nothing (the stale cache is read as if edited); ``shift40`` refreshes the field and then
    moves its cells' keys 40 positions on (a RoPE position bug), before the erratum of ``field_erratum``."""
    n = len(ctx_new)
    if variant == "noop":
        return engine.read(suffix, n)
    f0, f1 = min(slots), max(slots) + 1
    engine.refresh(ctx_new, f0, f1)
    if variant == f"shift{SHIFT}":
        engine.seq_add(engine.REQUEST, f0, f1, SHIFT)
    elif variant != "correct":
        raise KVProbeError(f"unknown edit variant '{variant}'; known: {', '.join(VARIANTS)}")
    if op == "in_place":
        return engine.read(suffix, n)
    if op == "field_erratum":
        return engine.append(ctx_new, erratum_prompt).logits
    raise KVProbeError(f"unknown edit '{op}'; known: {', '.join(OPS)}")


@torch.no_grad()
def edit_effect(lm: HookableModel, engine: LlamaCppEngine, template: Any, inst: Any,
                ops: Sequence[str] = OPS, variants: Sequence[str] = VARIANTS,
                noise_batches: Sequence[int] = NOISE_BATCHES, batch: int = ENGINE_BATCH) -> dict[str, Any]:
    """One instance: each edit's effect on the action logit difference (LD after the edit - LD of the stale
    cache) in the HF oracle and in the engine (each variant: the correct edit and the mutants), and the
    engine's noise: the largest change of the stale cache's LD over other batch splits of the same context."""
    tok, chat, r = lm.tokenizer, lm.has_chat_template, 1
    pair = tokenize_pair(tok, inst, chat)
    ctx_old, ctx_new, suffix = list(pair.ids_old[:-r]), list(pair.ids_new[:-r]), list(pair.ids_new[-r:])
    slots = list(pair.field_slots)
    if slots != list(range(slots[0], slots[-1] + 1)):
        raise KVProbeError(f"field slots {slots} are not contiguous; the engine refreshes one span")
    if max(slots) + SHIFT >= len(ctx_new):
        raise KVProbeError(f"the field must end more than {SHIFT} tokens before the readout")
    line = erratum_line(template, inst, inst.new_value)
    fe_prompt = prompt_ids(tok, inst, erratum_body(template, inst, inst.new_value, [line]), chat)
    if fe_prompt[-r:] != suffix:
        raise KVProbeError("the erratum prompt ends in another readout token than the plain prompt")

    def ld(x: np.ndarray) -> float:
        return float(x[pair.new_action_id] - x[pair.old_action_id])

    stale_state = prefill(lm, ctx_old)
    hf_stale = ld(_hf(lm, stale_state, suffix))
    e = FieldEdit(stale_state, ctx_old, ctx_new, slots, suffix)
    hf_res = {"in_place": edit.in_place(lm, e), "field_erratum": edit.field_erratum(lm, e, fe_prompt, r)}
    hf_effect = {op: ld(_hf(lm, hf_res[op].state, hf_res[op].suffix_ids)) - hf_stale for op in ops}

    prev = engine.batch_tokens
    try:
        stale_by_batch: dict[int, float] = {}
        for b in (batch, *noise_batches):
            engine.set_batch_tokens(min(b, engine.n_batch))
            engine.clear()
            engine.cache_context(ctx_old)
            stale_by_batch[b] = ld(engine.read(suffix, len(ctx_old)))
        engine.set_batch_tokens(batch)
        eng_stale = stale_by_batch[batch]
        eng_effect: dict[str, dict[str, float]] = {}
        for op in ops:
            eng_effect[op] = {}
            for v in variants:
                engine.clear()
                engine.cache_context(ctx_old)
                eng_effect[op][v] = ld(_engine_edit(engine, op, v, ctx_new, slots, suffix, fe_prompt)) - eng_stale
    finally:
        engine.set_batch_tokens(prev)
    dev = {b: abs(v - eng_stale) for b, v in stale_by_batch.items() if b != batch}
    same_path = [d for b, d in dev.items() if (b < 64) == (batch < 64)]
    return {"scenario": inst.scenario, "n_tokens": len(pair.ids_new), "field_slots": slots, "batch": batch,
            "hf_stale_ld": hf_stale, "hf_effect": hf_effect, "engine_stale_ld": eng_stale,
            "engine_effect": eng_effect, "stale_ld_by_batch": {str(b): v for b, v in stale_by_batch.items()},
            "noise": max(dev.values(), default=0.0), "noise_same_path": max(same_path, default=0.0)}


def judge(rows: Sequence[dict[str, Any]], op: str, variant: str = "correct",
          check: EffectCheck = EffectCheck()) -> dict[str, Any]:
    """The check's verdict for one edit and variant over instances from :func:`edit_effect`."""
    judged = [r for r in rows if check.judged(r["hf_effect"][op], r["noise"])]
    ok = [r for r in judged if check.passes(r["hf_effect"][op], r["engine_effect"][op][variant], r["noise"])]
    if len(judged) < check.min_judged:
        verdict = "not judged"
    else:
        verdict = "pass" if len(ok) == len(judged) else "fail"
    return {"op": op, "variant": variant, "judged": len(judged), "passed": len(ok), "n": len(rows),
            "verdict": verdict}


def engine_check(rows: Sequence[dict[str, Any]], variant: str = "correct", ops: Sequence[str] = OPS,
                 check: EffectCheck = EffectCheck()) -> str:
    """``pass`` when the edit variant passes on every edit that has judged instances (and at least one has),
    else ``fail``: the engine check's verdict for the correct edit or a mutant."""
    verdicts = [judge(rows, op, variant, check)["verdict"] for op in ops]
    judged = [v for v in verdicts if v != "not judged"]
    return "pass" if judged and all(v == "pass" for v in judged) else "fail"
