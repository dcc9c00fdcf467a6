"""A load client for the serving benchmark: Poisson arrivals at an offered rate, or all at once.

Three kinds of server on the loopback interface, behind one client:

- ``LlamaServerTarget``: llama.cpp's own ``llama-server`` (a separate process, :mod:`kvprobe.backends.llama_server`)
  with its slots and prompt cache. Each response's ``timings`` give the prompt tokens the server took from its
  cache (``cache_n``) and those it evaluated (``prompt_n``); its Prometheus ``/metrics`` give the same as
  cumulative counters (``llamacpp:prompt_tokens_cached_total``, ``llamacpp:prompt_tokens_total``), differenced
  around each cell. Both are the server's own numbers.
- ``KvprobeTarget``: kvprobe's in-process baseline (``kvprobe.backends.server``): a single-entry longest-prefix
  cache that kvprobe decides, over the llama.cpp low-level API. Its "reused" count is kvprobe's own arithmetic
  (llama.cpp's eval counter only confirms how many tokens kvprobe then asked it to evaluate): a labelled
  baseline, not an engine's prefix cache.
- ``OpenAITarget``: an OpenAI-compatible server such as ``vllm serve`` (``POST /v1/completions``, streamed, the
  prompt given as token ids). Prefix-cache hits are read from its Prometheus ``/metrics``: vLLM's
  ``prefix_cache_hits`` / ``prefix_cache_queries`` token counters, differenced around each cell. A server
  without them reports no hit rate (``None``), never an inferred one.

Only loopback addresses are accepted: a load test must never leave the machine.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import numpy as np

from kvprobe.errors import KVProbeError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# vLLM's prefix-cache counters (tokens), newest name first; each exported with a ``_total`` suffix
PROM_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
PROM_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
# llama-server's counters (tokens): prompt tokens taken from a slot's cache, and prompt tokens evaluated
LLAMACPP_CACHED = "llamacpp:prompt_tokens_cached_total"
LLAMACPP_EVALUATED = "llamacpp:prompt_tokens_total"


@dataclass(frozen=True)
class Reply:
    start: float  # perf_counter when the request was sent
    ttft: float  # seconds to the first streamed token
    tpot: float  # seconds per output token after the first (nan for one token)
    end: float  # perf_counter of the last token
    prompt_tokens: int
    reused_tokens: int | None  # prompt tokens the server took from its cache for this request, when it says
    evaluated_tokens: int | None = None  # prompt tokens the server evaluated for this request, when it says
    slot: int | None = None  # the server slot that answered, when it says


class Target(Protocol):
    """A server the client can load: one streamed request, and the engine's cumulative cache counters."""

    label: str

    def send(self, tokens: list[int], max_tokens: int) -> Reply: ...

    def cache_counters(self) -> tuple[float, float] | None:
        """(hit tokens, queried tokens) so far, from the server's own metrics; None if it exports none."""
        ...


def _loopback(host: str) -> str:
    if host not in LOOPBACK:
        raise KVProbeError(f"the load client only targets the loopback interface; got host {host!r}")
    return host


