"""Validated run configs: YAML + CLI overrides -> a frozen pydantic model (``extra="forbid"``).

Errors name the key, what is wrong, and the keys or values that are allowed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvprobe.errors import KVProbeError
from kvprobe.models.registry import DEFAULT_MODEL


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskConfig(Strict):
    template: str = "configs/tasks/gated.yaml"
    scenarios: list[str] | None = None  # None: every scenario of the template
    n_instances: int = Field(24, ge=1)
    n_filler: int = Field(24, ge=20, description="neutral filler rules between rule and decision (paper: >= 20)")


class GateConfig(Strict):
    """Inclusion gate: an instance enters the summary only if the oracle moves the decision enough."""

    min_flip: float = Field(0.5, ge=0.0, description="minimum oracle flip (nats of the action logit difference)")
    require_oracle_correct: bool = False


class RunConfig(Strict):
    experiment: str
    model: str = DEFAULT_MODEL
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = Field(16, ge=1, description="cache states per readout forward")
    task: TaskConfig = TaskConfig()
    gate: GateConfig = GateConfig()
    params: dict[str, Any] = Field(default_factory=dict, description="experiment-specific; validated by the experiment")
    output_dir: str = "results"

    def hash(self, extra: str = "", params: dict[str, Any] | None = None) -> str:
        """Hash of everything that can change the numbers (not where the record is written).

        ``extra`` folds in content the config only points to (the task template file's hash); ``params``,
        when given, replaces the raw params by the experiment's resolved ones (defaults included)."""
        payload = {**self.model_dump(exclude={"output_dir"}), "_extra": extra}
        if params is not None:
            payload["params"] = params
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part)) if hasattr(cls, "model_fields") else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return sorted(cls.model_fields) if hasattr(cls, "model_fields") else []


def format_validation_error(exc: Exception, model: type[BaseModel] | None = None, prefix: str = "") -> str:
    """One line per problem: ``key 'task.n_instance': not a known key (allowed: ...)``."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in (prefix, *loc) if p != "")
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc) if model is not None else []
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"key '{key}' is not a known key{hint}; remove or rename it")
        elif err["type"] == "missing":
            lines.append(f"key '{key}' is required")
        else:
            lines.append(f"key '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise KVProbeError(f"--set {dotted}: '{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise KVProbeError(f"--set takes key=value (e.g. --set task.n_instances=8); got '{pair}'")
        key, raw = pair.split("=", 1)
        _set_dotted(out, key.strip(), yaml.safe_load(raw))
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise KVProbeError(f"config {p} does not exist (configs/ lists the experiments)")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise KVProbeError(f"config {p} must be a YAML mapping of keys")
        data = loaded
    data = _merge(data, overrides or {})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise KVProbeError(f"config {path}: {format_validation_error(exc, RunConfig)}") from None


def validate_params(params_model: type[BaseModel], params: dict[str, Any], where: str) -> BaseModel:
    try:
        return params_model.model_validate(params)
    except ValidationError as exc:
        raise KVProbeError(f"config {where}: {format_validation_error(exc, params_model, prefix='params')}") from None
