"""The packed control record of one block: identity (40 B) + policy (16 B) + mechanism (8 B) = 64 B.

The seed's object model splits a KV block's metadata in three by lifetime:

- identity is fixed at creation and is the block's name: it travels with the payload to every tier;
- policy (tenant, QoS class, priority, reuse score, recency, residency intent) changes on scheduler events
  and is rewritten in place, 16 bytes, without reading or writing a payload byte;
- mechanism (residency, format, transfer state, validity, pinned / in-flight) describes one copy in one tier
  and is regenerated whenever a copy is made, never carried across.

Each tier keeps one 64-byte record per copy it holds (``struct`` layouts below, little-endian, no padding).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import torch

# seq_id, prefix_hash, parent (0 = none), pos_start, pos_stop, layer_start, layer_stop, head_start, head_stop,
# then 2 reserved bytes (record version) so the identity is 40 B and policy starts 8-aligned.
IDENTITY = struct.Struct("<QQQIIHHBBH")
# tenant, qos, priority, residency intent, reserved, reuse score, recency (logical clock)
POLICY = struct.Struct("<IBBBBfI")
# residency (tier), format (dtype code), transfer state, flags, epoch of this copy
MECHANISM = struct.Struct("<BBBBI")
RECORD_SIZE = IDENTITY.size + POLICY.size + MECHANISM.size
POLICY_OFFSET = IDENTITY.size
MECHANISM_OFFSET = IDENTITY.size + POLICY.size
RECORD_VERSION = 1

assert (IDENTITY.size, POLICY.size, MECHANISM.size, RECORD_SIZE) == (40, 16, 8, 64)


def hash64(*parts: bytes | str | int) -> int:
    """A stable, nonzero 64-bit hash (0 is reserved for 'no parent')."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        b = p.encode() if isinstance(p, str) else int(p).to_bytes(8, "little", signed=True) if isinstance(p, int) else p
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little") or 1


def tokens_hash(token_ids: list[int] | tuple[int, ...], *context: str) -> int:
    """64-bit hash of a token sequence under a context (model fingerprint, tokenizer hash)."""
    return hash64(*context, b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))


@dataclass(frozen=True)
class Identity:
    """Immutable: which K/V these are. ``block_id`` is a hash of exactly these fields."""

    seq_id: int  # the sequence (or chunk) the block belongs to: hash of its tokens, model and tokenizer
    pos_start: int  # position range [pos_start, pos_stop) the keys were rotated at
    pos_stop: int
    layer_start: int  # layer range [layer_start, layer_stop)
    layer_stop: int
    head_start: int = 0  # KV-head group [head_start, head_stop)
    head_stop: int = 0
    prefix_hash: int = 0  # hash of every token the block's K/V attended to before its own (0 = none)
    parent: int = 0  # block id this one was derived from (refresh, re-rotation); 0 = none

    def pack(self) -> bytes:
        return IDENTITY.pack(self.seq_id, self.prefix_hash, self.parent, self.pos_start, self.pos_stop,
                             self.layer_start, self.layer_stop, self.head_start, self.head_stop, RECORD_VERSION)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Identity":
        seq, prefix, parent, p0, p1, l0, l1, h0, h1, version = IDENTITY.unpack(bytes(raw[:IDENTITY.size]))
        if version != RECORD_VERSION:
            raise ValueError(f"control record version {version}; this code reads version {RECORD_VERSION}")
        return cls(seq, p0, p1, l0, l1, h0, h1, prefix, parent)

    @property
    def block_id(self) -> int:
        return hash64(b"block", self.pack())


class QoS(IntEnum):
    BATCH = 0
    STANDARD = 1
    INTERACTIVE = 2


class Intent(IntEnum):
    """Scheduler-supplied residency intent."""

    NONE = 0
    KEEP_HOT = 1
    MAY_DEMOTE = 2
    PREFETCH = 3


@dataclass(frozen=True)
class Policy:
    tenant: int = 0
    qos: QoS = QoS.STANDARD
    priority: int = 0
    intent: Intent = Intent.NONE
    reuse_score: float = 0.0
    recency: int = 0  # logical clock of the last use

    def pack(self) -> bytes:
        return POLICY.pack(self.tenant, int(self.qos), self.priority, int(self.intent), 0, self.reuse_score,
                           self.recency)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Policy":
        tenant, qos, priority, intent, _, reuse, recency = POLICY.unpack(bytes(raw))
        return cls(tenant, QoS(qos), priority, Intent(intent), reuse, recency)


class Tier(IntEnum):
    NONE = 0
    RAM = 1
    DISK = 2


class Transfer(IntEnum):
    IDLE = 0
    INBOUND = 1  # being written into this tier
    OUTBOUND = 2  # being read out of this tier


class Flags(IntFlag):
    VALID = 1
    PINNED = 2
    IN_FLIGHT = 4


FORMATS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
FORMAT_DTYPES = {v: k for k, v in FORMATS.items()}


@dataclass(frozen=True)
class Mechanism:
    """Local to one copy in one tier; built fresh by the tier that receives a copy."""

    residency: Tier
    format: int  # dtype code (FORMATS)
    transfer: Transfer = Transfer.IDLE
    flags: Flags = Flags.VALID
    epoch: int = 0  # which copy this is, per tier (a new copy gets a new epoch)

    def pack(self) -> bytes:
        return MECHANISM.pack(int(self.residency), self.format, int(self.transfer), int(self.flags), self.epoch)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Mechanism":
        res, fmt, transfer, flags, epoch = MECHANISM.unpack(bytes(raw))
        return cls(Tier(res), fmt, Transfer(transfer), Flags(flags), epoch)
