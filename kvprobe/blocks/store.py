"""BlockStore: write-once KV payloads in a RAM tier over a disk tier, with policy updated in place.

Operations and what each may move (``Ledger`` counts every byte, by operation):

- ``put``: a new block into RAM (its payload's one creation write);
- ``demote``: make sure the disk holds a copy, then drop the RAM copy. The disk copy is written at most once
  in the block's life: a second demotion finds it and writes nothing (the seed's delta_b <= 1);
- ``promote`` / ``get``: copy a disk payload into RAM through the memory map (a read); the disk copy stays,
  so the next demotion is a clean discard;
- ``evict``: drop the RAM copy, never a writeback. With a disk copy the block stays in the store; without
  one it leaves the store (a block is recomputable; the caller chose not to keep it);
- ``update_policy``: 16 bytes per copy, in place; zero payload bytes;
- ``derive``: a new block computed from an existing one (in-place refresh, re-rotation) whose identity names
  its parent; ``append``: a new block after existing ones (an erratum). Neither touches a stored payload.

Mechanism records are built by the tier receiving a copy (new epoch, its own residency and transfer state);
identity and policy bytes travel with the copy.

Write-once is enforced, not assumed:

- readers get copies: what ``get`` / ``promote`` return is the caller's own; mutating it changes no stored
  copy, and nothing later demoted or promoted;
- a second ``put`` of an identity with a different payload is refused (``KVProbeError``); the same payload is
  idempotent;
- every promotion checks the payload's digest; a mismatch raises ``CorruptBlockError`` and moves the payload
  aside into ``<root>/quarantine/`` (``BlockStore.quarantined`` lists it). ``demote`` checks the RAM copy's
  digest before writing it;
- a policy update is validated (``Policy``'s ranges) before any byte is written, and is serialised with the
  moves of the same block, so the copies never disagree and no update lands on a recycled slot.

Crash safety and recovery on open are the disk tier's (``kvprobe.blocks.tiers``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from safetensors import SafetensorError

from kvprobe.blocks.record import (FORMAT_DTYPES, FORMATS, Flags, Identity, Intent, Mechanism, Policy, RecordError,
                                   Tier, Transfer)
from kvprobe.blocks.tiers import CorruptBlockError, DiskTier, Payload, Quarantined, RamTier, digest, payload_nbytes
from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState

_BLOCK_STRIPES = 64


def state_payload(state: KVState, layer_start: int = 0) -> Payload:
    """A KVState (batch 1) as named tensors: ``k<layer>`` / ``v<layer>`` by absolute layer, plus positions."""
    if state.batch != 1:
        raise KVProbeError(f"a block holds one sequence; got a state of batch {state.batch}")
    out = {f"k{layer_start + i}": k for i, k in enumerate(state.keys)}
    out |= {f"v{layer_start + i}": v for i, v in enumerate(state.values)}
    out["positions"] = state.positions
    return out


def payload_state(payload: Payload, ident: Identity) -> KVState:
    """The payload's tensors as a KVState (shared, not copied: the store copies before calling this)."""
    layers = range(ident.layer_start, ident.layer_stop)
    return KVState(tuple(payload[f"k{i}"] for i in layers), tuple(payload[f"v{i}"] for i in layers),
                   payload["positions"])


@dataclass
class Ledger:
    """Bytes moved between tiers, per operation name: payload (K/V tensors) read and written, and metadata
    (control records) written. The copy handed to a reader is the reader's, not tier traffic: not counted."""

    payload_read: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload_written: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    metadata: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _copy(payload: Payload) -> Payload:
    return {k: v.detach().clone() for k, v in payload.items()}


