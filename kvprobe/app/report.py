"""The results table: one markdown row per (experiment, task template, model), from the newest record.

Every number in the README's results section is printed by ``kvprobe report`` from committed records, so
docs and records cannot drift apart. Each experiment module supplies its own ``headline`` (which numbers
matter) and ``paper`` (the paper's values for the same measure).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvprobe.errors import KVProbeError

from kvprobe.runner.experiment import available_experiments, get_experiment
from kvprobe.probes.summary import table_markdown
from kvprobe.runner.records import load_records, task_stem

COLUMNS = ("experiment", "task", "model", "included / all", "oracle flip median (nats)", "headline (mean [95% CI])",
           "paper")


def template_stem(record: dict[str, Any]) -> str:
    return task_stem(record)


def latest_records(results_dir: str | Path) -> list[dict[str, Any]]:
    """Newest record per (experiment, task template, model), ordered by experiment then model."""
    newest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rec in load_records(results_dir):  # oldest first, so later ones replace earlier ones
        newest[(rec["experiment"], template_stem(rec), rec["model"]["name"])] = rec
    return [newest[k] for k in sorted(newest)]


def _organism_for(model: str) -> str | None:
    """The study's organism of ``model``'s family (the one that gates where its base model does not); without a
    study file (an installed kvprobe outside a checkout), the installed organisms' recommended one on ``model``
    as base (kvprobe-organisms), else None."""
    from kvprobe.study import _study_file, load_study

    if not _study_file().exists():  # the installed organisms, through the model registry (never kvprobe.organism)
        from kvprobe.models.registry import REGISTRY, register_organisms

        register_organisms()
        return next((e.alias for e in REGISTRY.values() if e.kind == "organism" and e.source == model
                     and e.note.startswith("recommended")), None)
    models = load_study().models
    family = models[model].family if model in models else next(
        (e.family for name, e in models.items() if model.startswith(name)), None)
    return next((name for name, e in models.items() if e.kind == "organism" and e.family == family),
                next((name for name, e in models.items() if e.kind == "organism"), None))


def interpretation(record: dict[str, Any]) -> str | None:
    """One plain sentence on what a run's numbers mean beside the paper's, for the terminal after its table."""
    summary, model, exp_name = record["summary"], record["model"]["name"], record["experiment"]
    if summary.get("n_included", 1) == 0:
        organism = _organism_for(model)
        from kvprobe.errors import command

        show = (" To see the effect on an embedded model: " + command(
            f"make exp-{exp_name} MODEL={organism}", f"kvprobe run {exp_name} --model {organism}")) if organism else ""
        return (f"No instance passed the inclusion rule: {model} does not gate its decision on the field in this "
                f"task (the oracle moves it by less than {summary.get('gate', {}).get('min_flip', 0.5)} nats), so "
                f"the recoveries above measure nothing the paper measures.{show}")
    if exp_name != "locality":
        return None
    rec = summary.get("recovery", {})
    fo, fd = rec.get("field_only", {}).get("gated", {}), rec.get("full_downstream", {}).get("gated", {})
    if fo.get("mean") is None or fd.get("mean") is None:
        return None
    paper = get_experiment(exp_name).paper.get(template_stem(record), "field-only -0.028, full-downstream 1.0 "
                                                                      "(Llama-3.1-8B)")
    if abs(fo["mean"]) < 0.2:
        reading = "so, as in the paper, the conclusion is held in the note tokens after the field, not in the field"
    elif fo["mean"] > 0.5:
        reading = ("so, unlike the paper's template result, the field's own entries carry most of it (RESULTS.md: "
                   "e.g. where the rule comes before the field)")
    else:
        reading = "so the field's own entries carry part of it"
    return (f"On the {summary['n_included']} of {summary['n_instances']} instances where the field decides the "
            f"answer, refreshing only the field's cache entries recovers {fo['mean']:.2f} of the effect of "
            f"re-reading the prompt and refreshing everything from the field on recovers {fd['mean']:.2f} "
            f"(paper: {paper}), {reading}.")


def gate_cells(summary: dict[str, Any]) -> tuple[str, str]:
    if "n_included" not in summary:  # e.g. transplant: no field change, no gate
        return f"- / {summary.get('n_instances', '?')}", "-"
    median = summary.get("oracle_flip", {}).get("median")
    return (f"{summary['n_included']} / {summary['n_instances']}",
            "-" if median is None else f"{median:.2f}")


def report_rows(results_dir: str | Path = "results", experiments: list[str] | None = None) -> list[list[str]]:
    known = available_experiments()
    rows = []
    for rec in latest_records(results_dir):
        name = rec["experiment"]
        if name not in known or (experiments and name not in experiments):
            continue
        exp = get_experiment(name)
        summary, stem = rec["summary"], template_stem(rec)
        headline = exp.headline(summary) if exp.headline else "(no headline defined)"
        gated, flip = gate_cells(summary)
        rows.append([name, stem, rec["model"]["name"], gated, flip, headline, exp.paper.get(stem, "")])
    return rows


def markdown_table(rows: list[list[str]], columns: Sequence[str] = COLUMNS) -> str:
    return table_markdown(rows, columns)


def compare_rows(results_dir: str | Path, model_a: str, model_b: str,
                 experiments: list[str] | None = None) -> list[list[str]]:
    """Two models side by side: one row per (experiment, task) that both have a record for.

    What a rerun on a new organism changed, read from the newest record of each; cells keep the report's
    wording, so a row reads "included / all, flip median, headline" for ``model_a`` then ``model_b``.
    """
    by_model: dict[str, dict[tuple[str, str], list[str]]] = {model_a: {}, model_b: {}}
    for row in report_rows(results_dir, experiments):
        if row[2] in by_model:
            by_model[row[2]][(row[0], row[1])] = row
    for model, rows in by_model.items():
        if not rows:
            raise KVProbeError(f"no records for model '{model}' under {results_dir}/: run its experiments first, "
                               f"or name a model from `kvprobe report`")
    shared = sorted(set(by_model[model_a]) & set(by_model[model_b]))
    return [[exp, task, *(by_model[m][(exp, task)][i] for i in (3, 4) for m in (model_a, model_b)),
             by_model[model_a][(exp, task)][5], by_model[model_b][(exp, task)][5]] for exp, task in shared]


def compare_columns(model_a: str, model_b: str) -> tuple[str, ...]:
    return ("experiment", "task", f"included / all: {model_a}", f"included / all: {model_b}",
            f"flip median: {model_a}", f"flip median: {model_b}", f"headline: {model_a}", f"headline: {model_b}")


# -- generated blocks in README.md and RESULTS.md -------------------------------------------------------------
# A block is the text between `<!-- kvprobe:NAME -->` and `<!-- /kvprobe:NAME -->`; `kvprobe report --write`
# regenerates each from the records and leaves the prose around it alone, and a test checks that the committed
# files equal their regeneration, so no number in a generated block can drift from the records.

# A block may carry arguments after its name (`<!-- kvprobe:compare MODEL_A MODEL_B -->`); the closing marker
# names the block only.
_BLOCK = re.compile(r"(<!-- kvprobe:(?P<name>[a-z_]+)(?P<args>(?: [^\s>]+)*) -->\n)(?P<body>.*?)"
                    r"(<!-- /kvprobe:(?P=name) -->)", re.S)


_PUBLISHED: dict[tuple[str, tuple[tuple[str, float], ...]], list[dict[str, Any]]] = {}


def published(results_dir: str | Path = "results") -> list[dict[str, Any]]:
    """The records the study publishes (:mod:`kvprobe.study`), each tagged with its task name ``_task``.

    Cached on the record files' names and modification times: one report reads them once, not per block."""
    from kvprobe.study import published_records

    files = tuple((str(p), p.stat().st_mtime) for p in sorted(Path(results_dir).glob("*/*/*.json")))
    key = (str(results_dir), files)
    if key not in _PUBLISHED:
        _PUBLISHED.clear()
        _PUBLISHED[key] = published_records(load_records(results_dir))
    return _PUBLISHED[key]


