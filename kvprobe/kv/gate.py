"""The RoPE correctness gate: a re-rotated chunk must equal the same chunk prefilled at the target offset.

The paper's transplant (Section 5, Figure 4b; Section 8 / Appendix F for the variants) precompiles a chunk
at positions 0..L-1, re-rotates its post-RoPE keys to where it lands (values are position-free) and splices
it in; DESIGN.md core idea 3 requires that this equal an offset prefill to float tolerance, checked by this
gate before any compose run. Per offset it reports:

- ``key_rel_layer0``: layer-0 keys depend only on the token embedding and RoPE, so this isolates the
  rotation itself (for MLA, "keys" here and below are the rotated k_pe; the latent is position-free). It is held to the rotation tolerance ``key_tol`` (fp32: 1e-5 relative).
- ``key_rel_all`` (max over layers) and ``logit_rel`` (next-token logits after each prefix of a short
  random suffix, read over both states at the same positions). Deeper layers also carry the reference's
  own float32 position noise: transformers computes RoPE angles as ``float32(p) * inv_freq``, whose
  absolute error grows like ``2**-24 * p``, so a prefill at position 30k is itself not translation
  invariant to 1e-5. Their tolerance is ``deep_tol + 2**-24 * (largest position)``.
- ``no_rotation_key_rel`` / ``no_rotation_logit_rel``: the same comparison when the keys are relabelled
  with the target positions but NOT rotated (the paper's no-rotate control). It must be large: it shows the
  gate can fail. ``rotate=False`` (CLI ``--no-rotate``) gates that control itself, which must fail.

Errors are max-abs-difference over max-abs of the reference (inf-norm relative), per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.backends.hf import hf_prefill, hf_read_logits
from kvprobe.kv.rope import rerotate, rope_layer_info, rotated_vectors

LARGE_OFFSET = 32768
DEFAULT_OFFSETS = (0, 17, 500, 3000, LARGE_OFFSET)
# (rotation tolerance on layer-0 keys, base tolerance on all keys and logits) per model dtype
DEFAULT_TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-10, 1e-8),
                      torch.float16: (4e-3, 4e-2), torch.bfloat16: (3e-2, 1e-1)}
FP32_ANGLE_EPS = 2.0 ** -24


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-abs difference over max-abs of the reference (inf-norm relative)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _unwrap(lm: HookableModel) -> torch.nn.Module:
    return lm if isinstance(lm, torch.nn.Module) else lm.model


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(key_tol, deep_tol)`` for a model of this dtype."""
    try:
        return DEFAULT_TOLERANCES[dtype]
    except KeyError:
        raise KVProbeError(f"no default gate tolerances for dtype {dtype}; pass key_tol and deep_tol") from None


