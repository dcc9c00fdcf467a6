"""Benchmark: time to first token, full prefill vs transplant, at growing context lengths (paper Figure 6a).

For each length L the context is a system head, a skill chunk of ~L tokens (filler rules of the gated
template, repeated) and a short task suffix. Full prefill runs head + chunk + suffix. Transplant reuses the
chunk precompiled once in isolation (not timed: it is paid once per skill) and times only what a request
pays: the head prefill, the re-rotation of the chunk's keys, and the suffix prefill over the composed cache.
Both are measured side by side in this run, each the median of ``--repeats``.

    make bench-ttft [MODEL=smollm2-135m] [ARGS="--lengths 1000 2000 4000 8000"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvprobe.kv.compose import precompile
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.rope import rerotate
from kvprobe.models.loading import load_model
from kvprobe.tasks.gated import load_template


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model, device="cpu", dtype="float32")
    tok = lm.tokenizer
    tpl = load_template("configs/tasks/gated.yaml")
    head = tok("You are a customer-support agent.\nSKILL: STORE POLICY\n", add_special_tokens=False)["input_ids"]
    suffix = tok("\nOrder A1234 is pending. The customer asks to cancel it. Decision:",
                 add_special_tokens=False)["input_ids"]
    rules = tok("\n".join(tpl.filler_rules) + "\n", add_special_tokens=False)["input_ids"]
    print(f"{args.model}: head {len(head)} tokens, suffix {len(suffix)} tokens, median of {args.repeats}")
    print(f"{'chunk':>7}{'full (s)':>10}{'transplant (s)':>16}{'rotation (s)':>14}{'rotation share':>16}"
          f"{'speedup':>9}{'logit cos':>11}")
    with torch.no_grad():
        for length in args.lengths:
            chunk = (rules * (length // len(rules) + 1))[:length]
            block = precompile(lm, chunk)  # paid once per skill, not per request
            t_full, full = _median_time(lambda: read_logits(lm, prefill(lm, head + chunk + suffix[:-1]),
                                                             suffix[-1:]), args.repeats)
            rot_times = []

            def transplant():
                state = prefill(lm, head)
                t = time.perf_counter()
                moved = rerotate(block, torch.arange(len(head), len(head) + len(chunk)), lm)
                rot_times.append(time.perf_counter() - t)
                state = prefill(lm, suffix[:-1], prior=state.concat(moved))
                return read_logits(lm, state, suffix[-1:])

            t_tr, spliced = _median_time(transplant, args.repeats)
            t_rot = statistics.median(rot_times)
            cos = torch.nn.functional.cosine_similarity(full[0].double(), spliced[0].double(), dim=0).item()
            print(f"{length:>7}{t_full:>10.3f}{t_tr:>16.3f}{t_rot:>14.3f}{t_rot / t_tr:>16.1%}"
                  f"{t_full / t_tr:>8.1f}x{cos:>11.4f}")


if __name__ == "__main__":
    main()
