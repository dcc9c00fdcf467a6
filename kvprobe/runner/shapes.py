"""Typed summaries and rows: the shape an experiment's record holds, declared once as pydantic models.

An experiment may declare ``Experiment.summary_model`` (its ``summary``) and ``Experiment.row_model`` (a row as the
claims read it: the record's row with the summary's ``row_measures`` under their names,
:func:`kvprobe.claims.claim_rows`). The models name the fields that the experiment's headline, table, claims and
figures read. Other fields are allowed (``extra="allow"``), so a model does not have to describe everything. A field
that older records lack is declared ``X | None = None``, and the committed records carry it explicitly as null
(``tools/migrate_records.py`` writes it once). Readers then test ``is None``, a state the model names, and never
``"key" in summary``.

- :func:`complete`: a summary with every declared field that defaults to None and is absent written as null, in
  the model's order. The runner applies it to each new summary, and the migration applies it to committed ones, so
  old and new records have one shape.
- :func:`declares`: whether a dotted path (a claim's ``"read_top.12"``, ``"crossfit.top8"``) names declared fields
  of a model. The claims' paths are checked against the row models with it, so a field renamed in the code but not
  in a claim fails a test instead of reading None on every row.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union

from pydantic import BaseModel

from kvprobe.schema import Shape

__all__ = ["Shape", "complete", "declares", "optional_fields"]


def optional_fields(model: type[BaseModel]) -> list[str]:
    """The model's fields whose default is None (those older records may lack), in declaration order."""
    return [name for name, info in model.model_fields.items()
            if not info.is_required() and info.get_default(call_default_factory=True) is None]


def complete(model: type[BaseModel] | None, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with each of ``model``'s None-default fields it lacks appended as None (nothing else changes).
    Idempotent."""
    if model is None:
        return summary
    missing = [name for name in optional_fields(model) if name not in summary]
    return {**summary, **{name: None for name in missing}} if missing else summary


def _strip_optional(ann: Any) -> list[Any]:
    """The alternatives of ``X | None`` (or of any union) without None."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        return [a for a in typing.get_args(ann) if a is not type(None)]
    return [ann]


def _declares(ann: Any, parts: list[str]) -> bool:
    if not parts:
        return True
    part, rest = parts[0], parts[1:]
    for alt in _strip_optional(ann):
        origin = typing.get_origin(alt)
        if alt is Any:
            return True
        if isinstance(alt, type) and issubclass(alt, BaseModel):
            field = alt.model_fields.get(part)
            if field is not None and _declares(field.annotation, rest):
                return True
        elif origin is dict:
            args = typing.get_args(alt)
            if _declares(args[1] if len(args) == 2 else Any, rest):
                return True
        elif origin in (list, tuple):
            args = typing.get_args(alt)
            item = args[0] if args else Any
            if part in ("*", "@slope"):  # the rest of the path read on each item (kvprobe.claims.get)
                if _declares(item, rest):
                    return True
            elif part.isdigit() and _declares(item, rest):
                return True
    return False


def declares(model: type[BaseModel], path: str) -> bool:
    """Whether ``path`` (dotted, as :func:`kvprobe.claims.get` reads it: ``"a.b"``, ``"turns.*.x"``, ``"x / y"``)
    names fields ``model`` declares: a model's field by its name (an extra field does not count), any key of a
    ``dict[str, X]``, an index, ``*`` or ``@slope`` of a list. A ``{name}`` step (filled from the summary) matches
    any field."""
    if " / " in path:
        return all(declares(model, p.strip()) for p in path.split(" / ", 1))
    parts = path.split(".")
    if any("{" in p for p in parts):
        head = parts[: next(i for i, p in enumerate(parts) if "{" in p)]
        return _declares(model, head) if head else True
    return _declares(model, parts)
