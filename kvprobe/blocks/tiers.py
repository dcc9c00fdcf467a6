"""Tiers: where copies of block payloads sit, each with its own table of 64-byte control records.

- ``RamTier``: payload tensors in process memory; control records in a ``bytearray``.
- ``DiskTier``: one safetensors file per payload, written once and read back through safetensors' memory
  map; control records in ``control.bin``, mirrored in memory and written through with one ``pwrite`` per
  change (a policy update is one 16-byte ``pwrite`` and never touches a payload file).

A tier never rewrites a payload it holds: ``write`` of an id it already has is an error.

Crash safety of the disk tier (what a process kill or a power loss can leave, and what reopening does):

- a payload is written to ``.incoming-*.tmp``, ``fsync``-ed, renamed over its final name and the directory
  ``fsync``-ed; only then is its record written (one ``pwrite`` of 64 B, which a kill cannot split: records
  never straddle a page) and ``control.bin`` ``fsync``-ed. A write that returned is durable;
- the payload file carries the block's identity, digest and policy in its metadata, so a payload file left
  without a record (a kill between the rename and the record) is adopted on reopen after its digest checks;
- a drop renames the payload to ``*.drop`` before clearing the record; reopening finishes a pending drop;
- reopening removes stale ``.incoming-*.tmp`` files and moves aside (``quarantine/``) every payload that is
  truncated, unparseable, or disagrees with its name or record, and clears every record whose check byte or
  fields do not decode; ``DiskTier.quarantined`` and ``DiskTier.repairs`` say what was done, and a warning is
  logged. Every other block opens;
- a policy update is not ``fsync``-ed (``sync()`` / ``close()`` do): after a power loss a block may carry its
  previous policy, never a torn one (the check byte catches a torn record, and the block is re-adopted from its
  payload file with the policy written there at demotion).

One process at a time: opening a disk tier takes an exclusive ``flock`` on ``<root>/.lock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from kvprobe.blocks.record import (FORMATS, IDENTITY, MECHANISM_OFFSET, POLICY, POLICY_OFFSET, RECORD_SIZE, Flags,
                                   Identity, Mechanism, Policy, Tier, Transfer, pack_record, record_problem, seal)
from kvprobe.errors import KVProbeError

log = logging.getLogger(__name__)

Payload = dict[str, torch.Tensor]
_STRIPES = 64
_INITIAL_RECORDS = 64
PAYLOAD_FORMAT = "kvprobe-block-2"  # payload file metadata: identity, digest, policy at demotion
_PAYLOAD_NAME = re.compile(r"^[0-9a-f]{16}\.safetensors$")
_TEMP_PREFIX, _TEMP_SUFFIX = ".incoming-", ".tmp"
_DROP_SUFFIX = ".drop"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


class CorruptBlockError(KVProbeError):
    """A stored payload's bytes do not match its digest (or its file does not parse); the block was moved to
    the store's ``quarantine/`` folder and left the store."""


