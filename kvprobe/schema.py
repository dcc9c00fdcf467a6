"""Config-schema helpers shared by every validated YAML of kvprobe (run configs, task templates, studies):
hash-neutral params and one-line validation messages; and :class:`Shape`, the base of the records' typed summaries
and rows. Low in the layering: tasks and probes use it, and the runner builds on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvprobe.errors import closest


class Shape(BaseModel):
    """Base of the typed summaries and rows of records (:mod:`kvprobe.runner.shapes`): extra fields pass, the
    declared ones are typed."""

    model_config = ConfigDict(extra="allow", frozen=True)


_UNSET = object()


def hash_neutral(default: Any, neutral: Any = _UNSET, **kwargs: Any) -> Any:
    """A param added after records were written, whose ``default`` reproduces those records' numbers: it enters the
    record hash only when set to something else, so adding it renames no committed record. Where the older records'
    behaviour is not the new default (a design fault fixed), ``neutral`` is that older value: the param enters the
    hash unless it holds ``neutral``, so the new default gets new names and the older records, which state the
    ``neutral`` value in their params (migrated once), keep theirs."""
    extra: dict[str, Any] = {"hash_neutral_default": True}
    if neutral is not _UNSET:
        extra["hash_neutral_value"] = neutral
    return Field(default, json_schema_extra=extra, **kwargs)


def hashed_params(params: BaseModel) -> dict[str, Any]:
    """A model as hashed: its JSON dump, defaults included, except hash-neutral fields left at their default
    (recursively, so a hash-neutral field of a nested section counts too)."""
    dumped = params.model_dump(mode="json")
    for name, info in type(params).model_fields.items():
        value = getattr(params, name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        neutral = extra["hash_neutral_value"] if "hash_neutral_value" in extra else \
            info.get_default(call_default_factory=True)
        if extra.get("hash_neutral_default") and value == neutral:
            dumped.pop(name, None)
        elif isinstance(value, BaseModel):
            dumped[name] = hashed_params(value)
    return dumped


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part)) if hasattr(cls, "model_fields") else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return sorted(cls.model_fields) if hasattr(cls, "model_fields") else []


def format_validation_error(exc: Exception, model: type[BaseModel] | None = None, prefix: str = "",
                            renames: Mapping[str, str] | None = None) -> str:
    """One line per problem: ``key 'task.n_instance': not a known key (allowed: ...)``. ``renames`` maps a
    field's name to the key users write (a config section documented under another name)."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in (prefix, *loc) if p != "")
        if renames and loc and str(loc[0]) in renames:
            key = renames[str(loc[0])] + key[len(str(loc[0])):]
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc) if model is not None else []
            hint = closest(str(loc[-1]), allowed) if loc else ""
            hint += f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"key '{key}' is not a known key{hint}; remove or rename it")
        elif err["type"] == "missing":
            lines.append(f"key '{key}' is required")
        else:
            lines.append(f"key '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


def distinct_subset(value: list[str], allowed: Any, key: str) -> list[str]:
    """A config list that must name some of ``allowed``, each once (a params validator's body)."""
    if not value or any(v not in allowed for v in value) or len(set(value)) != len(value):
        raise ValueError(f"{key} must be a non-empty subset of {list(allowed)}, each once; got {value}")
    return value