@torch.no_grad()
def run_gate(lm_or_model: Any, chunk_len: int = 64, offsets: Sequence[int] = DEFAULT_OFFSETS, seed: int = 0,
             suffix_len: int = 3, key_tol: float | None = None, deep_tol: float | None = None,
             rotate: bool = True) -> dict[str, Any]:
    """Prefill a random chunk at 0, re-rotate it to each offset, compare with the chunk prefilled there.

    Returns ``{"rows": [per-offset dict], "passed": bool, "rope": [per-layer description], ...}``; a row
    passes when its layer-0 key error is within ``key_tol`` and its all-layer key and logit errors within
    ``deep_tol`` plus the float32 angle allowance. An offset the RoPE variant refuses to re-rotate to
    (longrope across its short/long switch) is reported as a ``refused`` row, not compared. Tolerances default by the model's dtype
    (:data:`DEFAULT_TOLERANCES`). ``rotate=False`` relabels positions without rotating (a control that
    must fail at any non-zero offset). No tokenizer is needed: the tokens are random ids.
    """
    model = _unwrap(lm_or_model)
    if chunk_len < 1 or suffix_len < 1:
        raise KVProbeError("chunk_len and suffix_len must be at least 1")
    offsets = [int(o) for o in offsets]
    if not offsets or min(offsets) < 0:
        raise KVProbeError(f"offsets must be non-negative; got {offsets}")
    dtype = next(model.parameters()).dtype
    d_key, d_deep = default_tolerances(dtype) if key_tol is None or deep_tol is None else (key_tol, deep_tol)
    key_tol = d_key if key_tol is None else float(key_tol)
    deep_tol = d_deep if deep_tol is None else float(deep_tol)
    infos = rope_layer_info(model)  # refuses inexact variants before any compute

    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (chunk_len,), generator=g)
    suffix = torch.randint(0, vocab, (suffix_len,), generator=g)
    at_zero = hf_prefill(model, ids)
    rows = []
    for off in offsets:
        target = torch.arange(off, off + chunk_len)
        unrotated = at_zero.with_positions(target, at_zero.keys)
        try:
            moved = rerotate(at_zero, target, infos) if rotate else unrotated
        except KVProbeError as exc:  # a move this RoPE refuses (longrope across its switch): compose refuses too
            rows.append({"offset": off, "refused": str(exc), "passed": True})
            continue
        ref = hf_prefill(model, ids, positions=target)
        ref_rot = rotated_vectors(ref, infos)  # keys, or MLA's k_pe
        key_errs = [relative_error(a, b) for a, b in zip(rotated_vectors(moved, infos), ref_rot)]
        logit_rel, control_logit_rel = 0.0, 0.0
        for j in range(1, suffix_len + 1):  # logits after each prefix of the suffix, all states at once
            lg = hf_read_logits(model, [moved, ref, unrotated], suffix[:j],
                             suffix_positions=range(off + chunk_len, off + chunk_len + j))
            logit_rel = max(logit_rel, relative_error(lg[0], lg[1]))
            control_logit_rel = max(control_logit_rel, relative_error(lg[2], lg[1]))
        deep_allowed = deep_tol + FP32_ANGLE_EPS * (off + chunk_len + suffix_len)
        row = {
            "offset": off,
            "key_rel_layer0": key_errs[0],
            "key_rel_all": max(key_errs),
            "key_rel_by_layer": key_errs,
            "logit_rel": logit_rel,
            "no_rotation_key_rel": relative_error(rotated_vectors(unrotated, infos)[0], ref_rot[0]),
            "no_rotation_logit_rel": control_logit_rel,
            "deep_tol": deep_allowed,
        }
        row["passed"] = bool(row["key_rel_layer0"] <= key_tol and row["key_rel_all"] <= deep_allowed
                             and row["logit_rel"] <= deep_allowed)
        rows.append(row)
    return {
        "model_type": str(model.config.get_text_config().model_type),
        "dtype": str(dtype).removeprefix("torch."),
        "chunk_len": chunk_len,
        "suffix_len": suffix_len,
        "seed": seed,
        "rotate": rotate,
        "key_tol": key_tol,
        "deep_tol": deep_tol,
        "rope": sorted({info.describe() for info in infos}),
        "rows": rows,
        "refused_offsets": [r["offset"] for r in rows if "refused" in r],
        "passed": all(r["passed"] for r in rows),
    }


def format_gate(result: dict[str, Any]) -> str:
    """A small table of :func:`run_gate`'s result."""
    lines = [f"rope: {'; '.join(result['rope'])}   dtype {result['dtype']}   chunk {result['chunk_len']}"
             + ("" if result["rotate"] else "   (--no-rotate: positions relabelled, keys NOT rotated)"),
             f"{'offset':>8}{'key L0 rel':>12}{'key all rel':>13}{'logit rel':>11}{'deep tol':>10}"
             f"{'no-rot key':>12}{'no-rot logit':>14}  verdict"]
    for r in result["rows"]:
        if "refused" in r:
            lines.append(f"{r['offset']:>8}  refused (re-rotation there is refused, so compose refuses it too): "
                         f"{r['refused']}")
            continue
        lines.append(f"{r['offset']:>8}{r['key_rel_layer0']:>12.1e}{r['key_rel_all']:>13.1e}{r['logit_rel']:>11.1e}"
                     f"{r['deep_tol']:>10.1e}{r['no_rotation_key_rel']:>12.1e}{r['no_rotation_logit_rel']:>14.1e}"
                     f"  {'pass' if r['passed'] else 'FAIL'}")
    lines.append(f"tolerances: layer-0 keys {result['key_tol']:.0e}; all keys and logits {result['deep_tol']:.0e} "
                 f"+ 2^-24 x position -> {'PASSED' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)
