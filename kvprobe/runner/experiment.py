"""Experiment registry and the run loop shared by every experiment.

An experiment module in ``experiments/`` (imported as ``kvprobe.experiments.<name>``) defines
``EXPERIMENT = Experiment(...)``: its parameters model, a function that measures one instance (returning a row),
and a function that summarizes the rows. The runner does everything else: config, model, instances, progress,
resume, gate bookkeeping, the record.

Everything else about an experiment is declared in that module too, and found there by the application
(:mod:`kvprobe.app`): its paper section (``section``, a key of :data:`kvprobe.runner.sections.SECTIONS`), its
claims, and any figure it draws itself (``figures``). Experiments are discovered, never listed: the modules of
``kvprobe.experiments`` and of the folders named in ``$KVPROBE_EXPERIMENTS`` (:mod:`kvprobe.runner.plugins`).

The run core never asks where a record is published: :func:`run_experiment` takes the publication policy as an
argument (``publishes``; the CLI passes the study's, :func:`kvprobe.study.is_published`).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from tqdm.auto import tqdm

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError, closest
from kvprobe.runner.config import RunConfig, hashed_params, validate_params
from kvprobe.runner.records import (RecordLock, RecordWriter, _clean, check_clean_tree, git_commit, package_versions,
                                    read_record, record_path)

if TYPE_CHECKING:
    from kvprobe.interop.unwrap import ModelLike

log = logging.getLogger(__name__)


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Context:
    """What an experiment's functions get: the validated config, its params, the model and the task."""

    cfg: RunConfig
    params: Any
    lm: HookableModel
    template: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)  # per-run state set by setup()
    instances: list[Any] = field(default_factory=list)  # the run's instances, once built (summaries may revisit them)
    progress: bool = False  # the run shows progress bars: a long pass in setup or summarize may show its own


@dataclass(frozen=True)
class Experiment:
    name: str
    doc: str
    run_instance: Callable[[Context, Any], dict[str, Any]]
    summarize: Callable[[Context, list[dict[str, Any]]], dict[str, Any]]
    params: type[BaseModel] = NoParams
    make_instances: Callable[[Context], list[Any]] | None = None  # default: gated instances from cfg.task
    setup: Callable[[Context], None] | None = None
    table: Callable[[dict[str, Any]], str] | None = None  # short text table of a summary for the terminal
    # One line of the results table (`kvprobe report`): the summary's headline numbers, and the paper's
    # values to set beside them, keyed by task template stem ("gated", "polarity", "twohop", ...).
    headline: Callable[[dict[str, Any]], str] | None = None
    paper: dict[str, str] = field(default_factory=dict)
    # The paper's testable claims about this experiment (kvprobe.claims.Claim), evaluated from records by
    # `kvprobe claims`; each names the task template stem it applies to, like ``paper``.
    claims: tuple[Any, ...] = ()
    # kvprobe's own predictions of how a measure moves with model size (kvprobe.trends.Trend), declared before the
    # runs that test them and tested on the study's published records by `kvprobe claims`.
    trends: tuple[Any, ...] = ()
    # Whether run_instance reads the task template itself (``ctx.template``: erratum wording, prompt layout), so
    # generated instances (``task.generator``) cannot stand in for the template's.
    needs_template: bool = False
    # The paper section the experiment belongs to: a key of kvprobe.runner.sections.SECTIONS ("sec3", "appD", ...);
    # the report orders pages, claims and tables by it, then by ``section_order`` (ties by name).
    section: str = ""
    section_order: int = 0
    # Figures this module draws itself: file stem -> draw(published records of this experiment, path). Figures
    # shared across experiments live in kvprobe/figures/<module>.py (its ``FIGURES``); both are found, not listed.
    figures: dict[str, Callable[[list[dict[str, Any]], Path], None]] = field(default_factory=dict)
    # The record's typed shape (kvprobe.runner.shapes): the summary, and a row as the claims read it (with the
    # summary's row_measures). The headline, table, claims and figures read the fields these declare; claims'
    # dotted paths are checked against ``row_model`` by the tests, and each new summary is completed and checked
    # against ``summary_model`` by the runner.
    summary_model: type[BaseModel] | None = None
    row_model: type[BaseModel] | None = None


