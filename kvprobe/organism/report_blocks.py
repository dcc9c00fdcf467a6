"""The organism tables of the history page (``docs/history/organisms.md``), contributed to ``kvprobe report``
through the ``kvprobe.report_blocks`` entry point, so the report never imports the organism package. The tables
are the selection study's (``organisms/tooling/blocks.py`` of a checkout); without it nothing is registered."""

from __future__ import annotations

from collections.abc import Callable


def register(register_block: Callable[[str, Callable[..., str]], None]) -> None:
    """Register each organism table as a generated block (``<!-- kvprobe:organism_seeds -->``, ...)."""
    from kvprobe.organism.selection import tooling

    found = tooling()
    if found is not None:
        found.blocks.register(register_block)
