"""Reproduction check: a new run of a config against the committed record of the same config.

When ``results/`` already holds a record for the exact config (same hash), a rerun goes to the untracked
``runs/`` folder beside it and ends with this check, so a newcomer's first command both works and tells them
whether their machine reproduces the committed numbers.

What is compared, per instance (rows matched by ``index``):
- logit differences in nats (row keys ending in ``_ld``, and ``flip``): the verdict's tolerance applies here,
  set from a measured spread (:data:`THREAD_SPREAD_NATS`, :data:`TOLERANCE_FACTOR`) and still four orders of
  magnitude below the smallest flip an included instance has (0.5 nats), so any real change is caught;
- discrete fields (booleans, strings, integers: inclusion, decisions, token positions): must be equal;
- recoveries (a state's fraction of the stale -> oracle flip): reported, not judged. A ratio over a flip of
  a few hundredths of a nat magnifies fp32 noise, so recovery differences are shown over all instances and
  over the included ones (whose flips pass the inclusion threshold);
- other numbers (cosines, accuracies, ...): reported and judged at ``tol_other``.
Timings (``seconds``) are ignored; a field the committed record lacks (added by newer code) is listed, not
judged; a field the new run lacks is a mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# Measured: the recommended SmolLM2 organism's committed locality record (48 instances, made at 2 threads) rerun
# on its 2-core CPU at OMP_NUM_THREADS 1 (48 instances), 2 (48) and 4 (the first 10): 2 and 4 threads reproduce it
# bit for bit, 1 thread differs by at most 1.14e-5 nats on any logit difference (a different fp32 reduction order).
THREAD_SPREAD_NATS = 1.14e-5
# Room for what a thread count does not vary: another CPU's SIMD width or BLAS build reorders sums again.
TOLERANCE_FACTOR = 50


def _round_up_1sig(x: float) -> float:
    """``x`` rounded up to one significant digit (5.7e-4 -> 6e-4): a tolerance reads as a round number."""
    exponent = math.floor(math.log10(x))
    return float(f"{math.ceil(round(x / 10 ** exponent, 9))}e{exponent}")


DEFAULT_TOL_NATS = _round_up_1sig(TOLERANCE_FACTOR * THREAD_SPREAD_NATS)  # 6e-4 nats
DEFAULT_TOL_OTHER = 1e-3
_IGNORED = {"seconds"}


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1].split("[", 1)[0]


def _is_nats(key: str) -> bool:
    leaf = _leaf(key)
    return leaf.endswith("_ld") or leaf == "flip"


def _is_float(v: Any) -> bool:
    return isinstance(v, float) or (v is None)


@dataclass
class ReproductionCheck:
    """Per-key maximum absolute differences and the verdict."""

    tol_nats: float
    tol_other: float
    n_reference: int
    n_new: int
    nats: dict[str, float] = field(default_factory=dict)  # state -> max |delta ld| (nats)
    recovery_all: dict[str, float] = field(default_factory=dict)  # state -> max |delta recovery|, all instances
    recovery_included: dict[str, float] = field(default_factory=dict)  # same, included instances only
    other: dict[str, float] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)  # discrete fields that differ, missing instances
    added_fields: set[str] = field(default_factory=set)  # in the new rows only (reported, not judged)

    @property
    def reproduced(self) -> bool:
        return (not self.mismatches and all(v <= self.tol_nats for v in self.nats.values())
                and all(v <= self.tol_other for v in self.other.values()))

    @property
    def verdict(self) -> str:
        return "reproduced" if self.reproduced else "differs"

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "tol_nats": self.tol_nats, "tol_other": self.tol_other,
                "n_reference": self.n_reference, "n_new": self.n_new, "max_abs_diff_nats": self.nats,
                "max_abs_diff_recovery_all": self.recovery_all,
                "max_abs_diff_recovery_included": self.recovery_included, "max_abs_diff_other": self.other,
                "mismatches": self.mismatches[:20], "added_fields": sorted(self.added_fields)}


def reproduction_table(rep: Mapping[str, Any]) -> str:
    """Terminal table of a record's ``reproduction`` block (:meth:`ReproductionCheck.to_dict`)."""
    def cell(v: float | None, width: int) -> str:
        return f"{'-' if v is None else f'{v:.2e}':>{width}}"

    nats, rec_all, rec_inc = rep["max_abs_diff_nats"], rep["max_abs_diff_recovery_all"], \
        rep["max_abs_diff_recovery_included"]
    lines = [f"reproduction check against the committed record {rep.get('reference', '')}".rstrip()]
    if rec_inc:
        lines.append(f"{'state':<22}{'max |d ld| (nats)':>20}{'max |d recovery|':>18}{'(included)':>12}")
    else:  # no included instance: a recovery there is a ratio over a flip of noise, its difference noise too
        lines.append(f"{'state':<22}{'max |d ld| (nats)':>20}")
    for s in sorted({k.removesuffix("_ld") for k in nats} | set(rec_all)):
        line = f"{s:<22}{cell(nats.get(f'{s}_ld', nats.get(s)), 20)}"
        lines.append(line + (f"{cell(rec_all.get(s), 18)}{cell(rec_inc.get(s), 12)}" if rec_inc else ""))
    for k, v in sorted(rep["max_abs_diff_other"].items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"{k:<40}{v:.2e}")
    if not rec_inc and rec_all:
        lines.append("(recoveries not compared: no instance passed the inclusion rule)")
    lines += [f"mismatch: {m}" for m in rep["mismatches"][:5]]
    if rep.get("added_fields"):
        lines.append(f"fields the committed record does not have (not compared): {', '.join(rep['added_fields'])}")
    lines.append(f"verdict: {rep['verdict']} (tolerance {rep['tol_nats']:g} nats on logit differences, "
                 f"{rep['tol_other']:g} on other numbers; discrete fields must match; "
                 f"{rep['n_new']} of {rep['n_reference']} instances compared)")
    return "\n".join(lines)


