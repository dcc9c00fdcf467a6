"""Tiers: where copies of block payloads sit, each with its own table of 64-byte control records.

- ``RamTier``: payload tensors in process memory; control records in a ``bytearray``.
- ``DiskTier``: one safetensors file per payload, written once (temp file + atomic rename) and read back
  through safetensors' memory map; control records in ``control.bin``, itself memory-mapped, so a policy
  update is a 16-byte store into the map and never touches a payload file.

A tier never rewrites a payload it holds: ``write`` of an id it already has is an error.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvprobe.blocks.record import (MECHANISM, MECHANISM_OFFSET, POLICY, POLICY_OFFSET, RECORD_SIZE, Flags, Identity,
                                   Mechanism, Policy)
from kvprobe.errors import KVProbeError

Payload = dict[str, torch.Tensor]
_STRIPES = 64
# field name -> index in the POLICY struct (index 4 is the reserved byte)
_POLICY_FIELDS = {"tenant": 0, "qos": 1, "priority": 2, "intent": 3, "reuse_score": 5, "recency": 6}


def payload_nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


class ControlTable:
    """Fixed-size slots of packed records over a writable buffer; striped locks make each update atomic."""

    def __init__(self, buffer: bytearray | mmap.mmap) -> None:
        self.buf = buffer
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

    def _grow(self) -> None:  # the disk table overrides this to remap its file
        self.buf.extend(bytes(len(self.buf) or RECORD_SIZE * 64))

    def add(self, ident: Identity, policy: Policy, mech: Mechanism) -> None:
        bid = ident.block_id
        with self._alloc:
            if bid in self.slots:
                raise KVProbeError(f"block {bid:016x} already has a record in this tier")
            if self._free:
                slot = self._free.pop()
            else:
                if self._next >= self.capacity:
                    self._grow()
                slot, self._next = self._next, self._next + 1
            off = slot * RECORD_SIZE
            with self._locks[slot % _STRIPES]:
                self.buf[off:off + RECORD_SIZE] = ident.pack() + policy.pack() + mech.pack()
                self._written[slot % _STRIPES] += RECORD_SIZE
            self.slots[bid] = slot

    def remove(self, bid: int) -> None:
        with self._alloc:
            slot = self.slots.pop(bid)
            off = slot * RECORD_SIZE
            with self._locks[slot % _STRIPES]:
                self.buf[off:off + RECORD_SIZE] = bytes(RECORD_SIZE)  # VALID cleared with the rest
                self._written[slot % _STRIPES] += RECORD_SIZE
            self._free.append(slot)

    def record(self, bid: int) -> bytes:
        slot = self.slots[bid]
        with self._locks[slot % _STRIPES]:
            return bytes(self.buf[slot * RECORD_SIZE:(slot + 1) * RECORD_SIZE])

    def identity(self, bid: int) -> Identity:
        return Identity.unpack(self.record(bid))

    def policy(self, bid: int) -> Policy:
        return Policy.unpack(self.record(bid)[POLICY_OFFSET:MECHANISM_OFFSET])

    def mechanism(self, bid: int) -> Mechanism:
        return Mechanism.unpack(self.record(bid)[MECHANISM_OFFSET:])

    def write_policy(self, bid: int, policy: Policy) -> int:
        """Overwrite the 16 policy bytes in place; returns the bytes written."""
        slot = self.slots[bid]
        raw = policy.pack()
        with self._locks[slot % _STRIPES]:
            self.buf[slot * RECORD_SIZE + POLICY_OFFSET:slot * RECORD_SIZE + MECHANISM_OFFSET] = raw
            self._written[slot % _STRIPES] += POLICY.size
        return POLICY.size

    def update_policy(self, bid: int, changes: dict[str, object]) -> int:
        """Read-modify-write of some policy fields, atomic under the record's stripe lock; 16 bytes written."""
        slot = self.slots[bid]
        off = slot * RECORD_SIZE + POLICY_OFFSET
        with self._locks[slot % _STRIPES]:
            fields = list(POLICY.unpack_from(self.buf, off))
            for name, value in changes.items():
                fields[_POLICY_FIELDS[name]] = int(value) if name != "reuse_score" else float(value)
            POLICY.pack_into(self.buf, off, *fields)
            self._written[slot % _STRIPES] += POLICY.size
        return POLICY.size

    def write_mechanism(self, bid: int, mech: Mechanism) -> None:
        slot = self.slots[bid]
        with self._locks[slot % _STRIPES]:
            self.buf[slot * RECORD_SIZE + MECHANISM_OFFSET:(slot + 1) * RECORD_SIZE] = mech.pack()
            self._written[slot % _STRIPES] += MECHANISM.size

    def valid_records(self) -> Iterator[tuple[int, bytes]]:
        """(slot, record) of every slot whose mechanism says VALID (used to reopen a disk tier)."""
        for slot in range(self.capacity):
            raw = bytes(self.buf[slot * RECORD_SIZE:(slot + 1) * RECORD_SIZE])
            if Mechanism.unpack(raw[MECHANISM_OFFSET:]).flags & Flags.VALID:
                yield slot, raw


