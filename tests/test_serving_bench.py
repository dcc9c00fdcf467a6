"""The serving benchmark's client, record and figure, without an engine: a mock OpenAI-compatible server (what
vLLM exposes) with Prometheus counters, a mock of llama-server's streamed /completion and /metrics, the
binary's checksum gate, and a synthetic record drawn by the Fig. 14a function."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvprobe.backends.client import (LlamaServerTarget, OpenAITarget, llamacpp_cache_counters,
                                     prometheus_cache_counters, run_cell)
from kvprobe.errors import KVProbeError

METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {h}
vllm:num_requests_running{{engine="0",model_name="m"}} 0.0
"""


@pytest.fixture
def mock_vllm():
    """Streams 3 tokens per completion; counts as cached every prompt token it saw in the previous request's
    prompt prefix (a toy prefix cache), and exports the counters vLLM exports."""
    counters = {"h": 0.0, "q": 0.0, "last": []}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            return None

        def do_GET(self):  # noqa: N802
            with lock:
                body = METRICS.format(q=counters["q"], h=counters["h"]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and req["stream"] and req["model"] == "m"
            prompt = req["prompt"]
            with lock:
                shared = 0
                for a, b in zip(counters["last"], prompt):
                    if a != b:
                        break
                    shared += 1
                counters["h"] += shared
                counters["q"] += len(prompt)
                counters["last"] = prompt
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(req["max_tokens"]):
                self.wfile.write(b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\n\n")
                self.wfile.flush()
            usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": req["max_tokens"]}}
            self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", counters
    server.shutdown()
    server.server_close()


def test_prometheus_counters_are_read_by_name_not_guessed():
    assert prometheus_cache_counters(METRICS.format(q=100.0, h=75.0)) == (75.0, 100.0)
    older = "vllm:gpu_prefix_cache_queries_total 10\nvllm:gpu_prefix_cache_hits_total 4\n"
    assert prometheus_cache_counters(older) == (4.0, 10.0)
    assert prometheus_cache_counters("vllm:num_requests_running 0\n") is None  # no counters: no hit rate


def test_client_reads_the_hit_rate_from_the_servers_metrics(mock_vllm):
    url, counters = mock_vllm
    target = OpenAITarget(url, "m")
    base = list(range(100))
    target.send(base, 1)  # warm
    prompts = [base + [1000 + i] for i in range(4)]  # each shares the 100-token prefix with the one before
    cell = run_cell(target, prompts, None, 3, 60.0, seed=0)
    assert cell["sent"] == cell["done"] == 4 and cell["prompt_tokens"] == 4 * 101
    assert cell["hit_source"] == "server /metrics"
    assert cell["queried_tokens"] == 4 * 101 and cell["reused_tokens"] == 4 * 100
    assert cell["hit_rate"] == pytest.approx(400 / 404)
    assert cell["ttft_p50"] <= cell["ttft_p90"] and cell["tpot"] >= 0
    # a prompt that differs from the first token on gets no hit: the rate follows the server, not the client
    cold = run_cell(target, [[5000 + i] + base for i in range(2)], 100.0, 2, 60.0, seed=1)
    assert cold["hit_rate"] == 0.0


LLAMACPP_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {evaluated}
llamacpp:prompt_tokens_cached_total {cached}
llamacpp:tokens_predicted_total 9
llamacpp:requests_processing 0
"""


@pytest.fixture
def mock_llama_server():
    """llama-server's /completion stream (data: lines, a final stop message with timings) and /metrics; its
    cache: the prompt prefix shared with the previous request (what one slot with cache_prompt keeps)."""
    state = {"cached": 0, "evaluated": 0, "last": []}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            return None

        def do_GET(self):  # noqa: N802
            with lock:
                body = LLAMACPP_METRICS.format(**state).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/completion" and req["stream"] and req["cache_prompt"] is True
            prompt = req["prompt"]
            with lock:
                shared = 0
                for a, b in zip(state["last"], prompt):
                    if a != b:
                        break
                    shared += 1
                shared = min(shared, len(prompt) - 1)
                state["cached"] += shared
                state["evaluated"] += len(prompt) - shared
                state["last"] = prompt
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(req["n_predict"]):
                self.wfile.write(b"data: " + json.dumps({"content": f"t{i}", "stop": False}).encode() + b"\n\n")
                self.wfile.flush()
            final = {"content": "", "stop": True, "id_slot": 0,
                     "timings": {"cache_n": shared, "prompt_n": len(prompt) - shared}}
            self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_llamacpp_metrics_are_read_by_name():
    assert llamacpp_cache_counters(LLAMACPP_METRICS.format(evaluated=30, cached=70)) == (70.0, 100.0)
    assert llamacpp_cache_counters("llamacpp:requests_processing 0\n") is None


def test_llama_server_target_takes_the_servers_counts_per_response_and_from_metrics(mock_llama_server):
    target = LlamaServerTarget(mock_llama_server)
    base = list(range(100))
    target.send(base, 1)  # warm
    cell = run_cell(target, [base + [1000 + i] for i in range(3)], None, 2, 60.0, seed=0)
    assert cell["done"] == 3 and cell["hit_source"].startswith("llama-server timings")
    assert cell["reused_tokens"] + cell["evaluated_tokens"] == cell["prompt_tokens"] == 303
    assert cell["metrics"]["reused_tokens"] == cell["reused_tokens"]
    assert cell["metrics"]["queried_tokens"] == 303 and cell["slots_used"] == [0]


def test_llama_server_binary_is_refused_unless_its_checksum_is_listed(tmp_path, monkeypatch):
    import hashlib

    from kvprobe.backends.llama_server import ENV_BINARY, locate_llama_server

    monkeypatch.delenv(ENV_BINARY, raising=False)
    with pytest.raises(KVProbeError, match="make llama-server"):
        locate_llama_server(tmp_path / "llama-server")
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"#!/bin/sh\n")
    binary.chmod(0o755)
    with pytest.raises(KVProbeError, match="no SHA256SUMS"):
        locate_llama_server(binary)
    (tmp_path / "SHA256SUMS").write_text("0" * 64 + "  llama-server\n")
    with pytest.raises(KVProbeError, match="changed"):
        locate_llama_server(binary)
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    (tmp_path / "SHA256SUMS").write_text(f"{digest}  llama-server\n")
    monkeypatch.setenv(ENV_BINARY, str(binary))
    assert locate_llama_server().sha256 == digest


def test_client_refuses_anything_but_loopback():
    with pytest.raises(KVProbeError, match="loopback"):
        OpenAITarget("http://10.0.0.5:8000", "m")
    with pytest.raises(KVProbeError, match="loopback"):
        OpenAITarget("http://example.com", "m")


def _record(model="smollm2-135m"):
    cells = []
    for arm, ttft, hit in (("erratum", 0.5, 0.97), ("in_prefix_edit", 9.0, 0.01)):
        for k, rate in enumerate([0.05, 0.1, None]):
            cells.append({"arm": arm, "rate": rate, "sent": 3, "done": 3, "ttft_p50": ttft * (k + 1),
                          "ttft_p90": ttft * (k + 1.5), "tpot": 0.05, "throughput_rps": 0.1 / ttft,
                          "prompt_tokens": 3000, "reused_tokens": hit * 3000, "hit_rate": hit,
                          "hit_source": "engine per-request counters"})
    return {"benchmark": "serve", "model": model, "engine": "llama.cpp (test)",
            "sizes": [{"prefix_tokens": 1000, "requests_per_cell": 3, "prompt_tokens": {}, "cells": cells}]}


def test_fig14a_renders_from_the_committed_bench_record(tmp_path):
    from kvprobe.figures import BENCH, render_all
    from kvprobe.runner.records import atomic_write_json

    assert BENCH["fig14a_serve"][0] == "serve"
    atomic_write_json(tmp_path / "bench" / "serve_smollm2-135m.json", _record())
    atomic_write_json(tmp_path / "bench" / "ttft_smollm2-135m.json", {"benchmark": "ttft"})  # not a serve record
    paths = render_all(tmp_path, tmp_path / "figs")
    assert [p.name for p in paths if p.name.startswith("fig14a")] == ["fig14a_serve.png"]
    assert paths[0].stat().st_size > 20_000


def test_bench_output_writes_text_and_record_side_by_side(tmp_path, capsys):
    from kvprobe.runner.bench import BenchOutput

    out = BenchOutput("serve", "smollm2-135m")
    out.print("a line")
    js, txt = out.write({"sizes": [], "x": float("nan")}, tmp_path)
    rec = json.loads(js.read_text())
    assert rec["benchmark"] == "serve" and rec["x"] is None and "commit" in rec["git"]
    lines = txt.read_text().splitlines()
    assert lines[0].startswith("# python ") and lines[1:] == ["a line"]
    assert not list(tmp_path.glob("*.tmp"))
    assert "a line" in capsys.readouterr().out
