"""Stored KV blocks, following the KV block object model (payload / identity / policy / mechanism).

- payload: the K/V tensors of one token range on a set of layers; write-once. Re-rotating a block makes a
  NEW block whose identity names its parent; nothing rewrites a stored payload.
- identity (immutable, travels with the payload): block id (content hash), sequence/chunk id, position
  range, layers, KV-head group, prefix hash, model fingerprint, tokenizer hash, provenance (parent id).
- policy (mutable in place, no payload write): tags such as priority or reuse counters.
- mechanism (local to where the block sits): location, format, pinned; regenerated on load.

A library stores blocks as ``<id>.safetensors`` (payload) + ``<id>.json`` (identity and policy).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState


def token_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BlockIdentity:
    chunk_id: str  # content hash of the block's tokens
    model_fingerprint: str
    tokenizer_hash: str
    position_start: int
    position_stop: int
    layers: tuple[int, ...]
    kv_heads: tuple[int, int]  # [first, last) KV-head group held
    prefix_hash: str  # hash of the tokens the block attended to before it ("" = prefilled in isolation)
    parent: str | None = None  # the block this one was derived from (e.g. by re-rotation)

    @property
    def block_id(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Block:
    payload: KVState
    identity: BlockIdentity
    token_ids: tuple[int, ...]
    policy: dict[str, Any] = field(default_factory=dict)  # mutable without touching the payload
    mechanism: dict[str, Any] = field(default_factory=dict)  # local: location, format, pinned

    @property
    def block_id(self) -> str:
        return self.identity.block_id

    @classmethod
    def from_state(cls, state: KVState, token_ids: list[int], model_fingerprint: str, tokenizer_hash: str,
                   prefix_ids: list[int] | None = None, parent: str | None = None) -> "Block":
        pos = state.positions
        ident = BlockIdentity(token_hash(token_ids), model_fingerprint, tokenizer_hash, int(pos.min()),
                              int(pos.max()) + 1, tuple(range(state.n_layers)), (0, state.keys[0].shape[1]),
                              token_hash(prefix_ids) if prefix_ids else "", parent)
        return cls(state, ident, tuple(int(i) for i in token_ids), mechanism={"location": "memory", "format": str(
            state.keys[0].dtype).removeprefix("torch.")})

    def derive(self, payload: KVState) -> "Block":
        """A new block from a new payload (e.g. re-rotated); its identity names this block as parent."""
        pos = payload.positions
        ident = replace(self.identity, position_start=int(pos.min()), position_stop=int(pos.max()) + 1,
                        parent=self.block_id)
        return Block(payload, ident, self.token_ids, dict(self.policy), {"location": "memory",
                                                                          **{k: v for k, v in self.mechanism.items()
                                                                             if k == "format"}})


class BlockLibrary:
    """Precompiled blocks on disk, keyed by block id; writes are atomic and never overwrite a payload."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _paths(self, block_id: str) -> tuple[Path, Path]:
        return self.root / f"{block_id}.safetensors", self.root / f"{block_id}.json"

    def put(self, block: Block) -> str:
        tensors_path, meta_path = self._paths(block.block_id)
        if not tensors_path.exists():  # write-once: an existing payload with this identity is the same bytes
            tensors = {f"k{i}": k.contiguous().cpu() for i, k in enumerate(block.payload.keys)}
            tensors |= {f"v{i}": v.contiguous().cpu() for i, v in enumerate(block.payload.values)}
            tensors["positions"] = block.payload.positions.contiguous()
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp)
            os.replace(tmp, tensors_path)
        self.update_policy(block)
        return block.block_id

    def update_policy(self, block: Block) -> None:
        """Metadata only: identity + policy JSON; the payload file is not touched."""
        _, meta_path = self._paths(block.block_id)
        meta = {"identity": asdict(block.identity), "block_id": block.block_id, "token_ids": list(block.token_ids),
                "policy": block.policy}
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, meta_path)

    def get(self, block_id: str) -> Block:
        tensors_path, meta_path = self._paths(block_id)
        if not meta_path.exists():
            raise KVProbeError(f"no block {block_id} in {self.root}")
        meta = json.loads(meta_path.read_text())
        t = load_file(str(tensors_path))
        n = len([k for k in t if k.startswith("k")])
        state = KVState(tuple(t[f"k{i}"] for i in range(n)), tuple(t[f"v{i}"] for i in range(n)), t["positions"])
        ident = meta["identity"]
        ident = BlockIdentity(**{**ident, "layers": tuple(ident["layers"]), "kv_heads": tuple(ident["kv_heads"])})
        if ident.block_id != block_id:
            raise KVProbeError(f"block {block_id}: stored identity hashes to {ident.block_id}; the library is corrupt")
        return Block(state, ident, tuple(meta["token_ids"]), meta["policy"],
                     {"location": str(tensors_path.name), "format": str(state.keys[0].dtype).removeprefix("torch.")})

    def find(self, token_ids: list[int], model_fingerprint: str, tokenizer_hash: str) -> Block | None:
        """A block of these tokens for this model and tokenizer, prefilled in isolation at position 0."""
        want = token_hash(token_ids)
        for meta_path in sorted(self.root.glob("*.json")):
            ident = json.loads(meta_path.read_text())["identity"]
            if (ident["chunk_id"], ident["model_fingerprint"], ident["tokenizer_hash"], ident["prefix_hash"],
                    ident["position_start"]) == (want, model_fingerprint, tokenizer_hash, "", 0):
                return self.get(meta_path.stem)
        return None


# tokenizer -> (vocabulary size, hash): every block lookup names the tokenizer, and hashing a 50k vocabulary
# took about a second per lookup (bench-ttft's store fetch); a changed vocabulary size recomputes it
_TOKENIZER_HASHES: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()


def tokenizer_hash(tokenizer: Any) -> str:
    if tokenizer is None:
        return "none"
    vocab = tokenizer.get_vocab()
    try:
        cached = _TOKENIZER_HASHES.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        cached = None
    if cached is not None and cached[0] == len(vocab):
        return cached[1]
    out = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    try:
        _TOKENIZER_HASHES[tokenizer] = (len(vocab), out)
    except TypeError:
        pass
    return out

