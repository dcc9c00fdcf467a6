"""Figure 14a: prefix-cache serving under Poisson load, in-prefix edit vs append-only erratum.

Reads the serving benchmark's records (``results/bench/serve_<model>.json``, ``benchmarks/serve.py``). One row
per (model, prefix size): TTFT p50 and p90 against offered load, throughput against offered load, and the
engine's own prefix-cache hit rate per arm (read from its counters by the benchmark, never inferred here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from kvprobe.figures.common import save

ARMS = {"in_prefix_edit": ("in-prefix edit", "tab:red"), "erratum": ("append-only erratum", "tab:blue")}


def _load_label(rate: float | None) -> str:
    return f"{rate:g}/s" if rate else "unthrottled"


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


SHORT = {"in_prefix_edit": "edit", "erratum": "erratum"}
WIDTH_IN = 6.5  # the figure fits a page column at its dpi


def _hit(cell: dict[str, Any]) -> float:
    return _num(cell.get("hit_rate"))


def fig14a_serve(records: list[dict[str, Any]], path: Path) -> None:
    """TTFT p50/p90, throughput and the server's own prefix-cache hit rate per arm, against offered load."""
    rows = [(rec, size) for rec in records for size in rec.get("sizes", [])]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 3, figsize=(WIDTH_IN, 2.5 * len(rows) + 1.0), squeeze=False,
                             gridspec_kw={"width_ratios": [1.15, 1.0, 1.0]})
    for (rec, size), (ax_t, ax_x, ax_h) in zip(rows, axes):
        loads = list(dict.fromkeys(c["rate"] for c in size["cells"]))
        xs = np.arange(len(loads))
        width = 0.38
        for j, (arm, (label, color)) in enumerate(ARMS.items()):
            by = {c["rate"]: c for c in size["cells"] if c["arm"] == arm}
            cells = [by.get(r) for r in loads]
            get = lambda key: [_num(c[key]) if c else float("nan") for c in cells]  # noqa: E731
            ax_t.plot(xs, get("ttft_p50"), "o-", color=color, ms=4, label=f"{SHORT[arm]} p50")
            ax_t.plot(xs, get("ttft_p90"), "s--", color=color, ms=3, alpha=0.7, label=f"{SHORT[arm]} p90")
            ax_x.plot(xs, get("throughput_rps"), "o-", color=color, ms=4, label=label)
            hits = [_hit(c) * 100 if c else float("nan") for c in cells]
            bars = ax_h.bar(xs + (j - 0.5) * width, hits, width, color=color, label=label)
            for b, h in zip(bars, hits):
                if np.isfinite(h):
                    ax_h.annotate(f"{h:.0f}", (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom",
                                  fontsize=6)
        n_req = size.get("requests_per_cell")
        for ax in (ax_t, ax_x, ax_h):
            ax.set_xticks(xs, [_load_label(r).replace("unthrottled", "all at\nonce") for r in loads], fontsize=6)
            ax.set_xlabel("offered load (req/s)", fontsize=7)
            ax.tick_params(axis="y", labelsize=6)
            ax.grid(alpha=0.3, axis="y")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT at the client (s)", fontsize=7)
        ax_t.legend(fontsize=5.5, loc="best")
        ax_t.set_title(f"prefix {size['prefix_tokens']} tok, {n_req} req/arm/load", fontsize=7, loc="left")
        ax_x.set_ylabel("completed req/s", fontsize=7)
        ax_x.legend(fontsize=5.5, loc="best")
        ax_x.set_title("throughput", fontsize=7, loc="left")
        ax_h.set_ylim(0, 110)
        ax_h.set_ylabel("prompt tokens from cache (%)", fontsize=7)
        sources = sorted({c.get("hit_source", "") for c in size["cells"]})
        server_counts = "llama-server" in " ".join(sources)
        ax_h.set_title("hit rate (server's counters)" if server_counts else "hit rate", fontsize=7, loc="left")
    rec0 = records[0]
    server = rec0.get("server") or {}
    if server.get("kind") == "llama-server":
        sub = (f"llama-server {server.get('build', '')}, {rec0['model']}, {server.get('n_parallel')} slots, "
               f"cache_prompt, --cache-reuse {server.get('cache_reuse')}, {server.get('threads')} CPU thread\n"
               "hit rate: the server's timings.cache_n / prompt tokens (its /metrics agree)")
    else:
        sub = rec0.get("engine", "")
    fig.suptitle(f"Fig. 14a: in-prefix edit vs append-only erratum under Poisson load\n{sub}", fontsize=7)
    fig.tight_layout()
    fig._kvprobe_laid_out = True
    save(fig, path)


# figure file stem -> (benchmark whose records it reads, drawing function); merged into kvprobe.figures.BENCH
# benchmark figures: stem -> (benchmark whose records it reads: results/bench/<name>_<model>.json, drawing function)
BENCH_FIGURES = {"fig14a_serve": ("serve", fig14a_serve)}
