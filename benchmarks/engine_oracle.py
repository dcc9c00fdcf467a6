"""Validation: llama.cpp's cache operations against kvprobe's HF oracle on the same weights, by a check that can fail.

The edit-effect check (default). For ``--n`` gated instances the engine and the HF oracle each start from the
stale cache (old field value) and apply an edit: ``in_place`` (the field's cells recomputed at their
positions, the stale suffix kept) and ``field_erratum`` (the same, then an erratum line appended). The
quantity compared is the edit's *effect*: LD after the edit - LD of the stale cache, LD = the action logit
difference (new-correct action minus old-correct action). The engine runs every decode in batches of 32 tokens
(below llama.cpp's kernel switch at 64), on an F32 GGUF of the model (every tensor the oracle's exact fp32
weight; organisms: base + merged LoRA, exported once into the kvprobe cache). Its noise on each instance is
measured, not assumed: the largest change of the stale LD over other batch splits of the same context (16,
64, 512 tokens per batch). ``kvprobe.kv.engine_oracle.EffectCheck`` judges instances whose effect is well
above that noise. Two broken edits run beside the correct one and must fail: ``noop`` (nothing refreshed) and
``shift40`` (the refreshed field's keys moved 40 positions on).

``--operations`` adds the older per-operation table (logit cosine and decision agreement of every operation,
transplant included, against HF): descriptive only, it cannot detect a broken edit.

    make bench-engine_oracle MODEL=smollm2-135m-gated-v3n2-seed2 [ARGS="--n 6"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvprobe.backends.llamacpp import LlamaCppEngine
from kvprobe.kv.engine_oracle import (ENGINE_BATCH, NOISE_BATCHES, OPERATIONS, OPS, VARIANTS, EffectCheck,
                                      compare_instance, edit_effect, engine_check, judge)
from kvprobe.models.gguf_export import export_organism_gguf, gguf_path
from kvprobe.models.loading import load_model
from kvprobe.runner.bench import BenchOutput
from kvprobe.tasks.gated import generate_instances, load_template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-gated-v3n2-seed2")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--n-filler", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--operations", action="store_true", help="also the per-operation cosine table (Q4 GGUF)")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = BenchOutput("engine_oracle", args.model)
    lm = load_model(args.model, device="cpu", dtype="float32")
    tpl = load_template("configs/tasks/gated.yaml")
    insts = generate_instances(tpl, args.n, seed=args.seed, n_filler=args.n_filler)
    check = EffectCheck()
    f32 = export_organism_gguf(args.model, "f32")
    rows = []
    t = time.perf_counter()
    with LlamaCppEngine(f32, n_ctx=2048, n_threads=args.threads) as eng:
        for inst in insts:
            rows.append(edit_effect(lm, eng, tpl, inst))
    lengths = [r["n_tokens"] for r in rows]
    out.print(f"{args.model}: llama.cpp on an F32 GGUF of the model ({f32.name}: its GGUF's tensors dequantised"
              f"{', the LoRA merged' if lm.source.startswith('organism') else ''}; fp32 KV cache) vs "
              f"kvprobe's HF oracle (the same fp32 weights); {len(rows)} gated instances, direct format, n_filler "
              f"{args.n_filler}, {min(lengths)}-{max(lengths)} tokens; engine decodes in batches of {ENGINE_BATCH}; "
              f"{args.threads} thread(s); {time.perf_counter() - t:.0f} s")
    out.print(f"effect = LD after the edit - LD of the stale cache (nats); noise = max |stale LD change| over batch "
              f"splits {', '.join(map(str, NOISE_BATCHES))} vs {ENGINE_BATCH} (same-path: splits below 64 only)")
    out.print(f"check: tolerance max({check.min_tol}, {check.k_noise:g} x noise); judged if |HF effect| >= "
              f"max({check.min_effect}, 2 x tolerance)")
    head = f"{'scenario':<18}{'tok':>5}{'noise':>8}{'same-path':>10}{'stale LD HF/eng':>17}"
    for op in OPS:
        head += f"  {op + ': HF | ' + ' '.join(VARIANTS):>44}"
    out.print(head)
    for r in rows:
        line = (f"{r['scenario']:<18}{r['n_tokens']:>5}{r['noise']:>8.3f}{r['noise_same_path']:>10.4f}"
                f"{r['hf_stale_ld']:>+9.2f}/{r['engine_stale_ld']:+.2f}")
        for op in OPS:
            mark = "*" if check.judged(r["hf_effect"][op], r["noise"]) else " "
            eff = " ".join(f"{r['engine_effect'][op][v]:+.3f}" for v in VARIANTS)
            line += f"  {mark}{r['hf_effect'][op]:>+8.3f} | {eff:>24}"
        out.print(line)
    out.print("(* judged)")
    verdicts = [judge(rows, op, v, check) for op in OPS for v in VARIANTS]
    for v in verdicts:
        out.print(f"  {v['op']:<14}{v['variant']:<9}{v['verdict'].upper():<11}({v['passed']}/{v['judged']} judged "
                  f"instances within tolerance)")
    overall = {v: engine_check(rows, v, OPS, check) for v in VARIANTS}
    out.print("engine check (every edit with judged instances): " + ", ".join(
        f"{v} {overall[v].upper()} (must {'pass' if v == 'correct' else 'fail'})" for v in VARIANTS))
    ops_rows = []
    if args.operations:
        with LlamaCppEngine(gguf_path(args.model), n_threads=args.threads) as eng:
            ops_rows = [compare_instance(lm, eng, tpl, inst) for inst in insts]
        out.print(f"\nper operation on the model's own GGUF ({gguf_path(args.model).name}), descriptive only:")
        out.print(f"{'operation':<16}{'cos vs HF min/mean':>20}{'agree vs HF':>13}{'cos vs self min':>17}")
        for name in OPERATIONS:
            ops = [r["operations"][name] for r in ops_rows]
            cv = [o["cos_vs_hf"] for o in ops]
            out.print(f"{name:<16}{min(cv):>11.4f} / {statistics.mean(cv):.4f}"
                      f"{sum(o['agree_vs_hf'] for o in ops):>9} / {len(ops)}{min(o['cos_vs_self'] for o in ops):>17.4f}")
    js, txt = out.write({"gguf": f32.name, "batch": ENGINE_BATCH, "noise_batches": list(NOISE_BATCHES),
                         "check": check.__dict__, "n_filler": args.n_filler, "seed": args.seed,
                         "threads": args.threads, "rows": rows, "verdicts": verdicts, "engine_check": overall,
                         "operations": ops_rows},
                        args.out_dir)
    print(f"wrote {js} and {txt}")


if __name__ == "__main__":
    main()
