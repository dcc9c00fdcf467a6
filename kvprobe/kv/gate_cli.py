"""``kvprobe gate --model ALIAS_OR_PATH``: the RoPE correctness gate (exits 1 above tolerance, 2 on errors)."""

from __future__ import annotations

import argparse
import json


def result_offsets(result: dict) -> list[int]:
    return [r["offset"] for r in result["rows"] if "refused" not in r] or [0]


def _gate(args: argparse.Namespace) -> int:
    from kvprobe.kv.gate import DEFAULT_OFFSETS, format_gate, run_gate
    from kvprobe.models.loading import load_model

    lm = load_model(args.model, device=args.device, dtype=args.dtype, seed=args.seed, random_init=args.random_init)
    result = run_gate(lm, chunk_len=args.chunk_len, offsets=args.offsets or DEFAULT_OFFSETS, seed=args.seed,
                      suffix_len=args.suffix_len, key_tol=args.tol, deep_tol=args.deep_tol,
                      rotate=not args.no_rotate)
    window = lm.spec.sliding_window
    if window is not None and args.chunk_len > window:
        # A chunk wider than the window: also report kvprobe's full per-token KV against the default
        # truncating cache (informational: the verdict stays the rotation gate's).
        from kvprobe.kv.sliding import compare_window_policies, format_window_comparison

        result["window_policies"] = compare_window_policies(lm.model, args.chunk_len, max(result_offsets(result)),
                                                            seed=args.seed, suffix_len=args.suffix_len)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"RoPE gate on {args.model} ({result['model_type']}, {lm.spec.n_layers} layers)")
        print(format_gate(result))
        if "window_policies" in result:
            print(format_window_comparison(result["window_policies"]))
        elif window is not None:
            print(f"(sliding window {window}: pass --chunk-len {window + 64} or more to compare kvprobe's full "
                  f"per-token KV with the default truncating cache)")
    return 0 if result["passed"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gate", help="check that re-rotated KV equals an offset prefill (exits 1 if not)")
    p.add_argument("--model", required=True, help="alias, Hugging Face id or model directory")
    p.add_argument("--random-init", action="store_true",
                   help="allow a directory with a config.json but no weights (the gate is exact on random weights too)")
    p.add_argument("--chunk-len", type=int, default=64)
    p.add_argument("--suffix-len", type=int, default=3, help="suffix tokens whose next-token logits are compared")
    p.add_argument("--offsets", type=int, nargs="+", default=None,
                   help="target offsets (default: 0 17 500 3000 32768)")
    p.add_argument("--tol", "--key-tol", dest="tol", type=float, default=None,
                   help="relative tolerance of the rotation (layer-0 keys); default by dtype, fp32 1e-5")
    p.add_argument("--deep-tol", "--logit-tol", dest="deep_tol", type=float, default=None,
                   help="relative tolerance on all layers' keys and the logits, plus 2^-24 x position; "
                        "default by dtype, fp32 1e-4")
    p.add_argument("--no-rotate", action="store_true",
                   help="debugging control: relabel positions without rotating the keys (must FAIL)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random tokens (and config-only weights)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=_gate)
