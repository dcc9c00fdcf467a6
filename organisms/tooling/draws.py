"""Test draws: scored only by ``kvprobe organism test``, each scoring logged, a sealed draw scored once.

Training (``organism train``) and the seed spread score validation cells only; every test scoring goes
through :func:`score_test_draw`, which appends one line per scoring to ``organisms/test_log.jsonl`` (a
committed file). A *sealed* draw is one pre-registered before any organism was scored on it
(``docs/history/sealed_draw.md``): its word list, size and draw seeds are fixed here, it refuses a dirty
working tree, and it refuses a second scoring of the same organism.

The older test draws (``v1``: the first word list, ``v2``: the second) were read many times during the
organism search; they stay scorable, logged, for comparison only.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprobe.errors import KVProbeError

LOG_FILE = "test_log.jsonl"


@dataclass(frozen=True)
class TestDraw:
    words: str | None  # the word list drawn from (None: the default list)
    sealed: bool
    pairs: int | None = None  # fixed pairs per cell (sealed draws); None: --pairs
    note: str = ""


TEST_DRAWS: dict[str, TestDraw] = {
    "v1": TestDraw(None, False, note="first word list; read many times during the organism search"),
    "v2": TestDraw("kvprobe/tasks/data/scenario_words_v2.yaml", False,
                   note="second word list; read many times during the organism search"),
    "sealed-1": TestDraw("kvprobe/tasks/data/scenario_words_sealed.yaml", True, pairs=32,
                         note="pre-registered in docs/history/sealed_draw.md; every test word new"),
}


def log_path() -> Path:
    from kvprobe.models import organisms as registry

    return registry.ORGANISMS_DIR / LOG_FILE


def read_log(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or log_path()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _git_state(repo: Path) -> tuple[str | None, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, True
    return commit, dirty


def check_may_score(draw_name: str, aliases: list[str], log: list[dict[str, Any]], dirty: bool) -> TestDraw:
    """The draw, or one clear error: unknown draw, a sealed draw from a dirty tree, or scored before."""
    if draw_name not in TEST_DRAWS:
        raise KVProbeError(f"--draw {draw_name}: one of {', '.join(TEST_DRAWS)}")
    draw = TEST_DRAWS[draw_name]
    if not draw.sealed:
        return draw
    if dirty:
        raise KVProbeError(f"draw {draw_name} is sealed: score it from a clean working tree (commit first), so the "
                           "log names the exact code that scored it")
    for entry in log:
        if entry["draw"] == draw_name and set(entry["aliases"]) & set(aliases):
            raise KVProbeError(f"draw {draw_name} is sealed and was already scored for {entry['aliases']} at commit "
                               f"{str(entry['git_commit'])[:12]} ({entry['scored_at']}): a sealed draw is scored once")
    return draw


def score_test_draw(folders: list[Path], draw_name: str, pairs: int | None = None, progress: bool = True
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Score the organisms in ``folders`` (one recipe's seeds, the primary first) on a test draw; store the
    block in the primary card (:func:`organisms.tooling.validation.score_larger_draw`) and append the log
    entry. Returns (block, log entry)."""
    from kvprobe.models import organisms as registry
    from organisms.tooling.validation import block_key, recipe_summary, score_larger_draw

    aliases = [json.loads((Path(f) / "card.json").read_text())["alias"] for f in folders]
    commit, dirty = _git_state(registry.ORGANISMS_DIR.parent)
    draw = check_may_score(draw_name, aliases, read_log(), dirty)
    if draw.pairs is not None and pairs not in (None, draw.pairs):
        raise KVProbeError(f"draw {draw_name} has {draw.pairs} pairs per cell, fixed when it was pre-registered; "
                           "drop --pairs")
    n = draw.pairs or pairs or 32
    block = score_larger_draw(folders, pairs=n, progress=progress, split="test", words=draw.words)
    summary = recipe_summary(block)
    entry = {"draw": draw_name, "sealed": draw.sealed, "aliases": aliases, "pairs_per_cell": n,
             "words": block["words"], "card_key": block_key("test", block["words"]), "data_hash": block["data_hash"],
             "git_commit": commit, "git_dirty": dirty,
             "scored_at": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
             "cells": {name: {"n_pairs": c["n_pairs"], "accuracy_per_seed": c["accuracy"]["per_seed"],
                              "median_flip_per_seed": c["median_flip"]["per_seed"],
                              "pooled": {k: round(v, 4) for k, v in c["pooled"].items()}}
                       for name, c in summary["cells"].items()}}
    path = log_path()
    with path.open("a") as fh:
        fh.write(json.dumps(entry, sort_keys=True) + "\n")
    return block, entry


SEALED_GOALS = "accuracy >= 0.90 in both cells and a median flip of 2-10 nats (pre-registered, commit 586145f)"


def sealed_draw_table(_results_dir: Any = None, path: Path | None = None) -> str:
    """Markdown: each organism's one scoring on a sealed draw (``organisms/test_log.jsonl``), per cell, with the
    exact (Clopper-Pearson) interval of its accuracy and whether the pre-registered goals were met (the
    ``kvprobe:sealed_draw`` block of RESULTS.md and the README)."""
    from kvprobe.stats.inference import proportion_ci

    rows = ["| organism | draw | unseen formats (system_user, tool_call) | train formats (gated_template, user_turn, "
            "document_qa) | both cells | median flip (nats) | pre-registered goals met |", "|" + "---|" * 7]
    for entry in read_log(path):
        if not entry.get("sealed"):
            continue
        cells = entry["cells"]

        def shown(name: str) -> str:
            cell = cells[name]
            n = 2 * cell["n_pairs"]  # each pair is decided both ways (old -> new and new -> old)
            k = round(cell["accuracy_per_seed"][0] * n)
            lo, hi = proportion_ci(k, n)
            return f"{k}/{n} = {k / n:.3f} [{lo:.3f}, {hi:.3f}]"

        accs = {name: cells[name]["accuracy_per_seed"][0] for name in ("test_unseen_formats", "test_train_formats")}
        flip = cells["both"]["median_flip_per_seed"][0]
        missed = [f"{'unseen' if n == 'test_unseen_formats' else 'train'} formats {a:.3f} < 0.90"
                  for n, a in accs.items() if a < 0.9]
        if not 2 <= flip <= 10:
            missed.append(f"median flip {flip:.2f} outside 2-10")
        rows.append(f"| `{entry['aliases'][0]}` | {entry['draw']} | {shown('test_unseen_formats')} | "
                    f"{shown('test_train_formats')} | {shown('both')} | {flip:.2f} | "
                    + ("yes" if not missed else "no: " + "; ".join(missed)) + " |")
    if len(rows) == 2:
        return "(no organism has been scored on a sealed draw yet: `kvprobe organism test ALIAS --draw NAME`)"
    return "\n".join(rows) + (f"\n\nDecisions correct / decisions (each pair decided both ways, so the two decisions "
                              f"of a pair are not independent). Goals: {SEALED_GOALS}. Intervals: exact "
                              f"(Clopper-Pearson) on decisions, 95%.")
