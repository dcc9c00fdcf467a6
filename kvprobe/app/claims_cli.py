"""``kvprobe claims``: test every declared paper claim on the records, write ``claims.json`` and the claims figure.

The command lives in the application shell, so :mod:`kvprobe.claims` (the declarations, tests and the table) never
imports the figures. Its outputs go beside the records it reads: the claims figure of a folder other than the
published ``results/`` goes to ``<results>/figures/claims_forest.png`` (never over the published
``figures/claims_forest.png``), and a failing call leaves no partial output (no empty claims.json)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path


@contextlib.contextmanager
def no_partial_output(paths: Sequence[Path]) -> Iterator[None]:
    """If the body fails, put ``paths`` back as they were: a file it wrote is restored to its old bytes or
    removed, and a folder it created for them is removed, so a failing command leaves nothing behind."""
    before = {p: p.read_bytes() if p.is_file() else None for p in paths}
    missing_dirs = {d for p in paths for d in [p.parent, *p.parent.parents] if not d.exists()}
    try:
        yield
    except BaseException:
        for p, data in before.items():
            if data is not None:
                p.write_bytes(data)
            else:
                p.unlink(missing_ok=True)
        for d in sorted(missing_dirs, key=lambda d: len(d.parts), reverse=True):
            if d.is_dir():
                shutil.rmtree(d)
        raise


def _write(args: argparse.Namespace) -> int:
    from kvprobe.claims import (claim_records, claims_document, claims_rows, headline, lineage_summary, markdown,
                                read_claims, summary_counts, write_document)
    from kvprobe.trends import with_trends
    from kvprobe.errors import KVProbeError

    records = claim_records(args.results)
    rows = claims_rows(records)
    if not rows:  # evaluated before anything is written: a failing call leaves no claims.json
        raise KVProbeError(f"no records with declared claims under {args.results}/ (run an experiment first)")
    path = Path(args.out) if args.out else Path(args.results) / "claims.json"
    doc = with_trends(claims_document(rows), records)
    write_document(path, doc)
    for t in doc.get("trends", []):
        print(f"trend {t['key']}: {t['verdict']}")
    if args.table:
        print(markdown(rows) + "\n")
    for h in headline(rows).values():
        print(h["text"])
    for key, s in lineage_summary(rows).items():
        print(f"{key}: reproduced in {s['independent_lineages']} independent lineage(s): {s['reading']}")
    print("\n" + ", ".join(f"{k}: {v}" for k, v in summary_counts(rows).items()))
    print(f"claims: {path}" + ("" if args.table else " (every row with its test: --table, or the pages under "
                                                     "docs/results/)"))
    if args.figure:
        from kvprobe.figures import claims as claims_figure  # the figures package sets the Agg backend first

        figure = Path(args.figure)
        figure.parent.mkdir(parents=True, exist_ok=True)
        # drawn from the rows as written (rounded in claims.json), so `kvprobe figures` draws the same bytes
        claims_figure.fig_claims(records, figure, read_claims(path))
        print(f"figure: {figure}")
    return 0


def _cmd_claims(args: argparse.Namespace) -> int:
    from kvprobe.errors import default_results_dir
    from kvprobe.runner.records import current_umask
    from kvprobe.study import output_paths

    args.results = args.results or default_results_dir()
    if args.figure is None:
        args.figure = str(output_paths(args.results)[1])
    outputs = [Path(args.out) if args.out else Path(args.results) / "claims.json"]
    if args.figure:
        outputs.append(Path(args.figure))
    with no_partial_output(outputs):
        code = _write(args)
    for out in outputs:  # claims.json is written through a temporary file (0600): give it a plain file's mode
        if out.is_file():
            out.chmod(0o666 & ~current_umask())
    return code


def register(sub: argparse._SubParsersAction) -> None:
    """The ``kvprobe claims`` sub-command."""
    p = sub.add_parser("claims", help="test every declared paper claim on the newest records; write the table")
    p.add_argument("--results", default=None, help="the records folder (default: results in a checkout, else runs)")
    p.add_argument("--out", help="where the claims JSON goes (default: <results>/claims.json)")
    p.add_argument("--figure", default=None,
                   help="claims figure path ('' for none; default: figures/claims_forest.png for the published "
                        "results/, else <results>/figures/claims_forest.png)")
    p.add_argument("--table", action="store_true", help="also print every row with its test, p, q and verdict")
    p.set_defaults(func=_cmd_claims)
