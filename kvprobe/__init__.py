"""kvprobe: read, patch, edit and compose the KV cache of decoder LLMs.

The public surface most users need::

    import kvprobe
    lm = kvprobe.load_model("smollm2-135m")
    state = kvprobe.prefill(lm, ids)            # a KVState: per-layer K/V + absolute positions
    mixed = state.mix(other, positions=[10, 11])
    logits = kvprobe.read_logits(lm, [state, mixed], suffix_ids)
"""

from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.loading import LoadedModel, load_model
from kvprobe.patching.sites import Site

__all__ = ["KVProbeError", "KVState", "LoadedModel", "Site", "load_model", "prefill", "read_logits"]
__version__ = "0.1.0"