def _stream(host: str, port: int, path: str, body: dict, timeout: float):
    """POST ``body``; yields (perf_counter, line) for each non-empty response line."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise KVProbeError(f"{path} answered {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            if line.strip():
                yield time.perf_counter(), line.strip()
    finally:
        conn.close()


def _reply(t0: float, stamps: list[float], prompt_tokens: int, reused: int | None,
           evaluated: int | None = None, slot: int | None = None) -> Reply:
    if not stamps:
        raise KVProbeError("the server streamed no token")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return Reply(t0, stamps[0] - t0, tpot, stamps[-1], prompt_tokens, reused, evaluated, slot)


def _get(host: str, port: int, path: str) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.read().decode() if resp.status == 200 else ""
    finally:
        conn.close()


class LlamaServerTarget:
    """llama.cpp's ``llama-server`` on loopback: ``POST /completion`` with the prompt as token ids, streamed,
    greedy, ``cache_prompt`` on; the hit counts are the server's own (``timings`` and ``/metrics``)."""

    hit_source = "llama-server timings.cache_n / timings.prompt_n per response"

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 3600.0, label: str = "") -> None:
        self.host, self.port, self.timeout = _loopback(host), port, timeout
        self.label = label or f"llama-server at http://{host}:{port}"

    def send(self, tokens: list[int], max_tokens: int, slot: int | None = None) -> Reply:
        """One streamed request; ``slot`` pins it to that server slot (``id_slot``), else the server picks."""
        body = {"prompt": tokens, "n_predict": max_tokens, "cache_prompt": True, "stream": True,
                "temperature": 0.0, "top_k": 1, "ignore_eos": True}
        if slot is not None:
            body["id_slot"] = int(slot)
        t0 = time.perf_counter()
        stamps, final = [], None
        for t, line in _stream(self.host, self.port, "/completion", body, self.timeout):
            if not line.startswith(b"data:"):
                continue
            msg = json.loads(line[5:].strip())
            if msg.get("stop"):
                final = msg
                break
            stamps.append(t)
        if final is None or "timings" not in final:
            raise KVProbeError("llama-server's stream ended without its final message (stop, timings)")
        tm = final["timings"]
        cached, evaluated = int(tm["cache_n"]), int(tm["prompt_n"])
        if cached + evaluated != len(tokens):
            raise KVProbeError(f"llama-server counted {cached} cached + {evaluated} evaluated prompt tokens for a "
                               f"{len(tokens)}-token prompt")
        return _reply(t0, stamps, len(tokens), cached, evaluated, final.get("id_slot"))

    def cache_counters(self) -> tuple[float, float] | None:
        return llamacpp_cache_counters(_get(self.host, self.port, "/metrics"))


class KvprobeTarget:
    """kvprobe's in-process baseline server (``kvprobe.backends.server``) on 127.0.0.1: the reuse decision is
    kvprobe's single-entry longest-prefix cache, not an engine's."""

    hit_source = "baseline: kvprobe's single-entry prefix cache (its decision; llama.cpp's eval counter)"

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 3600.0) -> None:
        self.host, self.port, self.timeout = _loopback(host), port, timeout
        self.label = f"kvprobe.backends.server (in-process baseline over llama.cpp) at http://{host}:{port}"

    def send(self, tokens: list[int], max_tokens: int) -> Reply:
        t0 = time.perf_counter()
        stamps, stats = [], {}
        for t, line in _stream(self.host, self.port, "/generate", {"tokens": tokens, "max_tokens": max_tokens},
                               self.timeout):
            msg = json.loads(line)
            if msg.get("done"):
                stats = msg
                break
            stamps.append(t)
        return _reply(t0, stamps, int(stats["prompt_tokens"]), int(stats["engine_reused_tokens"]),
                      int(stats["engine_evaluated_prompt_tokens"]))

    def cache_counters(self) -> tuple[float, float] | None:
        return None  # counted per request instead


