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


def fig14a_serve(records: list[dict[str, Any]], path: Path) -> None:
    rows = [(rec, size) for rec in records for size in rec.get("sizes", [])]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 3, figsize=(12, 3.3 * len(rows) + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [1.3, 1.3, 0.8]})
    for (rec, size), (ax_t, ax_x, ax_h) in zip(rows, axes):
        loads = list(dict.fromkeys(c["rate"] for c in size["cells"]))
        xs = np.arange(len(loads))
        hits = {}
        for arm, (label, color) in ARMS.items():
            by = {c["rate"]: c for c in size["cells"] if c["arm"] == arm}
            cells = [by.get(r) for r in loads]
            get = lambda key: [_num(c[key]) if c else float("nan") for c in cells]  # noqa: E731
            ax_t.plot(xs, get("ttft_p50"), "o-", color=color, label=f"{label} p50")
            ax_t.plot(xs, get("ttft_p90"), "s--", color=color, alpha=0.7, label=f"{label} p90")
            ax_x.plot(xs, get("throughput_rps"), "o-", color=color, label=label)
            done = [c for c in cells if c and c["hit_rate"] is not None]
            # tokens the server looked up: its own query counter when it exports one, else the prompts
            asked = sum(_num(c.get("queried_tokens") or c["prompt_tokens"]) for c in done)
            hits[arm] = sum(_num(c["reused_tokens"]) for c in done) / asked if asked else float("nan")
        n_req = size.get("requests_per_cell")
        title = (f"{rec['model']}, prefix {size['prefix_tokens']} tokens "
                 f"({n_req} requests per arm and load)")
        for ax in (ax_t, ax_x):
            ax.set_xticks(xs, [_load_label(r) for r in loads], fontsize=8)
            ax.set_xlabel("offered load")
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT (s, log)")
        ax_t.set_title(title, fontsize=9, loc="left")
        ax_t.legend(fontsize=7, loc="best")
        ax_x.set_yscale("log")  # the arms differ by an order of magnitude or more
        ax_x.set_ylabel("throughput (completed req/s, log)")
        ax_x.legend(fontsize=7, loc="best")
        names = list(ARMS)
        bars = ax_h.bar(range(len(names)), [hits[a] * 100 for a in names], color=[ARMS[a][1] for a in names])
        for b, a in zip(bars, names):
            ax_h.annotate(f"{hits[a]:.1%}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                          va="bottom", fontsize=8)
        ax_h.set_xticks(range(len(names)), ["edit", "erratum"], fontsize=8)
        ax_h.set_ylim(0, 110)
        ax_h.set_ylabel("prefix-cache hit rate (%)")
        sources = {c.get("hit_source", "") for c in size["cells"]}
        ax_h.set_title(f"all loads; {', '.join(sorted(sources))}", fontsize=7)
    engine = records[0].get("engine", "")
    fig.suptitle(f"Prefix-cache serving under Poisson load (paper Fig. 14a)\n{engine}", fontsize=9)
    save(fig, path)


# figure file stem -> (benchmark whose records it reads, drawing function); merged into kvprobe.figures.BENCH
BENCH_FIGURES = {"fig14a_serve": ("serve", fig14a_serve)}
