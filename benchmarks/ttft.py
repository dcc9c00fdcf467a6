"""Benchmark: time to first token, full prefill vs transplant, at growing context lengths (paper Sec. 5, Fig. 6a),
through kvprobe's transformers path and through the llama.cpp engine, side by side in one run.

For each length L the context is a system head, a skill chunk of ~L tokens (filler rules of the gated
template, repeated) and a short task suffix. Full prefill runs head + chunk + suffix. A transplant reuses the
chunk precompiled once in isolation (paid once per skill, not timed) and times what a request pays: the head
prefill, one seam token (the chunk's first token recomputed after the head), the chunk's keys moved to their
new positions, and the suffix over the composed cache.

- transformers (fp32): the precompiled chunk lives in the block store (``kvprobe.blocks``, blocks of
  ``--block-tokens`` positions) and is loaded from it, never recomputed: a warm hit (RAM tier) and a cold hit
  (disk tier: RAM copies evicted, the safetensors files' pages dropped from the OS cache with
  ``posix_fadvise(DONTNEED)``, then promoted through the memory map). Recompute is the full prefill.
- llama.cpp (``--engine``, the GGUF of the same model): the chunk precompiled in its own sequence, then
  ``seq_add`` (the engine re-rotates the keys), ``seq_cp`` into the request and one seam token
  (``LlamaCppEngine.transplant``); full prefill is ``full_reprefill``.

Each time is the median of ``--repeats`` (``--full-repeats`` for full prefills). The growth exponent is the least-squares slope of log time against
log L over the lengths run (1 = linear, 2 = quadratic): what was measured, not what was expected.

    make bench-ttft [MODEL=smollm2-135m] [ARGS="--lengths 1000 2000 4000 8000 --threads 1"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvprobe.blocks import BlockStore
from kvprobe.blocks.chunks import load_chunk, store_chunk
from kvprobe.blocks.tiers import payload_nbytes
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.loading import load_model
from kvprobe.runner.bench import BenchOutput
from kvprobe.tasks.gated import load_template


def _median_time(fn, repeats: int, setup=None) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        if setup is not None:
            setup()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def growth_exponent(lengths: list[int], times: list[float]) -> float:
    """Least-squares slope of log(time) on log(length)."""
    return float(np.polyfit(np.log(lengths), np.log(times), 1)[0]) if len(lengths) > 1 else float("nan")


def drop_from_page_cache(store: BlockStore, bids: list[int]) -> None:
    """Evict the RAM copies (a clean discard: the disk holds the blocks) and ask the OS to drop the payload
    files' cached pages, so the next lookup is a promotion that reads the disk."""
    for b in bids:
        if b in store.ram:
            store.evict(b)
        fd = os.open(store.disk.path(b), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each transplant (median)")
    ap.add_argument("--full-repeats", type=int, help="repeats of each full prefill (default: --repeats)")
    ap.add_argument("--block-tokens", type=int, default=256, help="positions per stored block")
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                    help="also through llama.cpp (needs kvprobe[engine] and a GGUF alias)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (torch follows OMP_NUM_THREADS)")
    ap.add_argument("--out-dir", default="results/bench", help="where the text output and JSON record go")
    args = ap.parse_args()
    full_repeats = args.full_repeats or args.repeats
    out = BenchOutput("ttft", args.model)
    lm = load_model(args.model, device="cpu", dtype="float32")
    tok = lm.tokenizer
    tpl = load_template("configs/tasks/gated.yaml")
    head = tok("You are a customer-support agent.\nSKILL: STORE POLICY\n", add_special_tokens=False)["input_ids"]
    suffix = tok("\nOrder A1234 is pending. The customer asks to cancel it. Decision:",
                 add_special_tokens=False)["input_ids"]
    rules = tok("\n".join(tpl.filler_rules) + "\n", add_special_tokens=False)["input_ids"]
    engine = None
    if args.engine:
        from kvprobe.backends.llamacpp import LlamaCppEngine
        from kvprobe.models.gguf_export import gguf_path

        # the request sequence (head + chunk + suffix) and the precompiled chunk's own sequence share one pool
        n_ctx = 2 * max(args.lengths) + 2 * (len(head) + len(suffix)) + 64
        engine = LlamaCppEngine(gguf_path(args.model), n_ctx=n_ctx, n_threads=args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvprobe-ttft-"))
    store = BlockStore(root / "store")
    out.print(f"{args.model}: head {len(head)} tokens, suffix {len(suffix)} tokens; median of {args.repeats} "
              f"(transplants) and {full_repeats} (full prefills); "
              f"transformers fp32 on CPU (torch threads {torch.get_num_threads()})"
              + (f"; llama.cpp {engine.__class__.__name__} on the GGUF ({args.threads} thread(s), f32 cache)"
                 if engine else "; llama.cpp not run (--no-engine)"))
    out.print(f"transformers transplant: chunk from the block store ({args.block_tokens}-position blocks), "
              "warm = RAM hit, cold = disk promotion (mmap, page cache dropped); 'fetch' = the store lookup alone")
    hdr = (f"{'chunk':>6}{'HF full':>9}{'warm':>8}{'(fetch)':>9}{'cold':>8}{'(fetch)':>9}{'full/warm':>10}"
           f"{'full/cold':>10}{'cos':>8}")
    if engine:
        hdr += f" |{'eng full':>9}{'eng tr':>8}{'full/tr':>8}{'cos':>8}"
    out.print("times in seconds; cos = logit cosine of the transplant vs the same backend's full prefill")
    out.print(hdr)
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            chunk = (rules * (length // len(rules) + 1))[:length]
            bids = store_chunk(store, lm, chunk, block_tokens=args.block_tokens, state=precompile(lm, chunk))
            for b in bids:
                store.demote(b)  # the disk tier holds the chunk (its one demotion); RAM copies come back on use
            full_ids = head + chunk + suffix
            t_full, full = _median_time(lambda: read_logits(lm, prefill(lm, full_ids[:-1]), suffix[-1:]),
                                        full_repeats)
            fetch: list[float] = []

            def transplant():
                t = time.perf_counter()
                block = load_chunk(store, lm, chunk, block_tokens=args.block_tokens)
                fetch.append(time.perf_counter() - t)
                state = assemble(lm, [Live(tuple(head)), Spliced(tuple(chunk), block, seam=1),
                                      Live(tuple(suffix[:-1]))])
                return read_logits(lm, state, suffix[-1:])

            t_cold, cold = _median_time(transplant, args.repeats, setup=lambda: drop_from_page_cache(store, bids))
            fetch_cold = statistics.median(fetch)
            fetch.clear()
            load_chunk(store, lm, chunk, block_tokens=args.block_tokens)  # every block in RAM
            t_warm, warm = _median_time(transplant, args.repeats)
            fetch_warm = statistics.median(fetch)
            row = {"chunk_tokens": length, "prompt_tokens": len(full_ids), "hf_full_s": t_full,
                   "hf_warm_s": t_warm, "hf_warm_fetch_s": fetch_warm, "hf_cold_s": t_cold,
                   "hf_cold_fetch_s": fetch_cold, "hf_cos": _cos(full[0], warm[0]),
                   "hf_cos_cold": _cos(full[0], cold[0]), "blocks": len(bids),
                   "payload_bytes": sum(payload_nbytes(store.ram.payloads[b]) for b in bids)}
            line = (f"{length:>6}{t_full:>9.3f}{t_warm:>8.3f}{fetch_warm:>9.4f}{t_cold:>8.3f}{fetch_cold:>9.4f}"
                    f"{t_full / t_warm:>9.1f}x{t_full / t_cold:>9.1f}x{row['hf_cos']:>8.4f}")
            if engine:
                engine.clear()
                seq = engine.precompile(chunk)  # paid once per skill
                e_full_t, e_full = _median_time(lambda: engine.full_reprefill(full_ids), full_repeats)
                e_tr_t, e_tr = _median_time(lambda: engine.transplant(head, seq, len(chunk), chunk[0], suffix),
                                            args.repeats)
                row |= {"engine_full_s": e_full_t, "engine_transplant_s": e_tr_t,
                        "engine_transplant_decoded": e_tr.decoded_tokens, "engine_cos": _cos(e_full.logits, e_tr.logits)}
                line += (f" |{e_full_t:>9.3f}{e_tr_t:>8.3f}{e_full_t / e_tr_t:>7.1f}x{row['engine_cos']:>8.4f}")
            for b in bids:
                store.drop(b)  # the next length stores its own chunk
            out.print(line)
            rows.append(row)
    lengths = [r["chunk_tokens"] for r in rows]
    cols = {"HF full prefill": "hf_full_s", "HF transplant, warm": "hf_warm_s", "HF transplant, cold": "hf_cold_s"}
    if engine:
        cols |= {"llama.cpp full prefill": "engine_full_s", "llama.cpp transplant": "engine_transplant_s"}
    growth = {}
    out.print(f"\ngrowth from {lengths[0]} to {lengths[-1]} chunk tokens ({lengths[-1] / lengths[0]:g}x longer): "
              "time ratio, and the fitted exponent of time ~ L^k")
    for label, key in cols.items():
        ts = [r[key] for r in rows]
        growth[key] = growth_exponent(lengths, ts)
        out.print(f"  {label:<26} {ts[-1] / ts[0]:>6.1f}x   k = {growth[key]:.2f}")
    out.print(f"\ntotal {time.perf_counter() - out.t0:.0f} s")
    js, txt = out.write({"head_tokens": len(head), "suffix_tokens": len(suffix), "repeats": args.repeats,
                         "full_repeats": full_repeats,
                         "block_tokens": args.block_tokens, "engine_threads": args.threads if engine else None,
                         "torch_threads": torch.get_num_threads(), "rows": rows, "growth_exponent": growth},
                        args.out_dir)
    if engine:
        engine.close()
    store.close()
    print(f"wrote {js} and {txt}")


if __name__ == "__main__":
    main()