class OpenAITarget:
    """An OpenAI-compatible completions server on loopback (e.g. ``vllm serve MODEL --enable-prefix-caching``)."""

    hit_source = "server /metrics"

    def __init__(self, url: str, model: str, timeout: float = 3600.0) -> None:
        parts = urlsplit(url)
        self.host = _loopback(parts.hostname or "")
        self.port = parts.port or 80
        self.base = parts.path.rstrip("/")
        self.model, self.timeout = model, timeout
        self.label = f"OpenAI-compatible server at {url} (model {model})"

    def send(self, tokens: list[int], max_tokens: int) -> Reply:
        body = {"model": self.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        stamps, prompt_tokens = [], len(tokens)
        for t, line in _stream(self.host, self.port, f"{self.base}/v1/completions", body, self.timeout):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if msg.get("usage"):
                prompt_tokens = int(msg["usage"].get("prompt_tokens", prompt_tokens))
            if msg.get("choices"):
                stamps.append(t)
        return _reply(t0, stamps, prompt_tokens, None)

    def cache_counters(self) -> tuple[float, float] | None:
        return prometheus_cache_counters(_get(self.host, self.port, f"{self.base}/metrics"))


def _prometheus_samples(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return samples


def llamacpp_cache_counters(text: str) -> tuple[float, float] | None:
    """(cached prompt tokens, cached + evaluated prompt tokens) from llama-server's ``/metrics``:
    ``llamacpp:prompt_tokens_cached_total`` and ``llamacpp:prompt_tokens_total`` (the evaluated ones)."""
    samples = _prometheus_samples(text)
    cached, evaluated = samples.get(LLAMACPP_CACHED), samples.get(LLAMACPP_EVALUATED)
    return None if cached is None or evaluated is None else (cached, cached + evaluated)


def prometheus_cache_counters(text: str) -> tuple[float, float] | None:
    """(hits, queries) summed over label sets from vLLM's Prometheus text, by the first counter name present."""
    samples = _prometheus_samples(text)

    def first(names: tuple[str, ...]) -> float | None:
        for n in names:
            for key in (f"{n}_total", n):
                if key in samples:
                    return samples[key]
        return None

    hits, queries = first(PROM_HITS), first(PROM_QUERIES)
    return None if hits is None or queries is None else (hits, queries)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_cell(target: Target, prompts: list[list[int]], rate: float | None, max_tokens: int, deadline_s: float,
             seed: int) -> dict:
    """Send ``prompts`` as a Poisson process of ``rate`` requests/s (None: all at once), stop sending at
    ``deadline_s``, and count only requests finished by then. Late requests are waited for before returning
    (the next cell must not queue behind them) but not counted."""
    results: list[Reply] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    rng = random.Random(seed)
    threads = []
    before = target.cache_counters()
    t_start = time.perf_counter()

    def worker(p: list[int]) -> None:
        try:
            r = target.send(p, max_tokens)
        except BaseException as e:  # reported below: a failed request must not pass as a slow one
            with lock:
                errors.append(e)
            return
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
        th.join()
    if errors:
        raise KVProbeError(f"{len(errors)} request(s) failed: {errors[0]!r}")
    after = target.cache_counters()
    done = [r for r in results if r.end - t_start <= deadline_s]
    span = max(r.end for r in done) - t_start if done else float("nan")
    ttft = [r.ttft for r in done]
    cell = {"rate": rate, "sent": len(threads), "done": len(done),
            "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90),
            "tpot": statistics.median(r.tpot for r in done) if done else float("nan"),
            "throughput_rps": len(done) / span if done else 0.0,
            "prompt_tokens": sum(r.prompt_tokens for r in done)}
    source = getattr(target, "hit_source", "server")
    per_request = bool(results) and all(r.reused_tokens is not None for r in results)
    if per_request:
        # per request, as the server reported it for each completed request
        reused = sum(r.reused_tokens for r in done)
        cell |= {"reused_tokens": reused, "hit_rate": reused / cell["prompt_tokens"] if done else float("nan"),
                 "hit_source": source}
        if all(r.evaluated_tokens is not None for r in done):
            cell["evaluated_tokens"] = sum(r.evaluated_tokens for r in done)
        slots = sorted({r.slot for r in done if r.slot is not None})
        if slots:
            cell["slots_used"] = slots
    metrics = None
    if before is not None and after is not None and after[1] > before[1]:
        # the server's cumulative counters around the cell (every request sent, late ones included)
        metrics = {"reused_tokens": after[0] - before[0], "queried_tokens": after[1] - before[1],
                   "hit_rate": (after[0] - before[0]) / (after[1] - before[1])}
    if per_request and metrics is not None:
        cell["metrics"] = metrics
    elif metrics is not None:
        cell |= {**metrics, "hit_source": "server /metrics"}
    elif not per_request:
        cell |= {"reused_tokens": None, "hit_rate": None, "hit_source": "not reported by the server"}
    return cell
