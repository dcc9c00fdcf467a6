"""A real engine: the paper's cache operations on llama.cpp's own KV cache (llama-cpp-python's low-level API).

Every operation works on the engine's cache cells through ``llama_memory_seq_rm / seq_cp / seq_add`` and
batches with explicit positions; nothing is re-tokenised (callers pass token ids, normally from the HF
tokenizer of the same GGUF, so the engine and kvprobe's HF oracle see identical ids):

- ``in_place``: remove the field's cells, decode the new field tokens at the same positions (they attend to
  the cells before them; llama.cpp masks by position), keep the stale suffix;
- ``erratum``: keep the cached prefix the erratum prompt shares, decode the rest after it;
- ``field_erratum``: ``in_place``, then ``erratum``;
- ``transplant``: a chunk precompiled once in its own sequence at 0..L-1 is shifted (``seq_add``: llama.cpp
  re-rotates the keys itself), copied into the request's sequence (``seq_cp``), and its first token is
  recomputed with the real context (one seam-repair token);
- ``full_reprefill``: a clean prefill of the whole prompt.

Each returns the next-token logits after the prompt and how many tokens it decoded. The KV cache is kept in
fp32 so the comparison with the fp32 HF oracle measures the operations and the quantised matmuls, not a
half-precision cache.

Batch sizes change the numbers. llama.cpp's CPU matmuls take another kernel path at 64 tokens per batch and
above: the same tokens decoded in batches of 64 or more give other logits than in batches below 64 (which all
equal token-by-token decoding), by up to ~0.9 nats on a 320-token prompt of the Q4_1 model. ``batch_tokens``
(default ``n_batch``) sets the tokens per ``llama_decode`` call; a comparison between two cache states is only
clean when both were built with batches on the same side of that switch (``kvprobe.kv.engine_oracle`` uses 32).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvprobe.errors import KVProbeError

try:
    import llama_cpp as _llama
except ImportError:  # the engine is an optional extra
    _llama = None

GGML_TYPE_F32 = 0


def available() -> bool:
    return _llama is not None


@dataclass(frozen=True)
class EngineResult:
    logits: np.ndarray  # [vocab] float32, after the last prompt token
    decoded_tokens: int  # tokens this operation ran through the model (the readout suffix included)
    total_tokens: int  # tokens of the prompt the logits answer


class LlamaCppEngine:
    """One llama.cpp model and context with a unified KV cache shared by ``n_seq`` sequences."""

    REQUEST = 0  # the sequence a request's cache lives in
    HOLD = 1  # parks a request's stale suffix cells while its field is re-decoded (see ``refresh``)
    CHUNKS = 2  # first sequence for precompiled chunks

    def __init__(self, gguf: str | Path, n_ctx: int = 4096, n_seq: int = 4, n_batch: int = 512, n_threads: int = 2,
                 f32_cache: bool = True, batch_tokens: int | None = None) -> None:
        if _llama is None:
            raise KVProbeError("llama-cpp-python is not installed: `pip install kvprobe[engine]` (see the Makefile)")
        _llama.llama_backend_init()
        _llama.llama_log_set(_SILENT, ctypes.c_void_p(0))
        mparams = _llama.llama_model_default_params()
        self.model = _llama.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise KVProbeError(f"llama.cpp could not load {gguf}")
        cparams = _llama.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.kv_unified = True  # one cell pool: seq_cp shares cells between sequences instead of copying streams
        cparams.no_perf = False
        if f32_cache:
            cparams.type_k = cparams.type_v = GGML_TYPE_F32
        self.ctx = _llama.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise KVProbeError("llama.cpp could not create a context")
        self.mem = _llama.llama_get_memory(self.ctx)
        self.n_vocab = _llama.llama_vocab_n_tokens(_llama.llama_model_get_vocab(self.model))
        self.n_batch, self.n_ctx, self.n_seq = n_batch, n_ctx, n_seq
        self.batch_tokens = n_batch
        self.set_batch_tokens(batch_tokens or n_batch)
        self._batch = _llama.llama_batch_init(n_batch, 0, n_seq)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            _llama.llama_batch_free(self._batch)
            _llama.llama_free(self.ctx)
            _llama.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self) -> "LlamaCppEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_batch_tokens(self, n: int) -> None:
        """Tokens per ``llama_decode`` call from now on (1..n_batch): which side of the kernel switch at 64
        tokens per batch every later decode takes (see the module docstring)."""
        if not 1 <= n <= self.n_batch:
            raise KVProbeError(f"batch_tokens must lie in [1, n_batch={self.n_batch}]; got {n}")
        self.batch_tokens = int(n)

    # -- primitives -------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], positions: Sequence[int], seq: int = REQUEST) -> np.ndarray:
        """Decode tokens at explicit positions into ``seq``; returns the logits after the last one."""
        if len(ids) != len(positions) or not ids:
            raise KVProbeError(f"{len(ids)} tokens for {len(positions)} positions")
        b = self._batch
        step = self.batch_tokens
        for lo in range(0, len(ids), step):
            part = range(lo, min(lo + step, len(ids)))
            b.n_tokens = len(part)
            for j, i in enumerate(part):
                b.token[j], b.pos[j], b.n_seq_id[j] = int(ids[i]), int(positions[i]), 1
                b.seq_id[j][0] = seq
                b.logits[j] = i == len(ids) - 1
            rc = _llama.llama_decode(self.ctx, b)
            if rc != 0:
                raise KVProbeError(f"llama_decode returned {rc} (cache full? n_ctx={self.n_ctx})")
        ptr = _llama.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if not _llama.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise KVProbeError(f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence {seq}")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        _llama.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        _llama.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def seq_pos_max(self, seq: int) -> int:
        return int(_llama.llama_memory_seq_pos_max(self.mem, seq))

    def clear(self) -> None:
        _llama.llama_memory_clear(self.mem, True)

    def perf(self) -> dict[str, float]:
        """The engine's own counters: prompt tokens evaluated (``n_p_eval``), single tokens evaluated
        (``n_eval``), how many times a compute graph was reused (``n_graph_reused``: llama.h's ``n_reused``,
        which counts graphs, not tokens or cache cells) and the prompt-eval time."""
        d = _llama.llama_perf_context(self.ctx)
        return {"n_p_eval": d.n_p_eval, "n_eval": d.n_eval, "n_graph_reused": d.n_reused, "t_p_eval_ms": d.t_p_eval_ms}

    # -- the paper's operations -----------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], seq: int = REQUEST, start: int = 0) -> np.ndarray:
        """A clean prefill of ``ids`` at ``start..`` in ``seq`` (its old cells removed first)."""
        self.seq_rm(seq)
        return self.decode(ids, range(start, start + len(ids)), seq)

    def full_reprefill(self, prompt: Sequence[int]) -> EngineResult:
        logits = self.prefill(prompt)
        return EngineResult(logits, len(prompt), len(prompt))

    def cache_context(self, context: Sequence[int]) -> None:
        """The stale cache a request starts from: ``context`` prefilled in the request sequence."""
        self.prefill(context)

    def read(self, suffix: Sequence[int], start: int) -> np.ndarray:
        """The logits after ``suffix`` decoded over the request's first ``start`` cached positions; the cache is
        left as it was."""
        return self._readout(suffix, start)

    def _readout(self, suffix: Sequence[int], start: int) -> np.ndarray:
        """Decode the query suffix after ``start`` cached positions, then drop it (the cache stays as before)."""
        self.seq_rm(self.REQUEST, start, -1)
        logits = self.decode(suffix, range(start, start + len(suffix)))
        self.seq_rm(self.REQUEST, start, -1)
        return logits

    def refresh(self, new_context: Sequence[int], f0: int, f1: int) -> None:
        """Replace the request's cells at positions [f0, f1) by ``new_context[f0:f1]`` decoded at those
        positions over the cells before f0; the stale suffix cells are kept, not recomputed. llama.cpp accepts
        a batch only right after a sequence's last position, so the suffix cells are parked in a holding
        sequence (``seq_cp`` shares cells, it copies no data), the request is cut back to f0, the field decoded,
        and the parked cells handed back."""
        n = self.seq_pos_max(self.REQUEST) + 1
        self.seq_rm(self.HOLD)
        self.seq_cp(self.REQUEST, self.HOLD, f1, n)
        self.seq_rm(self.REQUEST, f0, -1)
        self.decode(list(new_context[f0:f1]), range(f0, f1))
        self.seq_cp(self.HOLD, self.REQUEST, f1, n)
        self.seq_rm(self.HOLD)

    def in_place(self, new_context: Sequence[int], field_slots: Sequence[int], suffix: Sequence[int]) -> EngineResult:
        """Over the cached stale context: the field's cells replaced by the new value's, same positions."""
        n = self.seq_pos_max(self.REQUEST) + 1
        if n != len(new_context):
            raise KVProbeError(f"the cache holds {n} positions; the new context has {len(new_context)} tokens")
        f0, f1 = min(field_slots), max(field_slots) + 1
        self.refresh(new_context, f0, f1)
        return EngineResult(self._readout(suffix, n), (f1 - f0) + len(suffix), n + len(suffix))

    def append(self, cached: Sequence[int], prompt: Sequence[int]) -> EngineResult:
        """Reuse the cached cells of the longest prefix ``cached`` shares with ``prompt``; decode the rest.
        The cache then holds ``prompt`` (the erratum is part of the conversation from now on)."""
        cut = common_prefix(cached, prompt)
        if cut == len(prompt):
            cut -= 1  # the last token must be decoded to read logits
        self.seq_rm(self.REQUEST, cut, -1)
        logits = self.decode(list(prompt[cut:]), range(cut, len(prompt)))
        return EngineResult(logits, len(prompt) - cut, len(prompt))

    def erratum(self, stale_context: Sequence[int], erratum_prompt: Sequence[int]) -> EngineResult:
        return self.append(stale_context, erratum_prompt)

    def field_erratum(self, new_context: Sequence[int], field_slots: Sequence[int],
                      erratum_prompt: Sequence[int]) -> EngineResult:
        f0, f1 = min(field_slots), max(field_slots) + 1
        self.refresh(new_context, f0, f1)
        res = self.append(new_context, erratum_prompt)
        return EngineResult(res.logits, res.decoded_tokens + (f1 - f0), res.total_tokens)

    def precompile(self, chunk: Sequence[int], slot: int = 0) -> int:
        """Prefill a chunk alone at positions 0..L-1 in its own sequence; returns that sequence id."""
        seq = self.CHUNKS + slot
        if seq >= self.n_seq:
            raise KVProbeError(f"chunk slot {slot} needs sequence {seq}; the context has {self.n_seq} sequences")
        self.prefill(chunk, seq)
        return seq

    def transplant(self, head: Sequence[int], chunk_seq: int, chunk_len: int, chunk_first: int,
                   tail: Sequence[int], seam: int = 1) -> EngineResult:
        """head + the precompiled chunk moved to follow it + tail, read after the tail. The chunk sequence is
        shifted to the target offset, its cells copied (shared) into the request, and shifted back after."""
        h = len(head)
        if seam not in (0, 1):
            raise KVProbeError("the engine transplant repairs 0 or 1 seam tokens")
        self.seq_rm(self.REQUEST)
        decoded = 0
        if h:
            self.decode(head, range(h))
            decoded += h
        if seam:  # the chunk's first token recomputed with the real context, right after the head
            self.decode([chunk_first], [h])
            decoded += 1
        self.seq_add(chunk_seq, 0, chunk_len, h)  # llama.cpp re-rotates the keys (its K-shift) on the next decode
        self.seq_cp(chunk_seq, self.REQUEST, h + seam, h + chunk_len)
        logits = self.decode(tail, range(h + chunk_len, h + chunk_len + len(tail)))
        decoded += len(tail)
        # Shared cells have one position: release the request's view before the chunk moves back to 0..L-1.
        self.seq_rm(self.REQUEST)
        self.seq_add(chunk_seq, h, h + chunk_len, -h)
        return EngineResult(logits, decoded, h + chunk_len + len(tail))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if _llama is not None:
    @_llama.llama_log_callback
    def _SILENT(level, text, user_data):  # noqa: N802 - llama.cpp logs to stderr by default
        return None
else:
    _SILENT = None