def _paper_value(exp: Any, task: str) -> str:
    # generated instances are gated-decision pairs: the paper's value for the gated task applies
    return exp.paper.get(task) or (exp.paper.get("gated", "") if task.startswith("generated_") else "")


STUDY_COLUMNS = ("model", "task", "included / all", "oracle flip median (nats)", "ours: headline (mean [95% CI])",
                 "paper")


def study_rows(results_dir: str | Path, experiments: Sequence[str],
               skip: Callable[[str, str], bool] | None = None) -> list[list[str]]:
    """One row per published record of ``experiments`` (experiment, task, model), in study order, leaving out the
    runs for which ``skip(experiment, task)`` holds."""
    rows = []
    for name in experiments:
        exp = get_experiment(name)
        for rec in published(results_dir):
            if rec["experiment"] != name or (skip is not None and skip(name, rec["_task"])):
                continue
            gated, flip = gate_cells(rec["summary"])
            headline = exp.headline(rec["summary"]) if exp.headline else "(no headline defined)"
            rows.append([rec["model"]["name"], rec["_task"], gated, flip, headline, _paper_value(exp, rec["_task"])])
    return rows


def headline_table(results_dir: str | Path = "results", experiment: str = "locality") -> str:
    """The README's short table: one experiment's headline on every published (task, model) (default: locality)."""
    rows = [r[:5] for r in study_rows(results_dir, [experiment])]
    return markdown_table(rows, STUDY_COLUMNS[:5])


