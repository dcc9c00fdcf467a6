"""An import-linter contract type for a package that installs into kvprobe from outside ``kvprobe/``.

``kvprobe.experiments`` is the top-level ``experiments/`` folder (pyproject's ``package-dir``; in a checkout,
``kvprobe/__init__.py`` maps it). grimp builds its graph from the files under ``kvprobe/``, so it has no module
``kvprobe.experiments``, and it drops an import of one (a ``forbidden`` contract naming it aborts with "Module
'kvprobe.experiments' does not exist"). This contract reads the imports itself, with the parser of
``tools/import_graph.py`` (every import: module scope, function-local and ``TYPE_CHECKING``), and breaks on any
import of the mapped package from the source modules. Loading experiments by name (``importlib``), as the run
core does, is not an import of one.

In ``.importlinter``::

    [importlinter]
    contract_types =
        forbidden_mapped: tools.lint_contracts.ForbiddenMappedContract

    [importlinter:contract:nothing-imports-experiments]
    type = forbidden_mapped
    source_modules = kvprobe
    forbidden_modules = kvprobe.experiments
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _checkout() -> Path:
    spec = importlib.util.find_spec("kvprobe")
    if spec is None or spec.origin is None:
        raise RuntimeError("kvprobe is not importable from here")
    return Path(spec.origin).resolve().parents[1]


def _inside(module: str, packages: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


class ForbiddenMappedContract(Contract):
    """Source modules (grimp's, under ``kvprobe/``) never import the forbidden modules, which may live in a folder
    mapped into the package from outside it (``kvprobe.experiments``).

    Configuration options:
        - source_modules:    the packages or modules whose imports are checked.
        - forbidden_modules: the modules (and their descendants) they may not import.
    """

    type_name = "forbidden_mapped"

    source_modules = fields.ListField(subfield=fields.StringField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        from tools.import_graph import read_graph

        root = _checkout()
        parsed = read_graph(root)
        sources = [str(s) for s in self.source_modules]
        forbidden = [str(f) for f in self.forbidden_modules]
        missing = [m for m in forbidden if m not in parsed.modules]
        if missing:
            raise ValueError(f"forbidden module(s) {', '.join(missing)} not found under {root}")
        violations = []
        for (importer, imported), kinds in sorted(parsed.edges.items()):
            if importer in graph.modules and _inside(importer, sources) and _inside(imported, forbidden) \
                    and not _inside(importer, forbidden):
                lines = sorted(n for ls in kinds.values() for n in ls)
                violations.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for v in check.metadata["violations"]:
            output.print_error(f"{v['importer']} -> {v['imported']} (l. {', '.join(map(str, v['lines']))})",
                               bold=False)
            output.new_line()
