"""The ``kvprobe`` command line: run, models, figures (and the commands later issues add)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvprobe.errors import KVProbeError


def _cmd_run(args: argparse.Namespace) -> int:
    from kvprobe.runner.config import load_config, parse_overrides
    from kvprobe.runner.experiment import get_experiment, run_experiment

    overrides = parse_overrides(args.set or [])
    if args.model:
        overrides["model"] = args.model
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    cfg = load_config(args.config, overrides)
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # transformers' own hub lookups honour it too
    path, record = run_experiment(cfg, overwrite=args.overwrite, fresh=args.fresh, progress=not args.quiet,
                                  config_source=args.config, offline=True if args.offline else None,
                                  tol_nats=args.tol_nats, publish=args.publish)
    exp = get_experiment(cfg.experiment)
    if exp.table is not None:
        print(exp.table(record["summary"]))
    from kvprobe.runner.report import interpretation

    sentence = interpretation(record)
    if sentence:
        print(sentence)
    print(f"record: {path}")
    if "reproduction" in record:
        from kvprobe.runner.reproduce import reproduction_table

        print(reproduction_table(record["reproduction"]))
        print("(this config's record is committed, so this run went to runs/; --overwrite replaces the committed one)")
    elif path.parts[:1] == ("runs",):
        print("(scratch: the study (study.yaml) does not publish this config, so its record went to runs/, "
              "where no report, claim or figure reads it; --publish writes it to results/)")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from kvprobe.models.loading import weights_available
    from kvprobe.models.registry import REGISTRY, resolve

    resolve(next(iter(REGISTRY)))  # registers the organisms shipped with kvprobe
    w = max(30, max(len(a) for a in REGISTRY) + 2)
    print(f"{'alias':<{w}}{'here':<6}source")
    for alias, entry in REGISTRY.items():
        here = "yes" if weights_available(entry) else "no"
        print(f"{alias:<{w}}{here:<6}{entry.describe_source()}" + (f"  ({entry.note})" if entry.note else ""))
    print("\nAny local model directory also works as --model PATH (a config.json alone builds random weights).")
    return 0


def _cmd_figures(args: argparse.Namespace) -> int:
    from kvprobe.figures import render_all

    for path in render_all(args.results, args.out):
        print(f"figure: {path}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kvprobe.runner.report import (compare_columns, compare_rows, markdown_table, report_rows, stale_documents,
                                       write_documents)

    if args.compare:
        print(markdown_table(compare_rows(args.results, *args.compare, args.experiment), compare_columns(*args.compare)))
        return 0
    rows = report_rows(args.results, args.experiment)
    if not rows:
        raise KVProbeError(f"no records under {args.results}/ (run an experiment first: make exp-locality)")
    if args.check:
        from kvprobe.runner.pages import stale_pages

        stale = [*stale_documents(args.check, args.results), *stale_pages(args.results, args.pages)]
        for p in stale:
            print(f"{p}: its generated blocks differ from the records (run `make report`)")
        return 1 if stale else 0
    if args.write:
        from kvprobe.runner.pages import write_pages

        changed = [*write_documents(args.write, args.results), *write_pages(args.results, args.pages)]
        print("regenerated: " + (", ".join(map(str, changed)) if changed else "nothing changed"))
        return 0
    print(markdown_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvprobe", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment config and write its record")
    run.add_argument("config", help="a YAML file in configs/ (e.g. configs/locality.yaml)")
    run.add_argument("--model", help="alias (see `kvprobe models`) or a model directory")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted), repeatable")
    run.add_argument("--output-dir", help="where records go (default: results)")
    run.add_argument("--overwrite", action="store_true", help="replace a finished record of the same config")
    run.add_argument("--publish", action="store_true",
                     help="write the record to results/ even if the study (study.yaml) does not publish it")
    run.add_argument("--fresh", action="store_true", help="discard a partial run instead of resuming it")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--offline", action="store_true",
                     help="never download weights (as HF_HUB_OFFLINE=1): a paper alias must be in the local HF cache")
    run.add_argument("--tol-nats", type=float, default=None,
                     help="reproduction-check tolerance on logit differences (default 1e-3 nats)")
    run.set_defaults(func=_cmd_run)

    models = sub.add_parser("models", help="list model aliases, their source and whether weights are here")
    models.set_defaults(func=_cmd_models)

    figs = sub.add_parser("figures", help="render every figure from the records present")
    figs.add_argument("--results", default="results")
    figs.add_argument("--out", default="figures")
    figs.set_defaults(func=_cmd_figures)

    report = sub.add_parser("report", help="markdown results table: headline numbers of the newest records")
    report.add_argument("--results", default="results")
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

    from kvprobe.runner import extra_commands

    extra_commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except KVProbeError as exc:
        print(f"kvprobe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