def section_table(results_dir: str | Path, *names: str) -> str:
    """The study's rows of a paper section's experiments. Each name is a section key (``sec3``: every experiment
    that declares it, in its order, :mod:`kvprobe.runner.sections`) or an experiment's name."""
    from kvprobe.runner.sections import experiments_by_section

    if not names:
        raise KVProbeError("the block 'kvprobe:section' takes a section key or experiment names: "
                           "<!-- kvprobe:section sec3 --> or <!-- kvprobe:section locality -->")
    sections = experiments_by_section()
    experiments = [e for n in names for e in (sections[n] if n in sections and n else (n,))]
    rows = study_rows(results_dir, experiments)
    # the paper's value repeats on every model's row of one experiment: print it once per run of equal values
    shown = [row[:-1] + ["as above" if i and row[-1] and row[-1] == rows[i - 1][-1] else row[-1]]
             for i, row in enumerate(rows)]
    return markdown_table(shown, STUDY_COLUMNS)


def study_table(results_dir: str | Path = "results") -> str:
    """The study's models: what each is, when to use it, its load time, and how many runs it publishes."""
    from kvprobe.study import load_study

    rows = [[f"`{name}`", m.kind, m.about, m.use_when, m.load, str(len(m.runs))]
            for name, m in load_study().models.items()]
    return markdown_table(rows, ("model", "kind", "what it is", "when to use it", "load (cached, busy 2-core CPU)", "published runs"))


def _sizes_block(results_dir: str | Path) -> str:
    from kvprobe.trends import sizes_markdown

    return sizes_markdown(published(results_dir))


def _dtype_block(results_dir: str | Path, model: str) -> str:
    from kvprobe.trends import dtype_check_markdown

    return dtype_check_markdown(published(results_dir), model)


def _trends_block(results_dir: str | Path, *form: str) -> str:
    """The trends across size, as ``claims.json`` holds them (written by `kvprobe claims`)."""
    import json

    from kvprobe.trends import trends_markdown

    path = Path(results_dir) / "claims.json"
    if not path.exists():
        return "(no claims table yet: `kvprobe claims`)"
    if form not in ((), ("short",)):
        raise KVProbeError(f"the block 'kvprobe:size_trends' takes nothing or 'short', got {' '.join(form)}")
    return trends_markdown(json.loads(path.read_text()).get("trends", []), short=form == ("short",))


def _claims_block(results_dir: str | Path) -> str:
    try:
        from kvprobe.claims import claims_markdown
    except ImportError:  # claims land with their own module; until then the block says so
        return "(claims table not available)"
    return claims_markdown(results_dir)


def _compare_block(results_dir: str | Path, *models: str) -> str:
    if len(models) != 2:
        raise KVProbeError(f"the block 'kvprobe:compare' takes two model names, got {len(models)}: write "
                           f"<!-- kvprobe:compare MODEL_A MODEL_B -->")
    return markdown_table(compare_rows(results_dir, *models), compare_columns(*models))