class BlockStore:
    def __init__(self, root: str | Path | None = None, verify: bool = False) -> None:
        """RAM only when ``root`` is None; else RAM over a disk tier in ``root`` (reopened if it exists, after
        recovering from any crash: see ``quarantined`` and ``repairs``). ``verify`` checks every payload's
        digest while opening (otherwise each is checked when promoted)."""
        self.ram = RamTier()
        self.disk = DiskTier(root, verify=verify) if root is not None else None
        self.ledger = Ledger()
        self.demotions: dict[int, int] = defaultdict(int)  # disk payload writes per block, over its life
        self._digests: dict[int, str] = dict(self.disk.digests) if self.disk is not None else {}
        self._lock = threading.RLock()  # serialises moves (put, demote, promote, evict, drop)
        # A block's moves and its policy updates exclude each other (per block, striped), so a move never copies
        # a policy that an update is changing and an update never lands on a record being removed.
        self._block_locks = [threading.RLock() for _ in range(_BLOCK_STRIPES)]
        self._ledger_lock = threading.Lock()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def quarantined(self) -> list[Quarantined]:
        """Blocks found damaged (on open or on promotion), each with the reason and where its file went."""
        return self.disk.quarantined if self.disk is not None else []

    @property
    def repairs(self) -> list[str]:
        """What opening the disk tier fixed without losing a block (stale temp files, adopted payloads...)."""
        return self.disk.repairs if self.disk is not None else []

    def _block_lock(self, bid: int) -> threading.RLock:
        return self._block_locks[bid % _BLOCK_STRIPES]

    # -- accounting -------------------------------------------------------------------------------
    def _tiers(self) -> list[RamTier | DiskTier]:
        return [self.ram] + ([self.disk] if self.disk is not None else [])

    def _snapshot(self) -> tuple[int, int, int]:
        tiers = self._tiers()
        return (sum(t.payload_bytes_read for t in tiers), sum(t.payload_bytes_written for t in tiers),
                sum(t.table.metadata_bytes_written for t in tiers))

    def _account(self, op: str, before: tuple[int, int, int]) -> None:
        after = self._snapshot()
        with self._ledger_lock:
            self.ledger.payload_read[op] += after[0] - before[0]
            self.ledger.payload_written[op] += after[1] - before[1]
            self.ledger.metadata[op] += after[2] - before[2]
            self.ledger.calls[op] += 1

    # -- queries ----------------------------------------------------------------------------------
    def __contains__(self, bid: int) -> bool:
        return bid in self.ram or (self.disk is not None and bid in self.disk)

    def block_ids(self) -> set[int]:
        return set(self.ram.payloads) | (set(self.disk.table.slots) if self.disk is not None else set())

    def where(self, bid: int) -> list[Tier]:
        return [t for t, tier in ((Tier.RAM, self.ram), (Tier.DISK, self.disk)) if tier is not None and bid in tier]

    def _table_with(self, bid: int):
        for tier in self._tiers():
            if bid in tier:
                return tier.table
        raise KVProbeError(f"no block {bid:016x} in the store")

    def identity(self, bid: int) -> Identity:
        return self._table_with(bid).identity(bid)

    def policy(self, bid: int) -> Policy:
        return self._table_with(bid).policy(bid)

    def mechanism(self, bid: int, tier: Tier) -> Mechanism:
        holder = self.ram if tier == Tier.RAM else self.disk
        if holder is None or bid not in holder:
            raise KVProbeError(f"block {bid:016x} has no copy in {tier.name}")
        return holder.table.mechanism(bid)

    def digest_of(self, bid: int) -> str:
        """The payload's digest recorded when the block was created."""
        return self._digests[bid]

    def copy_digests(self, bid: int) -> dict[Tier, str]:
        """The digest of every copy's bytes as they are now (reads the payloads; for checks, not serving)."""
        out = {}
        if bid in self.ram:
            out[Tier.RAM] = digest(self.ram.payloads[bid])
        if self.disk is not None and bid in self.disk:
            out[Tier.DISK] = digest(self.disk.read(bid, count=False))  # a check, not traffic
        return out

    # -- writes -----------------------------------------------------------------------------------
    def put(self, ident: Identity, state: KVState, policy: Policy = Policy()) -> int:
        """Store a new block in RAM; returns its id. The same identity with the same payload is the same block
        (no write); with a different payload it is refused: payloads are write-once."""
        if not isinstance(ident, Identity) or not isinstance(policy, Policy):
            raise KVProbeError(f"put takes an Identity and a Policy; got {type(ident).__name__} and "
                               f"{type(policy).__name__}")
        self._check_shape(ident, state)
        payload = _copy(state_payload(state, ident.layer_start))  # the store's own bytes, then their digest
        payload_digest = digest(payload)
        bid = ident.block_id
        with self._lock, self._block_lock(bid):
            before = self._snapshot()
            if bid in self:
                if self._digests[bid] != payload_digest:
                    raise KVProbeError(f"block {bid:016x} is already stored with a different payload (digest "
                                       f"{self._digests[bid]}, this one {payload_digest}); payloads are write-once: "
                                       "give new K/V a new identity (store.derive, or another seq_id), or drop the "
                                       "old block first")
            else:
                self.ram.write(ident, policy, self._fresh_mechanism(self.ram, Tier.RAM, payload), payload, owned=True)
                self._digests[bid] = payload_digest
            self._account("put", before)
        return bid

    def append(self, after: int | None, ident: Identity, state: KVState, policy: Policy = Policy()) -> int:
        """An erratum: a new block placed after block ``after`` (its positions must follow it)."""
        if after is not None:
            prev = self.identity(after)
            if ident.pos_start < prev.pos_stop:
                raise KVProbeError(f"an appended block starts at {ident.pos_start}, inside block {after:016x} "
                                   f"(which ends at {prev.pos_stop}); append after it or derive a child")
        return self.put(ident, state, policy)

    def derive(self, parent: int, state: KVState, seq_id: int | None = None, prefix_hash: int | None = None,
               policy: Policy | None = None) -> int:
        """A child block (in-place refresh, re-rotation) whose identity names ``parent``; the parent's payload
        is left exactly as it is. The child's position range comes from ``state``."""
        base = self.identity(parent)
        pos = state.positions
        ident = replace(base, pos_start=int(pos.min()), pos_stop=int(pos.max()) + 1, parent=parent,
                        seq_id=base.seq_id if seq_id is None else seq_id,
                        prefix_hash=base.prefix_hash if prefix_hash is None else prefix_hash)
        if ident.block_id == parent:
            raise KVProbeError("a derived block must differ from its parent in identity")
        return self.put(ident, state, self.policy(parent) if policy is None else policy)

    def update_policy(self, bid: int, **changes: object) -> int:
        """Rewrite the policy of every copy in place (16 B each); returns the metadata bytes written.
        No payload byte is read or written. The new policy is validated first: a refused update changes
        nothing, in any tier."""
        unknown = set(changes) - set(Policy.__dataclass_fields__)
        if unknown:
            raise KVProbeError(f"unknown policy field(s) {sorted(unknown)}; policy has "
                               f"{sorted(Policy.__dataclass_fields__)}")
        with self._block_lock(bid):
            holders = [tier for tier in self._tiers() if bid in tier]
            if not holders:
                raise KVProbeError(f"no block {bid:016x} in the store")
            try:
                new = replace(holders[0].table.policy(bid), **changes)
            except RecordError as e:
                raise RecordError(f"policy update of block {bid:016x} refused, nothing written: {e}") from None
            written = sum(tier.table.write_policy(bid, new) for tier in holders)
        with self._ledger_lock:  # the ledger's ints are shared by writer threads
            self.ledger.metadata["update_policy"] += written
            self.ledger.calls["update_policy"] += 1
        return written

    def pin(self, bid: int, pinned: bool = True) -> None:
        with self._block_lock(bid):
            mech = self.mechanism(bid, Tier.RAM)
            flags = mech.flags | Flags.PINNED if pinned else mech.flags & ~Flags.PINNED
            self.ram.table.write_mechanism(bid, replace(mech, flags=flags))

    def sync(self) -> None:
        """Make every policy update so far durable (payload writes and record changes already are)."""
        if self.disk is not None:
            self.disk.sync()

    # -- moves ------------------------------------------------------------------------------------
    def demote(self, bid: int) -> int:
        """RAM -> disk; returns the payload bytes written (0 when the disk already holds the block). When it
        returns, the disk copy and its record are durable."""
        if self.disk is None:
            raise KVProbeError("this store has no disk tier; open it with a root directory")
        with self._lock, self._block_lock(bid):
            self._check_movable(bid)
            before = self._snapshot()
            written = 0
            if bid not in self.disk:
                payload = self.ram.read(bid)
                if digest(payload) != self._digests[bid]:  # never handed out, so only a bug or bad memory
                    self.ram.discard(bid)
                    self._forget(bid)
                    raise CorruptBlockError(f"block {bid:016x}: its RAM copy no longer matches its digest; it was "
                                            "not written to disk and left the store: recompute it and put it again")
                ident, policy = self.ram.table.identity(bid), self.ram.table.policy(bid)
                mech = self._fresh_mechanism(self.disk, Tier.DISK, payload)
                self.disk.write(ident, policy, mech, payload, self._digests[bid])
                self.demotions[bid] += 1
                written = payload_nbytes(payload)
            self.ram.discard(bid)
            self._account("demote", before)
            return written

    def promote(self, bid: int) -> KVState:
        """Disk -> RAM (the disk copy stays), after checking the payload's digest; returns a copy. A block
        already in RAM is returned as a copy of the RAM payload. A payload whose bytes do not match its digest
        raises ``CorruptBlockError`` and is quarantined."""
        with self._lock, self._block_lock(bid):
            if bid in self.ram:
                return payload_state(_copy(self.ram.payloads[bid]), self.ram.table.identity(bid))
            if self.disk is None or bid not in self.disk:
                raise KVProbeError(f"no block {bid:016x} in the store")
            before = self._snapshot()
            try:
                payload = _copy(self.disk.read(bid))  # own the bytes, then check them (the file may change later)
            except (OSError, SafetensorError, ValueError, RuntimeError) as e:
                raise self._quarantine(bid, f"payload file unreadable ({type(e).__name__}: {e})")
            actual = digest(payload)
            if actual != self._digests[bid]:
                raise self._quarantine(bid, f"payload digest {actual} != recorded {self._digests[bid]} (bytes "
                                            "changed on disk)")
            ident, policy = self.disk.table.identity(bid), self.disk.table.policy(bid)
            self.ram.write(ident, policy, self._fresh_mechanism(self.ram, Tier.RAM, payload), payload, owned=True)
            self._account("promote", before)
            return payload_state(_copy(payload), ident)

    def get(self, bid: int) -> KVState:
        """The lookup path: a copy of the RAM copy on a hit, else a (checked) promotion from disk."""
        payload = self.ram.payloads.get(bid)
        if payload is not None:
            try:
                ident = self.ram.table.identity(bid)
            except KVProbeError:  # evicted meanwhile
                return self.promote(bid)
            return payload_state(_copy(payload), ident)
        return self.promote(bid)

    def verify(self) -> list[Quarantined]:
        """Read every disk payload and check its digest now; quarantines and returns the ones that fail."""
        if self.disk is None:
            return []
        found = []
        with self._lock:
            for bid in sorted(self.disk.table.slots):
                try:
                    ok = digest(self.disk.read(bid, count=False)) == self._digests[bid]
                except (OSError, SafetensorError, ValueError, RuntimeError):
                    ok = False
                if not ok:
                    found.append(self.disk.quarantine(bid, "payload digest mismatch (verify)"))
                    if bid not in self:
                        self._forget(bid)
        return found

    def evict(self, bid: int) -> None:
        """Drop the RAM copy without writing anything anywhere."""
        with self._lock, self._block_lock(bid):
            self._check_movable(bid)
            before = self._snapshot()
            self.ram.discard(bid)
            if bid not in self:
                self._forget(bid)
            self._account("evict", before)

    def drop(self, bid: int) -> None:
        """Remove every copy (the block's life ends; a later put of the same identity is a new life)."""
        with self._lock, self._block_lock(bid):
            for tier in self._tiers():
                if bid in tier:
                    tier.discard(bid)
            self._forget(bid)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- helpers ----------------------------------------------------------------------------------
    def _quarantine(self, bid: int, reason: str) -> CorruptBlockError:
        """Move a damaged disk payload aside; returns the error to raise (a caller never sees its bytes)."""
        q = self.disk.quarantine(bid, reason)
        if bid not in self:
            self._forget(bid)
        return CorruptBlockError(f"block {bid:016x}: {reason}; the payload was moved to {q.moved_to} and the block "
                                "left the store: recompute it and put it again")

    def _forget(self, bid: int) -> None:
        self._digests.pop(bid, None)
        self.demotions.pop(bid, None)

    def _check_movable(self, bid: int) -> None:
        if bid not in self.ram:
            raise KVProbeError(f"block {bid:016x} has no RAM copy")
        if self.ram.table.mechanism(bid).flags & Flags.PINNED:
            raise KVProbeError(f"block {bid:016x} is pinned in RAM; unpin it first")

    @staticmethod
    def _fresh_mechanism(tier: RamTier | DiskTier, residency: Tier, payload: Payload) -> Mechanism:
        dtype = next(t.dtype for name, t in payload.items() if name.startswith("k"))
        if dtype not in FORMATS:
            raise KVProbeError(f"payload dtype {dtype} has no format code; use one of {sorted(map(str, FORMATS))}")
        return Mechanism(residency, FORMATS[dtype], Transfer.IDLE, Flags.VALID, tier.next_epoch())

    @staticmethod
    def _check_shape(ident: Identity, state: KVState) -> None:
        if state.n_layers != ident.layer_stop - ident.layer_start:
            raise KVProbeError(f"identity names layers [{ident.layer_start}, {ident.layer_stop}) but the state has "
                               f"{state.n_layers}")
        pos = state.positions
        if state.length != ident.pos_stop - ident.pos_start or (state.length and (
                int(pos.min()) != ident.pos_start or int(pos.max()) + 1 != ident.pos_stop)):
            raise KVProbeError(f"identity names positions [{ident.pos_start}, {ident.pos_stop}) but the state holds "
                               f"{state.length} slots at {int(pos.min()) if state.length else '-'}..")
        heads = state.keys[0].shape[1]
        if ident.head_stop - ident.head_start != heads:
            raise KVProbeError(f"identity names KV heads [{ident.head_start}, {ident.head_stop}) but the state has "
                               f"{heads}")


__all__ = ["BlockStore", "CorruptBlockError", "Ledger", "Quarantined", "digest", "payload_state", "state_payload",
           "FORMAT_DTYPES", "Intent"]
