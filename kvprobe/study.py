"""The study: which models and runs kvprobe's main results are about (``study.yaml``).

A run is *published* when its resolved config (config file + overrides + model, hashed as the record is named:
:func:`kvprobe.runner.experiment.record_hash`) is one the study lists. Published records are the only ones the
report, the README headline, the claims summary and the figures read; every other record in ``results/`` is
archive, and a new run of an unlisted config goes to ``runs/`` (scratch) unless ``--publish`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvprobe.errors import KVProbeError

STUDY_FILE = "study.yaml"  # beside configs/, not in it: every configs/*.yaml is an experiment config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StudyRun(_Strict):
    config: str = Field(description="a config file stem in configs/ (e.g. locality_chat) or in a plugin folder")
    set: dict[str, Any] = Field(default_factory=dict, description="overrides, nested as `--set` builds them")
    task: str | None = Field(None, description="the prompt shape's name in tables (default: the task stem)")


class StudyModel(_Strict):
    kind: Literal["pretrained", "organism"]
    family: str
    about: str = Field(description="what the model is, one line")
    use_when: str = Field(description="when to use it, one line")
    load: str = Field(description="load time once cached")
    main_task: str = Field("gated", description="the prompt shape its headline numbers use, where it has several")
    runs: list[StudyRun] = Field(min_length=1)


class Study(_Strict):
    models: dict[str, StudyModel] = Field(min_length=1)


@dataclass(frozen=True)
class PublishedRun:
    """One run the study publishes, resolved: the record it names is ``results/<experiment>/<model>/<hash>.json``."""

    model: str
    experiment: str
    task: str
    config: str
    config_hash: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.experiment, self.task, self.model)


def _study_file() -> Path:
    from kvprobe.cache_dir import project_path

    return project_path(STUDY_FILE)


def study_present(study_path: str | Path | None = None) -> bool:
    """Whether there is a study file: an installed kvprobe outside a checkout has none, and then nothing is
    published (figures, reports and claims read every record of the folder they are given)."""
    return Path(study_path).exists() if study_path is not None else _study_file().exists()


def publishes_into(results_dir: str | Path) -> bool:
    """Whether ``results_dir`` is the study's published folder (``results/`` beside ``study.yaml``): only then do
    ``kvprobe figures`` and ``kvprobe claims`` write the published figures (``figures/``); for any other folder
    (``runs/``, a scratch folder, every folder of an installed kvprobe) they write inside that folder."""
    if not study_present():
        return False
    return Path(results_dir).resolve() == _study_file().resolve().parent / "results"


def output_paths(results_dir: str | Path) -> tuple[Path, Path]:
    """(figures folder, claims figure) for the records in ``results_dir``: the published ``figures/`` for the
    published folder, else ``<results_dir>/figures/``, so a scratch folder's figures never replace published ones."""
    figures = Path(results_dir).parent / "figures" if publishes_into(results_dir) else Path(results_dir) / "figures"
    return figures, figures / "claims_forest.png"


