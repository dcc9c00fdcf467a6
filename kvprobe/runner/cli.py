"""Moved to :mod:`kvprobe.app.cli`; kept one release for console scripts installed before the move."""
from kvprobe.app.cli import main  # noqa: F401
