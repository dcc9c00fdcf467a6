"""A real HTTP server in front of the llama.cpp engine, with a prefix cache, for the serving benchmark.

``POST /generate`` with ``{"tokens": [...], "max_tokens": k}`` streams one line per generated token (greedy),
then a final JSON line with the request's counters. One engine serves every request in arrival order (a
llama.cpp context is single-threaded); the queueing delay is part of time to first token, as in a server.

Prefix cache: the engine's request sequence keeps the cells of the previous request (prompt + output). A new
request keeps the cells of the longest token prefix it shares with them (``seq_rm`` from there on) and decodes
the rest. The reused-token count is read from the engine's own counters: the prompt tokens the request asked
for minus the tokens llama.cpp evaluated for it (``llama_perf_context``: prompt-batch plus single-token evals).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from kvprobe.backends.llamacpp import LlamaCppEngine, common_prefix


class PrefixCachingEngine:
    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self.cached: list[int] = []
        self.lock = threading.Lock()
        # llama_perf_context reports max(1, count): make both counters real before differencing them
        engine.decode([0, 0], [0, 1], engine.HOLD)
        engine.decode([0], [2], engine.HOLD)
        engine.seq_rm(engine.HOLD)
        engine.seq_rm(engine.REQUEST)

    def _evaluated(self) -> int:
        p = self.engine.perf()
        return int(p["n_p_eval"] + p["n_eval"])

    def generate(self, prompt: list[int], max_tokens: int, emit) -> dict[str, Any]:
        eng = self.engine
        with self.lock:
            before = self._evaluated()
            cut = min(common_prefix(self.cached, prompt), len(prompt) - 1)
            eng.seq_rm(eng.REQUEST, cut, -1)
            logits = eng.decode(prompt[cut:], range(cut, len(prompt)))
            evaluated = self._evaluated() - before
            out: list[int] = []
            for i in range(max_tokens):
                tok = int(np.argmax(logits))
                out.append(tok)
                emit(tok)
                if i + 1 < max_tokens:
                    logits = eng.decode([tok], [len(prompt) + i])
            self.cached = prompt + out[:-1]  # the last token was emitted, not decoded
            return {"prompt_tokens": len(prompt), "engine_evaluated_prompt_tokens": evaluated,
                    "engine_reused_tokens": len(prompt) - evaluated, "generated": len(out)}


def make_server(engine: PrefixCachingEngine, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            return None

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                self.send_error(404, "POST /generate")
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")  # one request per connection: the client may stop reading
            self.close_connection = True  # at the final line, so never read a next request from it
            self.end_headers()

            def write(line: str) -> None:
                data = (line + "\n").encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            stats = engine.generate([int(t) for t in body["tokens"]], int(body.get("max_tokens", 8)),
                                    lambda tok: write(json.dumps({"token": tok})))
            write(json.dumps({"done": True, **stats}))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return ThreadingHTTPServer((host, port), Handler)
