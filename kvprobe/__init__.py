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

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _map_checkout_experiments() -> None:
    """In a checkout, ``kvprobe.experiments`` is the repository's top-level ``experiments/`` folder (an installed
    wheel has it as a real subpackage, mapped by pyproject's ``package-dir``). Registered here so that running from
    a checkout, with or without an editable install, always imports this checkout's experiments."""
    if "kvprobe.experiments" in _sys.modules or (_Path(__file__).parent / "experiments").is_dir():
        return
    init = _Path(__file__).resolve().parent.parent / "experiments" / "__init__.py"
    if not init.is_file():
        return
    spec = _ilu.spec_from_file_location("kvprobe.experiments", init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        return
    module = _ilu.module_from_spec(spec)
    _sys.modules["kvprobe.experiments"] = module
    globals()["experiments"] = module  # as an import of the subpackage would bind it
    spec.loader.exec_module(module)


_map_checkout_experiments()

from kvprobe.backends import HookableModel, KVBackend  # noqa: E402
from kvprobe.errors import KVProbeError  # noqa: E402
from kvprobe.interop.unwrap import ModelLike, as_lm, at_boundary  # noqa: E402
from kvprobe.kv import readout as _readout  # noqa: E402
from kvprobe.kv.state import KVState  # noqa: E402
from kvprobe.models.loading import LoadedModel, load_model  # noqa: E402
from kvprobe.patching import sweep as _patching_sweep  # noqa: E402
from kvprobe.patching.sites import Site  # noqa: E402

prefill = at_boundary(_readout.prefill)
read_logits = at_boundary(_readout.read_logits)
kv_sweep = at_boundary(_patching_sweep.kv_sweep)

__all__ = ["HookableModel", "KVBackend", "KVProbeError", "KVState", "LoadedModel", "ModelLike", "Site", "as_lm",
           "kv_sweep", "load_model", "prefill", "read_logits"]
__version__ = "0.1.0"
