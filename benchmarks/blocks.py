"""Benchmark: the block store's metadata costs, which the seed says must be measured, not argued.

A real chunk of the model (the gated template's filler rules, ``--chunk`` tokens) is precompiled once and
stored as blocks of ``--block-tokens`` positions. Then, side by side in this run:

1. the control record's size against a block's payload;
2. lookup throughput on the promotion path: a RAM hit (the reader gets a copy), and a promotion from the disk
   tier (memory-mapped safetensors, file pages warm in the OS cache, the payload's digest checked) followed by
   an eviction that writes nothing;
3. policy-update cost under 1..N concurrent writer threads (validated, then one 16-byte store per copy under
   its stripe lock; on disk a ``pwrite``),
   beside the same update through ``kvprobe.kv.blocks.BlockLibrary`` (JSON metadata rewritten per update);
4. payload vs metadata bytes moved per operation, from the store's ledger.

With ``--faults`` it runs the store's fault campaigns instead (``kvprobe.blocks.faults``; no model is loaded):
children SIGKILLed at random store syscalls and on timers, concurrent policy writers over recycled record
slots, and flipped / truncated / extended files; each prints its trials, acknowledged blocks lost and torn
blocks accepted (both must be 0).

    make bench-blocks [MODEL=smollm2-135m] [ARGS="--chunk 1024 --block-tokens 64"]
    make bench-blocks ARGS="--faults [--kills 200 --damage 400 --updater-rounds 8]"
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvprobe.blocks import RECORD_SIZE, BlockStore, QoS, faults
from kvprobe.blocks.chunks import store_chunk, store_erratum, store_refresh
from kvprobe.kv.blocks import Block, BlockLibrary
from kvprobe.kv.compose import precompile
from kvprobe.kv.readout import prefill
from kvprobe.models.loading import load_model
from kvprobe.tasks.gated import load_template


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}/s"


def run_faults(args: argparse.Namespace) -> int:
    """The fault campaigns, each in its own temporary directory; returns 1 if any lost or accepted a torn block."""
    print(f"block store fault campaigns, seed {args.seed}; a 'trial' is one killed child, one damaged store or one "
          f"round of threads")
    failed = 0
    for name, run in (("kills", lambda d: faults.kill_trials(d, trials=args.kills, seed=args.seed)),
                      ("threads", lambda d: faults.concurrent_updaters(d, rounds=args.updater_rounds, seconds=0.5,
                                                                      seed=args.seed)),
                      ("damage", lambda d: faults.corruption_trials(d, trials=args.damage, seed=args.seed))):
        with tempfile.TemporaryDirectory(prefix=f"kvprobe-faults-{name}-") as d:
            t = time.perf_counter()
            report = run(d)
            print(f"\n{report.line()}\n   ({time.perf_counter() - t:.1f} s)")
            for problem in report.problems:
                print(f"   FAILED: {problem}")
            failed |= not report.ok
    return int(failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--faults", action="store_true", help="run the fault campaigns (no model) instead")
    ap.add_argument("--kills", type=int, default=200, help="--faults: children to SIGKILL")
    ap.add_argument("--damage", type=int, default=400, help="--faults: stores to damage")
    ap.add_argument("--updater-rounds", type=int, default=8, help="--faults: rounds of concurrent updaters (0.5 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--updates", type=int, default=20000, help="policy updates per thread count")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.faults:
        raise SystemExit(run_faults(args))
    lm = load_model(args.model, device="cpu", dtype="float32")
    tpl = load_template("configs/tasks/gated.yaml")
    rules = lm.tokenizer("\n".join(tpl.filler_rules) + "\n", add_special_tokens=False)["input_ids"]
    chunk = (rules * (args.chunk // len(rules) + 1))[:args.chunk]
    with torch.no_grad():
        state = precompile(lm, chunk)
    root = Path(tempfile.mkdtemp(prefix="kvprobe-blocks-"))
    store = BlockStore(root / "store")
    bids = store_chunk(store, lm, chunk, block_tokens=args.block_tokens, state=state)
    block_bytes = store.get(bids[0]).nbytes()
    print(f"{args.model}: chunk {len(chunk)} tokens in {len(bids)} blocks of {args.block_tokens} positions; "
          f"fp32 K/V payload {block_bytes / 2**20:.2f} MiB per block; median of {args.repeats} where timed")
    print(f"\n1. control record: {RECORD_SIZE} B per block copy (identity 40 + policy 16 + mechanism 8) = "
          f"{RECORD_SIZE / block_bytes:.5%} of a block's payload")

    # 2. lookups on the promotion path
    rng = random.Random(0)
    order = [rng.choice(bids) for _ in range(args.lookups)]
    for b in bids:
        store.demote(b)  # each block's one demotion: the disk now holds every block
    store.get(bids[0])
    store.evict(bids[0])  # warm the file pages
    ram_t, disk_t = [], []
    for _ in range(args.repeats):
        for b in bids:
            store.get(b)
        t = time.perf_counter()
        for b in order:
            store.get(b)
        ram_t.append(time.perf_counter() - t)
        n_disk = min(args.lookups, 200)
        t = time.perf_counter()
        for b in order[:n_disk]:
            if b in store.ram:
                store.evict(b)  # a clean discard: the disk copy is there
            store.get(b)
        disk_t.append(time.perf_counter() - t)
        for b in bids:
            if b in store.ram:
                store.evict(b)
    ram_s, disk_s = statistics.median(ram_t), statistics.median(disk_t)
    print("\n2. lookup on the promotion path")
    print(f"   RAM hit (a copy out):    {_rate(args.lookups, ram_s):>12}  ({ram_s / args.lookups * 1e6:.1f} us each)")
    print(f"   promotion (mmap+digest): {_rate(n_disk, disk_s):>12}  ({disk_s / n_disk * 1e6:.1f} us each, "
          f"{n_disk * block_bytes / disk_s / 2**30:.2f} GiB/s of payload; evictions before it wrote "
          f"{store.ledger.payload_written['evict']} B)")
    print(f"   RAM hit / disk promotion: {disk_s / n_disk / (ram_s / args.lookups):.0f}x")

    # 3. policy updates under concurrent writers
    for b in bids:
        store.get(b)  # each block in both tiers: an update writes both records
    print(f"\n3. policy update (tenant, QoS, priority, reuse score, recency) on blocks held in RAM and on disk")
    print(f"   {'writers':>7}{'updates':>9}{'ns/update':>11}{'updates/s':>12}{'payload B':>11}{'metadata B':>12}")
    base_ns = None
    for n_threads in args.threads:
        per = args.updates // n_threads
        runs = []
        for rep in range(args.repeats):
            moved_before = store._snapshot()
            barrier = threading.Barrier(n_threads + 1)

            def writer(seed: int) -> None:
                r = random.Random(seed)
                barrier.wait()
                for i in range(per):
                    store.update_policy(bids[r.randrange(len(bids))], priority=i % 256, qos=QoS(i % 3),
                                        reuse_score=float(i), recency=i)

            threads = [threading.Thread(target=writer, args=(rep * 100 + k,)) for k in range(n_threads)]
            for th in threads:
                th.start()
            barrier.wait()
            t = time.perf_counter()
            for th in threads:
                th.join()
            runs.append(time.perf_counter() - t)
            after = store._snapshot()
        s = statistics.median(runs)
        total = per * n_threads
        ns = s / total * 1e9
        base_ns = base_ns or ns
        print(f"   {n_threads:>7}{total:>9}{ns:>11.0f}{total / s:>12,.0f}{after[0] + after[1] - moved_before[0] - moved_before[1]:>11}"
              f"{after[2] - moved_before[2]:>12}")
    lib = BlockLibrary(root / "library")
    block = Block.from_state(state.slice(0, args.block_tokens), chunk[:args.block_tokens], lm.fingerprint, "tok")
    lib.put(block)
    n_lib = max(args.updates // 20, 50)
    lib_t = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for i in range(n_lib):
            block.policy["priority"] = i
            lib.update_policy(block)
        lib_t.append(time.perf_counter() - t)
    lib_ns = statistics.median(lib_t) / n_lib * 1e9
    meta_bytes = (root / "library" / f"{block.block_id}.json").stat().st_size
    print(f"   kv.blocks.BlockLibrary.update_policy (1 writer, JSON file of {meta_bytes} B rewritten): {lib_ns:,.0f} "
          f"ns/update = {lib_ns / base_ns:.0f}x the store's 1-writer cost")

    # 4. bytes moved per operation
    fresh = BlockStore(root / "ledger")
    rows = []

    def step(label, fn):
        before = fresh._snapshot()
        out = fn()
        after = fresh._snapshot()
        rows.append((label, after[0] - before[0], after[1] - before[1], after[2] - before[2]))
        return out

    n = args.block_tokens
    (bid,) = step("put (precompiled chunk)", lambda: store_chunk(fresh, lm, chunk[:n], state=state.slice(0, n)))
    step("demote (first)", lambda: fresh.demote(bid))
    base = step("promote", lambda: fresh.get(bid))
    step("get (RAM hit)", lambda: fresh.get(bid))
    step("evict (disk copy)", lambda: fresh.evict(bid))
    step("promote", lambda: fresh.get(bid))
    step("demote (second)", lambda: fresh.demote(bid))
    step("promote", lambda: fresh.get(bid))
    step("update_policy", lambda: fresh.update_policy(bid, priority=3, qos=QoS.INTERACTIVE))
    with torch.no_grad():
        err = prefill(lm, chunk[:8], prior=base).slice(n)
        field = prefill(lm, chunk[4:8], prior=base.slice(0, 4)).slice(4, 8)
    step("erratum (8 tok)", lambda: store_erratum(fresh, lm, bid, chunk[:8], err, chunk[:n]))
    step("refresh (4 tok)", lambda: store_refresh(fresh, lm, bid, chunk[4:8], field))
    print(f"\n4. bytes moved per operation, in order, on one block of {n} positions (payload read / written; "
          f"control metadata written)")
    print(f"   {'operation':<24}{'payload read':>14}{'payload written':>17}{'metadata':>10}")
    for label, r, w, m in rows:
        print(f"   {label:<24}{r:>14,}{w:>17,}{m:>10}")
    print(f"   demotions of the chunk block over its life (delta_b): {fresh.demotions[bid]}; its payload file was "
          f"written once and the erratum and refresh made new blocks ({len(fresh.block_ids())} in the store)")

if __name__ == "__main__":
    main()
