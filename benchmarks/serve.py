"""Benchmark: prefix-cache serving under Poisson load, in-prefix edit vs append-only erratum (paper Sec. 9).

A real HTTP server (``kvprobe.backends.server``, bound to 127.0.0.1) runs the llama.cpp engine with a prefix
cache. The shared prefix is the tau2 retail policy (read at run time from ``$KVPROBE_TAU2_RETAIL`` or
``../shared/data/tau2-retail/policy.md`` relative to the repository), padded to ``--prefix-tokens``, with one
mutable field near its top (an order's status). Every request changes the field's value:

- in-prefix edit: the new value is written into the field, inside the prefix;
- erratum: the prefix keeps its original value and a correction line is appended after it.

A client sends each arm's requests as a Poisson process at each offered rate and unthrottled (all at once),
bounded by ``--requests`` per cell and ``--cell-seconds`` per cell (requests not finished by then are counted
as incomplete, and the server is drained before the next cell). Per arm and load: TTFT p50/p90, TPOT, throughput, and the engine's own reused-token counts.

    make bench-serve [MODEL=smollm2-135m] [ARGS="--rates 0.05 0.1 0.2 --requests 4"]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from kvprobe.backends.llamacpp import LlamaCppEngine
from kvprobe.models.loading import gguf_path
from kvprobe.backends.server import PrefixCachingEngine, make_server
from kvprobe.models.loading import load_model

REPO = Path(__file__).resolve().parents[1]
STATUSES = ["pending", "processed", "delivered", "cancelled", "returned", "exchanged"]


def policy_text() -> str:
    path = Path(os.environ.get("KVPROBE_TAU2_RETAIL", REPO / ".." / "shared" / "data" / "tau2-retail"))
    path = path / "policy.md" if path.is_dir() else path
    if not path.exists():
        raise SystemExit(f"no tau2 retail policy at {path}: set KVPROBE_TAU2_RETAIL to its policy.md or folder")
    return path.read_text()


def build_prompts(tok, prefix_tokens: int, n: int, seed: int) -> dict[str, list[list[int]]]:
    policy = policy_text()
    pad = "\n\n## Appendix: store notes\n" + "\n".join(
        f"- Note {i}: keep the order record and the user's profile consistent." for i in range(400))
    rng = random.Random(seed)
    values = [f"{rng.choice(STATUSES)} (ref {rng.randrange(10**5):05d})" for _ in range(n)]
    original = "pending (ref 00000)"

    def prefix(value: str) -> str:
        head = f"# Current order\nOrder #W2378156 status: {value}\n\n"
        text = head + policy + pad
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return tok.decode(ids[:prefix_tokens]) if len(ids) > prefix_tokens else text

    question = "\n\nUser: Can I cancel order #W2378156? Answer yes or no.\nAgent:"
    base = prefix(original)
    arms = {"in_prefix_edit": [prefix(v) + question for v in values],
            "erratum": [base + f"\n\nCorrection: order #W2378156 status is now {v}." + question for v in values]}
    out = {arm: [tok(t, add_special_tokens=False)["input_ids"] for t in texts] for arm, texts in arms.items()}
    out["warm"] = [tok(base + question, add_special_tokens=False)["input_ids"]]  # the cache before any change
    return out


def send(port: int, tokens: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/generate", json.dumps({"tokens": tokens, "max_tokens": max_tokens}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps, stats = [], {}
    while True:
        line = resp.readline()
        if not line:
            break
        msg = json.loads(line)
        if msg.get("done"):
            stats = msg
            break
        stamps.append(time.perf_counter())
    conn.close()
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "end": stamps[-1], "start": t0, **stats}


def run_cell(port: int, prompts: list[list[int]], rate: float | None, max_tokens: int, deadline_s: float,
             seed: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    rng = random.Random(seed)
    threads = []
    t_start = time.perf_counter()

    def worker(p):
        r = send(port, p, max_tokens)
        with lock:
            results.append(r)

    for p in prompts:
        if rate:
            time.sleep(rng.expovariate(rate))
        if time.perf_counter() - t_start > deadline_s:
            break
        th = threading.Thread(target=worker, args=(p,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=max(0.0, deadline_s - (time.perf_counter() - t_start)))
    with lock:
        done = [r for r in results if r["end"] - t_start <= deadline_s]
    for th in threads:  # drain: the next cell must not queue behind this one's late requests
        th.join()
    span = (max(r["end"] for r in done) - t_start) if done else float("nan")
    ttft = [r["ttft"] for r in done]
    return {"sent": len(threads), "done": len(done),
            "ttft_p50": float(np.percentile(ttft, 50)) if done else float("nan"),
            "ttft_p90": float(np.percentile(ttft, 90)) if done else float("nan"),
            "tpot": statistics.median(r["tpot"] for r in done) if done else float("nan"),
            "throughput_rps": len(done) / span if done else 0.0,
            "prompt_tokens": sum(r["prompt_tokens"] for r in done),
            "reused_tokens": sum(r["engine_reused_tokens"] for r in done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="offered requests/s")
    ap.add_argument("--requests", type=int, default=4, help="requests per arm and load")
    ap.add_argument("--cell-seconds", type=float, default=40.0, help="time bound per arm and load")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = load_model(args.model).tokenizer
    loads: list[float | None] = [*args.rates, None]
    n_total = args.requests * len(loads)
    prompts = build_prompts(tok, args.prefix_tokens, n_total, args.seed)
    engine = PrefixCachingEngine(LlamaCppEngine(gguf_path(args.model), n_ctx=4096, n_threads=args.threads))
    server = make_server(engine)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lens = {arm: statistics.mean(len(p) for p in ps) for arm, ps in prompts.items() if arm != "warm"}
    print(f"{args.model} llama.cpp (GGUF {gguf_path(args.model).name}, {args.threads} threads) behind HTTP on "
          f"127.0.0.1; prompts: in-prefix edit {lens['in_prefix_edit']:.0f} tokens, erratum {lens['erratum']:.0f} "
          f"tokens (tau2 retail policy padded to {args.prefix_tokens}, one mutable field at its top); "
          f"{args.max_tokens} output tokens; <= {args.requests} requests and {args.cell_seconds:.0f} s per cell")
    t_all = time.perf_counter()
    table = {}
    for arm in ("erratum", "in_prefix_edit"):
        # warm the cache with the arm's base prefix (the state a server holds before the field changes)
        send(port, prompts["warm"][0], 1)
        for k, rate in enumerate(loads):
            cell = prompts[arm][k * args.requests:(k + 1) * args.requests]
            table[(arm, rate)] = run_cell(port, cell, rate, args.max_tokens, args.cell_seconds, args.seed + k)
    server.shutdown()
    print(f"{'load':>12}{'arm':>16}{'done/sent':>11}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'TPOT s':>9}"
          f"{'req/s':>8}{'reused tok (engine)':>21}{'hit rate':>10}")
    for rate in loads:
        for arm in ("in_prefix_edit", "erratum"):
            c = table[(arm, rate)]
            hit = c["reused_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else float("nan")
            label = f"{rate:g}/s" if rate else "unthrottled"
            print(f"{label:>12}{arm:>16}{c['done']:>6}/{c['sent']:<4}{c['ttft_p50']:>12.2f}{c['ttft_p90']:>12.2f}"
                  f"{c['tpot']:>9.3f}{c['throughput_rps']:>8.3f}{c['reused_tokens']:>12}/{c['prompt_tokens']:<8}"
                  f"{hit:>10.1%}")
    print("ratios, in-prefix edit / erratum (same load, this run):")
    for rate in loads:
        e, a = table[("in_prefix_edit", rate)], table[("erratum", rate)]
        label = f"{rate:g}/s" if rate else "unthrottled"
        print(f"{label:>12}: TTFT p50 {e['ttft_p50'] / a['ttft_p50']:.1f}x  p90 {e['ttft_p90'] / a['ttft_p90']:.1f}x  "
              f"throughput erratum/edit {a['throughput_rps'] / e['throughput_rps'] if e['throughput_rps'] else float('inf'):.1f}x")
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
