"""Suffix concentration: where downstream does the decision's information sit? (paper Section 3 probe (2),
Figure 3b/3c)

For each instance we patch the oracle's downstream K/V into the stale cache one position at a time (all
layers) and rank positions by their causal effect on the decision. Cumulative recovery is then read as
more top-ranked positions are patched together (K = 1, 2, 4, ...), and layer-resolved recovery patches every
downstream position at one layer band at a time. The top positions are decoded so aggregator and
delimiter tokens are visible in the rows. All cells of an instance are read by the shared-base sweep
engine from the instance's two prefills.

Where our setting differs: small models; the gate excludes instances whose oracle flip is too small for a
ratio to mean anything, and both gated and all-instance summaries are recorded.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.patching.ranking import ranked_instance, sweep_recovery
from kvprobe.patching.sweep import KVPatch
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.runner.summary import gate_summary
from kvprobe.stats.bootstrap import summarize


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    top_k: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    layer_bands: int = Field(6, ge=1, description="layers are grouped into this many contiguous bands")
    decode_top: int = 8


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    pp, anchor, ranking = ranked_instance(lm, inst, ctx.cfg.batch_size)
    pair = pp.pair
    ks = [k for k in p.top_k if k < len(ranking.positions)] + [len(ranking.positions)]
    n = lm.spec.n_layers
    bands = [list(range(round(b * n / p.layer_bands), round((b + 1) * n / p.layer_bands))) for b in range(p.layer_bands)]
    cells = [KVPatch.of(ranking.positions[:k]) for k in ks] + [KVPatch.of(pp.downstream_slots, band) for band in bands]
    rec = sweep_recovery(lm, pp, anchor, cells).tolist()
    top = ranking.positions[: p.decode_top]
    return {**inst.row(), "n_tokens": len(pair), "n_downstream": len(pp.downstream_slots), **anchor.row(),
            "included": anchor.gate(ctx.cfg.gate.min_flip, ctx.cfg.gate.require_oracle_correct),
            "cumulative": {str(k): rec[i] for i, k in enumerate(ks)},
            "layer_bands": [{"layers": [b[0], b[-1]], "recovery": rec[len(ks) + i]} for i, b in enumerate(bands)],
            "top_positions": top, "top_effects": ranking.effects[: p.decode_top],
            "top_tokens": [lm.tokenizer.decode([pair.ids_old[t]]) for t in top],
            "top_relative_position": [(t - pp.field_slots[-1]) / len(pp.downstream_slots) for t in top]}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = gate_summary(rows, ctx.cfg.gate)
    gated = [r for r in rows if r["included"]] or rows
    out["summary_over"] = "gated" if any(r["included"] for r in rows) else "all (no instance passed the gate)"
    ks = [k for k in ctx.params.top_k] + ["all"]
    out["cumulative"] = {}
    for k in ks:
        vals = [r["cumulative"].get(str(k)) if k != "all" else r["cumulative"][max(r["cumulative"], key=int)]
                for r in gated]
        out["cumulative"][str(k)] = summarize([v for v in vals if v is not None], seed=ctx.cfg.seed)
    out["layer_bands"] = [{"layers": b["layers"], **summarize([r["layer_bands"][i]["recovery"] for r in gated],
                                                               seed=ctx.cfg.seed)}
                          for i, b in enumerate(gated[0]["layer_bands"])]
    counts: dict[str, int] = {}
    for r in gated:
        for tok in r["top_tokens"][:4]:
            counts[tok] = counts.get(tok, 0) + 1
    out["most_frequent_top_tokens"] = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"instances {s['n_instances']}, included {s['n_included']} (gate: flip >= {s['gate']['min_flip']}); "
             f"summary over {s['summary_over']}", "cumulative recovery, top-K downstream positions:"]
    lines += [f"  K={k:<5} {v['mean']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]" for k, v in s["cumulative"].items()
              if v["n"]]
    lines.append("layer bands (all downstream positions at those layers):")
    lines += [f"  L{b['layers'][0]}-{b['layers'][1]:<4} {b['mean']:+.3f} [{b['ci_low']:+.3f}, {b['ci_high']:+.3f}]"
              for b in s["layer_bands"]]
    lines.append("top tokens: " + ", ".join(f"{t!r}x{c}" for t, c in s["most_frequent_top_tokens"]))
    return "\n".join(lines)


EXPERIMENT = Experiment(name="suffix", doc=__doc__, params=Params, run_instance=run_instance,
                        summarize=summarize_rows, table=table)
