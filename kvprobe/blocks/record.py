"""The packed control record of one block: identity (40 B) + policy (16 B) + mechanism (8 B) = 64 B.

The seed's object model splits a KV block's metadata in three by lifetime:

- identity is fixed at creation and is the block's name: it travels with the payload to every tier;
- policy (tenant, QoS class, priority, reuse score, recency, residency intent) changes on scheduler events
  and is rewritten in place, 16 bytes, without reading or writing a payload byte;
- mechanism (residency, format, transfer state, validity, pinned / in-flight) describes one copy in one tier
  and is regenerated whenever a copy is made, never carried across.

Each tier keeps one 64-byte record per copy it holds (``struct`` layouts below, little-endian, no padding).
The policy's one spare byte holds a CRC-8 over identity and policy (``seal``), so a record with a flipped
identity or policy byte is detected when a disk tier is reopened instead of being read as another block or
another priority. Identity and policy are validated when constructed: a value the record cannot hold is refused
before anything is written.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import torch

from kvprobe.errors import KVProbeError

# seq_id, prefix_hash, parent (0 = none), pos_start, pos_stop, layer_start, layer_stop, head_start, head_stop,
# then 2 bytes of record version so the identity is 40 B and policy starts 8-aligned.
IDENTITY = struct.Struct("<QQQIIHHBBH")
# tenant, qos, priority, residency intent, check (CRC-8 of identity + policy), reuse score, recency (logical clock)
POLICY = struct.Struct("<IBBBBfI")
# residency (tier), format (dtype code), transfer state, flags, epoch of this copy
MECHANISM = struct.Struct("<BBBBI")
RECORD_SIZE = IDENTITY.size + POLICY.size + MECHANISM.size
POLICY_OFFSET = IDENTITY.size
MECHANISM_OFFSET = IDENTITY.size + POLICY.size
CHECK_OFFSET = POLICY_OFFSET + 7  # the check byte inside the record
RECORD_VERSION = 2  # 2: the policy's spare byte became the record check

assert (IDENTITY.size, POLICY.size, MECHANISM.size, RECORD_SIZE) == (40, 16, 8, 64)


_F32 = struct.Struct("<f")


def _crc8_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
        table.append(crc)
    return tuple(table)


_CRC8 = _crc8_table()


def crc8(data: bytes, crc: int = 0) -> int:
    """CRC-8 (polynomial 0x07), continued from ``crc``: detects every error confined to 8 consecutive bits, so
    any one bad byte."""
    for byte in data:
        crc = _CRC8[crc ^ byte]
    return crc


@functools.lru_cache(maxsize=1 << 16)
def _identity_crc(identity: bytes) -> int:  # a block's identity never changes: hash it once per block
    return crc8(identity)


def record_check(identity_and_policy: bytes) -> int:
    """The check byte of a record's first 56 bytes (identity + policy), the check byte itself read as 0."""
    policy = bytearray(identity_and_policy[POLICY_OFFSET:MECHANISM_OFFSET])
    policy[CHECK_OFFSET - POLICY_OFFSET] = 0
    return crc8(bytes(policy), _identity_crc(bytes(identity_and_policy[:POLICY_OFFSET])))


def seal(identity: bytes, policy: bytes) -> bytes:
    """The 16 policy bytes with the check byte set for this identity."""
    out = bytearray(policy)
    out[CHECK_OFFSET - POLICY_OFFSET] = record_check(identity + policy)
    return bytes(out)


def pack_record(ident: "Identity", policy: "Policy", mech: "Mechanism") -> bytes:
    """The full 64-byte record, sealed."""
    raw = ident.pack()
    return raw + seal(raw, policy.pack()) + mech.pack()


def record_problem(raw: bytes) -> str | None:
    """Why a 64-byte record cannot be trusted (bad check, version or field value), or None if it decodes."""
    if len(raw) != RECORD_SIZE:
        return f"record of {len(raw)} B, expected {RECORD_SIZE}"
    if raw[CHECK_OFFSET] != record_check(raw):
        return f"check byte {raw[CHECK_OFFSET]:#04x} != {record_check(raw):#04x} (identity or policy bytes changed)"
    try:
        Identity.unpack(raw)
        Policy.unpack(raw[POLICY_OFFSET:MECHANISM_OFFSET])
        Mechanism.unpack(raw[MECHANISM_OFFSET:])
    except (ValueError, struct.error) as e:
        return str(e)
    return None