def _bump(d: dict[str, float], key: str, a: Any, b: Any) -> None:
    if a is None and b is None:
        d[key] = max(d.get(key, 0.0), 0.0)
        return
    if a is None or b is None:
        d[key] = float("inf")
        return
    d[key] = max(d.get(key, 0.0), abs(float(a) - float(b)))


def compare_records(reference: Mapping[str, Any], new: Mapping[str, Any], tol_nats: float = DEFAULT_TOL_NATS,
                    tol_other: float = DEFAULT_TOL_OTHER) -> ReproductionCheck:
    """Compare the per-instance rows of two records of the same config."""
    ref_rows = {int(r["index"]): r for r in reference.get("rows", [])}
    new_rows = {int(r["index"]): r for r in new.get("rows", [])}
    check = ReproductionCheck(tol_nats, tol_other, len(ref_rows), len(new_rows))
    for idx in sorted(set(ref_rows) ^ set(new_rows)):
        check.mismatches.append(f"instance {idx} is in only one record")
    for idx in sorted(set(ref_rows) & set(new_rows)):
        a_row, b_row = ref_rows[idx], new_rows[idx]
        a_flat = {k: v for k, v in _flatten(a_row) if _leaf(k) not in _IGNORED}
        b_flat = {k: v for k, v in _flatten(b_row) if _leaf(k) not in _IGNORED}
        states = {k.removesuffix("_ld") for k in a_flat if k.endswith("_ld") and "." not in k}
        included = bool(a_row.get("included"))
        for key in sorted(set(a_flat) | set(b_flat)):
            if key not in b_flat:
                check.mismatches.append(f"instance {idx}: '{key}' is missing from the new run")
                continue
            if key not in a_flat:  # a field newer code adds contradicts nothing the record holds
                check.added_fields.add(key)
                continue
            a, b = a_flat[key], b_flat[key]
            if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str):
                if a != b:
                    check.mismatches.append(f"instance {idx}: {key} {a!r} -> {b!r}")
            elif isinstance(a, int) and isinstance(b, int):
                if a != b:
                    check.mismatches.append(f"instance {idx}: {key} {a} -> {b}")
            elif _is_nats(key):
                _bump(check.nats, key, a, b)
            elif key in states:
                _bump(check.recovery_all, key, a, b)
                if included:
                    _bump(check.recovery_included, key, a, b)
            elif _is_float(a) or _is_float(b) or isinstance(a, (int, float)):
                _bump(check.other, key.split("[", 1)[0], a, b)
    return check
