"""The block store: 64-byte control records, write-once payloads across RAM and disk, policy without payload
traffic, the paper's edits as new blocks, precompiled chunks served from the store; and the faults it must
survive: callers mutating what they read, conflicting puts, damaged bytes, process kills, concurrent updaters.

The fault campaigns print their counts (run with ``-s``); ``benchmarks/blocks.py --faults`` runs them larger."""

import logging
import os
import tempfile
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvprobe.blocks import (RECORD_SIZE, BlockStore, CorruptBlockError, Flags, Identity, Intent, Policy, QoS,
                            RecordError, Tier)
from kvprobe.blocks import faults, tiers
from kvprobe.blocks.chunks import load_chunk, put_block, store_chunk, store_erratum, store_refresh, store_rerotated
from kvprobe.blocks.record import IDENTITY, MECHANISM, MECHANISM_OFFSET, POLICY, POLICY_OFFSET, Mechanism
from kvprobe.blocks.store import digest, state_payload
from kvprobe.blocks.tiers import ControlTable
from kvprobe.errors import KVProbeError
from kvprobe.kv import prefill, read_logits
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.state import KVState


def _state(seed: int, slots: int = 4, start: int = 0, layers: int = 2, heads: int = 2) -> KVState:
    g = torch.Generator().manual_seed(seed)
    ks = tuple(torch.randn(1, heads, slots, 8, generator=g) for _ in range(layers))
    vs = tuple(torch.randn(1, heads, slots, 8, generator=g) for _ in range(layers))
    return KVState(ks, vs, torch.arange(start, start + slots))


def _ident(seed: int, slots: int = 4, start: int = 0, layers: int = 2, heads: int = 2, parent: int = 0) -> Identity:
    return Identity(seed + 1, start, start + slots, 0, layers, 0, heads, prefix_hash=seed * 7, parent=parent)


def test_control_record_is_64_bytes_and_round_trips():
    assert (IDENTITY.size, POLICY.size, MECHANISM.size, RECORD_SIZE) == (40, 16, 8, 64)
    ident = Identity(2**64 - 1, 100, 164, 3, 17, 1, 3, prefix_hash=12345, parent=999)
    assert Identity.unpack(ident.pack()) == ident and ident.block_id != Identity(2**64 - 1, 100, 164, 3, 17, 1, 3,
                                                                               12345, 998).block_id
    pol = Policy(tenant=7, qos=QoS.INTERACTIVE, priority=200, intent=Intent.KEEP_HOT, reuse_score=1.5, recency=42)
    assert Policy.unpack(pol.pack()) == pol
    store = BlockStore()
    bid = store.put(_ident(0), _state(0), pol)
    assert len(store.ram.table.record(bid)) == 64 and store.policy(bid) == pol and store.identity(bid) == _ident(0)


def test_tiers_round_trip_and_reopen_from_disk(tmp_path):
    store = BlockStore(tmp_path)
    bid = store.put(_ident(1), _state(1))
    assert store.demote(bid) > 0 and store.where(bid) == [Tier.DISK]
    got = store.get(bid)  # promotion through the memory map
    assert got.max_abs_diff(_state(1)) == 0 and store.where(bid) == [Tier.RAM, Tier.DISK]
    ram_epoch, disk_epoch = store.mechanism(bid, Tier.RAM).epoch, store.mechanism(bid, Tier.DISK).epoch
    assert store.mechanism(bid, Tier.RAM).residency == Tier.RAM and ram_epoch != 1  # regenerated, not copied
    store.update_policy(bid, priority=9)
    store.close()
    cold = BlockStore(tmp_path)  # a new process: the disk tier's control table is the index
    assert cold.where(bid) == [Tier.DISK] and cold.policy(bid).priority == 9 and cold.identity(bid) == _ident(1)
    assert cold.mechanism(bid, Tier.DISK).epoch == disk_epoch
    assert cold.get(bid).max_abs_diff(_state(1)) == 0