def _experiments_package() -> Any:
    """``kvprobe.experiments``, loaded by name like every experiment (nothing in kvprobe imports it), its search
    path extended by the plugin folders of ``$KVPROBE_EXPERIMENTS`` (:func:`kvprobe.runner.plugins.plugin_dirs`)."""
    from kvprobe.runner.plugins import extend_path

    package = importlib.import_module("kvprobe.experiments")
    extend_path(package)
    return package


def available_experiments() -> dict[str, str]:
    """Experiment name -> module name: every module of ``kvprobe.experiments`` and of the plugin folders."""
    package = _experiments_package()
    names: dict[str, str] = {}
    for m in pkgutil.iter_modules(package.__path__):
        if not m.name.startswith("_"):
            names.setdefault(m.name, m.name)
    return names


def get_experiment(name: str) -> Experiment:
    names = available_experiments()
    if name not in names:
        raise KVProbeError(f"unknown experiment '{name}'{closest(name, names)}: choose from {', '.join(sorted(names))}")
    module = importlib.import_module(f"kvprobe.experiments.{name}")  # by name (available_experiments set the path)
    exp = getattr(module, "EXPERIMENT", None)
    if not isinstance(exp, Experiment):
        raise KVProbeError(f"experiments/{name}.py defines no EXPERIMENT")
    return exp


def default_instances(ctx: Context) -> list[Any]:
    """The run's instances: the template's (``task.template``), or the generator's (``task.generator``)."""
    from kvprobe.tasks.gated import generate_instances, load_template

    gen = ctx.cfg.task.generator
    if gen is not None:
        from kvprobe.cache_dir import project_path
        from kvprobe.tasks.generator import build_generated, load_words, template_families

        words, lm = load_words(project_path(gen.words)), ctx.lm
        # task.scenarios: the template's hand-written scenarios (their own rules, never counterfactual) in the
        # generator's formats; instance i takes scenario i, cycling.
        fixed = template_families(ctx.cfg.task.scenarios)
        return [build_generated(i, ctx.cfg.seed, gen.split, gen.formats[i % len(gen.formats)],
                                tokenizer=lm.tokenizer, chat=lm.has_chat_template, distance=gen.distance,
                                counterfactual=0.0 if fixed else gen.counterfactual, words=words,
                                family=fixed[i % len(fixed)] if fixed else None, rule_at=gen.rule_at)
                for i in range(ctx.cfg.task.n_instances)]

    ctx.template = load_template(ctx.cfg.task.template)
    return generate_instances(ctx.template, ctx.cfg.task.n_instances, ctx.cfg.seed, ctx.cfg.task.scenarios,
                              ctx.cfg.task.n_filler)


def task_template_sha(cfg: RunConfig) -> str:
    import hashlib

    from kvprobe.cache_dir import project_path

    path = project_path(cfg.task.generator.words if cfg.task.generator else cfg.task.template)
    if not path.exists():
        return ""
    if cfg.task.generator or path.suffix not in (".yaml", ".yml"):
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    from kvprobe.tasks.gated import template_chain

    chain = template_chain(path)  # a template that extends another hashes as the concatenation, child first
    return hashlib.sha256(b"".join(p.read_bytes() for p in chain)).hexdigest()[:16]


def record_hash(cfg: RunConfig, params: BaseModel, template_sha: str | None = None) -> str:
    """The record's name: the config plus the task template's content plus the params as resolved.

    Resolved means defaults included, so editing a template or changing a default in code makes a new
    record, never a silent mix with (or a refusal on) an old one."""
    sha = task_template_sha(cfg) if template_sha is None else template_sha
    return cfg.hash(extra=sha, params=hashed_params(params))