def digest(payload: Payload) -> str:
    """Content hash of a payload (names, dtypes, shapes and bytes): what a copy is checked against. SHA-256
    (hardware-accelerated on current x86 and ARM), cut to 128 bits."""
    h = hashlib.sha256()
    for name in sorted(payload):
        t = payload[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashed in place, no bytes copy
    return h.hexdigest()[:32]


def payload_nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ControlTable:
    """Fixed-size slots of packed records over a buffer; striped locks make each record change atomic.

    A block's slot is looked up and re-checked under its stripe lock, and a slot changes owner only under that
    lock, so an update can never land on a slot that was recycled for another block."""

    def __init__(self, records: int = _INITIAL_RECORDS) -> None:
        self.buf = bytearray(RECORD_SIZE * records)
        self.slots: dict[int, int] = {}  # block id -> slot
        self._free: list[int] = []
        self._next = 0
        self._locks = [threading.Lock() for _ in range(_STRIPES)]
        self._alloc = threading.Lock()
        self._written = [0] * _STRIPES  # metadata bytes written, per stripe (each updated under its lock)

    @property
    def metadata_bytes_written(self) -> int:
        return sum(self._written)

    @property
    def capacity(self) -> int:
        return len(self.buf) // RECORD_SIZE

    # -- storage (the disk table writes through to its file) --------------------------------------
    def _store(self, off: int, data: bytes) -> None:
        self.buf[off:off + len(data)] = data

    def _grow(self) -> None:
        self.buf.extend(bytes(len(self.buf) or RECORD_SIZE * _INITIAL_RECORDS))

    def sync(self) -> None:
        """Make every record change so far durable (nothing to do in RAM)."""

    # -- slots ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked_slot(self, bid: int) -> Iterator[int]:
        """The block's slot, with its stripe lock held; re-checked under the lock (slots are recycled)."""
        while True:
            slot = self.slots.get(bid)
            if slot is None:
                raise KVProbeError(f"no record for block {bid:016x} in this tier")
            lock = self._locks[slot % _STRIPES]
            with lock:
                if self.slots.get(bid) == slot:
                    yield slot
                    return
            # the slot changed owner between the lookup and the lock: look again

    def add(self, ident: Identity, policy: Policy, mech: Mechanism) -> int:
        """Write a new record (one 64-byte store); returns its slot."""
        bid = ident.block_id
        record = pack_record(ident, policy, mech)
        with self._alloc:
            if bid in self.slots:
                raise KVProbeError(f"block {bid:016x} already has a record in this tier")
            if self._free:
                slot = self._free.pop()
            else:
                if self._next >= self.capacity:
                    self._grow()
                slot, self._next = self._next, self._next + 1
            try:
                with self._locks[slot % _STRIPES]:
                    self._store(slot * RECORD_SIZE, record)
                    self.slots[bid] = slot
                    self._written[slot % _STRIPES] += RECORD_SIZE
            except BaseException:
                self._free.append(slot)
                raise
        return slot

    def remove(self, bid: int) -> None:
        with self._alloc:
            with self._locked_slot(bid) as slot:
                self._store(slot * RECORD_SIZE, bytes(RECORD_SIZE))  # VALID cleared with the rest, in one store
                del self.slots[bid]
                self._written[slot % _STRIPES] += RECORD_SIZE
            self._free.append(slot)

    def clear_slot(self, slot: int) -> None:
        """Zero a slot no block owns (a record found corrupt on reopen)."""
        with self._alloc, self._locks[slot % _STRIPES]:
            if slot in self.slots.values():
                raise KVProbeError(f"slot {slot} belongs to a block; remove the block instead")
            self._store(slot * RECORD_SIZE, bytes(RECORD_SIZE))

    def record(self, bid: int) -> bytes:
        with self._locked_slot(bid) as slot:
            return bytes(self.buf[slot * RECORD_SIZE:(slot + 1) * RECORD_SIZE])

    def identity(self, bid: int) -> Identity:
        return Identity.unpack(self.record(bid))

    def policy(self, bid: int) -> Policy:
        return Policy.unpack(self.record(bid)[POLICY_OFFSET:MECHANISM_OFFSET])

    def mechanism(self, bid: int) -> Mechanism:
        return Mechanism.unpack(self.record(bid)[MECHANISM_OFFSET:])

    def write_policy(self, bid: int, policy: Policy) -> int:
        """Overwrite the 16 policy bytes (with the record's check byte) in one store; returns the bytes written.
        ``policy`` is a validated ``Policy``, so nothing can fail half way."""
        with self._locked_slot(bid) as slot:
            off = slot * RECORD_SIZE
            self._store(off + POLICY_OFFSET, seal(bytes(self.buf[off:off + IDENTITY.size]), policy.pack()))
            self._written[slot % _STRIPES] += POLICY.size
        return POLICY.size

    def update_policy(self, bid: int, changes: dict[str, object]) -> int:
        """Read-modify-write of some policy fields, atomic under the record's stripe lock; 16 bytes written.
        The new policy is built (and validated) before any byte is written: a refused value changes nothing."""
        with self._locked_slot(bid) as slot:
            off = slot * RECORD_SIZE
            current = Policy.unpack(self.buf[off + POLICY_OFFSET:off + MECHANISM_OFFSET])
            new = replace(current, **changes)  # raises on an unknown field or a value the record cannot hold
            self._store(off + POLICY_OFFSET, seal(bytes(self.buf[off:off + IDENTITY.size]), new.pack()))
            self._written[slot % _STRIPES] += POLICY.size
        return POLICY.size

    def write_mechanism(self, bid: int, mech: Mechanism) -> None:
        with self._locked_slot(bid) as slot:
            self._store(slot * RECORD_SIZE + MECHANISM_OFFSET, mech.pack())
            self._written[slot % _STRIPES] += len(mech.pack())

    def raw_slots(self) -> Iterator[tuple[int, bytes]]:
        """(slot, record) of every slot that is not all zero (used to reopen a disk tier)."""
        empty = bytes(RECORD_SIZE)
        for slot in range(self.capacity):
            raw = bytes(self.buf[slot * RECORD_SIZE:(slot + 1) * RECORD_SIZE])
            if raw != empty:
                yield slot, raw


class RamTier:
    name = "ram"

    def __init__(self) -> None:
        self.table = ControlTable()
        self.payloads: dict[int, Payload] = {}
        self.payload_bytes_written = 0
        self.payload_bytes_read = 0
        self._epoch = 0

    def __contains__(self, bid: int) -> bool:
        return bid in self.payloads

    def next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def write(self, ident: Identity, policy: Policy, mech: Mechanism, payload: Payload, owned: bool = False) -> None:
        """Keep a payload. The tier owns its copy: it clones the caller's tensors unless ``owned`` says the
        caller hands over fresh tensors nobody else holds."""
        bid = ident.block_id
        if bid in self.payloads:
            raise KVProbeError(f"block {bid:016x} is already in RAM; payloads are write-once")
        copy = payload if owned else {k: v.detach().clone().contiguous() for k, v in payload.items()}
        self.table.add(ident, policy, mech)
        self.payloads[bid] = copy
        self.payload_bytes_written += payload_nbytes(copy)

    def read(self, bid: int) -> Payload:
        """The tier's own tensors (the store never hands these out; it copies them)."""
        payload = self.payloads[bid]
        self.payload_bytes_read += payload_nbytes(payload)
        return payload

    def discard(self, bid: int) -> None:
        self.table.remove(bid)
        del self.payloads[bid]


class _DiskTable(ControlTable):
    """``control.bin``: an in-memory mirror written through with ``pwrite`` (a change of one record is one
    syscall within one page, which a kill cannot split)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.padded_from: int | None = None  # the file's size when it was not a whole number of records
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        raw = bytearray(os.pread(self._fd, os.fstat(self._fd).st_size, 0))
        super().__init__(0)
        size = len(raw)
        if size % RECORD_SIZE or size == 0:  # torn growth, a truncated file, or a new one: pad with empty slots
            self.padded_from = size if size else None
            raw.extend(bytes(max(RECORD_SIZE * _INITIAL_RECORDS, -size % RECORD_SIZE)))
            os.ftruncate(self._fd, len(raw))
            os.fsync(self._fd)
        self.buf = raw

    def _store(self, off: int, data: bytes) -> None:
        if os.pwrite(self._fd, data, off) != len(data):  # a regular file writes all or raises
            raise OSError(f"short write to {self.path}")
        self.buf[off:off + len(data)] = data

    def _grow(self) -> None:
        size = len(self.buf)
        os.ftruncate(self._fd, size * 2)  # new slots are zero: empty
        self.buf.extend(bytes(size))

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a store dropped without close(): release the descriptor (writes are in the file)
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class Quarantined:
    """A block (or record) that reopening or a promotion found damaged, and where its file went."""

    block_id: int | None  # None when the damage hides which block it was
    reason: str
    moved_to: Path | None  # the file in ``quarantine/``; None when there was no file to move


@dataclass(frozen=True)
class PayloadHeader:
    identity: Identity
    digest: str
    policy: Policy


def read_payload_header(path: Path) -> PayloadHeader:
    """Parse a payload file's safetensors header and check that the file holds exactly the bytes it declares;
    raises ``CorruptBlockError`` naming what is wrong. Reads the header only, not the payload."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptBlockError(f"{size} B: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CorruptBlockError(f"header of {n} B in a file of {size} B (truncated)")
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        spans = []
        for name, info in header.items():
            begin, end = info["data_offsets"]
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            if end - begin != numel * _DTYPE_BYTES[info["dtype"]]:
                raise CorruptBlockError(f"tensor {name!r}: {end - begin} B for shape {info['shape']} {info['dtype']}")
            spans.append((begin, end))
        spans.sort()
        cursor = 0
        for begin, end in spans:
            if begin != cursor:
                raise CorruptBlockError(f"tensor data at {begin}, expected {cursor} (overlap or gap)")
            cursor = end
        if cursor != size - 8 - n:
            raise CorruptBlockError(f"tensors declare {cursor} B of data, the file holds {size - 8 - n} B "
                                    f"({'truncated' if cursor > size - 8 - n else 'trailing bytes'})")
        if meta.get("format") != PAYLOAD_FORMAT:
            raise CorruptBlockError(f"payload format {meta.get('format')!r}, expected {PAYLOAD_FORMAT!r}")
        ident = Identity.unpack(bytes.fromhex(meta["identity"]))
        policy = Policy.unpack(bytes.fromhex(meta["policy"]))
        return PayloadHeader(ident, str(meta["digest"]), policy)
    except CorruptBlockError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error) as e:
        raise CorruptBlockError(f"unreadable header: {type(e).__name__}: {e}") from None


