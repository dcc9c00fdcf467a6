"""Fault injection for the block store: process kills, concurrent policy writers, damaged bytes.

Each campaign returns a ``FaultReport`` whose ``lost`` (acknowledged blocks missing or wrong after recovery)
and ``torn_accepted`` (blocks served with bytes other than the ones stored) must both be 0:

- ``kill_trials``: a forked child runs a random plan of puts + demotions, policy updates, promotions and drops
  against a disk store and acknowledges each operation after it returns; it is killed with SIGKILL at a
  random store syscall (``write``/``pwrite``/``fsync``/``rename``/``unlink``/``ftruncate``, before or after it)
  or on a random timer; after half the kills a second child that only reopens the store is killed inside its
  recovery. The parent reopens the store and checks every block against the acknowledged operations (the one
  in flight may have happened or not), and the next child re-demotes whatever the kill lost;
- ``concurrent_updaters``: threads updating one set of blocks' policies while another thread evicts, drops
  and re-puts blocks (recycling record slots) and moves blocks between tiers; no update may land on another
  block, refused updates must change nothing, and a block's copies must agree;
- ``corruption_trials``: one byte flipped, a file truncated, or garbage appended, in a random file of a closed
  store; reopening must open every undamaged block and never serve damaged bytes.

``benchmarks/blocks.py --faults`` runs all three and prints the counts; ``tests/test_blocks.py`` runs them
smaller.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import select
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvprobe.blocks import tiers
from kvprobe.blocks.record import RECORD_SIZE, Identity, Policy
from kvprobe.blocks.store import BlockStore, state_payload
from kvprobe.blocks.tiers import CorruptBlockError, digest
from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState


@dataclass
class FaultReport:
    campaign: str
    trials: int
    acknowledged: int = 0  # acknowledged operations (kills), updates (threads) or stored blocks (damage) checked
    lost: int = 0  # acknowledged blocks missing, wrong, or with a policy neither acknowledged nor in flight
    torn_accepted: int = 0  # a block served (or listed and promotable) with bytes other than the stored ones
    quarantined: int = 0  # blocks moved aside (damaged bytes, or an unacknowledged write)
    repairs: int = 0  # reopen fixes that lost nothing (temp files removed, payloads adopted, records cleared)
    errors: int = 0  # operations that raised where they must not (e.g. a re-demotion refused)
    notes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # the first few failures, for the assertion message

    def fail(self, counter: str, message: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.problems) < 10:
            self.problems.append(message)

    def note(self, key: str, n: int = 1) -> None:
        self.notes[key] = self.notes.get(key, 0) + n

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.torn_accepted == 0 and self.errors == 0

    def line(self) -> str:
        extra = "".join(f", {k} {v}" for k, v in sorted(self.notes.items()))
        return (f"{self.campaign}: trials {self.trials}, acknowledged {self.acknowledged}, acknowledged blocks "
                f"lost {self.lost}, torn blocks accepted {self.torn_accepted}, errors {self.errors}, quarantined "
                f"{self.quarantined}, repairs {self.repairs}{extra}")


def block(seed: int) -> tuple[Identity, KVState]:
    """A deterministic block: 2 layers x 2 KV heads x 8 dims, 8 positions (512 for every 4th seed, so a
    timed kill can land inside a payload write)."""
    slots = 512 if seed % 4 == 3 else 8
    g = torch.Generator().manual_seed(seed)
    keys = tuple(torch.randn(1, 2, slots, 8, generator=g) for _ in range(2))
    values = tuple(torch.randn(1, 2, slots, 8, generator=g) for _ in range(2))
    ident = Identity(1_000_003 * (seed + 1), 0, slots, 0, 2, 0, 2, prefix_hash=seed + 7)
    return ident, KVState(keys, values, torch.arange(slots))


@functools.lru_cache(maxsize=4096)
def block_digest(seed: int) -> str:
    return digest(state_payload(block(seed)[1]))


@functools.lru_cache(maxsize=4096)
def block_id(seed: int) -> int:
    return block(seed)[0].block_id


def _quiet(campaign: Callable[..., FaultReport]) -> Callable[..., FaultReport]:
    """The campaigns reopen damaged stores hundreds of times: they count the recovery reports rather than log
    each one."""

    @functools.wraps(campaign)
    def run(*args: object, **kwargs: object) -> FaultReport:
        logger = logging.getLogger(tiers.__name__)
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            return campaign(*args, **kwargs)
        finally:
            logger.setLevel(level)

    return run


# -- kills ----------------------------------------------------------------------------------------------
_KILL_POINTS = ("write", "pwrite", "fsync", "replace", "unlink", "ftruncate")


class _KillingOS:
    """Stands in for ``os`` inside ``kvprobe.blocks.tiers`` in a child: SIGKILLs the process at its n-th store
    syscall, just before or just after it, and says where on the acknowledgement pipe first."""

    def __init__(self, at: int, after: bool, ack_fd: int) -> None:
        self._at, self._after, self._ack_fd, self._calls = at, after, ack_fd, 0

    def __getattr__(self, name: str) -> object:
        real = getattr(os, name)
        if name not in _KILL_POINTS:
            return real

        def call(*args: object, **kwargs: object) -> object:
            self._calls += 1
            if self._calls == self._at and not self._after:
                self._die(f"before {name}")
            out = real(*args, **kwargs)
            if self._calls == self._at and self._after:
                self._die(f"after {name}")
            return out

        return call

    def _die(self, where: str) -> None:
        os.write(self._ack_fd, f"kill {where}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


# store syscalls per operation (a bound for where a kill can land): a demotion writes, fsyncs, renames,
# fsyncs the directory, writes its record and fsyncs control.bin; a drop renames, writes, fsyncs, unlinks
# and fsyncs the directory; a policy update is one pwrite; opening fsyncs control.bin and the directory.
_SYSCALLS = {"demote": 6, "drop": 5, "policy": 1, "promote": 0}
_OPEN_SYSCALLS = 3


def _plan(rng: random.Random, present: dict[int, int], retry: list[int], next_seed: list[int]) -> list[tuple]:
    """Operations for one child, legal in sequence from the state ``present`` (seed -> priority on disk)."""
    state = dict(present)
    ops: list[tuple] = []
    for _ in range(rng.randint(4, 10)):
        kind = rng.choice(["demote", "demote", "policy", "policy", "promote", "drop"] if state else ["demote"])
        if kind == "demote":
            if retry:
                seed = retry.pop()
            else:
                seed, next_seed[0] = next_seed[0], next_seed[0] + 1
            if seed in state:
                continue
            prio = rng.randrange(256)
            ops.append(("demote", seed, prio))
            state[seed] = prio
        elif kind == "policy":
            seed = rng.choice(sorted(state))
            prio = rng.randrange(256)
            ops.append(("policy", seed, prio))
            state[seed] = prio
        elif kind == "promote":
            ops.append(("promote", rng.choice(sorted(state))))
        else:
            seed = rng.choice(sorted(state))
            ops.append(("drop", seed))
            del state[seed]
    return ops


def _apply(state: dict[int, int], op: tuple) -> dict[int, int]:
    out = dict(state)
    if op[0] in ("demote", "policy"):
        out[op[1]] = op[2]
    elif op[0] == "drop":
        out.pop(op[1], None)
    return out


def _child(root: Path, plan: list[tuple], ack_fd: int, kill_at: int | None, after: bool) -> None:
    """Runs in the forked child; never returns."""
    try:
        torch.set_num_threads(1)
        if kill_at is not None:
            tiers.os = _KillingOS(kill_at, after, ack_fd)
        store = BlockStore(root)
        for i, op in enumerate(plan):
            ident, state = block(op[1])
            bid = ident.block_id
            if op[0] == "demote":
                store.put(ident, state, Policy(priority=op[2]))
                store.demote(bid)
            elif op[0] == "policy":
                store.update_policy(bid, priority=op[2])
            elif op[0] == "promote":
                if digest(state_payload(store.get(bid))) != block_digest(op[1]):
                    os.write(ack_fd, f"torn {op[1]}\n".encode())
                store.evict(bid)
            else:
                store.drop(bid)
            os.write(ack_fd, f"ack {i}\n".encode())
        store.close()
        os.write(ack_fd, b"done\n")
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which counts it
        os.write(ack_fd, f"error {type(e).__name__}: {e}".replace("\n", " ")[:400].encode() + b"\n")
    finally:
        os._exit(0)


def _run_child(root: Path, plan: list[tuple], kill_at: int | None, after: bool, delay: float | None
               ) -> tuple[list[str], float]:
    read_fd, write_fd = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(root, plan, write_fd, kill_at, after)
    os.close(write_fd)
    if delay is not None:
        select.select([], [], [], delay)  # a plain sleep, as close to the delay as the scheduler allows
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    elapsed = time.perf_counter() - t0
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    return b"".join(chunks).decode(errors="replace").splitlines(), elapsed


@_quiet
def kill_trials(root: str | Path, trials: int = 60, seed: int = 0) -> FaultReport:
    """SIGKILL a child store at random points until ``trials`` children were killed (a child that finishes
    first is checked too, and not counted), over one store that lives on across the kills; half the attempts
    kill at a store syscall, half on a timer."""
    if sys.platform != "linux":
        raise KVProbeError("kill_trials forks and SIGKILLs a child: it runs on Linux")
    root = Path(root)
    rng = random.Random(seed)
    report = FaultReport("SIGKILL", trials)
    present: dict[int, int] = {}  # seed -> priority, as found after the last recovery
    retry: list[int] = []
    next_seed = [seed * 100_000]
    # a child's run time, so that timed kills land inside it: one calibration child runs a plan to the end
    calibration = _plan(rng, present, retry, next_seed)
    lines, elapsed = _run_child(root, calibration, None, False, None)
    if "done" not in lines:
        raise KVProbeError(f"the calibration child did not finish: {lines[-3:]}")
    per_op = elapsed / len(calibration)
    for op in calibration:
        present = _apply(present, op)
    killed = trial = 0
    while killed < trials:
        trial += 1
        if trial > 3 * trials:
            raise KVProbeError(f"only {killed} of {trial - 1} children were killed before finishing: the timed "
                               "kills come too late on this machine")
        plan = _plan(rng, present, retry, next_seed)
        syscall_kill = trial % 2 == 1
        kill_at = rng.randint(1, _OPEN_SYSCALLS + sum(_SYSCALLS[op[0]] for op in plan)) if syscall_kill else None
        delay = None if syscall_kill else rng.uniform(0, 0.8 * per_op * len(plan))  # mostly before the end
        lines, elapsed = _run_child(root, plan, kill_at, rng.random() < 0.5, delay)
        acked = sum(1 for ln in lines if ln.startswith("ack "))
        if "done" in lines:
            report.note("children that finished before the kill")
        else:
            killed += 1
        report.acknowledged += acked
        for ln in lines:
            if ln.startswith("kill "):
                report.note(f"killed {ln[5:]}")
            elif ln.startswith("torn"):
                report.fail("torn_accepted", f"trial {trial}: child promoted damaged bytes of block {ln.split()[1]}")
        if "done" not in lines and rng.random() < 0.5:
            # a second crash, inside the recovery of the first: a child that only opens the store, killed at one
            # of its first recovery syscalls (removing temp files, clearing records, adopting, fsyncing)
            rec_lines, _ = _run_child(root, [], rng.randint(1, 8), rng.random() < 0.5, None)
            if any(ln.startswith("kill ") for ln in rec_lines):
                report.note("recoveries killed")
            lines += [ln for ln in rec_lines if ln.startswith("error")]
        for ln in lines:
            if ln.startswith("error"):
                report.fail("errors", f"trial {trial}: child {ln}")
        expected = present
        for op in plan[:acked]:
            expected = _apply(expected, op)
        in_flight = plan[acked] if acked < len(plan) and "done" not in lines else None
        allowed_after = _apply(expected, in_flight) if in_flight else expected
        with BlockStore(root) as store:
            report.quarantined += len(store.quarantined)
            report.repairs += len(store.repairs)
            for r in store.repairs:
                report.note("payloads adopted" if r.startswith("adopted") else
                            "temp files removed" if "temp file" in r else "other repairs")
            for q in store.quarantined:
                if q.block_id is not None and any(block_id(s) == q.block_id for s in expected):
                    report.fail("lost", f"trial {trial}: acknowledged block quarantined: {q.reason}")
            seeds = set(present) | set(expected) | set(allowed_after) | {op[1] for op in plan}
            by_id = {block_id(s): s for s in seeds}
            found: dict[int, int] = {}
            touched = {op[1] for op in plan} | set(retry)
            for bid in sorted(store.block_ids()):
                s = by_id.get(bid)
                if s is None:
                    report.fail("torn_accepted", f"trial {trial}: an unknown block {bid:016x} opened")
                    continue
                if s not in touched and trial % 10:  # untouched blocks: listed is enough, read every 10th trial
                    found[s] = store.policy(bid).priority
                    continue
                try:
                    served = digest(state_payload(store.get(bid)))
                except CorruptBlockError as e:
                    if s in expected:
                        report.fail("lost", f"trial {trial}: acknowledged block {s} corrupt: {e}")
                    continue
                if served != block_digest(s):
                    report.fail("torn_accepted", f"trial {trial}: block {s} served with other bytes")
                    continue
                found[s] = store.policy(bid).priority
                store.evict(bid)
            for s in seeds:
                ok_states = {("absent" if s not in st else st[s]) for st in (expected, allowed_after)}
                now = found.get(s, "absent")
                if now not in ok_states:
                    counter = "lost" if s in expected else "errors"
                    report.fail(counter, f"trial {trial}: block {s} is {now!r}, expected one of "
                                         f"{sorted(map(str, ok_states))} (in flight: {in_flight})")
            if any(root.glob(".incoming-*")):
                report.fail("errors", f"trial {trial}: temp files left after reopening")
            retry.extend(s for s in seeds if s not in found and s not in retry)  # lost by the kill: demote again
            present = found
    report.note("blocks on disk at the end", len(present))
    return report


# -- concurrent updaters --------------------------------------------------------------------------------
@_quiet
def concurrent_updaters(root: str | Path, rounds: int = 4, seconds: float = 0.25, writers: int = 3, seed: int = 0
                        ) -> FaultReport:
    """``rounds`` fresh stores, each ``seconds`` long: writers set marked policies on blocks A while a mover
    recycles slots (drop / evict / re-put A, put B) and moves A between tiers; another thread sends refused
    updates (priority >= 300). Checks: no B block ever carries a writer's mark, no refused update is accepted,
    and a block's copies agree."""
    report = FaultReport("concurrent updaters", rounds)
    for r in range(rounds):
        _updaters_round(Path(root) / f"round{r}", seconds, writers, seed * 100 + r, report)
    return report


