"""The registry of the paper's numbers (kvprobe/paper/values.yaml): every claim draws its paper side from it, every
quoted source is a sentence of the paper, and every number taken from the paper's released records equals that
record (as the paper's own site/data/build_data.py checks its numbers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvprobe.paper import PaperValue, Source, registry

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
PAPER_TEXT = SHARED / "seeds" / "003_8b7fc8c51536ec7e.txt"
RELEASED = SHARED / "data" / "paper-released-records"


def _normalize(text: str) -> str:
    """The paper's text as a reader sees it: math markup and typographic dashes and arrows as plain characters."""
    text = text.replace("$", "").replace("\\rightarrow", "->").replace("→", "->").replace("˜", " ")
    text = re.sub(r"\\[a-z]+\{([^}]*)\}", r"\1", text)  # \mathrm{x} -> x
    text = text.replace("{", "").replace("}", "").replace("\\", "")
    text = text.replace("–", "-").replace("—", "-").replace("−", "-").replace("’", "'")
    return re.sub(r"\s*->\s*", "->", re.sub(r"\s+", " ", text))


def test_every_entry_validates_and_every_claim_id_has_its_claim():
    from kvprobe.claims import declared_claims, paper_id
    from kvprobe.runner.experiment import available_experiments, get_experiment

    values = registry()
    used = {paper_id(name, c) for name in available_experiments() for c in get_experiment(name).claims}
    for name in available_experiments():
        assert all(c.paper_id in values for c in declared_claims(name))
    orphans = [k for k in values if not k.startswith(("figure.", "prose.")) and k not in used]
    assert not orphans, f"registry entries no claim reads (remove them or name the claim): {orphans}"


def test_a_source_is_a_quote_or_a_record_field_and_an_unknown_id_names_the_fix():
    with pytest.raises(ValueError):
        Source(quote="x", record="results/a.json", field="a")
    with pytest.raises(ValueError):
        Source(record="results/a.json")
    from kvprobe.errors import KVProbeError
    from kvprobe.paper import paper_value

    with pytest.raises(KVProbeError, match="did you mean 'locality.field_only_zero'"):
        paper_value("locality.field_only_zer")
    assert PaperValue(statement="x", value=(0.2, 0.4), location="Fig. 1").single == pytest.approx(0.3)


@pytest.mark.skipif(not PAPER_TEXT.exists(), reason="the paper's text is in the checkout's ../shared/seeds only")
def test_every_quoted_source_is_a_sentence_of_the_paper():
    paper = _normalize(PAPER_TEXT.read_text())
    quoted = {k: v.source.quote for k, v in registry().items() if v.source and v.source.quote}
    assert len(quoted) >= 5
    missing = {k: q for k, q in quoted.items() if _normalize(q) not in paper}
    assert not missing, f"quotes not found verbatim in the paper: {missing}"


def _field(record: dict, path: str) -> float:
    cur = record
    for part in path.split("."):
        cur = cur[part]
    return float(cur)


def _tolerance(value: float) -> float:
    """Half a unit in the last decimal the registry writes (0.78 -> 0.005): the paper rounds its records."""
    text = repr(value)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return 0.5 * 10 ** -decimals + 1e-12


@pytest.mark.skipif(not RELEASED.exists(), reason="the released records are in ../shared/data only")
def test_values_taken_from_released_records_equal_those_records():
    checked = 0
    for key, entry in registry().items():
        if not (entry.source and entry.source.record):
            continue
        record = json.loads((RELEASED / entry.source.record).read_text())
        actual = _field(record, entry.source.field)
        if entry.point is not None or isinstance(entry.value, float):
            expect = entry.point if entry.point is not None else entry.value
            assert abs(actual - expect) <= _tolerance(expect), (key, actual, expect)
        else:  # a range: the record's number is one of the values it spans
            low, high = entry.low_high
            assert low - _tolerance(low) <= actual <= high + _tolerance(high), (key, actual, entry.value)
        checked += 1
    assert checked >= 5


def test_a_record_check_fails_on_a_wrong_value():
    """The check above can fail: the released Llama field-only is -0.028, not -0.02."""
    if not RELEASED.exists():
        pytest.skip("the released records are in ../shared/data only")
    record = json.loads((RELEASED / "results/mech_causal_patch_llama31_8b.json").read_text())
    actual = _field(record, "agg.field_only_recovery.mean")
    assert abs(actual - (-0.028)) <= _tolerance(-0.028) and abs(actual - (-0.02)) > _tolerance(-0.02)


def test_the_figures_type_no_paper_number():
    """A figure's paper mark comes from the registry (kvprobe.paper), never a literal beside the word "paper"."""
    figures = Path(__file__).resolve().parents[1] / "kvprobe" / "figures"
    offenders = []
    for path in figures.glob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"paper", line, re.I) and re.search(r"(?<![\w.])-?\d+\.\d+", line) \
                    and not line.lstrip().startswith("#"):
                offenders.append(f"{path.name}:{i}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)
