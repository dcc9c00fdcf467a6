"""Benchmark: cumulative time to first token of the unified edit+compose agent vs reprefill-every-turn and
the front / end placement baselines (paper Figure 7b markers, Figure 12), side by side in one run, on a grid
of policy length x turns.

The policy (filler rules of the gated template, repeated to ~L tokens) is precompiled once (not timed: paid
once per policy). Per turn the world state changes. Unified: an erratum line is appended ahead of the
decision prompt; the first turn splices the policy (re-rotation) between the live head and tail; each later
turn reuses the previous turn's cache up to the shared prefix and prefills only its delta
(:func:`kvprobe.kv.edit.append_edit`), then reads the decision. Reprefill: every turn prefills the unified
path's whole prompt. Front / end: the state is rewritten in place (no erratum), the policy sits before the
state (front) or after it (end), and each turn reuses the previous turn's cache up to the first changed token
(reprefill-on-change; end therefore re-prefills the policy every turn). Cumulative TTFT = the sum over turns;
each speedup is that path's time over the unified path's, measured in this run.

    make bench-agent [MODEL=smollm2-135m] [ARGS="--policy-tokens 500 1000 2000 --turns 2 4 8"]
"""

from __future__ import annotations

import argparse
import time

from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.edit import append_edit
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.loading import load_model
from kvprobe.tasks.gated import load_template


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _cached_path(lm, prompts: list[list[int]], first) -> float:
    """Cumulative seconds: the first turn's cache from ``first(ids)``; each later turn reuses the previous
    turn's cache up to the first changed token and prefills the rest (:func:`append_edit`)."""
    total, cached, cached_ids = 0.0, None, None
    for ids in prompts:
        t = time.perf_counter()
        if cached is None:
            st, suffix = first(ids), ids[-1:]
        else:
            res = append_edit(lm, cached, cached_ids, ids, 1)
            st, suffix = res.state, res.suffix_ids
        read_logits(lm, st, suffix)
        total += time.perf_counter() - t
        cached, cached_ids = st, ids[:-1]
    return total


def run(lm, policy: list[int], head: list[int], states: list[list[int]], errata: list[list[int]],
        decision: list[int], turns: int) -> dict[str, float]:
    """Cumulative seconds over ``turns`` turns per path: unified, reprefill, front, end. ``states[0]`` is the
    initial session state, which the unified path keeps while it appends ``errata[:k+1]`` on turn k;
    ``states[k + 1]`` holds turn k's value written in place (front and end)."""
    block = precompile(lm, policy)  # paid once per policy: not timed
    prompts = [head + policy + states[0] + [t for e in errata[: k + 1] for t in e] + decision for k in range(turns)]
    n = len(head) + len(policy)
    unified = _cached_path(lm, prompts, lambda ids: assemble(
        lm, [Live(tuple(head)), Spliced(tuple(policy), block), Live(tuple(ids[n:-1]))]))
    reprefill = 0.0
    for ids in prompts:
        t = time.perf_counter()
        read_logits(lm, prefill(lm, ids[:-1]), ids[-1:])
        reprefill += time.perf_counter() - t
    full = lambda ids: prefill(lm, ids[:-1])  # noqa: E731 - reprefill-on-change starts from a full prefill
    front = _cached_path(lm, [head + policy + states[k + 1] + decision for k in range(turns)], full)
    end = _cached_path(lm, [head + states[k + 1] + policy + decision for k in range(turns)], full)
    return {"unified": unified, "reprefill": reprefill, "front": front, "end": end}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy-tokens", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    lm = load_model(args.model, device="cpu", dtype="float32")
    tok = lm.tokenizer
    tpl = load_template("configs/tasks/gated.yaml")
    head = _ids(tok, "You are a customer-support agent.\nPOLICY\n")
    rules = _ids(tok, "\n".join(tpl.filler_rules) + "\n")
    states = [_ids(tok, f"\nSESSION CONTEXT\norder_status: {'shipped' if k % 2 == 0 else 'pending'}\n")
              for k in range(max(args.turns) + 1)]
    decision = _ids(tok, "\nTASK\nDecide the next action: cancel_order or refuse. Decision:")
    errata = [_ids(tok, f"\n[STATE UPDATE] order_status: {'pending' if k % 2 == 0 else 'shipped'}")
              for k in range(max(args.turns))]
    print(f"{args.model}: cumulative TTFT, unified (policy spliced once, per-turn delta) vs reprefill every turn "
          "and the front / end placement baselines (in-place state, prefix cache), measured side by side in this "
          "run; speedup = that path's time over the unified path's")
    print(f"{'policy':>8}{'turns':>7}{'unified (s)':>13}{'reprefill (s)':>15}{'x reprefill':>13}{'x front':>9}"
          f"{'x end':>8}")
    for length in args.policy_tokens:
        policy = (rules * (length // len(rules) + 1))[:length]
        for turns in args.turns:
            t = run(lm, policy, head, states, errata, decision, turns)
            u = t["unified"]
            print(f"{length:>8}{turns:>7}{u:>13.3f}{t['reprefill']:>15.3f}{t['reprefill'] / u:>12.2f}x"
                  f"{t['front'] / u:>8.2f}x{t['end'] / u:>7.2f}x")


if __name__ == "__main__":
    main()