class RamTier:
    name = "ram"

    def __init__(self) -> None:
        self.table = ControlTable(bytearray(RECORD_SIZE * 64))
        self.payloads: dict[int, Payload] = {}
        self.payload_bytes_written = 0
        self.payload_bytes_read = 0
        self._epoch = 0

    def __contains__(self, bid: int) -> bool:
        return bid in self.payloads

    def next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def write(self, ident: Identity, policy: Policy, mech: Mechanism, payload: Payload) -> None:
        bid = ident.block_id
        if bid in self.payloads:
            raise KVProbeError(f"block {bid:016x} is already in RAM; payloads are write-once")
        # The tier owns its copy: nothing the caller does to its tensors afterwards can change it.
        self.payloads[bid] = {k: v.detach().clone().contiguous() for k, v in payload.items()}
        self.table.add(ident, policy, mech)
        self.payload_bytes_written += payload_nbytes(payload)

    def read(self, bid: int) -> Payload:
        payload = self.payloads[bid]
        self.payload_bytes_read += payload_nbytes(payload)
        return payload

    def discard(self, bid: int) -> None:
        del self.payloads[bid]
        self.table.remove(bid)


class _DiskTable(ControlTable):
    def __init__(self, path: Path) -> None:
        if not path.exists() or path.stat().st_size == 0:
            path.write_bytes(bytes(RECORD_SIZE * 64))
        self._file = open(path, "r+b")
        super().__init__(mmap.mmap(self._file.fileno(), 0))

    def _grow(self) -> None:
        size = len(self.buf)
        self.buf.flush()
        self.buf.close()
        self._file.truncate(size * 2)
        self.buf = mmap.mmap(self._file.fileno(), 0)

    def close(self) -> None:
        self.buf.flush()
        self.buf.close()
        self._file.close()


class DiskTier:
    name = "disk"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.table = _DiskTable(self.root / "control.bin")
        self.payload_bytes_written = 0
        self.payload_bytes_read = 0
        self._epoch = 0
        for slot, raw in self.table.valid_records():  # reopen: the records on disk are the index
            ident = Identity.unpack(raw)
            if not self.path(ident.block_id).exists():
                raise KVProbeError(f"disk tier {self.root}: record for block {ident.block_id:016x} but no payload file")
            self.table.slots[ident.block_id] = slot
            self._epoch = max(self._epoch, Mechanism.unpack(raw[MECHANISM_OFFSET:]).epoch)
        used = set(self.table.slots.values())
        self.table._next = max(used) + 1 if used else 0
        self.table._free = [s for s in range(self.table._next) if s not in used]

    def path(self, bid: int) -> Path:
        return self.root / f"{bid:016x}.safetensors"

    def __contains__(self, bid: int) -> bool:
        return bid in self.table.slots

    def next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def write(self, ident: Identity, policy: Policy, mech: Mechanism, payload: Payload, digest: str) -> None:
        bid = ident.block_id
        target = self.path(bid)
        if bid in self or target.exists():
            raise KVProbeError(f"block {bid:016x} already has a payload file; payloads are write-once")
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        os.close(fd)
        save_file({k: v.contiguous() for k, v in payload.items()}, tmp, metadata={"digest": digest})
        os.replace(tmp, target)
        self.table.add(ident, policy, mech)
        self.payload_bytes_written += payload_nbytes(payload)

    def read(self, bid: int, count: bool = True) -> Payload:
        with safe_open(str(self.path(bid)), framework="pt") as f:  # memory-mapped
            payload = {k: f.get_tensor(k) for k in f.keys()}
        if count:
            self.payload_bytes_read += payload_nbytes(payload)
        return payload

    def stored_digest(self, bid: int) -> str:
        with safe_open(str(self.path(bid)), framework="pt") as f:
            return f.metadata()["digest"]

    def discard(self, bid: int) -> None:
        self.table.remove(bid)
        self.path(bid).unlink()

    def close(self) -> None:
        self.table.close()
