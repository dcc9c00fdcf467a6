"""The organism tables of the history page (``docs/history/organisms.md``) as ``kvprobe report`` blocks, registered
through ``kvprobe.organism.report_blocks`` (the ``kvprobe.report_blocks`` entry point) when this tooling is here."""

from __future__ import annotations

from collections.abc import Callable

from organisms.tooling.draws import sealed_draw_table
from organisms.tooling.seeds import seed_table
from organisms.tooling.validation import decision_table, phrasing_table, test_draw_table, validation_table


def register(register_block: Callable[[str, Callable[..., str]], None]) -> None:
    """Register each organism table as a generated block (``<!-- kvprobe:organism_seeds -->``, ...)."""
    register_block("organism_seeds", seed_table)
    register_block("organism_validation", validation_table)
    register_block("organism_test_draw", test_draw_table)
    register_block("organism_phrasings", phrasing_table)
    register_block("organism_decisions", decision_table)
    register_block("sealed_draw", sealed_draw_table)
