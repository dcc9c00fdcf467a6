"""kvprobe: read, patch, edit and compose the KV cache of decoder LLMs.

The public surface most users need::

    import kvprobe
    lm = kvprobe.load_model("smollm2-135m")
    state = kvprobe.prefill(lm, ids)            # a KVState: per-layer K/V + absolute positions
    mixed = state.mix(other, positions=[10, 11])
    logits = kvprobe.read_logits(lm, [state, mixed], suffix_ids)

Every public function that takes a model also takes a TransformerLens ``TransformerBridge``, an nnsight
``LanguageModel`` or a transformers model, converted once at that boundary; the core below it takes the backend
protocol (:class:`kvprobe.backends.KVBackend` / :class:`kvprobe.backends.HookableModel`).
"""

from kvprobe.backends import HookableModel, KVBackend
from kvprobe.errors import KVProbeError
from kvprobe.interop.unwrap import ModelLike, as_lm, at_boundary
from kvprobe.kv import readout as _readout
from kvprobe.kv.state import KVState
from kvprobe.models.loading import LoadedModel, load_model
from kvprobe.patching import sweep as _patching_sweep
from kvprobe.patching.sites import Site

prefill = at_boundary(_readout.prefill)
read_logits = at_boundary(_readout.read_logits)
kv_sweep = at_boundary(_patching_sweep.kv_sweep)

__all__ = ["HookableModel", "KVBackend", "KVProbeError", "KVState", "LoadedModel", "ModelLike", "Site", "as_lm",
           "kv_sweep", "load_model", "prefill", "read_logits"]
__version__ = "0.1.0"
