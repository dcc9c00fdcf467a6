"""The RoPE correctness gate (paper Section 5: a transplant must equal an offset prefill).

Prefill a chunk at positions 0..L-1, re-rotate it to an offset, and compare with the same chunk prefilled
at that offset. Three numbers per offset:

- ``key_rel_layer0``: layer-0 keys depend only on the embedding and RoPE, so this isolates the rotation
  itself: it must be at fp32 precision (default tolerance 1e-5 relative);
- ``key_rel_all`` / ``logit_rel``: every layer's keys and the next-token logits of a short suffix. Deeper
  layers also carry the reference's own fp32 position noise (a prefill at position 20k is itself less
  precise than one at 0), so their tolerance is looser (default 1e-3 relative);
- ``no_rotation_logit_rel``: the same readout when the keys are relabelled but NOT rotated: the control
  that shows the gate can fail (it should be large).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.rope import rerotate

DEFAULT_OFFSETS = (17, 500, 3000, 20000)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@torch.no_grad()
def run_gate(lm: Any, chunk_len: int = 64, offsets: Sequence[int] = DEFAULT_OFFSETS, seed: int = 0,
             suffix_len: int = 4, key_tol: float = 1e-5, deep_tol: float = 1e-3) -> dict[str, Any]:
    model = lm.model if not isinstance(lm, torch.nn.Module) else lm
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (chunk_len,), generator=g)
    suffix = torch.randint(0, vocab, (suffix_len,), generator=g)
    at_zero = prefill(lm, ids)
    rows = []
    for off in offsets:
        target = torch.arange(off, off + chunk_len)
        ref = prefill(lm, ids, positions=target)
        moved = rerotate(at_zero, target, lm)
        unrotated = at_zero.with_positions(target, at_zero.keys)
        logits = read_logits(lm, [moved, ref, unrotated], suffix)
        row = {"offset": int(off), "key_rel_layer0": _rel(moved.keys[0], ref.keys[0]),
               "key_rel_all": max(_rel(a, b) for a, b in zip(moved.keys, ref.keys)),
               "logit_rel": _rel(logits[0], logits[1]), "no_rotation_logit_rel": _rel(logits[2], logits[1])}
        row["passed"] = bool(row["key_rel_layer0"] <= key_tol and row["key_rel_all"] <= deep_tol
                             and row["logit_rel"] <= deep_tol)
        rows.append(row)
    return {"chunk_len": chunk_len, "key_tol": key_tol, "deep_tol": deep_tol, "rows": rows,
            "passed": all(r["passed"] for r in rows)}


def format_gate(result: dict[str, Any]) -> str:
    lines = [f"{'offset':>8}{'key L0 rel':>12}{'key all rel':>13}{'logit rel':>11}{'no-rotation':>13}  verdict"]
    for r in result["rows"]:
        lines.append(f"{r['offset']:>8}{r['key_rel_layer0']:>12.1e}{r['key_rel_all']:>13.1e}{r['logit_rel']:>11.1e}"
                     f"{r['no_rotation_logit_rel']:>13.1e}  {'pass' if r['passed'] else 'FAIL'}")
    lines.append(f"tolerances: layer-0 keys {result['key_tol']:.0e}, deeper keys and logits {result['deep_tol']:.0e}"
                 f" -> {'PASSED' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)