def load_study(path: str | Path | None = None) -> Study:
    """The validated study; an unknown key or a bad value names the key and the fix."""
    from kvprobe.runner.config import format_validation_error

    p = Path(path) if path is not None else _study_file()
    if not p.exists():
        raise KVProbeError(f"study file {p} does not exist (it names the published models and runs)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise KVProbeError(f"study file {p} is not valid YAML: {exc}") from None
    try:
        return Study.model_validate(data)
    except ValidationError as exc:
        raise KVProbeError(f"study file {p}: {format_validation_error(exc, Study)}") from None


def resolve_run(model: str, run: StudyRun, configs_dir: Path) -> PublishedRun:
    """The record a study run names: its config resolved on ``model`` and hashed as the runner names records."""
    from kvprobe.runner.config import _merge, load_config, validate_params
    from kvprobe.runner.experiment import get_experiment, record_hash
    from kvprobe.runner.records import task_stem

    path = configs_dir / f"{run.config}.yaml"
    if not path.exists():  # a plugin experiment's config (kvprobe.runner.plugins)
        from kvprobe.runner.plugins import plugin_config

        path = plugin_config(run.config) or path
    if not path.exists():
        raise KVProbeError(f"study: model '{model}' names config '{run.config}', but {path} does not exist")
    cfg = load_config(path, _merge(run.set, {"model": model}))
    exp = get_experiment(cfg.experiment)
    params = validate_params(exp.params, cfg.params, str(path))
    task = run.task or task_stem({"config": cfg.model_dump()})
    return PublishedRun(model, exp.name, task, run.config, record_hash(cfg, params))


@lru_cache(maxsize=4)
def _published(study_path: str) -> tuple[PublishedRun, ...]:
    p = Path(study_path)
    study = load_study(p)
    from kvprobe.cache_dir import project_path

    configs_dir = project_path("configs")
    runs = tuple(resolve_run(model, run, configs_dir) for model, entry in study.models.items() for run in entry.runs)
    seen: dict[tuple[str, str, str], PublishedRun] = {}
    for r in runs:
        if r.key in seen:
            raise KVProbeError(f"study: model '{r.model}' has two runs of experiment '{r.experiment}' on task "
                               f"'{r.task}' (configs {seen[r.key].config} and {r.config}); give one a `task:` name")
        seen[r.key] = r
    return runs


def published_runs(study_path: str | Path | None = None) -> tuple[PublishedRun, ...]:
    """Every run the study publishes, resolved (cached per study file)."""
    return _published(str((Path(study_path) if study_path is not None else _study_file()).resolve()))


def study_models(study_path: str | Path | None = None) -> list[str]:
    """The study's models, in study order; none where there is no study file (an installed kvprobe)."""
    return list(load_study(study_path).models) if study_present(study_path) else []


def is_published(model: str, config_hash: str, study_path: str | Path | None = None) -> bool:
    """Whether the run of ``model`` whose record hash is ``config_hash`` is one the study publishes. An installed
    kvprobe outside a checkout has no study file: then nothing is published (every run is scratch unless
    ``--publish`` or ``--output-dir``)."""
    if not study_present(study_path):
        return False
    return any(r.model == model and r.config_hash == config_hash for r in published_runs(study_path))


def published_records(records: Sequence[dict[str, Any]], study_path: str | Path | None = None
                      ) -> list[dict[str, Any]]:
    """The records the study publishes, in study order, each tagged ``_task`` (its prompt shape's name).

    Selection is by (model, record hash), so one record per (experiment, task, model): never the newest of a
    pile, never a smoke run beside it. Without a study file (an installed kvprobe outside a checkout) nothing is."""
    if not study_present(study_path):
        return []
    if not set(load_study(study_path).models) & {r["model"]["name"] for r in records}:
        return []  # no study model among them (a scratch folder): nothing to resolve
    by_key = {(r["model"]["name"], r.get("config_hash")): r for r in records}
    out = []
    for run in published_runs(study_path):
        rec = by_key.get((run.model, run.config_hash))
        if rec is not None:
            out.append({**rec, "_task": run.task})
    return out


def archive_records(records: Sequence[dict[str, Any]], study_path: str | Path | None = None
                    ) -> list[dict[str, Any]]:
    """Every record the study does not publish (listed on the archive page)."""
    keys = {(r.model, r.config_hash) for r in published_runs(study_path)}
    return [r for r in records if (r["model"]["name"], r.get("config_hash")) not in keys]


def select(records: Sequence[dict[str, Any]], experiment: str, task: str | None = None,
           model: str | None = None) -> list[dict[str, Any]]:
    """Published records of one experiment (and task, and model when given): figures select by all three."""
    return [r for r in records if r["experiment"] == experiment and (task is None or r["_task"] == task)
            and (model is None or r["model"]["name"] == model)]


def main_records(published: Sequence[dict[str, Any]], study_path: str | Path | None = None
                 ) -> dict[tuple[str, str], dict[str, Any]]:
    """One record per (experiment, model) among ``published``: the model's ``main_task`` if it has a record on it,
    else its template task (``gated`` / ``polarity``, not generated instances), else its first in study order.
    What a figure draws for that model and what the claims summary's column reads."""
    models = load_study(study_path).models if study_present(study_path) else {}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    # (records of one (experiment, task, model) come oldest first: a later one of the same rank replaces it)
    for rec in published:
        key = (rec["experiment"], rec["model"]["name"])
        main = models[key[1]].main_task if key[1] in models else "gated"

        def rank(r: dict[str, Any]) -> int:
            return 0 if r["_task"] == main else 1 if not r["_task"].startswith("generated_") else 2
        if key not in out or rank(rec) < rank(out[key]) or rec["_task"] == out[key]["_task"]:
            out[key] = rec
    return out
