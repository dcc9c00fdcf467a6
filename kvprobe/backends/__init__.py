"""Model backends: the protocol the core needs (:mod:`kvprobe.backends.protocol`), the cache state it speaks
(:class:`KVState`), and the transformers implementation (:mod:`kvprobe.backends.hf`, the exactness oracle);
:mod:`kvprobe.backends.llamacpp` runs the paper's cache operations in a real engine (the ``engine`` extra)."""

from kvprobe.backends.protocol import HookableModel, KVBackend
from kvprobe.backends.state import KVState

__all__ = ["HookableModel", "KVBackend", "KVState"]
