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

from kvprobe.errors import KVProbeError, closest
from kvprobe.schema import hash_neutral, hashed_params  # noqa: F401  (also the runner's names)
from kvprobe.schema import format_validation_error as _format_validation_error
from kvprobe.models.registry import DEFAULT_MODEL
from kvprobe.tasks.generator import GeneratorFormats, GeneratorSplit, RulePosition


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GeneratorTask(Strict):
    """Instances from the procedural scenario generator (kvprobe.tasks.generator) instead of the template:
    instance i takes family i of ``split`` (or, with ``task.scenarios``, that list's scenario i, cycling) in
    format ``formats[i % len(formats)]``."""

    split: GeneratorSplit = Field("test", description="generator split the families come from")
    formats: GeneratorFormats = Field(default_factory=lambda: ["system_user", "tool_call"], min_length=1)
    distance: int | None = Field(None, ge=1, description="target field-to-decision tokens; None: 25 note lines")
    counterfactual: float = Field(0.5, ge=0.0, le=1.0, description="probability of an exchanged-values rule "
                                                      "(0 when task.scenarios names template scenarios)")
    rule_at: RulePosition = hash_neutral("format", description="'format' (each format's own place), or "
                                         "'before_field' / 'after_field' (moves the rule in user_turn / document_qa)")
    words: str = "kvprobe/tasks/data/scenario_words.yaml"


class TaskConfig(Strict):
    template: str = "configs/tasks/gated.yaml"
    # None: every scenario of the template; with task.generator, the template scenarios rendered in its formats
    scenarios: list[str] | None = None
    n_instances: int = Field(24, ge=1)
    n_filler: int = Field(24, ge=20, description="neutral filler rules between rule and decision (paper: >= 20)")
    generator: GeneratorTask | None = hash_neutral(None, description="generated instances instead of the template")


class GateConfig(Strict):
    """Inclusion rule: an instance enters the summary only if the oracle moves the decision enough.

    Written ``inclusion:`` in a config; ``gate:`` (the name the committed records were hashed under) is still
    accepted, and the hash keeps the old key so a renamed config names the same record."""

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
        payload = {k: v for k, v in hashed_params(self).items() if k != "output_dir"}
        payload["_extra"] = extra
        if params is not None:
            payload["params"] = params
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def format_validation_error(exc: Exception, model: type[BaseModel] | None = None, prefix: str = "") -> str:
    """One line per problem (:func:`kvprobe.schema.format_validation_error`); a run config's ``gate`` section
    is named by its documented key, ``inclusion``."""
    return _format_validation_error(exc, model, prefix, renames={"gate": "inclusion"} if model is RunConfig else None)


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
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
            raise KVProbeError(f"--set {key.strip()}: the value {raw!r} is not valid YAML ({what or 'parse error'}): "
                               "close every bracket and brace, e.g. --set \"task.generator={formats: [system_user]}\"") \
                from None
        _set_dotted(out, key.strip(), value)
    return out


def check_task_template(template: str) -> None:
    """A task template that does not exist is an error naming the closest shipped templates, raised before the
    model loads (a load takes seconds to minutes)."""
    from kvprobe.cache_dir import project_path

    if project_path(template).is_file():
        return
    shipped = sorted(f"configs/tasks/{p.name}" for p in project_path("configs/tasks").glob("*.yaml"))
    raise KVProbeError(f"key 'task.template': {template} does not exist{closest(template, shipped)}; give a task "
                       f"template file (kvprobe's: {', '.join(shipped)})")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _inclusion_key(data: dict[str, Any], where: Any) -> dict[str, Any]:
    """``inclusion:`` is the config's name for the inclusion rule; it is stored (and hashed) as ``gate``."""
    if "inclusion" not in data:
        return data
    if "gate" in data:
        raise KVProbeError(f"config {where}: keys 'inclusion' and 'gate' name the same rule; keep only 'inclusion'")
    out = {k: v for k, v in data.items() if k != "inclusion"}
    out["gate"] = data["inclusion"]
    return out


def config_names() -> list[str]:
    """The experiment configs shipped with kvprobe (``configs/<name>.yaml`` in a checkout or the installed package)."""
    from kvprobe.cache_dir import project_path

    return sorted(p.stem for p in project_path("configs").glob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """A config file as given, else one of kvprobe's configs: ``configs/locality.yaml`` from any directory, or just
    its name (``locality``; also ``<name>.yaml`` of a plugin folder, :mod:`kvprobe.runner.plugins`). A missing one
    is an error naming the closest config names."""
    from kvprobe.cache_dir import project_path
    from kvprobe.runner.plugins import plugin_config

    p = Path(path)
    if p.is_file():
        return p
    name = str(p) if p.suffix not in (".yaml", ".yml") and len(p.parts) == 1 else None
    if name is not None:
        p = Path("configs") / f"{p}.yaml"
    found = project_path(p)
    if found.is_file():
        return found
    plugin = plugin_config(name) if name is not None else None
    if plugin is not None:
        return plugin
    raise KVProbeError(f"config {path} does not exist{closest(Path(path).stem, config_names())}; "
                       "give a YAML file or one of kvprobe's config names (`ls configs/`)")


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a syntax error becomes one line naming the file, line and column."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x) or str(exc)
        raise KVProbeError(f"{where}: malformed YAML: {' '.join(what.split())}") from None


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_path(path)
        loaded = read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise KVProbeError(f"config {p} must be a YAML mapping of keys")
        data = loaded
    data = _merge(_inclusion_key(data, path), _inclusion_key(overrides or {}, "--set"))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise KVProbeError(f"config {path}: {format_validation_error(exc, RunConfig)}") from None


def validate_params(params_model: type[BaseModel], params: dict[str, Any], where: str) -> BaseModel:
    try:
        return params_model.model_validate(params)
    except ValidationError as exc:
        raise KVProbeError(f"config {where}: {format_validation_error(exc, params_model, prefix='params')}") from None
