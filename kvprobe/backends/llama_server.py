"""llama.cpp's own HTTP server (``llama-server``) as a separate process: what the serving benchmark loads.

The server keeps its own slots (``-np``), each with its own KV cache, reuses a request's cached prompt prefix
when the request asks for it (``"cache_prompt": true``), can reuse further matching chunks by shifting their
cells (``--cache-reuse N``), keeps idle slots' prompts in a host-memory prompt cache (``--cache-ram``), and counts
what it did: each response's ``timings.cache_n`` (prompt tokens taken from the cache) and ``timings.prompt_n``
(prompt tokens evaluated), and Prometheus counters on ``/metrics`` (``llamacpp:prompt_tokens_cached_total``,
``llamacpp:prompt_tokens_total``). kvprobe only reads those numbers.

The binary is found at ``$KVPROBE_LLAMA_SERVER`` or ``../shared/bin/llama-server`` (relative to the repository
root), and is used only if a ``SHA256SUMS`` file beside it names it with the digest it has. ``make
llama-server`` builds one from the llama.cpp source vendored in the llama-cpp-python sdist (the same source as
the engine extra) and writes its ``SHA256SUMS``. The server binds 127.0.0.1 only and is stopped when the
:class:`LlamaServer` context exits (normally, on an error or on Ctrl-C); on Linux it is also asked to die with
its parent (``PR_SET_PDEATHSIG``), so a killed benchmark leaves no server behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprobe.errors import KVProbeError

ENV_BINARY = "KVPROBE_LLAMA_SERVER"
DEFAULT_BINARY = Path("..") / "shared" / "bin" / "llama-server"  # relative to the repository root
HOST = "127.0.0.1"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    sha256: str  # checked against the SHA256SUMS beside the binary


def locate_llama_server(path: str | Path | None = None) -> ServerBinary:
    """The ``llama-server`` binary: ``path``, else ``$KVPROBE_LLAMA_SERVER``, else ``../shared/bin/llama-server``
    from the repository root; refused unless the ``SHA256SUMS`` beside it lists it with its actual digest."""
    given = path or os.environ.get(ENV_BINARY)
    binary = Path(given) if given else repo_root() / DEFAULT_BINARY
    how = "--server-bin" if path else (ENV_BINARY if given else f"the default {DEFAULT_BINARY}")
    if not binary.is_file():
        raise KVProbeError(
            f"llama-server not found at {binary} ({how}). Build it with `make llama-server` (llama.cpp from the "
            f"llama-cpp-python sdist, ~8 min on 2 cores; it prints where the binary lands), then pass "
            f"--server-bin PATH or set {ENV_BINARY}=PATH; or run the labelled in-process baseline with "
            "--server kvprobe-inprocess")
    sums = binary.parent / "SHA256SUMS"
    if not sums.is_file():
        raise KVProbeError(f"no SHA256SUMS beside {binary}: the binary cannot be checked; `make llama-server` "
                           f"writes one, or add a line '<sha256>  {binary.name}'")
    listed = {}
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            listed[parts[1].lstrip("*")] = parts[0].lower()
    if binary.name not in listed:
        raise KVProbeError(f"{sums} does not list {binary.name}")
    digest = _sha256(binary)
    if digest != listed[binary.name]:
        raise KVProbeError(f"{binary} has sha256 {digest}, but {sums} lists {listed[binary.name]}: the binary "
                           "changed; rebuild it (`make llama-server`) or restore it")
    if not os.access(binary, os.X_OK):
        raise KVProbeError(f"{binary} is not executable: chmod +x it")
    return ServerBinary(binary, digest)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class LlamaServer:
    """A ``llama-server`` process on 127.0.0.1 serving one GGUF; a context manager that always stops it."""

    binary: ServerBinary
    gguf: Path
    n_parallel: int = 4  # slots: requests decoded together, each slot with its own cache
    ctx_per_slot: int = 4096
    threads: int = 1  # -t and -tb
    cache_reuse: int = 64  # --cache-reuse: min chunk reused by KV shifting after the common prefix
    cache_ram_mib: int = 2048  # --cache-ram: the host-memory prompt cache (idle slots' prompts)
    startup_s: float = 180.0
    port: int = 0
    argv: list[str] = field(default_factory=list)
    props: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        return [str(self.binary.path), "-m", str(self.gguf), "--host", HOST, "--port", str(self.port),
                "-np", str(self.n_parallel), "-c", str(self.n_parallel * self.ctx_per_slot),
                "-t", str(self.threads), "-tb", str(self.threads), "--metrics",
                "--cache-reuse", str(self.cache_reuse), "--cache-ram", str(self.cache_ram_mib)]

    def describe(self) -> dict[str, Any]:
        """What a record stores: the flags (binary and model by file name only), the binary's digest and the
        server's own build info."""
        argv = ["llama-server", *self.command()[1:]]
        argv[argv.index("-m") + 1] = self.gguf.name
        argv[argv.index("--port") + 1] = "PORT"
        return {"argv": argv, "binary_sha256": self.binary.sha256, "n_parallel": self.n_parallel,
                "ctx_per_slot": self.ctx_per_slot, "threads": self.threads, "cache_reuse": self.cache_reuse,
                "cache_ram_mib": self.cache_ram_mib, "build": self.props.get("build_info"),
                "total_slots": self.props.get("total_slots")}

    def start(self) -> "LlamaServer":
        self.port = self.port or _free_port()
        self._log = tempfile.TemporaryFile(mode="w+b")
        kw: dict[str, Any] = {"preexec_fn": _die_with_parent} if sys.platform.startswith("linux") else {}
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, **kw)
        t0 = time.monotonic()
        while True:
            if self._proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise KVProbeError(f"llama-server exited with code {self._proc.returncode} while starting:\n{tail}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = self.get("/health", timeout=5)
                if status == 200:
                    break
            if time.monotonic() - t0 > self.startup_s:
                tail = self.log_tail()
                self.stop()
                raise KVProbeError(f"llama-server was not ready after {self.startup_s:.0f} s:\n{tail}")
            time.sleep(0.25)
        status, body = self.get("/props", timeout=30)
        self.props = json.loads(body) if status == 200 else {}
        return self

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def log_tail(self, n: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - n))
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
