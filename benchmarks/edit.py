"""Benchmark: per-method edit latency, side by side in one run, as ratios against a full reprefill.

For one gated instance on the chosen model, each method's latency is the time from the stale cache (already
held) to the decision logits: the edit itself plus the readout of the query suffix over the edited cache.
Every method is timed ``--repeats`` times, interleaved round-robin so drift in machine load hits all of
them alike; the median is reported with the recompute fraction. Not timed: the selective@K ranking (an
analysis-time causal sweep, computed once beforehand) and the hoisted prompt's value-independent prefix
(cached once when the prompt is designed).

    make bench-edit [MODEL=smollm2-135m]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvprobe.kv import edit
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.loading import load_model
from kvprobe.patching.pairs import prefill_pair
from kvprobe.patching.ranking import rank_downstream_by_effect
from kvprobe.tasks.edits import common_prefix_len, erratum_body, erratum_line, hoisted_body, prompt_ids
from kvprobe.tasks.gated import generate_instances, load_template, tokenize_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--template", default="configs/tasks/gated.yaml")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=8, help="K of field+selective@K")
    ap.add_argument("--cacheblend-ratio", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lm = load_model(args.model, device="cpu", dtype="float32")
    template = load_template(args.template)
    inst = generate_instances(template, 1, seed=args.seed)[0]
    tok, chat = lm.tokenizer, lm.has_chat_template
    pair = tokenize_pair(tok, inst, chat)
    pp = prefill_pair(lm, pair)
    e = edit.FieldEdit.from_pair(pp)
    ranked = rank_downstream_by_effect(lm, pp)
    line = erratum_line(template, inst, inst.new_value)
    err_old = prompt_ids(tok, inst, erratum_body(template, inst, inst.old_value, [line]), chat)
    err_new = prompt_ids(tok, inst, erratum_body(template, inst, inst.new_value, [line]), chat)
    hoist_old, hoist_new = (prompt_ids(tok, inst, hoisted_body(template, inst, v), chat)
                            for v in (inst.old_value, inst.new_value))
    hoist_prefix = prefill(lm, hoist_new[: common_prefix_len(hoist_old, hoist_new)])
    methods = {
        "stale": lambda: edit.stale(e),
        "in_place": lambda: edit.in_place(lm, e),
        f"selective@{args.k}": lambda: edit.field_selective(lm, e, ranked, args.k),
        f"cacheblend@{round(100 * args.cacheblend_ratio)}%": lambda: edit.cacheblend(lm, e, args.cacheblend_ratio),
        "erratum": lambda: edit.erratum(lm, e, err_old, 1),
        "field_erratum": lambda: edit.field_erratum(lm, e, err_new, 1),
        "hoist_to_end": lambda: edit.hoist_to_end(lm, hoist_old, hoist_new, 1, prefix=hoist_prefix),
        "full_downstream": lambda: edit.full_downstream(lm, e),
        "full_reprefill": lambda: edit.full_reprefill(lm, e),
    }

    def decide(make):
        res = make()
        read_logits(lm, res.state, res.suffix_ids)
        return res

    results = {name: decide(make) for name, make in methods.items()}  # warm-up, and the recompute counts
    times: dict[str, list[float]] = {name: [] for name in methods}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, make in methods.items():
                t = time.perf_counter()
                decide(make)
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["full_reprefill"])
    print(f"{args.model}: prompt {len(pair)} tokens (context {pp.context_length}), {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved repeats; edit + decision readout")
    print(f"{'method':<18}{'recompute':>10}{'ms':>10}{'x reprefill':>13}{'speedup':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<18}{100 * results[name].recompute_fraction:>9.1f}%{1000 * med:>10.1f}{med / base:>13.3f}"
              f"{base / med:>8.1f}x")


if __name__ == "__main__":
    main()
