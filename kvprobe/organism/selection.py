"""Where the organism selection study's tooling is: ``organisms/tooling/`` of a checkout (``organisms.tooling``).

The seeds, validation draws, test draws and choosing rule that picked the recommended organisms are not part of
the library; they stay beside the organisms they scored. In a checkout, ``kvprobe organism`` adds their commands
and ``kvprobe report`` their history tables (through :mod:`kvprobe.organism.report_blocks`); an installed kvprobe,
which has no ``organisms/tooling/``, simply has neither.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CHECKOUT_ORGANISMS = Path(__file__).resolve().parents[2] / "organisms"  # beside kvprobe/ in a checkout


def tooling() -> ModuleType | None:
    """``organisms.tooling`` with its ``cli`` and ``blocks`` loaded, or None where there is none. Found on the path
    (the checkout's root, as ``python -m kvprobe`` from it puts there), else in the checkout this kvprobe runs from."""
    if not (CHECKOUT_ORGANISMS / "tooling" / "__init__.py").is_file():
        return None
    here = sys.modules.get("organisms")
    if here is None:
        spec = importlib.util.find_spec("organisms")
        if spec is None:  # not on the path (a console script run from elsewhere): load the checkout's own
            spec = importlib.util.spec_from_file_location("organisms", CHECKOUT_ORGANISMS / "__init__.py",
                                                          submodule_search_locations=[str(CHECKOUT_ORGANISMS)])
            if spec is None or spec.loader is None:
                return None
            here = importlib.util.module_from_spec(spec)
            sys.modules["organisms"] = here
            spec.loader.exec_module(here)
        elif spec.origin is None or Path(spec.origin).resolve().parent != CHECKOUT_ORGANISMS:
            return None  # another package named organisms comes first on the path: leave it alone
    elif Path(str(getattr(here, "__file__", ""))).resolve().parent != CHECKOUT_ORGANISMS:
        return None  # another package named organisms is loaded: leave it alone
    for part in ("cli", "blocks"):
        importlib.import_module(f"organisms.tooling.{part}")
    return importlib.import_module("organisms.tooling")
