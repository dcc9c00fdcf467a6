"""Specificity: a few specific downstream positions carry the conclusion (paper Appendix C (iii), Table 4
right). Knockout and writability (probe (4), control (iv)) are the same measurement with the roles of the
two caches changed, so the three share one module shape:

- specificity: stale cache + the oracle's K/V at the top-k vs k random downstream positions (recovery);
- knockout: the oracle cache with the top-k vs k random downstream positions put back to stale: how far the
  decision returns toward stale (reported as 1 - recovery, so 0 = untouched, 1 = fully back to stale);
- writability: the stale cache with the oracle's notes injected on downstream positions only (the field and
  everything before it keep the old value): the decision follows the written note.

Positions are ranked per instance by single-position effect (kvprobe.patching.ranking); random draws are
seeded per instance and averaged over ``random_draws``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.patching.ranking import ranked_instance, sweep_recovery
from kvprobe.patching.sweep import KVPatch
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.runner.summary import gate_summary
from kvprobe.stats.bootstrap import summarize


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ks: list[int] = Field(default_factory=lambda: [1, 4, 8, 16, 32])
    random_draws: int = Field(8, ge=1)


def _measurements(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    pp, anchor, ranking = ranked_instance(lm, inst, ctx.cfg.batch_size)
    pair = pp.pair
    rng = random.Random(int(hashlib.sha256(f"{ctx.cfg.seed}:{inst.index}".encode()).hexdigest()[:8], 16))
    ks = [k for k in p.ks if k <= len(ranking.positions)]
    top = [KVPatch.of(ranking.positions[:k]) for k in ks]
    rand = [KVPatch.of(rng.sample(pp.downstream_slots, k)) for k in ks for _ in range(p.random_draws)]
    inject = sweep_recovery(lm, pp, anchor, top + rand + [KVPatch.of(pp.downstream_slots)]).tolist()
    # Knockout: base = oracle, donor = stale; recovery is still measured stale -> oracle.
    knock = sweep_recovery(lm, pp, anchor, top + rand, base=pp.new, donor=pp.old).tolist()
    d = p.random_draws
    row = {**inst.row(), "n_tokens": len(pair), **anchor.row(),
           "included": anchor.gate(ctx.cfg.gate.min_flip, ctx.cfg.gate.require_oracle_correct),
           "top_tokens": [lm.tokenizer.decode([pair.ids_old[t]]) for t in ranking.positions[:8]],
           "writability_all_notes": inject[-1]}
    for i, k in enumerate(ks):
        row[f"top{k}"] = inject[i]
        row[f"rand{k}"] = sum(inject[len(ks) + i * d: len(ks) + (i + 1) * d]) / d
        row[f"knockout_top{k}"] = 1 - knock[i]
        row[f"knockout_rand{k}"] = 1 - sum(knock[len(ks) + i * d: len(ks) + (i + 1) * d]) / d
    return row


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = gate_summary(rows, ctx.cfg.gate)
    use = [r for r in rows if r["included"]] or rows
    out["summary_over"] = "gated" if any(r["included"] for r in rows) else "all (no instance passed the gate)"
    keys = [k for k in rows[0] if k.startswith(("top", "rand", "knockout_", "writability")) and k != "top_tokens"]
    out["measures"] = {k: summarize([r[k] for r in use], seed=ctx.cfg.seed) for k in keys}
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']}, included {s['n_included']}; summary over {s['summary_over']}"]
    lines += [f"  {k:<22}{v['mean']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]" for k, v in s["measures"].items()
              if v["n"]]
    return "\n".join(lines)


EXPERIMENT = Experiment(name="specificity", doc=__doc__, params=Params, run_instance=_measurements,
                        summarize=summarize_rows, table=table)
