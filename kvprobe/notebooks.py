"""Run notebooks headless: ``python -m kvprobe.notebooks notebooks/ --out runs/notebooks`` (``make notebooks``).

Each notebook is executed by nbclient in a kernel of this Python, with the notebook's own folder as the working
directory (as Jupyter would run it): no server, no JupyterLab, nothing installed. The executed copies, outputs
included, go to ``--out``; the notebooks themselves are left as they are.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvprobe.errors import KVProbeError


def run_notebook(path: Path, out_dir: Path, timeout: int = 900) -> Path:
    """Execute ``path`` top to bottom and write the executed copy to ``out_dir``; a failing cell raises
    :class:`KVProbeError` naming the notebook, the cell and the error."""
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
    except ImportError as exc:
        raise KVProbeError(f"running notebooks needs nbclient and ipykernel ({exc.name} is missing): "
                           "`pip install nbclient ipykernel` (kvprobe's dev extra has both)") from None
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    try:
        client.execute()
    except CellExecutionError as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise KVProbeError(f"{path}: a cell failed: {last}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / path.name
    nbformat.write(nb, target)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvprobe.notebooks", description=__doc__.split("\n\n")[1])
    parser.add_argument("folder", nargs="?", default="notebooks", help="the notebooks folder (default: notebooks)")
    parser.add_argument("--out", default="runs/notebooks", help="where the executed copies go")
    parser.add_argument("--only", action="append", help="run only this notebook (its stem; repeatable)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = sorted(Path(args.folder).glob("*.ipynb"))
    if args.only:
        paths = [p for p in paths if p.stem in args.only]
    if not paths:
        print(f"kvprobe: error: no notebooks in {args.folder}/", file=sys.stderr)
        return 2
    failed = 0
    for path in paths:
        try:
            print(f"notebook: {path} -> {run_notebook(path, Path(args.out), args.timeout)}", flush=True)
        except KVProbeError as exc:
            print(f"kvprobe: error: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
