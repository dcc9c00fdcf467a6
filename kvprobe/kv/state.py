"""KVState lives in :mod:`kvprobe.backends.state` (the data type the backend protocol speaks); this name stays
for the code and notebooks that import it from here."""

from kvprobe.backends.state import KVState

__all__ = ["KVState"]
