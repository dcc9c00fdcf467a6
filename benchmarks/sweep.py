"""Benchmark: a full downstream-position x layer KV patch sweep, kvprobe's engine vs a naive loop.

The naive loop is what a TransformerLens-style ``generic_activation_patch`` pays: one full forward of the
prompt per cell (the clean activations are cached once, the corrupted prompt is re-run for every cell).
kvprobe prefills each prompt once and reads every cell as a one-token forward over a shared base cache.
Both are timed in this one run; the naive loop runs on a seeded sample of cells (all cells would take hours
on a CPU) and the max |difference| of recovery is checked on that sample.

    make bench-sweep [MODEL=smollm2-135m]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvprobe.kv.readout import prefill, read_logits
from kvprobe.metrics import logit_diff
from kvprobe.models.loading import load_model
from kvprobe.patching.pairs import measure, prefill_pair
from kvprobe.patching.sweep import KVPatch, kv_sweep
from kvprobe.tasks.gated import generate_instances, load_template, tokenize_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--template", default="configs/tasks/gated.yaml")
    ap.add_argument("--naive-cells", type=int, default=12, help="cells the naive loop runs (seeded sample)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--pick-from", type=int, default=8, help="sweep the largest-flip instance of the first N")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    lm = load_model(args.model, device="cpu", dtype="float32")
    # Recovery divides by the oracle flip, so on an instance whose decision barely moves float noise is
    # magnified; sweep the instance with the largest |flip| among the first --pick-from.
    best = None
    for inst in generate_instances(load_template(args.template), args.pick_from, seed=args.seed):
        pair = tokenize_pair(lm.tokenizer, inst, lm.has_chat_template)
        pp = prefill_pair(lm, pair)
        anchor, _, _ = measure(lm, pp, {})
        if best is None or abs(anchor.flip) > abs(best[2].flip):
            best = (pair, pp, anchor, inst.index)
    pair, pp, anchor, index = best
    cells = [KVPatch.of([p], [layer]) for p in pp.downstream_slots for layer in range(lm.spec.n_layers)]
    print(f"{args.model}: instance {index} (largest |oracle flip| of the first {args.pick_from}), prompt {len(pair)} tokens, {len(pp.downstream_slots)} downstream positions x "
          f"{lm.spec.n_layers} layers = {len(cells)} cells; oracle flip {anchor.flip:+.3f} nats")

    t = time.perf_counter()
    fast_logits = kv_sweep(lm, pp.old, pp.new, cells, pp.suffix, batch_size=args.batch_size, engine="shared")
    t_fast = time.perf_counter() - t
    fast_rec = anchor.recovery(logit_diff(fast_logits, pair.new_action_id, pair.old_action_id).double())

    sample = random.Random(args.seed).sample(range(len(cells)), min(args.naive_cells, len(cells)))
    ctx = pp.context_length
    t = time.perf_counter()
    naive_rec = []
    for i in sample:  # one full forward of the corrupted (old) context per cell, as a naive patch loop does
        state = prefill(lm, pair.ids_old[:ctx]).mix(pp.new, cells[i].positions, cells[i].layers)
        logits = read_logits(lm, state, pp.suffix)
        naive_rec.append(float(anchor.recovery(logit_diff(logits, pair.new_action_id, pair.old_action_id))[0]))
    t_naive = time.perf_counter() - t

    sub = [KVPatch.of(cells[i].positions, cells[i].layers) for i in sample]
    t = time.perf_counter()
    kv_sweep(lm, pp.old, pp.new, sub * max(1, 64 // len(sub)), pp.suffix, batch_size=16, engine="mix")
    t_mix = (time.perf_counter() - t) / (len(sub) * max(1, 64 // len(sub)))

    diff = max(abs(float(fast_rec[i]) - naive_rec[k]) for k, i in enumerate(sample))
    fast_cps, naive_cps = len(cells) / t_fast, len(sample) / t_naive
    print(f"{'engine':<34}{'cells/s':>10}{'ms/cell':>10}")
    print(f"{'naive: full forward per cell':<34}{naive_cps:>10.2f}{1000 / naive_cps:>10.1f}")
    print(f"{'batched mix (one cache per cell)':<34}{1 / t_mix:>10.2f}{1000 * t_mix:>10.1f}")
    print(f"{'kvprobe shared-base engine':<34}{fast_cps:>10.2f}{1000 / fast_cps:>10.2f}")
    print(f"speedup vs naive: {fast_cps / naive_cps:.1f}x   (vs batched mix: {fast_cps * t_mix:.1f}x)")
    print(f"max |recovery difference| on the {len(sample)} naive cells: {diff:.2e} "
          f"({'OK' if diff <= 1e-4 else 'ABOVE 1e-4'}; = {diff * abs(anchor.flip):.1e} nats of logit difference)")
    top = torch.topk(fast_rec.nan_to_num(0).abs(), 5).indices.tolist()
    for i in top:
        p, layer = cells[i].positions[0], cells[i].layers[0]
        print(f"  top cell: pos {p} ({lm.tokenizer.decode([pair.ids_old[p]])!r}) layer {layer}: "
              f"recovery {float(fast_rec[i]):+.4f}")


if __name__ == "__main__":
    main()