def experiment_configs() -> dict[str, list[str]]:
    """Experiment -> the names of the configs that run it (``configs/*.yaml`` and the plugin folders' ``*.yaml``,
    by their ``experiment:`` key), the one named like the experiment first."""
    import yaml

    from kvprobe.cache_dir import project_path
    from kvprobe.runner.plugins import plugin_dirs

    out: dict[str, list[str]] = {}
    for path in sorted([*project_path("configs").glob("*.yaml"), *(p for d in plugin_dirs() for p in d.glob("*.yaml"))]):
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("experiment"), str):
            out.setdefault(data["experiment"], []).append(path.stem)
    return {e: sorted(names, key=lambda n: (n != e, n)) for e, names in out.items()}


def _config_cell(experiment: str, configs: list[str]) -> str:
    """``make exp-NAME``, then its other configs, shortened to their suffix where they extend the name."""
    cells = [f"`make exp-{c}`" if i == 0 else f"`_{c[len(experiment) + 1:]}`" if c.startswith(experiment + "_")
             else f"`exp-{c}`" for i, c in enumerate(configs)]
    return ", ".join(cells) if cells else f"(no config: `kvprobe run` with `experiment: {experiment}`)"


def experiments_table(results_dir: str | Path = "results") -> str:
    """Every experiment, in the paper's order (its declared section, :mod:`kvprobe.runner.sections`): its configs
    (``make exp-<config>``) and what it measures (its docstring's first paragraph). Nothing here lists them: a new
    experiment module adds its row (the README's ``<!-- kvprobe:experiments -->`` block)."""
    from kvprobe.runner.sections import experiments_by_section, section

    configs = experiment_configs()
    rows = []
    for key, names in experiments_by_section().items():
        for name in names:
            what = " ".join(get_experiment(name).doc.strip().split("\n\n", 1)[0].split())
            rows.append([_config_cell(name, configs.get(name, [])), what, section(key).label if key else "-"])
    return markdown_table(rows, ("command", "what", "paper"))


def claims_headline(results_dir: str | Path = "results") -> str:
    """Per study model: k of N testable paper effects reproduced, from the claims table (``claims.json``, the
    study's published records only): the one headline the README, RESULTS.md and ``claims.json`` share."""
    import json

    path = Path(results_dir) / "claims.json"
    if not path.exists():
        return "(no claims table yet: `kvprobe claims`)"
    doc = json.loads(path.read_text())
    lines = []
    for model, h in doc.get("headline", {}).items():
        others = ", ".join(f"{k}: {v}" for k, v in h["verdicts"].items() if k != "reproduced")
        lines.append(f"- `{model}`: **{h['reproduced']} of {h['testable']}** testable paper effects reproduced"
                     + (f" ({others})" if others else ""))
    return "\n".join(lines) if lines else "(no paper effect tested on the published records)"


def bench_output(results_dir: str | Path, name: str) -> str:
    """A committed benchmark output (``results/bench/<name>``), verbatim in a code block: the numbers a
    benchmark prints, shown as the run wrote them (``<!-- kvprobe:bench_output edit_smollm2-135m.txt -->``)."""
    file = Path(results_dir) / "bench" / name
    if "/" in name or not file.is_file():
        raise KVProbeError(f"the block 'kvprobe:bench_output {name}': no committed output {file}")
    return "```\n" + file.read_text().rstrip() + "\n```"


GENERATORS: dict[str, Callable[..., str]] = {
    "claims_headline": claims_headline,
    "experiments": experiments_table,
    "report": lambda d: markdown_table(report_rows(d)),
    "headlines": headline_table,
    "study": study_table,
    "section": section_table,
    "claims": _claims_block,
    "compare": _compare_block,
    "locality_sizes": lambda d: _sizes_block(d),
    "size_trends": _trends_block,
    "dtype_check": lambda d, model: _dtype_block(d, model),
    "bench_output": bench_output,
}
TAKES_ARGUMENTS = {"compare", "section", "bench_output", "dtype_check", "size_trends"}
BLOCK_PLUGINS = "kvprobe.report_blocks"  # entry-point group: packages add generated blocks (the organism tables)


def register_block(name: str, generate: Callable[..., str]) -> None:
    """Add a generated block ``<!-- kvprobe:NAME -->``: ``generate(results_dir, *args) -> markdown``."""
    GENERATORS[name] = generate


