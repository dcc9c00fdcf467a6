"""The model-backend protocol: what kvprobe's cache core needs from a model, and nothing more.

Four operations make every cache state of the paper (stale, field-only, oracle, selective@K, erratum-appended,
transplanted): prefill a context into a cache, read next-token logits after a short suffix over one or more
caches, read the K/V of chosen slots with the positions they were rotated at, and recompute chosen slots over
the rest of a cache. :class:`KVBackend` names them, generic over the engine's cache type (kvprobe's
:class:`~kvprobe.backends.state.KVState` for transformers; an engine keeps its own). :class:`HookableModel`
adds what activation patching needs beyond the cache: the torch modules to hook and their layout.

Both are ``typing.Protocol`` classes checked structurally (``@runtime_checkable``, as transformers' and
TransformerLens's duck-typed model interfaces are), so a backend implements them without inheriting anything.
``kvprobe.models.loading.LoadedModel`` implements both through :class:`kvprobe.backends.hf.HFKVBackend`; a
TransformerLens bridge or an nnsight model becomes one at the public boundary (``kvprobe.interop.as_lm``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only: the layout type lives with the models, above this layer
    from transformers import PreTrainedTokenizerBase

    from kvprobe.backends.state import KVState
    from kvprobe.models.arch import ArchSpec

CacheT = TypeVar("CacheT")
Ids = Sequence[int] | torch.Tensor


@runtime_checkable
class KVBackend(Protocol[CacheT]):
    """A model as the cache core uses it: four cache operations over the engine's cache type ``CacheT``."""

    name: str
    fingerprint: str  # hashes the architecture and the exact weights; every record carries it
    tokenizer: PreTrainedTokenizerBase | None
    has_chat_template: bool

    def prefill(self, ids: Ids, positions: Ids | None = None, prior: CacheT | None = None,
                return_logits: bool = False) -> CacheT | tuple[CacheT, torch.Tensor]:
        """Run ``ids`` (after ``prior``) at ``positions`` (default: right after ``prior``) into a cache; with
        ``return_logits`` also the last position's logits ``[batch, vocab]``."""
        ...

    def read_logits(self, states: CacheT | Sequence[CacheT], suffix_ids: Ids, batch_size: int = 16,
                    suffix_positions: Sequence[int] | None = None) -> torch.Tensor:
        """Next-token logits ``[n_states, vocab]`` (float32, CPU) after ``suffix_ids`` over each cache."""
        ...

    def slot_kv(self, state: CacheT, slots: Sequence[int]) -> KVState:
        """The K/V of ``slots`` (every layer) with the absolute positions their keys were rotated at."""
        ...

    def recompute(self, state: CacheT, ids: Sequence[int], slots: Sequence[int]) -> CacheT:
        """``state`` with ``slots`` recomputed from ``ids[slot]`` at their recorded positions over every other
        slot, causally; ``ids`` covers every slot of the (edited) context."""
        ...

    def describe(self) -> dict[str, Any]:
        """What a record stores about the model: name, source, fingerprint, type, layers, dtype, device."""
        ...


@runtime_checkable
class HookableModel(KVBackend["KVState"], Protocol):
    """A :class:`KVBackend` over :class:`KVState` whose forward runs through torch modules kvprobe can hook:
    what activation patching, probes and features need."""

    model: torch.nn.Module
    spec: ArchSpec

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...
