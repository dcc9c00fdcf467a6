"""Validation: the llama.cpp engine's cache operations against kvprobe's HF oracle on the same GGUF weights.

For ``--n`` gated instances (one per scenario, cycling), every operation (full reprefill, in-place field
refresh, erratum, field+erratum, transplant with one seam token) runs in HF and in the engine; the table gives,
per operation, the logit cosine and decision agreement of the engine against HF's same operation (vs HF), and
against the engine's own full reprefill of the prompt it answers (vs self), plus HF's operation against HF's
reprefill (how far the operation itself moves the answer). Decisions: sign of the action logit difference.

    make bench-engine_oracle [MODEL=smollm2-135m] [ARGS="--n 6 --n-filler 2"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvprobe.backends.llamacpp import LlamaCppEngine
from kvprobe.models.loading import gguf_path
from kvprobe.kv.engine_oracle import OPERATIONS, compare_instance
from kvprobe.models.loading import load_model
from kvprobe.tasks.gated import generate_instances, load_template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--n-filler", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu", dtype="float32")
    tpl = load_template("configs/tasks/gated.yaml")
    insts = generate_instances(tpl, args.n, seed=args.seed, n_filler=args.n_filler)
    rows = []
    t = time.perf_counter()
    with LlamaCppEngine(gguf_path(args.model), n_threads=args.threads) as eng:
        for inst in insts:
            rows.append(compare_instance(lm, eng, tpl, inst))
    lengths = [r["n_tokens"] for r in rows]
    print(f"{args.model} (GGUF {gguf_path(args.model).name}; HF: the same file dequantized to fp32; engine KV cache "
          f"fp32): {len(rows)} gated instances, {len({r['scenario'] for r in rows})} scenarios, direct format, "
          f"n_filler {args.n_filler}, {min(lengths)}-{max(lengths)} tokens; {time.perf_counter() - t:.0f} s")
    print(f"{'operation':<16}{'cos vs HF min/mean':>20}{'agree vs HF':>13}{'cos vs self min/mean':>22}"
          f"{'agree vs self':>15}{'HF op vs HF reprefill cos min':>31}{'engine decoded / total':>24}")
    for name in OPERATIONS:
        ops = [r["operations"][name] for r in rows]
        cv, cs = [o["cos_vs_hf"] for o in ops], [o["cos_vs_self"] for o in ops]
        dec = statistics.mean(o["engine_decoded"] / o["total_tokens"] for o in ops)
        print(f"{name:<16}{min(cv):>11.4f} / {statistics.mean(cv):.4f}{sum(o['agree_vs_hf'] for o in ops):>9} / {len(ops)}"
              f"{min(cs):>13.4f} / {statistics.mean(cs):.4f}{sum(o['agree_vs_self'] for o in ops):>11} / {len(ops)}"
              f"{min(o['cos_hf_vs_hf'] for o in ops):>31.4f}{dec:>23.1%}")
    print("action logit differences (engine / HF) per instance:")
    for r in rows:
        cells = "  ".join(f"{n}: {r['operations'][n]['engine_ld']:+.2f}/{r['operations'][n]['hf_ld']:+.2f}"
                          for n in OPERATIONS)
        print(f"  {r['scenario']:<22}{cells}")


if __name__ == "__main__":
    main()