class DiskTier:
    name = "disk"

    def __init__(self, root: str | Path, verify: bool = False) -> None:
        """Open (or create) the tier in ``root``, recovering from whatever a crash left (module docstring).
        ``verify`` also reads every payload and checks its digest, quarantining mismatches; without it payload
        bytes are checked on every promotion (and an orphan's before it is adopted)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir = self.root / "quarantine"
        self._lock_file = open(self.root / ".lock", "a+b")
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise KVProbeError(f"the block store at {self.root} is open elsewhere (another process, or another "
                               f"BlockStore in this one); close that one first: one opener per store") from None
        self.payload_bytes_written = 0
        self.payload_bytes_read = 0
        self._epoch = 0
        self.digests: dict[int, str] = {}  # block id -> the digest its payload file records
        self.quarantined: list[Quarantined] = []
        self.repairs: list[str] = []  # what reopening fixed without losing a block
        try:
            self.table = _DiskTable(self.root / "control.bin")
            self._recover(verify)
        except BaseException:
            self._lock_file.close()
            raise

    # -- recovery ---------------------------------------------------------------------------------
    def _recover(self, verify: bool) -> None:
        if self.table.padded_from is not None:
            self.repairs.append(f"control.bin was {self.table.padded_from} B, not whole records: padded with "
                                "empty slots")
        for tmp in sorted(self.root.glob(f"{_TEMP_PREFIX}*{_TEMP_SUFFIX}")):
            os.unlink(tmp)
            self.repairs.append(f"removed stale temp file {tmp.name} (a write that never finished)")
        dropping = {p.name[:-len(_DROP_SUFFIX)] for p in self.root.glob(f"*.safetensors{_DROP_SUFFIX}")}
        records: dict[int, tuple[int, Identity, Mechanism, Policy]] = {}
        adopt: list[tuple[PayloadHeader, Path, int]] = []  # payloads without a record, checked, with their format
        for slot, raw in self.table.raw_slots():
            problem = record_problem(raw)
            if problem is None and not Mechanism.unpack(raw[MECHANISM_OFFSET:]).flags & Flags.VALID:
                problem = "VALID flag clear"
            if problem is None:
                ident = Identity.unpack(raw)
                bid = ident.block_id
                if bid in records:
                    problem = f"a second record for block {bid:016x}"
                elif self.path(bid).name in dropping:
                    self.table.clear_slot(slot)
                    continue  # a drop was under way: finish it
                else:
                    records[bid] = (slot, ident, Mechanism.unpack(raw[MECHANISM_OFFSET:]),
                                    Policy.unpack(raw[POLICY_OFFSET:MECHANISM_OFFSET]))
                    continue
            self.table.clear_slot(slot)
            self.repairs.append(f"cleared the record in slot {slot}: {problem} (its payload file, if intact, is "
                                "adopted below)")
        for name in sorted(dropping):
            os.unlink(self.root / (name + _DROP_SUFFIX))
            self.repairs.append(f"finished dropping {name}")
        files = {int(p.name[:16], 16): p for p in self.root.iterdir() if _PAYLOAD_NAME.match(p.name)}
        for bid in sorted(set(records) - set(files)):
            slot = records.pop(bid)[0]
            self.table.clear_slot(slot)
            self.quarantined.append(Quarantined(bid, "a control record but no payload file (the payload is lost)",
                                                None))
        for bid, path in sorted(files.items()):
            try:
                header = read_payload_header(path)
                if header.identity.block_id != bid:
                    raise CorruptBlockError(f"its identity hashes to {header.identity.block_id:016x}, not its name")
                if bid in records and records[bid][1] != header.identity:
                    raise CorruptBlockError("its identity differs from its control record's")
                if verify or bid not in records:  # an orphan is adopted only if its bytes check
                    payload = self.read(bid, count=False)
                    actual = digest(payload)
                    if actual != header.digest:
                        raise CorruptBlockError(f"payload digest {actual} != recorded {header.digest}")
                    if bid not in records:
                        dtype = next((t.dtype for n, t in payload.items() if n.startswith("k")), None)
                        if dtype not in FORMATS:
                            raise CorruptBlockError(f"key dtype {dtype} has no format code")
                        adopt.append((header, path, FORMATS[dtype]))
                    del payload
            except (CorruptBlockError, SafetensorError, OSError, RuntimeError, ValueError) as e:
                reason = str(e) if isinstance(e, CorruptBlockError) else f"unreadable ({type(e).__name__}: {e})"
                if bid in records:
                    self.table.clear_slot(records.pop(bid)[0])
                self.quarantined.append(Quarantined(bid, reason, self._move_aside(path, reason)))
                continue
            self.digests[bid] = header.digest
            if bid in records:
                slot, _, mech, _ = records[bid]
                self.table.slots[bid] = slot
                self._epoch = max(self._epoch, mech.epoch)
        used = set(self.table.slots.values())
        self.table._next = max(used) + 1 if used else 0
        self.table._free = [s for s in range(self.table._next) if s not in used]
        for header, path, fmt in adopt:
            self.table.add(header.identity, header.policy, Mechanism(Tier.DISK, fmt, Transfer.IDLE, Flags.VALID,
                                                                     self.next_epoch()))
            self.repairs.append(f"adopted {path.name}: a payload without a record (a write stopped between its "
                                "rename and its record); policy as at its demotion")
        self.table.sync()
        fsync_dir(self.root)
        if self.quarantined or self.repairs:
            log.warning("block store %s reopened: %d block(s) quarantined, %d repair(s)%s", self.root,
                        len(self.quarantined), len(self.repairs),
                        "".join(f"\n  quarantined {q.block_id and f'{q.block_id:016x}'}: {q.reason}"
                                for q in self.quarantined) + "".join(f"\n  {r}" for r in self.repairs))

    def _move_aside(self, path: Path, reason: str) -> Path:
        self.quarantine_dir.mkdir(exist_ok=True)
        dest = self.quarantine_dir / path.name
        while dest.exists():
            dest = dest.with_name(f"{dest.name}.{secrets.token_hex(2)}")
        os.replace(path, dest)
        dest.with_name(dest.name + ".why").write_text(reason + "\n")
        fsync_dir(self.quarantine_dir)
        fsync_dir(self.root)
        return dest

    def quarantine(self, bid: int, reason: str) -> Quarantined:
        """Move a block's payload aside and drop its record (a damaged payload found after opening)."""
        if bid in self.table.slots:
            self.table.remove(bid)
            self.table.sync()
        path = self.path(bid)
        q = Quarantined(bid, reason, self._move_aside(path, reason) if path.exists() else None)
        self.digests.pop(bid, None)
        self.quarantined.append(q)
        log.warning("block store %s: quarantined block %016x: %s", self.root, bid, reason)
        return q

    # -- the tier ---------------------------------------------------------------------------------
    def path(self, bid: int) -> Path:
        return self.root / f"{bid:016x}.safetensors"

    def __contains__(self, bid: int) -> bool:
        return bid in self.table.slots

    def next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def write(self, ident: Identity, policy: Policy, mech: Mechanism, payload: Payload, payload_digest: str) -> None:
        """Write a payload once, durably: temp file, fsync, rename, directory fsync; then its record, fsync."""
        bid = ident.block_id
        target = self.path(bid)
        if bid in self or target.exists():
            raise KVProbeError(f"block {bid:016x} already has a payload file; payloads are write-once")
        data = safetensors_bytes({k: v.contiguous() for k, v in payload.items()},
                                 metadata={"format": PAYLOAD_FORMAT, "digest": payload_digest,
                                           "identity": ident.pack().hex(), "policy": policy.pack().hex()})
        tmp = self.root / f"{_TEMP_PREFIX}{bid:016x}-{secrets.token_hex(4)}{_TEMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, target)
        fsync_dir(self.root)
        self.table.add(ident, policy, mech)
        self.table.sync()
        self.digests[bid] = payload_digest
        self.payload_bytes_written += payload_nbytes(payload)

    def read(self, bid: int, count: bool = True) -> Payload:
        """The payload through safetensors' memory map (tensors backed by the file: copy before keeping)."""
        with safe_open(str(self.path(bid)), framework="pt") as f:
            payload = {k: f.get_tensor(k) for k in f.keys()}
        if count:
            self.payload_bytes_read += payload_nbytes(payload)
        return payload

    def stored_digest(self, bid: int) -> str:
        return self.digests[bid]

    def discard(self, bid: int) -> None:
        """Remove a block: its payload is renamed to ``*.drop`` first, so a crash part way leaves a drop that
        reopening finishes, never a record without its payload."""
        path = self.path(bid)
        pending = path.with_name(path.name + _DROP_SUFFIX)
        os.replace(path, pending)
        self.table.remove(bid)
        self.table.sync()
        os.unlink(pending)
        fsync_dir(self.root)
        self.digests.pop(bid, None)

    def sync(self) -> None:
        """Make every policy update so far durable."""
        self.table.sync()

    def close(self) -> None:
        self.table.close()
        self._lock_file.close()