class RecordError(KVProbeError, ValueError):
    """A value that the 64-byte record cannot hold, or a record whose bytes do not decode."""


def _fit(obj: object, name: str, lo: int, hi: int) -> int:
    """Check that field ``name`` of a frozen dataclass is an integer in [lo, hi]; store it as a plain int."""
    value = getattr(obj, name)
    if type(value) is int and lo <= value <= hi:  # the common case, kept cheap: policy updates run this
        return value
    try:
        as_int = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        as_int = None
    if as_int is None or not lo <= as_int <= hi:
        raise RecordError(f"{type(obj).__name__}.{name}={value!r} does not fit its record field: use an integer "
                          f"in [{lo}, {hi}]")
    object.__setattr__(obj, name, as_int)
    return as_int


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

    def __post_init__(self) -> None:
        u64, u32, u16, u8 = 2**64 - 1, 2**32 - 1, 2**16 - 1, 2**8 - 1
        for name, hi in (("seq_id", u64), ("prefix_hash", u64), ("parent", u64), ("pos_start", u32),
                         ("pos_stop", u32), ("layer_start", u16), ("layer_stop", u16), ("head_start", u8),
                         ("head_stop", u8)):
            _fit(self, name, 0, hi)
        for lo, hi in (("pos_start", "pos_stop"), ("layer_start", "layer_stop"), ("head_start", "head_stop")):
            if getattr(self, lo) > getattr(self, hi):
                raise RecordError(f"Identity.{lo}={getattr(self, lo)} > {hi}={getattr(self, hi)}: a range is "
                                 f"[start, stop) with start <= stop")

    def pack(self) -> bytes:
        return IDENTITY.pack(self.seq_id, self.prefix_hash, self.parent, self.pos_start, self.pos_stop,
                             self.layer_start, self.layer_stop, self.head_start, self.head_stop, RECORD_VERSION)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Identity":
        seq, prefix, parent, p0, p1, l0, l1, h0, h1, version = IDENTITY.unpack(bytes(raw[:IDENTITY.size]))
        if version != RECORD_VERSION:
            raise RecordError(f"control record version {version}; this code reads version {RECORD_VERSION}")
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

    def __post_init__(self) -> None:
        # Validated here, so a refused value never reaches a record (a half-written policy would tear it).
        _fit(self, "tenant", 0, 2**32 - 1)
        _fit(self, "priority", 0, 255)
        _fit(self, "recency", 0, 2**32 - 1)
        for name, enum in (("qos", QoS), ("intent", Intent)):
            value = getattr(self, name)
            if type(value) is not enum:
                value = _fit(self, name, 0, 255)
                if value not in enum._value2member_map_:
                    raise RecordError(f"Policy.{name}={value!r}: use one of {[f'{m.name}={int(m)}' for m in enum]}")
                object.__setattr__(self, name, enum(value))
        reuse = self.reuse_score
        if isinstance(reuse, bool) or not isinstance(reuse, (int, float)) or not math.isfinite(reuse) \
                or abs(reuse) > 3.4e38:
            raise RecordError(f"Policy.reuse_score={reuse!r}: use a finite float within float32 range")
        # stored as the float32 the record holds, so a policy equals itself read back
        object.__setattr__(self, "reuse_score", _F32.unpack(_F32.pack(reuse))[0])

    def pack(self) -> bytes:
        """The 16 policy bytes with the check byte 0 (``seal`` sets it for an identity)."""
        return POLICY.pack(self.tenant, int(self.qos), self.priority, int(self.intent), 0, self.reuse_score,
                           self.recency)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Policy":
        tenant, qos, priority, intent, _check, reuse, recency = POLICY.unpack(bytes(raw))
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

    def __post_init__(self) -> None:
        _fit(self, "format", 0, 255)
        _fit(self, "epoch", 0, 2**32 - 1)

    def pack(self) -> bytes:
        return MECHANISM.pack(int(self.residency), self.format, int(self.transfer), int(self.flags), self.epoch)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Mechanism":
        res, fmt, transfer, flags, epoch = MECHANISM.unpack(bytes(raw))
        if flags & ~int(Flags.VALID | Flags.PINNED | Flags.IN_FLIGHT):
            raise RecordError(f"mechanism flags {flags:#04x} have unknown bits")
        return cls(Tier(res), fmt, Transfer(transfer), Flags(flags), epoch)