def _typed_check(exp: Experiment, summary: dict[str, Any]) -> dict[str, Any]:
    """The summary in its declared shape (:func:`kvprobe.runner.shapes.complete`: the model's optional fields it
    lacks written as null), checked against ``exp.summary_model``. A mismatch is a bug the experiment's tests catch;
    here it is logged and the record still written, since the rows may have taken hours."""
    from pydantic import ValidationError

    from kvprobe.runner.shapes import complete

    if exp.summary_model is None:
        return summary
    summary = complete(exp.summary_model, summary)
    try:
        exp.summary_model.model_validate(summary)
    except ValidationError as exc:
        log.error("%s: the summary does not match %s.%s: %s", exp.name, exp.summary_model.__module__,
                  exp.summary_model.__qualname__, exc)
    return summary


def verification_dir(output_dir: str | Path) -> Path:
    """Where a rerun of an already-recorded config goes: ``runs/`` beside the results folder (gitignored)."""
    return Path(output_dir).parent / "runs"


Publishes = Callable[[str, str], bool]  # (model, record hash) -> whether that run is published


# -- the run's safety rails (package): clean tree to publish, one run per config, Ctrl-C keeps what is done ----

def run_experiment(cfg: RunConfig, overwrite: bool = False, fresh: bool = False, lm: ModelLike | None = None,
                   progress: bool = True, config_source: str = "<config>", offline: bool | None = None,
                   tol_nats: float | None = None, random_init: bool = False, allow_dirty: bool = False,
                   publish: bool = False, publishes: Publishes | None = None) -> tuple[Path, dict[str, Any]]:
    """Run ``cfg`` end to end and return (record path, record).

    If ``results/`` already holds the record of this exact config and ``overwrite`` is not given, the run is
    a reproduction: it is written under ``runs/`` (untracked) and the returned record carries a
    ``reproduction`` block comparing it with the committed one (:mod:`kvprobe.runner.reproduce`).

    Otherwise the record goes to ``results/`` only if ``publishes(model, record hash)`` says the run is published
    or ``publish`` is given; any other run (a smoke run, a ``--set`` override) is scratch and goes to ``runs/``.
    An ``output_dir`` set explicitly is always honoured. ``publishes`` is the publication policy: ``kvprobe run``
    passes the study's (:func:`kvprobe.study.is_published`); its default, None, publishes nothing, so a Python
    caller's run is scratch unless it passes ``publish=True``, a policy, or an ``output_dir``.

    A record published into the checkout (``results/``) needs a clean working tree unless ``allow_dirty``; a lock
    beside the record refuses a second identical run while one is going; an interruption (Ctrl-C) raises
    :class:`kvprobe.errors.Interrupted` saying how many instances are saved for the resume."""
    import contextlib

    from kvprobe.errors import Interrupted

    run: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        try:
            return _run_experiment(cfg, overwrite, fresh, lm, progress, config_source, offline, tol_nats,
                                   random_init, allow_dirty, publish, publishes, stack, run)
        except KeyboardInterrupt:
            writer, n = run.get("writer"), run.get("n_instances")
            if writer is None or n is None:
                raise Interrupted("interrupted before the first instance ran; nothing was saved") from None
            raise Interrupted(f"{len(writer.done)} of {n} instances saved to {writer.partial}; rerun the same "
                              "command to resume") from None


