"""The kvprobe command line: run experiments, list models, draw figures, write reports and test the paper's claims.

``run``, ``models``, ``figures`` and ``report`` are here; the other commands register from
:mod:`kvprobe.app.commands`. This is the one place that passes the study's publication policy to the run core."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from pathlib import Path

from kvprobe.errors import KVProbeError, command, default_results_dir


@contextlib.contextmanager
def quiet_libraries(enabled: bool = True) -> Iterator[None]:
    """``--quiet``: no progress bars or warnings from the libraries underneath (transformers' loading bar, the
    hub's download bars, Python warnings such as FutureWarning); kvprobe's own messages and errors still print.
    Everything is restored on exit, so an in-process caller (a notebook, the tests) keeps its settings."""
    if not enabled:
        yield
        return
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    verbosity, bars_on = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars_off = hub_utils.are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    # transformers' GGUF dequantization bar is a bare tqdm, outside its progress-bar switch
    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    gguf_bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        gguf_utils.tqdm = gguf_bar
        hf_logging.set_verbosity(verbosity)
        if bars_on:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            hub_utils.enable_progress_bars()


def _cmd_run(args: argparse.Namespace) -> int:
    from kvprobe.runner.config import load_config, parse_overrides
    from kvprobe.runner.experiment import get_experiment, run_experiment
    from kvprobe.study import is_published

    overrides = parse_overrides(args.set or [])
    if args.model:
        overrides["model"] = args.model
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    cfg = load_config(args.config, overrides)
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # transformers' own hub lookups honour it too
    with quiet_libraries(args.quiet):
        path, record = run_experiment(cfg, overwrite=args.overwrite, fresh=args.fresh, progress=not args.quiet,
                                      config_source=args.config, offline=True if args.offline else None,
                                      tol_nats=args.tol_nats, random_init=args.random_init,
                                      allow_dirty=args.allow_dirty, publish=args.publish, publishes=is_published)
    exp = get_experiment(cfg.experiment)
    random_note = ("RANDOM-INIT MODEL: seeded random weights (a config-only directory), not a trained model; "
                   "these numbers test the pipeline, not the paper") if record["model"].get("random_init") else ""
    if random_note:
        print(random_note)
    if exp.table is not None:
        print(exp.table(record["summary"]))
    from kvprobe.app.report import interpretation

    if record["model"].get("random_init"):  # named by its folder and marked, never by the machine path
        from kvprobe.runner.records import random_init_label

        record = {**record, "model": {**record["model"], "name": random_init_label(record["model"]["name"])}}
    sentence = interpretation(record)
    if sentence:
        print(sentence)
    if random_note:
        print(random_note)
    print(f"record: {path}")
    if "reproduction" in record:
        from kvprobe.runner.reproduce import reproduction_table

        print(reproduction_table(record["reproduction"]))
        print("(this config's record is committed, so this run went to runs/; --overwrite replaces the committed one)")
    elif path.parts[:1] == ("runs",):
        print("(scratch: the study (study.yaml) does not publish this config, so its record went to runs/, "
              "where no report, claim or figure reads it; --publish writes it to results/)")
    result = result_line(record)
    if result:
        print(result)
    return 0


def result_line(record: dict) -> str | None:
    """The run's last line: how many instances the inclusion rule kept and, when any, the headline numbers
    beside the paper's value; no recovery at all when none was kept (each would be a ratio of noise)."""
    from kvprobe.runner.experiment import get_experiment
    from kvprobe.app.report import _paper_value, template_stem

    exp, summary = get_experiment(record["experiment"]), record["summary"]
    if exp.headline is None or "n_included" not in summary:
        return None
    paper = _paper_value(exp, template_stem(record))
    paper = f" (paper: {paper})" if paper else ""
    head = f"result: {record['model']['name']}, {summary['n_included']} of {summary['n_instances']} instances included"
    if not summary["n_included"]:
        return f"{head}; no recovery reported{paper}"
    try:
        headline = exp.headline(summary)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a summary too small for its headline's numbers
        headline = "too few instances for the headline (the table above has what was measured)"
    return f"{head}; {headline}{paper}"


def _cmd_models(args: argparse.Namespace) -> int:
    from kvprobe.models.loading import cache_usage, weights_available
    from kvprobe.models.registry import REGISTRY, register_organisms

    register_organisms()  # the organisms of the registry (listed below from it)
    w = max(30, max(len(a) for a in REGISTRY) + 2)
    print(f"{'alias':<{w}}{'here':<6}{'first load':<12}{'cache disk':<12}source")
    for alias, entry in REGISTRY.items():
        if entry.kind == "organism":
            continue  # listed below from the organism registry
        here = "yes" if weights_available(entry) else "no"
        usage = cache_usage(entry)
        first = cached = ""
        if usage is not None:
            first = f"{usage['first_load_s']:.0f} s" if usage["first_load_s"] is not None else "not timed"
            cached = f"{usage['bytes'] / 1e9:.2f} GB"
        elif entry.kind in ("gguf_package", "gguf_split_package", "gguf_assembler"):
            first, cached = "not yet", "0"
        print(f"{alias:<{w}}{here:<6}{first:<12}{cached:<12}{entry.describe_source()}"
              + (f"  ({entry.note})" if entry.note else ""))
    from kvprobe.cache_dir import cache_root

    print(f"\nfirst load: seconds the first load took on this machine (assembling the GGUF, dequantizing it to fp32 "
          f"and saving it in the cache; later loads read that cache); cache disk: what it takes under {cache_root()} "
          "(set KVPROBE_CACHE to move it). Organisms reuse their base model's cache.")
    from kvprobe.models.organisms import organisms_table

    print("\n" + organisms_table())
    print("Any Hugging Face id (org/name) of a supported architecture also works as --model, and so does a local "
          "model directory (a config.json without weights is refused unless --random-init).")
    return 0


def _cmd_figures(args: argparse.Namespace) -> int:
    from kvprobe.figures import render_all

    results = args.results or default_results_dir()
    for path in render_all(results, args.out):
        print(f"figure: {path}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kvprobe.app.report import (compare_columns, compare_rows, markdown_table, report_rows, stale_documents,
                                    write_documents)

    results = args.results or default_results_dir()
    if args.compare:
        print(markdown_table(compare_rows(results, *args.compare, args.experiment), compare_columns(*args.compare)))
        return 0
    rows = report_rows(results, args.experiment)
    if not rows:
        if results != "runs" and any(Path("runs").glob("*/*/*.json")):
            hint = "your runs are in runs/: `kvprobe report --results runs`"
        else:
            hint = "run an experiment first: " + command(
                "make exp-locality", "kvprobe run locality --model smollm2-135m-gated-v3n2-seed2")
        raise KVProbeError(f"no records under {results}/ ({hint})")
    if args.check:
        from kvprobe.app.pages import stale_pages

        stale = [*stale_documents(args.check, results), *stale_pages(results, args.pages)]
        for p in stale:
            print(f"{p}: its generated blocks differ from the records (run `make report`)")
        return 1 if stale else 0
    if args.write:
        from kvprobe.app.pages import write_pages

        changed = [*write_documents(args.write, results), *write_pages(results, args.pages)]
        print("regenerated: " + (", ".join(map(str, changed)) if changed else "nothing changed"))
        return 0
    print(markdown_table(rows))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvprobe")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvprobe", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=f"kvprobe {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment config and write its record")
    run.add_argument("config", help="a YAML file (e.g. configs/locality.yaml) or a config name (e.g. locality)")
    run.add_argument("--model", help="alias (see `kvprobe models`), Hugging Face id (org/name) or a model directory")
    run.add_argument("--random-init", action="store_true",
                     help="allow a model directory with a config.json but no weights (seeded random weights; the "
                          "record and the table say so)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted), repeatable")
    run.add_argument("--output-dir", help="where records go (default: results)")
    run.add_argument("--overwrite", action="store_true", help="replace a finished record of the same config")
    run.add_argument("--publish", action="store_true",
                     help="write the record to results/ even if the study (study.yaml) does not publish it")
    run.add_argument("--fresh", action="store_true", help="discard a partial run instead of resuming it")
    run.add_argument("--quiet", action="store_true",
                     help="no progress bars (kvprobe's or the libraries') and no library warnings")
    run.add_argument("--allow-dirty", action="store_true",
                     help="publish a record into the checkout (results/) although tracked files have uncommitted "
                          "changes; the record's git block says allow_dirty")
    run.add_argument("--offline", action="store_true",
                     help="never download weights (as HF_HUB_OFFLINE=1): a paper alias must be in the local HF cache")
    run.add_argument("--tol-nats", type=float, default=None,
                     help="reproduction-check tolerance on logit differences (default 6e-4 nats: 50x the spread measured "
                          "across thread counts, kvprobe.runner.reproduce)")
    run.set_defaults(func=_cmd_run)

    models = sub.add_parser("models", help="list model aliases, their source and whether weights are here")
    models.set_defaults(func=_cmd_models)

    figs = sub.add_parser("figures", help="render every figure from the records present")
    figs.add_argument("--results", help="the records folder (default: results in a checkout, else runs)")
    figs.add_argument("--out", help="where the figures go (default: figures/ for the published results/, else "
                                    "<results>/figures/: a scratch folder never replaces a published figure)")
    figs.set_defaults(func=_cmd_figures)

    report = sub.add_parser("report", help="markdown results table: headline numbers of the newest records")
    report.add_argument("--results", help="the records folder (default: results in a checkout, else runs)")
    report.add_argument("--experiment", action="append", help="only this experiment (repeatable)")
    report.add_argument("--write", nargs="+", metavar="FILE",
                        help="regenerate the <!-- kvprobe:NAME --> blocks of these markdown files in place")
    report.add_argument("--check", nargs="+", metavar="FILE",
                        help="exit 1 if these files' generated blocks differ from the records")
    report.add_argument("--pages", default="docs/results",
                        help="with --write / --check: the folder of generated per-experiment and archive pages")
    report.add_argument("--compare", nargs=2, metavar=("MODEL_A", "MODEL_B"),
                        help="two models side by side on every (experiment, task) both have records for")
    report.set_defaults(func=_cmd_report)

    from kvprobe.app import commands

    commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except KVProbeError as exc:
        print(f"kvprobe: {'interrupted' if exc.exit_code == 130 else 'error'}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kvprobe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
