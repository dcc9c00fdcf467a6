"""Sub-commands beyond run/models/figures register here, so the CLI core stays small."""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


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


def _guarded_claims(run: Callable[[Any], int]) -> Callable[[Any], int]:
    """``kvprobe claims`` with its outputs beside the records it reads: the claims figure of a folder other than
    the published ``results/`` goes to ``<results>/figures/claims_forest.png`` (never over the published
    ``figures/claims_forest.png``), and a failing call leaves no partial output (no empty claims.json)."""
    def cmd(args: Any) -> int:
        from kvprobe.errors import default_results_dir
        from kvprobe.study import output_paths

        args.results = args.results or default_results_dir()
        if args.figure is None:
            args.figure = str(output_paths(args.results)[1])
        outputs = [Path(args.out) if args.out else Path(args.results) / "claims.json"]
        if args.figure:
            outputs.append(Path(args.figure))
        with no_partial_output(outputs):
            code = run(args)
        from kvprobe.runner.records import current_umask

        for out in outputs:  # claims.json is written through a temporary file (0600): give it a plain file's mode
            if out.is_file():
                out.chmod(0o666 & ~current_umask())
        return code
    return cmd


def register(sub: argparse._SubParsersAction) -> None:
    from kvprobe import claims
    from kvprobe.features import cli as features_cli
    from kvprobe.kv import gate_cli
    from kvprobe.organism import cli as organism_cli

    gate_cli.register(sub)
    organism_cli.register(sub)
    claims.register(sub)
    claims_parser = sub.choices["claims"]
    claims_parser.set_defaults(results=None, figure=None, func=_guarded_claims(claims_parser.get_default("func")))
    for action in claims_parser._actions:
        if action.dest == "results":
            action.help = "the records folder (default: results in a checkout, else runs)"
        elif action.dest == "figure":
            action.help = ("claims figure path ('' for none; default: figures/claims_forest.png for the published "
                           "results/, else <results>/figures/claims_forest.png)")
    features_cli.register(sub)