def test_write_once_refusals_and_pinning(tmp_path):
    store = BlockStore(tmp_path)
    bid = store.put(_ident(2), _state(2))
    assert store.put(_ident(2), _state(2)) == bid and store.ram.payload_bytes_written == _state(2).nbytes() + 4 * 8
    with pytest.raises(KVProbeError, match="write-once"):
        store.ram.write(_ident(2), Policy(), store.mechanism(bid, Tier.RAM), state_payload(_state(2)))
    store.pin(bid)
    assert store.mechanism(bid, Tier.RAM).flags & Flags.PINNED
    with pytest.raises(KVProbeError, match="pinned"):
        store.demote(bid)
    store.pin(bid, False)
    store.demote(bid)
    with pytest.raises(KVProbeError, match="write-once"):
        store.disk.write(_ident(2), Policy(), store.mechanism(bid, Tier.DISK), state_payload(_state(2)), "x")
    with pytest.raises(KVProbeError, match="positions"):
        store.put(_ident(3, slots=5), _state(3))


class StoreWorkload(RuleBasedStateMachine):
    """Random promote / demote / evict / policy-update workloads against the seed's write-once consequences."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        self.store = BlockStore(self._dir.name)
        self.original: dict[int, str] = {}  # digest of each block's payload when it was created
        self.disk_writes: dict[int, int] = {}  # disk payload writes seen per block life, from the byte counters
        self.made: dict[int, tuple[int, int]] = {}  # block id -> (seed, slots) it was made from

    def teardown(self) -> None:
        self.store.close()
        self._dir.cleanup()

    @rule(seed=st.integers(0, 5), slots=st.integers(1, 6))
    def put(self, seed, slots):
        ident, state = _ident(seed, slots), _state(seed, slots)
        bid = self.store.put(ident, state)
        self.original.setdefault(bid, digest(state_payload(state)))
        self.disk_writes.setdefault(bid, 0)
        self.made[bid] = (seed, slots)

    @precondition(lambda self: self.store.block_ids())
    @rule(data=st.data(), how=st.sampled_from(["zero", "add", "positions"]))
    def mutate_what_get_returned(self, data, how):
        """A caller owns what it reads: mutating it must change no stored copy (the invariants check)."""
        got = self.store.get(data.draw(st.sampled_from(self._any())))
        {"zero": lambda: got.keys[0].zero_(), "add": lambda: got.values[-1].add_(1.0),
         "positions": lambda: got.positions.add_(3)}[how]()

    @precondition(lambda self: self.store.block_ids())
    @rule(data=st.data(), other=st.integers(6, 9))
    def conflicting_put_is_refused(self, data, other):
        bid = data.draw(st.sampled_from(self._any()))
        seed, slots = self.made[bid]
        records = [t.table.record(bid) for t in self.store._tiers() if bid in t]
        with pytest.raises(KVProbeError, match="different payload"):
            self.store.put(_ident(seed, slots), _state(other, slots))
        assert [t.table.record(bid) for t in self.store._tiers() if bid in t] == records

    @precondition(lambda self: self.store.block_ids())
    @rule(data=st.data(), bad=st.sampled_from([{"priority": 256}, {"priority": 300}, {"tenant": -1},
                                               {"tenant": 2**32}, {"qos": 9}, {"intent": 7},
                                               {"reuse_score": float("inf")}, {"tenant": 3, "priority": 999}]))
    def refused_policy_update_changes_nothing(self, data, bad):
        bid = data.draw(st.sampled_from(self._any()))
        records = [t.table.record(bid) for t in self.store._tiers() if bid in t]
        with pytest.raises(RecordError, match="nothing written"):
            self.store.update_policy(bid, **bad)
        assert [t.table.record(bid) for t in self.store._tiers() if bid in t] == records

    @rule()
    def reopen(self):
        """A new process: RAM copies are gone; disk blocks come back with their identity and policy."""
        on_disk = {bid: self.store.disk.table.record(bid)[:MECHANISM_OFFSET] for bid in self.store.disk.table.slots}
        self.store.close()
        self.store = BlockStore(self._dir.name)
        assert not self.store.quarantined and not self.store.repairs
        assert {bid: self.store.disk.table.record(bid)[:MECHANISM_OFFSET] for bid in self.store.disk.table.slots} \
            == on_disk
        for bid in [b for b in self.original if b not in on_disk]:  # RAM-only blocks ended with the process
            self.original.pop(bid)
            self.disk_writes.pop(bid)

    def _ram(self):
        return sorted(self.store.ram.payloads)

    def _any(self):
        return sorted(self.store.block_ids())

    @precondition(lambda self: self.store.ram.payloads)
    @rule(data=st.data())
    def demote(self, data):
        bid = data.draw(st.sampled_from(self._ram()))
        had_copy = bid in self.store.disk
        before = self.store.disk.payload_bytes_written
        written = self.store.demote(bid)
        assert self.store.disk.payload_bytes_written - before == written
        assert (written == 0) == had_copy
        self.disk_writes[bid] += bool(written)

    @precondition(lambda self: self.store.disk.table.slots)
    @rule(data=st.data())
    def promote(self, data):
        bid = data.draw(st.sampled_from(sorted(self.store.disk.table.slots)))
        writes = self.store.disk.payload_bytes_written
        assert digest(state_payload(self.store.promote(bid))) == self.original[bid]
        assert self.store.disk.payload_bytes_written == writes  # a promotion only reads the disk

    @precondition(lambda self: self.store.ram.payloads)
    @rule(data=st.data())
    def evict(self, data):
        bid = data.draw(st.sampled_from(self._ram()))
        had_copy = bid in self.store.disk
        before = (self.store.ram.payload_bytes_written, self.store.disk.payload_bytes_written)
        self.store.evict(bid)
        assert (self.store.ram.payload_bytes_written, self.store.disk.payload_bytes_written) == before  # no writeback
        assert (bid in self.store) == had_copy
        if not had_copy:  # the block's life ended; a later put starts a new one
            self.original.pop(bid)
            self.disk_writes.pop(bid)

    @precondition(lambda self: self.store.block_ids())
    @rule(data=st.data(), priority=st.integers(0, 255), reuse=st.floats(0, 100, width=32), tenant=st.integers(0, 9))
    def update_policy(self, data, priority, reuse, tenant):
        bid = data.draw(st.sampled_from(self._any()))
        tiers = self.store._tiers()
        payload_before = [(t.payload_bytes_read, t.payload_bytes_written) for t in tiers]
        written = self.store.update_policy(bid, priority=priority, reuse_score=reuse, tenant=tenant)
        assert [(t.payload_bytes_read, t.payload_bytes_written) for t in tiers] == payload_before  # zero payload
        assert written == POLICY.size * len(self.store.where(bid))
        assert self.store.policy(bid).priority == priority and self.store.policy(bid).tenant == tenant

    @invariant()
    def each_block_demotes_at_most_once(self):
        assert all(n <= 1 for n in self.disk_writes.values())
        assert all(n <= 1 for n in self.store.demotions.values())

    @invariant()
    def no_tier_copy_is_stale(self):
        for bid in self.store.block_ids():
            copies = self.store.copy_digests(bid)
            assert copies and set(copies.values()) == {self.original[bid]}
            # every copy of a block carries the same identity and policy; mechanism is its own
            records = [t.table.record(bid)[:56] for t in self.store._tiers() if bid in t]
            assert len(set(records)) == 1


TestStoreWorkload = StoreWorkload.TestCase
TestStoreWorkload.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_edits_make_new_blocks_and_never_rewrite_a_payload(tiny_lm, tmp_path):
    store = BlockStore(tmp_path)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (12,), generator=g).tolist()
    (bid,) = store_chunk(store, tiny_lm, ids)
    store.demote(bid)
    payload_file = store.disk.path(bid)
    stamp = (payload_file.stat().st_mtime_ns, payload_file.read_bytes())
    base = store.get(bid)
    # in-place refresh of slots 4..6 (a new field value): a child over those positions, naming its parent
    new_ids = ids[:4] + [7, 8, 9] + ids[7:]
    field_state = prefill(tiny_lm, new_ids[4:7], prior=base.slice(0, 4))
    child = store_refresh(store, tiny_lm, bid, new_ids[4:7], field_state.slice(4, 7))
    assert store.identity(child).parent == bid and (store.identity(child).pos_start, store.identity(child).pos_stop) \
        == (4, 7)
    # an erratum: a new block after the chunk, with no parent
    err_ids = [11, 12, 13]
    err = store_erratum(store, tiny_lm, bid, err_ids, prefill(tiny_lm, err_ids, prior=base).slice(12), ids)
    assert store.identity(err).parent == 0 and store.identity(err).pos_start == 12
    with pytest.raises(KVProbeError, match="inside block"):
        store_erratum(store, tiny_lm, bid, err_ids, base.slice(10), ids)
    # a re-rotation (transplant target) is a child too
    moved = store_rerotated(store, tiny_lm, bid, torch.arange(30, 42))
    assert store.identity(moved).parent == bid and store.get(moved).positions.tolist() == list(range(30, 42))
    assert (payload_file.stat().st_mtime_ns, payload_file.read_bytes()) == stamp
    assert store.get(bid).max_abs_diff(base) == 0 and store.demotions[bid] == 1


def test_precompiled_chunk_served_from_the_store_equals_a_fresh_precompile(tiny_lm, tmp_path):
    g = torch.Generator().manual_seed(9)
    head, chunk, tail = (torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 16, 5))
    store = BlockStore(tmp_path)
    bids = store_chunk(store, tiny_lm, chunk, block_tokens=5)
    assert len(bids) == 4 and [store.identity(b).pos_start for b in bids] == [0, 5, 10, 15]
    assert len({store.identity(b).prefix_hash for b in bids}) == 4  # chained by prefix
    for b in bids:
        store.demote(b)
    store.close()
    cold = BlockStore(tmp_path)
    loaded = load_chunk(cold, tiny_lm, chunk, block_tokens=5)  # promoted from disk, not recomputed
    fresh = precompile(tiny_lm, chunk)
    assert loaded is not None and loaded.max_abs_diff(fresh) < 1e-6 and cold.ledger.calls["promote"] == 4
    assert load_chunk(cold, tiny_lm, chunk[:-1], block_tokens=5) is None
    spliced = assemble(tiny_lm, [Live(tuple(head)), Spliced(tuple(chunk), loaded), Live(tuple(tail[:-1]))])
    ref = assemble(tiny_lm, [Live(tuple(head)), Spliced(tuple(chunk), fresh), Live(tuple(tail[:-1]))])
    assert (read_logits(tiny_lm, spliced, tail[-1:]) - read_logits(tiny_lm, ref, tail[-1:])).abs().max() < 1e-5


def test_put_block_wraps_the_library_block(tiny_lm):
    from kvprobe.kv.blocks import Block

    ids = list(range(3, 11))
    block = Block.from_state(precompile(tiny_lm, ids), ids, tiny_lm.fingerprint, "tok")
    store = BlockStore()
    bid = put_block(store, block)
    assert store.get(bid).max_abs_diff(block.payload) == 0 and store.identity(bid).pos_stop == len(ids)


def test_concurrent_policy_writers_are_atomic_per_record(tmp_path):
    import threading

    store = BlockStore(tmp_path)
    bids = [store.put(_ident(s), _state(s)) for s in range(3)]
    store.demote(bids[0])
    store.get(bids[0])  # one block in both tiers
    payload = store._snapshot()[:2]
    n, writers = 200, 4  # priority is one byte

    def writer(k):
        for i in range(n):  # each thread owns one field; a lost read-modify-write would clobber another's
            field = ["tenant", "priority", "recency", "reuse_score"][k]
            for b in bids:
                store.update_policy(b, **{field: i + 1})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in bids:
        assert store.policy(b) == Policy(tenant=n, priority=n, recency=n, reuse_score=float(n))
    assert store._snapshot()[:2] == payload
    assert store.ledger.metadata["update_policy"] == writers * n * 4 * 16  # 3 blocks, one of them in 2 tiers
    with pytest.raises(KVProbeError, match="unknown policy field"):
        store.update_policy(bids[0], colour=1)


def test_tokenizer_hash_is_cached_per_tokenizer_and_follows_a_changed_vocabulary():
    from kvprobe.kv.blocks import tokenizer_hash

    class Tok:
        def __init__(self):
            self.vocab, self.calls = {f"t{i}": i for i in range(100)}, 0

        def get_vocab(self):
            self.calls += 1
            return dict(self.vocab)

    tok, other = Tok(), Tok()
    first = tokenizer_hash(tok)
    assert tokenizer_hash(tok) == first == tokenizer_hash(other)  # same vocabulary, same hash
    tok.vocab["added"] = 100  # a token added to the same object: a new hash, not the cached one
    assert tokenizer_hash(tok) != first


# -- write-once, enforced -----------------------------------------------------------------------------------
def test_a_caller_mutating_what_it_read_changes_nothing_stored(tmp_path):
    store = BlockStore(tmp_path)
    bid = store.put(_ident(20), _state(20))
    original = digest(state_payload(_state(20)))
    hit = store.get(bid)  # a RAM hit
    for t in (*hit.keys, *hit.values):
        t.zero_()
    hit.positions.add_(5)
    assert store.copy_digests(bid) == {Tier.RAM: original}
    assert store.demote(bid) > 0 and store.copy_digests(bid) == {Tier.DISK: original}  # demoted unchanged
    promoted = store.promote(bid)  # from disk
    promoted.keys[0].fill_(7.0)
    assert store.get(bid).max_abs_diff(_state(20)) == 0
    store.evict(bid)
    assert digest(state_payload(store.get(bid))) == original == store.copy_digests(bid)[Tier.DISK]


def test_a_second_put_with_another_payload_is_refused_and_the_same_one_is_idempotent(tmp_path):
    store = BlockStore(tmp_path)
    bid = store.put(_ident(21), _state(21))
    written = store.ram.payload_bytes_written
    assert store.put(_ident(21), _state(21)) == bid and store.ram.payload_bytes_written == written
    with pytest.raises(KVProbeError, match="different payload.*write-once"):
        store.put(_ident(21), _state(22))
    store.demote(bid)
    store.close()
    cold = BlockStore(tmp_path)  # the digest comes back from the payload file
    with pytest.raises(KVProbeError, match="different payload"):
        cold.put(_ident(21), _state(22))
    assert cold.put(_ident(21), _state(21)) == bid and cold.get(bid).max_abs_diff(_state(21)) == 0


def _payload_data_offset(path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_a_damaged_payload_is_refused_on_promotion_and_quarantined(tmp_path, caplog):
    store = BlockStore(tmp_path)
    good, bad = store.put(_ident(23), _state(23)), store.put(_ident(24), _state(24))
    store.demote(good), store.demote(bad)
    store.close()
    path = tmp_path / f"{bad:016x}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[_payload_data_offset(path) + 5] ^= 0x40  # one flipped bit inside the K/V bytes, same size
    path.write_bytes(bytes(raw))
    store = BlockStore(tmp_path)  # the header is fine: the damage is found when the bytes are read
    assert store.block_ids() == {good, bad} and not store.quarantined
    with caplog.at_level(logging.WARNING, logger="kvprobe.blocks.tiers"):
        with pytest.raises(CorruptBlockError, match="digest.*quarantine"):
            store.get(bad)
    assert bad not in store and not path.exists() and (tmp_path / "quarantine" / path.name).exists()
    assert [q.block_id for q in store.quarantined] == [bad] and "digest" in store.quarantined[0].reason
    assert "quarantined block" in caplog.text
    assert store.get(good).max_abs_diff(_state(23)) == 0
    store.put(_ident(24), _state(24))  # recomputed: it can be stored and demoted again
    assert store.demote(bad) > 0 and store.get(bad).max_abs_diff(_state(24)) == 0
    store.close()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    verified = BlockStore(tmp_path, verify=True)  # verify=True finds it while opening
    assert bad not in verified and good in verified and [q.block_id for q in verified.quarantined] == [bad]


def test_reopening_quarantines_damaged_blocks_cleans_temp_files_adopts_orphans_and_opens_the_rest(tmp_path, caplog):
    store = BlockStore(tmp_path)
    bids = [store.put(_ident(30 + i), _state(30 + i), Policy(priority=10 + i)) for i in range(5)]
    for b in bids:
        store.demote(b)
    for i, b in enumerate(bids):
        store.update_policy(b, priority=100 + i)
    slots = dict(store.disk.table.slots)
    store.close()
    truncated, orphan, flipped, dropping, fine = bids
    p = tmp_path / f"{truncated:016x}.safetensors"
    p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])
    control = bytearray((tmp_path / "control.bin").read_bytes())
    # the orphan: a kill between its payload's rename and its record
    control[slots[orphan] * RECORD_SIZE:(slots[orphan] + 1) * RECORD_SIZE] = bytes(RECORD_SIZE)
    control[slots[flipped] * RECORD_SIZE + 3] ^= 0x10  # one identity byte
    (tmp_path / "control.bin").write_bytes(bytes(control))
    (tmp_path / ".incoming-0123456789abcdef-00000000.tmp").write_bytes(b"half a payload")
    os.replace(tmp_path / f"{dropping:016x}.safetensors", tmp_path / f"{dropping:016x}.safetensors.drop")
    with caplog.at_level(logging.WARNING, logger="kvprobe.blocks.tiers"):
        store = BlockStore(tmp_path)
    assert "reopened" in caplog.text and "truncated" in caplog.text
    assert store.block_ids() == {orphan, flipped, fine}  # every undamaged block opens
    assert [(q.block_id, q.moved_to.name) for q in store.quarantined] == [(truncated, p.name)]
    assert "truncated" in store.quarantined[0].reason and (tmp_path / "quarantine" / p.name).exists()
    repairs = "\n".join(store.repairs)
    assert "stale temp file" in repairs and "check byte" in repairs and "finished dropping" in repairs
    assert sum(r.startswith("adopted") for r in store.repairs) == 2 and not list(tmp_path.glob("*.tmp"))
    for i, b in enumerate(bids):
        if b in store:
            assert store.get(b).max_abs_diff(_state(30 + i)) == 0 and store.identity(b) == _ident(30 + i)
    assert store.policy(fine).priority == 104
    assert store.policy(orphan).priority == 11 and store.policy(flipped).priority == 12  # as at their demotion
    store.put(_ident(30), _state(30))  # the quarantined and the dropped block can be stored again
    store.put(_ident(33), _state(33))
    assert store.demote(truncated) > 0 and store.demote(dropping) > 0
    store.close()
    again = BlockStore(tmp_path)
    assert not again.quarantined and not again.repairs and len(again.block_ids()) == 5


def test_a_store_is_opened_by_one_opener_at_a_time(tmp_path):
    store = BlockStore(tmp_path)
    with pytest.raises(KVProbeError, match="open elsewhere"):
        BlockStore(tmp_path)
    store.close()
    BlockStore(tmp_path).close()


def test_a_demotion_is_durable_before_it_returns(tmp_path, monkeypatch):
    """Temp file written and fsynced, renamed, directory fsynced, then the record written and fsynced."""
    store = BlockStore(tmp_path)
    bid = store.put(_ident(25), _state(25))
    calls = []

    class Recording:
        def __getattr__(self, name):
            real = getattr(os, name)
            if name not in ("write", "pwrite", "fsync", "replace", "open"):
                return real

            def call(*args, **kwargs):
                out = real(*args, **kwargs)
                if name == "open":
                    calls.append(("open", os.path.basename(str(args[0]))))
                    fds[out] = os.path.basename(str(args[0])) or "."
                elif name == "fsync":
                    calls.append(("fsync", fds.get(args[0], "control.bin")))
                elif name == "replace":
                    calls.append(("replace", os.path.basename(str(args[1]))))
                else:
                    calls.append((name, fds.get(args[0], "control.bin")))
                return out

            return call

    fds = {}
    monkeypatch.setattr(tiers, "os", Recording())
    store.demote(bid)
    name = f"{bid:016x}.safetensors"
    tmp = next(c[1] for c in calls if c[0] == "open" and c[1].startswith(".incoming-"))
    events = [c for c in calls if c[0] != "open"]
    root = os.path.basename(str(tmp_path))
    assert events == [("write", tmp), ("fsync", tmp), ("replace", name), ("fsync", root), ("pwrite", "control.bin"),
                      ("fsync", "control.bin")]


def test_a_refused_policy_update_changes_nothing_in_ram_or_on_disk(tmp_path):
    store = BlockStore(tmp_path)
    bid = store.put(_ident(26), _state(26), Policy(tenant=7, priority=200, reuse_score=1.5, recency=42))
    store.demote(bid)
    store.get(bid)  # in both tiers
    before = [store.ram.table.record(bid), store.disk.table.record(bid), (tmp_path / "control.bin").read_bytes()]
    for bad in ({"priority": 300}, {"tenant": -1}, {"qos": 5}, {"reuse_score": float("nan")},
                {"recency": 2**32}, {"tenant": 1, "priority": 256}):
        with pytest.raises(RecordError, match="refused, nothing written"):
            store.update_policy(bid, **bad)
    with pytest.raises(KVProbeError, match="unknown policy field"):
        store.update_policy(bid, priority=1, colour=1)
    assert [store.ram.table.record(bid), store.disk.table.record(bid),
            (tmp_path / "control.bin").read_bytes()] == before
    with pytest.raises(RecordError, match="priority"):
        Policy(priority=300)
    store.close()
    assert BlockStore(tmp_path).policy(bid) == Policy(tenant=7, priority=200, reuse_score=1.5, recency=42)


def test_an_update_never_lands_on_a_recycled_slot():
    """The review's race, made deterministic: the updater is held between looking up the block's slot and
    writing it, while the block is removed and another block takes its slot."""
    table = ControlTable()
    b1, b2 = _ident(40), _ident(41)
    mech = Mechanism(Tier.RAM, 1)
    table.add(b1, Policy(), mech)
    looked_up, recycled = threading.Event(), threading.Event()
    updater = threading.current_thread()  # this thread updates; the helper recycles the slot

    class SlowLookups(dict):
        def get(self, key, default=None):
            out = super().get(key, default)
            self._hold()
            return out

        def __getitem__(self, key):
            out = super().__getitem__(key)
            self._hold()
            return out

        def _hold(self):
            if threading.current_thread() is updater and not looked_up.is_set():
                looked_up.set()
                recycled.wait(2)

    table.slots = SlowLookups(table.slots)
    errors = []

    def recycle():
        looked_up.wait(2)
        table.remove(b1.block_id)
        table.add(b2, Policy(), mech)  # takes the slot b1 freed
        recycled.set()

    helper = threading.Thread(target=recycle)
    helper.start()
    try:
        table.update_policy(b1.block_id, {"tenant": 4242})
    except KVProbeError as e:
        errors.append(str(e))
    helper.join()
    assert table.slots[b2.block_id] == 0 and table.policy(b2.block_id) == Policy()
    assert errors and "no record" in errors[0]


# -- fault campaigns (their counts print with -s) -----------------------------------------------------------
def test_sigkill_at_random_points_loses_no_acknowledged_block_and_accepts_no_torn_one(tmp_path):
    t = time.perf_counter()
    report = faults.kill_trials(tmp_path, trials=60, seed=1)
    print(f"\n{report.line()} ({time.perf_counter() - t:.1f} s)")
    assert report.ok, report.problems
    assert report.trials == 60 and report.acknowledged > report.trials
    assert len([k for k in report.notes if k.startswith("killed ")]) >= 6  # kills landed at several syscalls
    assert report.notes.get("recoveries killed", 0) > 0
    assert report.notes.get("payloads adopted", 0) + report.notes.get("temp files removed", 0) > 0


def test_concurrent_updaters_never_misdirect_or_tear_a_policy(tmp_path):
    t = time.perf_counter()
    report = faults.concurrent_updaters(tmp_path, rounds=3, seconds=0.3, seed=2)
    print(f"\n{report.line()} ({time.perf_counter() - t:.1f} s)")
    assert report.ok, report.problems
    assert report.acknowledged > 1000 and report.notes["drops that freed a slot"] > 20
    assert report.notes["refused updates"] > 100


def test_flipped_and_truncated_bytes_are_never_served_and_spare_the_other_blocks(tmp_path):
    t = time.perf_counter()
    report = faults.corruption_trials(tmp_path, trials=120, seed=3)
    print(f"\n{report.line()} ({time.perf_counter() - t:.1f} s)")
    assert report.ok, report.problems
    assert report.quarantined > 0 and report.notes.get("damage caught on promotion", 0) > 0
