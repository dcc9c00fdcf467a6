"""Interop with TransformerLens and nnsight: bring their model objects, hook names and caches to kvprobe.

- :func:`as_lm` (``unwrap``): a TransformerLens ``TransformerBridge``, an nnsight ``LanguageModel``, a plain
  Hugging Face model or a :class:`LoadedModel` -> the :class:`LoadedModel` every kvprobe function takes;
- :mod:`kvprobe.interop.sites`: kvprobe :class:`Site` <-> TransformerLens hook names and nnsight module paths
  (the table is docs/interop.md);
- :mod:`kvprobe.interop.kv`: KVState <-> a transformers DynamicCache, and from a TransformerLens
  ``ActivationCache`` or an nnsight trace;
- :mod:`kvprobe.interop.tl` / :mod:`kvprobe.interop.nnsight`: the same patches run through each library's own
  hooks (used by the tests and ``make bench-sweep`` to check that every backend gives the same numbers).
"""

from kvprobe.interop.unwrap import as_lm

__all__ = ["as_lm"]
