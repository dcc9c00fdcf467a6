"""Benchmark: a downstream-position x layer KV patch sweep, kvprobe against the real peers, in one run.

Every engine computes the same cells (the stale cache with the oracle's K/V at one downstream slot of one
layer, read by the query token) on the same instance:

- TransformerLens: a ``TransformerBridge`` on the same weights, one full forward of the prompt per cell with
  hooks (``generic_activation_patch``-style: donor ``hook_rot_k``/``hook_v`` at the slot, the context's
  ``hook_z`` held to the base run so only the query reads the patch; kvprobe.interop.tl);
- nnsight: one ``trace`` of the full prompt per cell, the same patch on k_proj/v_proj/o_proj (kvprobe.interop.nnsight);
- kvprobe materialised: one patched cache per cell (``KVState.mix``), read in batched one-token forwards;
- kvprobe exact engine: one shared base cache, per-row overrides, cells at layer l reusing the base's layers
  < l, and only the two action logits computed (kvprobe.patching.shared_engine);
- AtP* (kvprobe.patching.atp): every cell estimated from one forward + backward, validated against the
  exact engine on all cells (Spearman rho, top-20 recall, the false negatives).

The peers take a full forward per cell, so they run on a seeded subsample (``--peer-cells``) and their
agreement is checked on those cells; the materialised path is checked against the exact engine on
``--agree-cells`` cells spread over layers and positions (stratified by layer). Agreement is the max |difference|
of the decision's logit difference (nats) and of recovery.

    make bench-sweep [MODEL=smollm2-135m] [ARGS="--quick"]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvprobe.interop import nnsight as nn_backend
from kvprobe.interop import tl as tl_backend
from kvprobe.kv.readout import read_logits
from kvprobe.models.loading import load_model
from kvprobe.patching.atp import atp_kv, compare
from kvprobe.patching.pairs import measure, prefill_pair
from kvprobe.patching.shared_engine import shared_kv_sweep
from kvprobe.patching.sweep import KVPatch, kv_sweep
from kvprobe.tasks.gated import generate_instances, load_template, tokenize_pair


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def stratified(cells: Sequence[KVPatch], n: int, n_layers: int, seed: int) -> list[int]:
    """``n`` cell indices spread over layers (round robin) and positions (random within a layer)."""
    rng = random.Random(seed)
    by_layer = {layer: [i for i, c in enumerate(cells) if c.layers[0] == layer] for layer in range(n_layers)}
    for idx in by_layer.values():
        rng.shuffle(idx)
    out: list[int] = []
    while len(out) < min(n, len(cells)):
        for layer in range(n_layers):
            if by_layer[layer] and len(out) < n:
                out.append(by_layer[layer].pop())
    return sorted(out)


def boot_bridge(model: Any, tokenizer: Any) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(f"local/{model.config.model_type}", hf_model=model, tokenizer=tokenizer,
                                               hf_config_overrides={"architectures": [type(model).__name__]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--template", default="configs/tasks/gated.yaml")
    ap.add_argument("--pick-from", type=int, default=8, help="sweep the largest-flip instance of the first N")
    ap.add_argument("--peer-cells", type=int, default=30, help="cells each peer (TL, nnsight) runs: seeded sample")
    ap.add_argument("--agree-cells", type=int, default=240, help="cells the materialised path is checked on")
    ap.add_argument("--forward-cells", type=int, default=640, help="cells timed as full one-token forwards")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--top", type=int, default=20, help="top-k of the AtP* recall check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--positions", type=int, default=0, help="sweep only the last N downstream slots (0: all)")
    ap.add_argument("--quick", action="store_true", help="first 2 instances, last 32 downstream slots, 4 peer cells")
    args = ap.parse_args()
    if args.quick:
        args.pick_from, args.peer_cells, args.agree_cells, args.forward_cells, args.positions = 2, 4, 200, 128, 32
    lm = load_model(args.model, device="cpu", dtype="float32")
    best = None
    for inst in generate_instances(load_template(args.template), args.pick_from, seed=args.seed):
        pair = tokenize_pair(lm.tokenizer, inst, lm.has_chat_template)
        pp = prefill_pair(lm, pair)
        anchor, _, _ = measure(lm, pp, {})
        if best is None or abs(anchor.flip) > abs(best[2].flip):
            best = (pair, pp, anchor, inst.index)
    pair, pp, anchor, index = best
    n_layers = lm.spec.n_layers
    slots = pp.downstream_slots[-args.positions:] if args.positions else pp.downstream_slots
    cells = [KVPatch.of([p], [layer]) for p in slots for layer in range(n_layers)]
    actions = [pair.new_action_id, pair.old_action_id]
    ctx = pp.context_length
    print(f"{args.model}: instance {index} (largest |oracle flip| of the first {args.pick_from}), prompt {len(pair)} "
          f"tokens, {len(slots)} of {len(pp.downstream_slots)} downstream positions x {n_layers} layers = {len(cells)} "
          f"cells; oracle flip {anchor.flip:+.3f} nats; torch threads {torch.get_num_threads()}")

    def ld(logits: torch.Tensor, cols: Sequence[int] = actions) -> torch.Tensor:
        logits = logits.double()
        return logits[:, cols[0]] - logits[:, cols[1]]

    # What one cell costs as a full one-token forward: the same engine without layer sharing, full vocabulary,
    # timed before and after the exact sweep (other work on the machine shifts timings; both are printed).
    fwd_idx = stratified(cells, args.forward_cells, n_layers, args.seed + 1)

    def one_token_forward_ms() -> float:
        _, t = timed(lambda: shared_kv_sweep(lm, pp.old, pp.new, [cells[i] for i in fwd_idx], pp.suffix,
                                             batch_size=args.batch_size, share_layers=False))
        return 1000 * t / len(fwd_idx)

    ms_fwd_before = one_token_forward_ms()
    # kvprobe exact engine over every cell (plus the unpatched base in the same call).
    exact_logits, t_exact = timed(lambda: kv_sweep(lm, pp.old, pp.new, [KVPatch.of([])] + cells, pp.suffix,
                                                    batch_size=args.batch_size, token_ids=actions))
    exact_ld = ld(exact_logits, [0, 1])
    base_ld, exact_ld = float(exact_ld[0]), exact_ld[1:]
    exact_effect = exact_ld - base_ld
    ms_exact = 1000 * t_exact / (len(cells) + 1)
    ms_fwd_after = one_token_forward_ms()
    ms_fwd = (ms_fwd_before + ms_fwd_after) / 2
    reps = 5
    _, t_one = timed(lambda: [read_logits(lm, pp.old, pp.suffix) for _ in range(reps)])
    ms_one = 1000 * t_one / reps

    # kvprobe materialised path on a stratified sample, checked against the exact engine.
    agree_idx = stratified(cells, args.agree_cells, n_layers, args.seed)
    mix_logits, t_mix = timed(lambda: kv_sweep(lm, pp.old, pp.new, [cells[i] for i in agree_idx], pp.suffix,
                                               batch_size=16, engine="mix"))
    ms_mix = 1000 * t_mix / len(agree_idx)
    mix_diff = (ld(mix_logits) - exact_ld[agree_idx]).abs().max().item()

    # The peers, on a seeded subsample of the agreement cells.
    peer_idx = sorted(random.Random(args.seed).sample(agree_idx, min(args.peer_cells, len(agree_idx))))
    peers: dict[str, tuple[float, float]] = {}
    import nnsight

    nn_model = nnsight.LanguageModel(lm.model, tokenizer=lm.tokenizer)  # nnsight leaves the module as it is
    nn_patcher = nn_backend.KVCellPatcher(nn_model, lm, pair.ids_old, pair.ids_new[:ctx], ctx)
    nn_logits, t_nn = timed(lambda: nn_patcher.sweep([cells[i] for i in peer_idx]))
    peers["nnsight: one trace per cell"] = (1000 * t_nn / len(peer_idx),
                                            (ld(nn_logits) - exact_ld[peer_idx]).abs().max().item())
    bridge_model = load_model(args.model, device="cpu", dtype="float32").model  # the bridge rewires its model
    bridge = boot_bridge(bridge_model, lm.tokenizer)
    tl_patcher = tl_backend.KVCellPatcher(bridge, pair.ids_old, pair.ids_new[:ctx], ctx)
    tl_logits, t_tl = timed(lambda: tl_patcher.sweep([cells[i] for i in peer_idx]))
    peers["TransformerLens bridge: hooks, forward per cell"] = (1000 * t_tl / len(peer_idx),
                                                             (ld(tl_logits) - exact_ld[peer_idx]).abs().max().item())

    # AtP*: every cell from one forward + backward, against the exact engine on all cells.
    scores, t_atp = timed(lambda: atp_kv(lm, pp.old, pp.new, pp.suffix, *actions))
    est = scores.cells(cells)
    labels = [f"pos {c.positions[0]} ({lm.tokenizer.decode([pair.ids_old[c.positions[0]]])!r}) L{c.layers[0]}"
              for c in cells]
    agree = compare(est, exact_effect, args.top, labels)

    strongest, (ms_peer, _) = min(peers.items(), key=lambda kv: kv[1][0])
    print(f"\nkvprobe exact engine vs the strongest peer ({strongest.split(':')[0]}): "
          f"{ms_peer / ms_exact:.0f}x faster per cell ({ms_peer:.0f} ms vs {ms_exact:.2f} ms)")
    print(f"{'engine':<52}{'ms/cell':>10}{'cells/s':>10}{'x exact':>10}{'max|dLD| nats':>15}{'cells checked':>15}")
    rows = [(name, ms, diff, len(peer_idx)) for name, (ms, diff) in peers.items()]
    rows += [("kvprobe materialised (one cache per cell, batch 16)", ms_mix, mix_diff, len(agree_idx)),
             ("kvprobe exact engine (shared base, layer sharing)", ms_exact, 0.0, len(cells))]
    for name, ms, diff, n in rows:
        print(f"{name:<52}{ms:>10.2f}{1000 / ms:>10.1f}{ms / ms_exact:>10.1f}{diff:>15.2e}{n:>15}")
    print(f"{'AtP* (one forward + backward, all cells)':<52}{1000 * t_atp / len(cells):>10.4f}"
          f"{len(cells) / t_atp:>10.0f}{t_atp / t_exact * (len(cells) + 1) / len(cells):>10.3f}{'(estimate)':>15}"
          f"{len(cells):>15}")
    worst = max([d for _, (_, d) in peers.items()] + [mix_diff])
    print(f"agreement: max |logit-difference change| {worst:.2e} nats ({'OK' if worst <= 1e-4 else 'ABOVE'} at the "
          f"1e-4-nat tolerance) = {worst / abs(anchor.flip):.2e} in recovery (a ratio over this instance's "
          f"{abs(anchor.flip):.3f}-nat flip); the exact engine is the reference")
    print(f"\nexact engine cost: {ms_exact:.2f} ms/cell = {ms_exact / ms_fwd:.2f} of a one-token forward per cell "
          f"({ms_fwd:.2f} ms = mean of {ms_fwd_before:.2f} before and {ms_fwd_after:.2f} after the sweep: the same "
          f"batched engine running every layer and the full vocabulary, on {len(fwd_idx)} cells); a lone batch-1 "
          f"one-token forward over a copied cache takes {ms_one:.1f} ms ({ms_exact / ms_one:.3f} of it)")
    print(f"\nAtP* vs exact on all {len(cells)} cells: cost {t_atp:.2f} s vs {t_exact:.1f} s "
          f"({t_exact / t_atp:.0f}x cheaper); Spearman rho {agree['spearman']:.3f}; top-{agree['k']} recall by "
          f"|effect| {agree['recall_at_k']:.2f}; base logit difference {scores.base_metric:+.5f} (exact engine "
          f"{base_ld:+.5f})")
    for fn in agree["false_negatives"]:
        print(f"  false negative: {fn['cell']}: exact rank {fn['exact_rank']} ({fn['exact']:+.4f} nats), "
              f"AtP* rank {fn['atp_rank']} ({fn['atp']:+.4f})")
    rec = anchor.recovery(exact_ld)
    for i in torch.topk(rec.nan_to_num(0).abs(), 5).indices.tolist():
        print(f"  top cell: {labels[i]}: recovery {float(rec[i]):+.4f} (AtP* {float(est[i]) / anchor.flip:+.4f})")


if __name__ == "__main__":
    main()