def _updaters_round(root: Path, seconds: float, writers: int, seed: int, report: FaultReport) -> None:
    a_seeds = [seed * 1000 + i for i in range(6)]
    b_seeds = [seed * 1000 + 100 + i for i in range(12)]  # B blocks are never updated: a mark on one is misdirected
    a_ids = [block(s)[0].block_id for s in a_seeds]
    stop = threading.Event()
    counts = [0] * writers
    recycles = [0]
    errors: list[str] = []
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so lookups and slot recycling interleave
    store = BlockStore(root)
    try:
        for s in a_seeds:
            store.put(*block(s))
        c_ids = []  # blocks in both tiers that only refused updates touch: their records must never change
        for s in (seed * 1000 + 200, seed * 1000 + 201):
            c_ids.append(store.put(*block(s), Policy(tenant=7, priority=70, reuse_score=0.5)))
            store.demote(c_ids[-1])
            store.get(c_ids[-1])
        c_records = {bid: [t.table.record(bid) for t in store._tiers()] for bid in c_ids}

        def writer(k: int) -> None:
            r = random.Random(k)
            while not stop.is_set():
                bid = r.choice(a_ids)
                try:
                    store.update_policy(bid, tenant=4242 + k, priority=200 + k)
                    counts[k] += 1
                except KVProbeError as e:
                    if "no block" not in str(e) and "no record" not in str(e):
                        errors.append(f"writer {k}: {e}")

        def refuser() -> None:
            r = random.Random(99)
            while not stop.is_set():
                bid = r.choice(a_ids + c_ids)
                bad = r.choice([{"priority": 256 + r.randrange(100)}, {"tenant": -1}, {"qos": 9},
                                {"reuse_score": float("nan")}, {"tenant": 5, "priority": 999}])
                try:
                    store.update_policy(bid, **bad)
                    errors.append(f"an update {bad} was accepted")
                except KVProbeError:
                    counts.append(0)  # one refusal
                if bid in c_records and [t.table.record(bid) for t in store._tiers()] != c_records[bid]:
                    errors.append(f"a refused update {bad} changed block {bid:016x}'s records")

        def mover() -> None:
            r = random.Random(seed)
            live_b: list[int] = []
            while not stop.is_set():
                s = r.choice(a_seeds)
                bid = block(s)[0].block_id
                try:
                    action = r.random()
                    if bid not in store:
                        store.put(*block(s))
                    elif action < 0.3:
                        store.drop(bid)
                        b = r.choice(b_seeds)  # most likely to take the slot just freed
                        if b not in live_b:
                            store.put(*block(b))
                            live_b.append(b)
                    elif action < 0.6 and bid in store.ram:
                        store.demote(bid)
                    elif action < 0.8:
                        store.get(bid)
                    elif bid in store.ram:
                        store.evict(bid)
                    if len(live_b) > 6:
                        gone = live_b.pop(0)
                        if gone not in live_b:
                            store.drop(block(gone)[0].block_id)
                    recycles[0] += action < 0.3
                except KVProbeError as e:
                    errors.append(f"mover: {e}")

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
        threads += [threading.Thread(target=refuser), threading.Thread(target=mover)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        report.acknowledged += sum(counts[:writers])
        report.note("refused updates", len(counts) - writers)
        for e in errors:
            report.fail("errors", e)
        for bid in sorted(store.block_ids()):
            policies = {tier.table.policy(bid) for tier in store._tiers() if bid in tier}
            if len(policies) != 1:
                report.fail("lost", f"block {bid:016x}: its copies disagree: {policies}")
            pol = policies.pop()
            if bid not in a_ids and pol.tenant >= 4242:
                report.fail("lost", f"block {bid:016x} (never updated) carries a writer's mark {pol}")
            if pol.priority >= 256:
                report.fail("errors", f"block {bid:016x} has priority {pol.priority}")
    finally:
        sys.setswitchinterval(old_interval)
        store.close()
    report.note("drops that freed a slot", recycles[0])


# -- damaged bytes --------------------------------------------------------------------------------------
@_quiet
def corruption_trials(root: str | Path, trials: int = 200, seed: int = 0, blocks: int = 6) -> FaultReport:
    """Damage one file of a closed store per trial (flip a byte, truncate, append garbage), reopen it (every
    other trial with ``verify=True``) and read every block back."""
    root = Path(root)
    rng = random.Random(seed)
    report = FaultReport("damaged bytes", trials)
    seeds = [seed * 1000 + 500 + i for i in range(blocks)]
    pristine = root / "pristine"
    with BlockStore(pristine) as store:
        for i, s in enumerate(seeds):
            ident, state = block(s)
            store.put(ident, state, Policy(priority=10 + i))
            store.demote(ident.block_id)
            store.update_policy(ident.block_id, priority=100 + i)  # after demotion: an adopted payload shows 10 + i
    files = sorted(p.name for p in pristine.iterdir() if p.is_file() and not p.name.startswith("."))
    for trial in range(trials):
        work = root / f"trial{trial}"
        shutil.copytree(pristine, work)
        name = rng.choice(files)
        path = work / name
        data = bytearray(path.read_bytes())
        action = rng.choice(["flip", "flip", "flip", "truncate", "append"])
        if action == "flip":  # in control.bin, mostly inside the used records (the rest is empty slots)
            used = len(seeds) * RECORD_SIZE if name == "control.bin" and rng.random() < 0.8 else len(data)
            data[rng.randrange(used)] ^= rng.randrange(1, 256)
        elif action == "truncate":
            data = data[:rng.randrange(len(data))]
        else:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))
        path.write_bytes(bytes(data))
        report.note(f"{action} in {'control.bin' if name == 'control.bin' else 'a payload file'}")
        damaged = int(name[:16], 16) if name.endswith(".safetensors") else None
        verify = trial % 2 == 1
        with BlockStore(work, verify=verify) as store:
            report.acknowledged += len(seeds)
            report.quarantined += len(store.quarantined)
            report.repairs += len(store.repairs)
            reported = {q.block_id for q in store.quarantined}
            for i, s in enumerate(seeds):
                bid = block(s)[0].block_id
                where = f"trial {trial} ({action} in {name}, verify={verify}): block {s}"
                if bid not in store:
                    if bid != damaged:
                        report.fail("lost", f"{where} did not open (only {name} was damaged)")
                    elif bid not in reported:
                        report.fail("lost", f"{where} vanished without a quarantine report")
                    continue
                try:
                    served = digest(state_payload(store.get(bid)))
                except CorruptBlockError:
                    if bid != damaged:
                        report.fail("lost", f"{where} quarantined but its file was not damaged")
                    else:
                        report.note("damage caught on promotion")
                    continue
                if served != block_digest(s):
                    report.fail("torn_accepted", f"{where} served with damaged bytes")
                policy = store.policy(bid)
                if policy != Policy(priority=100 + i):
                    if policy == Policy(priority=10 + i) and store.repairs:
                        report.note("policy back to its demotion-time value (record rebuilt, reported)")
                    else:
                        report.fail("torn_accepted", f"{where} has policy {policy}, stored priority {100 + i}")
        shutil.rmtree(work)
    return report
