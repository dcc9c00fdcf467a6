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
"""

from __future__ import annotations

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
