"""The block store: 64-byte control records, write-once payloads across RAM and disk, policy without payload
traffic, the paper's edits as new blocks, and precompiled chunks served from the store."""

import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvprobe.blocks import RECORD_SIZE, BlockStore, Flags, Identity, Intent, Policy, QoS, Tier
from kvprobe.blocks.chunks import load_chunk, put_block, store_chunk, store_erratum, store_refresh, store_rerotated
from kvprobe.blocks.record import IDENTITY, MECHANISM, POLICY
from kvprobe.blocks.store import digest, state_payload
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

    def teardown(self) -> None:
        self.store.close()
        self._dir.cleanup()

    @rule(seed=st.integers(0, 5), slots=st.integers(1, 6))
    def put(self, seed, slots):
        ident, state = _ident(seed, slots), _state(seed, slots)
        bid = self.store.put(ident, state)
        self.original.setdefault(bid, digest(state_payload(state)))
        self.disk_writes.setdefault(bid, 0)

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
