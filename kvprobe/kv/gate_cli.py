"""``kvprobe gate --model ALIAS_OR_PATH``: the RoPE correctness gate; exits 1 above tolerance."""

from __future__ import annotations

import argparse


def _gate(args: argparse.Namespace) -> int:
    from kvprobe.kv.gate import format_gate, run_gate
    from kvprobe.models.loading import load_model

    lm = load_model(args.model, device=args.device, dtype="float32", seed=args.seed)
    result = run_gate(lm, chunk_len=args.chunk_len, offsets=args.offsets, seed=args.seed, key_tol=args.key_tol,
                      deep_tol=args.deep_tol)
    print(f"RoPE gate on {args.model} ({lm.spec.model_type}, {lm.spec.n_layers} layers, "
          f"rope {sorted({r.rope_type for r in lm.spec.rope})})")
    print(format_gate(result))
    return 0 if result["passed"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gate", help="check that re-rotated KV equals an offset prefill (exits 1 if not)")
    p.add_argument("--model", required=True, help="alias or model directory (a config.json alone works)")
    p.add_argument("--chunk-len", type=int, default=64)
    p.add_argument("--offsets", type=int, nargs="+", default=[17, 500, 3000, 20000])
    p.add_argument("--key-tol", type=float, default=1e-5, help="relative tolerance on layer-0 keys")
    p.add_argument("--deep-tol", type=float, default=1e-3, help="relative tolerance on all keys and logits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_gate)