def _run_experiment(cfg: RunConfig, overwrite: bool, fresh: bool, lm: ModelLike | None, progress: bool, config_source: str,
                    offline: bool | None, tol_nats: float | None, random_init: bool, allow_dirty: bool,
                    publish: bool, publishes: Publishes | None, stack: Any, run: dict[str, Any]
                    ) -> tuple[Path, dict[str, Any]]:
    import torch

    from kvprobe.runner.reproduce import DEFAULT_TOL_NATS, compare_records

    exp = get_experiment(cfg.experiment)
    params = validate_params(exp.params, cfg.params, config_source)
    if cfg.task.generator is not None and (exp.make_instances is not None or exp.needs_template):
        why = "builds its own instances" if exp.make_instances is not None else "reads the task template's wording"
        raise KVProbeError(f"config {config_source}: key 'task.generator': experiment '{exp.name}' {why}; "
                           "remove task.generator (it serves the template-free probes, e.g. locality, suffix)")
    template_sha = task_template_sha(cfg)
    resolved_params = params.model_dump(mode="json")
    chash = record_hash(cfg, params, template_sha)
    path = record_path(cfg.output_dir, exp.name, cfg.model, chash)
    reference: Path | None = None
    if path.exists() and not overwrite:
        reference, path = path, record_path(verification_dir(cfg.output_dir), exp.name, cfg.model, chash)
        if path.exists():
            log.warning("replacing the earlier reproduction run %s (an untracked copy; the committed record "
                        "%s is left as it is)", path, reference)
    scratch = reference is None and not publish and "output_dir" not in cfg.model_fields_set \
        and not (publishes is not None and publishes(cfg.model, chash))
    if scratch:  # never beside the published records: a later `make report` would read it
        path = record_path(verification_dir(cfg.output_dir), exp.name, cfg.model, chash)
    if cfg.task.generator is None:
        from kvprobe.runner.config import check_task_template

        check_task_template(cfg.task.template)  # a typo is reported before the model loads
    if lm is None:
        from kvprobe.models.registry import register_organisms, resolve

        register_organisms()  # the organism aliases, explicitly (resolve only looks them up)
        resolve(cfg.model)  # package: an unknown model is reported before the tree and lock checks
    check_clean_tree(path, allow_dirty)  # package: publish only from a clean tree
    stack.enter_context(RecordLock(path))  # package: a second identical run is refused while this one goes
    writer = RecordWriter(path, overwrite=overwrite or reference is not None or scratch, fresh=fresh)
    run["writer"] = writer
    t0 = time.perf_counter()
    if lm is None:
        from kvprobe.models.loading import load_model

        lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, offline=offline,
                        random_init=random_init)
    else:
        from kvprobe.interop.unwrap import as_lm

        lm = as_lm(lm)  # a TransformerLens bridge or nnsight model the user already holds
    t_load = time.perf_counter() - t0
    torch.manual_seed(cfg.seed)
    ctx = Context(cfg=cfg, params=params, lm=lm, progress=progress)
    instances = (exp.make_instances or default_instances)(ctx)
    ctx.instances = instances
    run["n_instances"] = len(instances)
    if exp.setup is not None:
        exp.setup(ctx)
    t1 = time.perf_counter()
    todo = [inst for inst in instances if inst.index not in writer.done]
    resumed = len(instances) - len(todo)
    bar = tqdm(todo, desc=f"{exp.name} on {cfg.model}", unit="inst", disable=not progress, initial=resumed,
               total=len(instances))
    for inst in bar:
        ti = time.perf_counter()
        row = {"index": inst.index, **exp.run_instance(ctx, inst)}
        row["seconds"] = round(time.perf_counter() - ti, 4)
        writer.add_row(row)
    rows = [writer.done[i.index] for i in instances]
    if progress:  # some summaries make passes of their own (cross-fitting, SAE evaluation): say the run goes on
        tqdm.write(f"{exp.name}: summarizing {len(rows)} instances")
    summary = _typed_check(exp, exp.summarize(ctx, rows))
    t_run = time.perf_counter() - t1
    record = {
        "experiment": exp.name,
        "config": cfg.model_dump(),
        "config_hash": chash,
        "params_resolved": resolved_params,
        "task_template_sha256": template_sha,
        "git": git_commit(allow_dirty),
        "packages": package_versions(),
        "model": lm.describe(),
        "seed": cfg.seed,
        "summary": summary,
        "rows": rows,
        "timings": {"load_s": round(t_load, 3), "run_s": round(t_run, 3), "resumed_instances": resumed},
    }
    if reference is not None:
        check = compare_records(read_record(reference), _clean(record),
                                tol_nats=DEFAULT_TOL_NATS if tol_nats is None else tol_nats)
        record["reproduction"] = {"reference": str(reference), **check.to_dict()}
    return writer.finish(record), record
