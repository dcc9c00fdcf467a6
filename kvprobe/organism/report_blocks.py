"""The organism tables of the history page (``docs/history/organisms.md``), contributed to ``kvprobe report``
through the ``kvprobe.report_blocks`` entry point, so the report never imports the organism package."""

from __future__ import annotations

from collections.abc import Callable

from kvprobe.organism.seeds import seed_table
from kvprobe.organism.test_draws import sealed_draw_table
from kvprobe.organism.validation import decision_table, phrasing_table, test_draw_table, validation_table


def register(register_block: Callable[[str, Callable[..., str]], None]) -> None:
    """Register each organism table as a generated block (``<!-- kvprobe:organism_seeds -->``, ...)."""
    register_block("organism_seeds", seed_table)
    register_block("organism_validation", validation_table)
    register_block("organism_test_draw", test_draw_table)
    register_block("organism_phrasings", phrasing_table)
    register_block("organism_decisions", decision_table)
    register_block("sealed_draw", sealed_draw_table)
