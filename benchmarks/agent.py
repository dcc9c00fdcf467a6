"""Benchmark: cumulative time to first token of the unified edit+compose agent vs reprefill-every-turn
(paper Figure 7b markers, Figure 12b), side by side in one run, on a grid of policy length x turns.

The policy (filler rules of the gated template, repeated to ~L tokens) is precompiled once (not timed: paid
once per policy). Per turn the world state changes and an erratum line is appended ahead of the decision
prompt. Unified: the first turn splices the policy (re-rotation) between the live head and tail; each later
turn reuses the previous turn's cache up to the shared prefix and prefills only its delta
(:func:`kvprobe.kv.edit.append_edit`), then reads the decision. Reprefill: every turn prefills the whole
prompt. Cumulative TTFT = the sum over turns; the speedup is reprefill / unified, measured in this run.

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


def run(lm, policy: list[int], head: list[int], state: list[int], errata: list[list[int]], decision: list[int],
        turns: int) -> tuple[float, float]:
    """(cumulative unified seconds, cumulative reprefill seconds) over ``turns`` turns."""
    block = precompile(lm, policy)  # paid once per policy: not timed
    prompts = [head + policy + state + [t for e in errata[: k + 1] for t in e] + decision for k in range(turns)]
    unified = reprefill = 0.0
    cached = cached_ids = None
    for k, ids in enumerate(prompts):
        t = time.perf_counter()
        if cached is None:
            st = assemble(lm, [Live(tuple(head)), Spliced(tuple(policy), block), Live(tuple(ids[len(head) + len(policy):-1]))])
            suffix = ids[-1:]
        else:
            res = append_edit(lm, cached, cached_ids, ids, 1)
            st, suffix = res.state, res.suffix_ids
        read_logits(lm, st, suffix)
        unified += time.perf_counter() - t
        cached, cached_ids = st, ids[:-1]
        t = time.perf_counter()
        read_logits(lm, prefill(lm, ids[:-1]), ids[-1:])
        reprefill += time.perf_counter() - t
    return unified, reprefill


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
    state = _ids(tok, "\nSESSION CONTEXT\norder_status: shipped\n")
    decision = _ids(tok, "\nTASK\nDecide the next action: cancel_order or refuse. Decision:")
    errata = [_ids(tok, f"\n[STATE UPDATE] order_status: {'pending' if k % 2 == 0 else 'shipped'}")
              for k in range(max(args.turns))]
    print(f"{args.model}: cumulative TTFT, unified (policy spliced once, per-turn delta) vs reprefill every turn, "
          "measured side by side in this run")
    print(f"{'policy':>8}{'turns':>7}{'unified (s)':>13}{'reprefill (s)':>15}{'speedup':>9}")
    for length in args.policy_tokens:
        policy = (rules * (length // len(rules) + 1))[:length]
        for turns in args.turns:
            u, r = run(lm, policy, head, state, errata, decision, turns)
            print(f"{length:>8}{turns:>7}{u:>13.3f}{r:>15.3f}{r / u:>8.2f}x")


if __name__ == "__main__":
    main()