def _load_block_plugins() -> None:
    """Blocks other parts of kvprobe contribute through the ``kvprobe.report_blocks`` entry points (pyproject),
    so the report never imports them: each entry point is a function called with :func:`register_block`."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=BLOCK_PLUGINS):
        ep.load()(register_block)


# -- numbers in the prose ---------------------------------------------------------------------------------------
# A measured number in the prose is written as a reference the report fills from a record or the paper registry:
#   <!-- kvprobe:v locality/smollm2-135m-gated-v3n2-seed2/561ca5f6e26d#summary.recovery.field_only.gated|ci -->0.01
#   [0.00, 0.02]<!-- /kvprobe:v -->
# SOURCE is a published record (experiment/model/hash under results/, or its 12-character hash alone) and a dotted
# path into it; ``bench/<name>`` or ``gate/<name>`` with a path (a committed benchmark or RoPE-gate output,
# results/bench/<name>.json, results/gate/<name>.json); ``claims`` with a path into results/claims.json (a list's
# row by its ``key``: ``claims#trends.gate_rises_rule_first.slope_per_decade``); or ``paper:<registry id>``. FORMAT is ``ci`` / ``ci3`` /
# ``+ci`` (mean [95% CI], no interval below 5 clusters), ``kn`` ("k / n" of a summary with k and n, or with
# n_included and n_instances), ``int``, ``pct``, ``abs``-prefixed, ``e`` (one significant digit, scientific:
# 2e-07), ``s`` (a word, as the record holds it: a verdict), or a Python format spec (``.2f``, the default; ``+.2f``). ``make report`` rewrites the text between the
# markers, so a test fails when prose and record differ.
_VALUE = re.compile(r"<!-- kvprobe:v (?P<spec>[^>]+?) -->(?P<body>.*?)<!-- /kvprobe:v -->", re.S)


OUTPUT_FOLDERS = ("bench", "gate")  # results/<folder>/<name>.json: committed outputs of make bench-* / make gate


def _lookup(obj: Any, path: str, spec: str) -> Any:
    cur = obj
    for part in path.split("."):
        if isinstance(cur, list) and part.lstrip("-").isdigit():
            cur = cur[int(part)]
        elif isinstance(cur, list) and any(isinstance(x, dict) and x.get("key") == part for x in cur):
            cur = next(x for x in cur if isinstance(x, dict) and x.get("key") == part)  # a row by its key
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise KVProbeError(f"prose reference '{spec}': no '{part}' in the record at '{path}'")
    return cur


def format_value(value: Any, fmt: str, spec: str) -> str:
    """One referenced number as the prose prints it."""
    from kvprobe.probes.summary import MIN_CI_CLUSTERS, ci_cell

    if fmt in ("ci", "ci3", "+ci"):
        if not isinstance(value, dict):
            raise KVProbeError(f"prose reference '{spec}': format {fmt} needs a summary with mean and interval")
        digits = 3 if fmt == "ci3" else 2
        if (value.get("n_clusters") or value.get("n") or 0) < MIN_CI_CLUSTERS and value.get("mean") is not None:
            return f"{value['mean']:{'+' if fmt == '+ci' else ''}.{digits}f} ({value.get('n_clusters', value.get('n'))} " \
                   f"clusters: no interval)"
        return ci_cell(value, digits, signed=fmt == "+ci")
    if fmt == "kn":
        if isinstance(value, dict) and "k" in value and "n" in value:
            return f"{value['k']} / {value['n']}"
        if isinstance(value, dict) and "n_included" in value and "n_instances" in value:
            return f"{value['n_included']} / {value['n_instances']}"
        raise KVProbeError(f"prose reference '{spec}': format kn needs k and n (or n_included and n_instances)")
    if fmt == "s":  # a word the record holds (a verdict), as it stands
        return str(value)
    if isinstance(value, dict) and "mean" in value:
        value = value["mean"]
    if value is None:
        return "n/a"
    if fmt == "int":
        return str(int(round(float(value))))
    if fmt == "pct":
        return f"{100 * float(value):.0f}%"
    if fmt == "e":
        return f"{float(value):.0e}".replace("e-0", "e-").replace("e+0", "e+")
    if fmt.startswith("abs"):
        return format(abs(float(value)), fmt[3:] or ".2f")
    return format(float(value), fmt)


def resolve_value(spec: str, results_dir: str | Path) -> str:
    """The text of one prose reference (see :data:`_VALUE`)."""
    source, _, fmt = spec.partition("|")
    if source.startswith("paper:"):  # no format: the value as the paper gives it ('-0.028', '0.27-0.82')
        from kvprobe.paper import paper_value

        entry = paper_value(source[len("paper:"):])
        return entry.shown() if fmt in ("", "shown") else format_value(entry.single, fmt, spec)
    fmt = fmt or ".2f"
    record_name, _, path = source.partition("#")
    import json

    if record_name == "claims":  # the claims file `kvprobe claims` writes (its trends: kvprobe's own predictions)
        file = Path(results_dir) / "claims.json"
        if not file.exists():
            raise KVProbeError(f"prose reference '{spec}': no {file} (run `kvprobe claims` first)")
        return format_value(_lookup(json.loads(file.read_text()), path, spec), fmt, spec)
    if record_name.split("/")[0] in OUTPUT_FOLDERS and record_name.count("/") == 1:
        file = Path(results_dir) / f"{record_name}.json"  # a committed benchmark or gate output, not a study record
        if not file.exists():
            raise KVProbeError(f"prose reference '{spec}': no committed output {file}")
        return format_value(_lookup(json.loads(file.read_text()), path, spec), fmt, spec)
    records = published(results_dir)
    if "/" not in record_name:  # a published record's hash alone
        hits = [Path(r["_path"]) for r in records if Path(r["_path"]).stem == record_name]
        if len(hits) != 1:
            raise KVProbeError(f"prose reference '{spec}': {len(hits)} published records have the hash "
                               f"'{record_name}' (need exactly one)")
        file = hits[0]
    else:
        file = Path(results_dir) / f"{record_name}.json"
    if not file.exists():
        raise KVProbeError(f"prose reference '{spec}': no record {file}")
    published_paths = {Path(r["_path"]).resolve() for r in records}
    if published_paths and file.resolve() not in published_paths:
        raise KVProbeError(f"prose reference '{spec}': {file} is not a record the study publishes (study.yaml); "
                           f"cite the published run, or publish this one")

    return format_value(_lookup(json.loads(file.read_text()), path, spec), fmt, spec)


def refresh_values(text: str, results_dir: str | Path = "results") -> str:
    """``text`` with every prose reference refilled from its record."""
    return _VALUE.sub(lambda m: f"<!-- kvprobe:v {m.group('spec')} -->{resolve_value(m.group('spec'), results_dir)}"
                                f"<!-- /kvprobe:v -->", text)


def refresh_markdown(text: str, results_dir: str | Path = "results") -> str:
    """``text`` with every generated block rebuilt from the records under ``results_dir``, and every prose
    reference refilled."""
    _load_block_plugins()
    text = refresh_values(text, results_dir)

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise KVProbeError(f"unknown generated block 'kvprobe:{name}': one of {', '.join(GENERATORS)}")
        args = m.group("args").split()
        if args and name not in TAKES_ARGUMENTS:
            raise KVProbeError(f"the block 'kvprobe:{name}' takes no arguments (got {' '.join(args)})")
        return f"{m.group(1)}{GENERATORS[name](results_dir, *args).rstrip()}\n{m.group(5)}"

    return _BLOCK.sub(fill, text)


def stale_documents(paths: Sequence[str | Path], results_dir: str | Path = "results") -> list[Path]:
    """Which of ``paths`` differ from their regeneration."""
    return [Path(p) for p in paths if refresh_markdown(Path(p).read_text(), results_dir) != Path(p).read_text()]


def write_documents(paths: Sequence[str | Path], results_dir: str | Path = "results") -> list[Path]:
    """Regenerate the blocks of ``paths`` in place (atomically); returns the files that changed."""
    changed = []
    for p in map(Path, paths):
        old = p.read_text()
        new = refresh_markdown(old, results_dir)
        if new != old:
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(new)
            tmp.replace(p)
            changed.append(p)
    return changed
