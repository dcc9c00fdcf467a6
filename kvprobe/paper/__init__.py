"""The paper's numbers, in one place: ``values.yaml`` beside this file.

Every number of the paper kvprobe compares with (a claim's paper value, a figure's paper mark) is an entry here,
keyed by an id: the claim's id (``experiment.key``, ``@template`` off the gated task, ``[param=value]`` for a
variant) or, for a number only a figure draws, ``figure.<stem>.<name>``. An entry holds the value or range as the
paper gives it, its n and interval where the paper gives them, the model and condition, the location (section,
figure or table) and its source: a sentence of the paper quoted verbatim, or a file and field of the paper's
released records. Claims, figures and pages read the entries; nothing else types a paper number.

A bound or margin that kvprobe adds (a TOST margin, a rate bound, a threshold) is not the paper's and is not
here: it is the claim's own, and the claims table prints it as kvprobe's.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvprobe.errors import KVProbeError, closest

VALUES_FILE = "values.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Strict):
    """Where the number comes from: a verbatim sentence of the paper, or a released record's file and field."""

    quote: str | None = Field(None, description="a sentence (or clause) of the paper, verbatim")
    record: str | None = Field(None, description="a file of the paper's released records, e.g. results/x.json")
    field: str | None = Field(None, description="the dotted path of the number in that record; for a curve, with "
                                                "'{k}' where each point's key goes")

    @model_validator(mode="after")
    def _one_kind(self) -> Source:
        if (self.quote is None) == (self.record is None):
            raise ValueError("give either quote (a sentence of the paper) or record + field (a released record)")
        if self.record is not None and not self.field:
            raise ValueError("a released-record source names its field (a dotted path into the record)")
        return self


class PaperValue(_Strict):
    """One number (or range) of the paper, as the paper states it."""

    statement: str = Field(description="the number(s) as the paper states them, with model and condition")
    basis: Literal["paper", "construction"] = Field(
        "paper", description="'construction' for a value that holds by definition (an identity), not a finding")
    value: float | tuple[float, float] | None = Field(None, description="the value, or [low, high]; none if "
                                                                         "the paper gives no number")
    point: float | None = Field(None, description="the single value a power analysis uses where value is a range "
                                                  "(default: its midpoint)")
    n: str | None = Field(None, description="the paper's n behind the number")
    ci: tuple[float, float] | None = Field(None, description="the paper's interval, where it gives one")
    model: str | None = None
    condition: str | None = Field(None, description="task, arm, scheme, placement: what the number is of")
    curve: dict[str, float] | None = Field(None, description="values along a sweep, e.g. recovery at k = 1/3/5 "
                                                             "heads (a figure's paper curve)")
    location: str = Field(description="section, figure or table: 'Sec. 3 (1)', 'Fig. 9b', 'Tab. 6'")
    source: Source | None = None

    def label(self, prefix: str = "paper") -> str:
        """A figure's legend text for this mark: 'paper 0.27-0.82 (Llama-3.1-8B)'."""
        return f"{prefix} {self.shown()}" + (f" ({self.model})" if self.model else "")

    @property
    def low_high(self) -> tuple[float, float] | None:
        if self.value is None:
            return None
        return (float(self.value), float(self.value)) if isinstance(self.value, float) else self.value

    @property
    def single(self) -> float | None:
        """The value as one number: ``point``, a scalar value, or a range's midpoint."""
        if self.point is not None:
            return self.point
        lh = self.low_high
        return None if lh is None else (lh[0] if lh[0] == lh[1] else (lh[0] + lh[1]) / 2)

    def shown(self) -> str:
        """The value as printed beside ours: '0.78', '0.27-0.82'."""
        lh = self.low_high
        if lh is None:
            return "no number"
        return f"{lh[0]:g}" if lh[0] == lh[1] else f"{lh[0]:g}-{lh[1]:g}"


@lru_cache(maxsize=1)
def registry() -> dict[str, PaperValue]:
    """Every entry of ``values.yaml``, validated (an entry that does not fit names its id and the field)."""
    text = resources.files(__name__).joinpath(VALUES_FILE).read_text()
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise KVProbeError(f"kvprobe/paper/{VALUES_FILE} is not valid YAML: {exc}") from None
    out = {}
    for key, entry in raw.items():
        try:
            out[str(key)] = PaperValue.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise KVProbeError(f"kvprobe/paper/{VALUES_FILE}: entry '{key}', field '{where}': {first['msg']}"
                               ) from None
    return out


def paper_value(key: str) -> PaperValue:
    """The registry entry ``key``; an unknown key names the closest ones and the file to add it to."""
    values = registry()
    if key not in values:
        raise KVProbeError(f"no paper value '{key}' in kvprobe/paper/{VALUES_FILE}{closest(key, values)}: add an "
                           f"entry with its statement, value, location and source")
    return values[key]


HEADLINE_PREFIX = "headline."


def headlines(experiment: str) -> dict[str, str]:
    """The paper's values beside an experiment's headline in the results tables, per task template stem
    (``headline.<experiment>@<task>`` entries), as an ``Experiment(paper=...)`` takes them."""
    prefix = f"{HEADLINE_PREFIX}{experiment}@"
    return {key[len(prefix):]: entry.statement for key, entry in registry().items() if key.startswith(prefix)}
