"""One place where a peer library's model object becomes a kvprobe :class:`LoadedModel`.

- nnsight ``LanguageModel``: its wrapped module *is* the Hugging Face model (nnsight hooks it only inside a
  trace), so kvprobe uses that module and the tokenizer as they are.
- TransformerLens ``TransformerBridge``: booting a bridge replaces the Hugging Face model's modules in place
  with bridge components (its attention is re-implemented, eagerly, so hooks see scores and patterns; the
  model no longer dispatches through transformers' attention interface, which kvprobe's shared-base engine
  plugs into). kvprobe therefore builds a plain Hugging Face model of the same class whose parameters and
  buffers *are* the bridge's tensors (no copy, built on the meta device): a patch written through the bridge's
  weights is seen by both.
- ``HookedTransformer``: not accepted. Its weights are converted to TransformerLens's own layout (folded
  norms, centred unembedding) and ``from_pretrained`` refuses the GGUF-derived configs kvprobe loads; use a
  ``TransformerBridge`` on the same Hugging Face model instead.

The unwrapped model is cached per wrapper object, so passing the same bridge to many kvprobe calls builds
its view once.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeAlias, TypeVar

import torch

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.models.arch import arch_spec
from kvprobe.models.loading import LoadedModel, fingerprint_model

if TYPE_CHECKING:
    from nnsight import LanguageModel
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedModel

# What a public kvprobe function accepts as a model: converted once, at the boundary, by :func:`as_lm`.
ModelLike: TypeAlias = "HookableModel | TransformerBridge | LanguageModel | PreTrainedModel"

_BRIDGE_WRAPPER = "_original_component."
_views: "weakref.WeakKeyDictionary[Any, LoadedModel]" = weakref.WeakKeyDictionary()


def _class_names(obj: Any) -> set[str]:
    return {f"{c.__module__}.{c.__name__}" for c in type(obj).__mro__}


def is_bridge(obj: Any) -> bool:
    return any(n.startswith("transformer_lens.") and n.endswith(".TransformerBridge") for n in _class_names(obj))


def is_hooked_transformer(obj: Any) -> bool:
    return any(n.startswith("transformer_lens.") and n.endswith(".HookedTransformer") for n in _class_names(obj))


def is_nnsight(obj: Any) -> bool:
    return "_module" in getattr(obj, "__dict__", {}) and any(n.startswith("nnsight.") for n in _class_names(obj))


def _set_tensor(root: torch.nn.Module, name: str, tensor: torch.Tensor, parameter: bool) -> None:
    path, _, leaf = name.rpartition(".")
    module = root.get_submodule(path) if path else root
    if parameter:
        module._parameters[leaf] = tensor
    else:
        module._buffers[leaf] = tensor


def hf_view_of_bridge(bridge: Any) -> torch.nn.Module:
    """A plain Hugging Face model sharing every parameter and buffer of the bridge's wrapped model."""
    wrapped = bridge.original_model
    params = {n.replace(_BRIDGE_WRAPPER, ""): p for n, p in wrapped.named_parameters(remove_duplicate=False)}
    buffers = {n.replace(_BRIDGE_WRAPPER, ""): b for n, b in wrapped.named_buffers(remove_duplicate=False)}
    config = copy.deepcopy(wrapped.config)
    with torch.device("meta"):
        view = type(wrapped)._from_config(config)
    missing = []
    for name, _ in list(view.named_parameters(remove_duplicate=False)):
        if name not in params:
            missing.append(name)
            continue
        _set_tensor(view, name, params[name], parameter=True)
    for name, _ in list(view.named_buffers(remove_duplicate=False)):
        if name in buffers:
            _set_tensor(view, name, buffers[name], parameter=False)
        else:
            missing.append(name)
    if missing:
        raise KVProbeError(f"the bridge's model has no tensor for {missing[:5]} (of {len(missing)}): this "
                           "TransformerLens architecture adapter renames modules kvprobe cannot map back")
    return view.eval()


def as_lm(obj: ModelLike, tokenizer: Any = None, name: str | None = None) -> HookableModel:
    """The :class:`~kvprobe.backends.HookableModel` behind ``obj`` (a LoadedModel or any other implementation of
    the protocol, a TransformerBridge, an nnsight LanguageModel, or a Hugging Face ``PreTrainedModel`` with
    ``tokenizer``)."""
    if isinstance(obj, HookableModel) and not is_nnsight(obj):
        return obj  # a LoadedModel, or another backend implementing the protocol
    if is_hooked_transformer(obj):
        raise KVProbeError("a HookedTransformer holds TransformerLens-layout weights (folded norms) that kvprobe "
                           "cannot map back to the Hugging Face model; boot a TransformerBridge on the same model "
                           "(TransformerBridge.boot_transformers(name, hf_model=..., tokenizer=...)) and pass that")
    try:
        return _views[obj]
    except (KeyError, TypeError):
        pass
    if is_bridge(obj):
        model, tok, source = hf_view_of_bridge(obj), tokenizer or _stock_tokenizer(obj.tokenizer), "transformer_lens bridge"
    elif is_nnsight(obj):
        model, tok, source = obj._module, tokenizer or getattr(obj, "tokenizer", None), "nnsight"
    elif isinstance(obj, torch.nn.Module) and hasattr(obj, "config"):
        model, tok, source = obj, tokenizer or _tokenizer_beside(obj), "transformers model"
    else:
        raise KVProbeError(f"kvprobe cannot use a {type(obj).__name__}: pass a LoadedModel, a TransformerLens "
                           "TransformerBridge, an nnsight LanguageModel or a transformers model")
    lm = LoadedModel(model=model, tokenizer=tok, spec=arch_spec(model.config),
                     name=name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
                     source=source, fingerprint=fingerprint_model(model),
                     has_chat_template=bool(tok is not None and getattr(tok, "chat_template", None)))
    try:
        _views[obj] = lm
    except TypeError:
        pass
    return lm


def _stock_tokenizer(bridge_tokenizer: Any) -> Any:
    """The stock Hugging Face tokenizer behind a bridge's: TransformerLens reloads it with ``add_bos_token=True``,
    which would prepend a BOS the native model never sees, so kvprobe reloads it from the same local files (or
    the HF cache). Falls back to the bridge's own tokenizer when those files are not here."""
    import logging

    from transformers import AutoTokenizer

    where = str(getattr(bridge_tokenizer, "name_or_path", "") or "")
    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True) if where else bridge_tokenizer
    except (OSError, ValueError):
        logging.getLogger(__name__).warning("using the bridge's tokenizer (it prepends BOS); pass as_lm(bridge, "
                                            "tokenizer) with the model's own tokenizer to match native runs")
        return bridge_tokenizer


def _tokenizer_beside(model: Any) -> Any:
    """The tokenizer saved with a Hugging Face model loaded from a local directory (None otherwise: pass it to
    ``as_lm(model, tokenizer)``). Never reaches the hub."""
    where = str(getattr(model.config, "_name_or_path", "") or "")
    if not where or not Path(where).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError):
        return None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def at_boundary(fn: Callable[Concatenate[HookableModel, _P], _R]) -> Callable[Concatenate[ModelLike, _P], _R]:
    """``fn`` made public: its model argument may be any :data:`ModelLike`, converted once by :func:`as_lm`
    before the core sees it (the core itself takes the protocol only)."""

    @functools.wraps(fn)
    def public(lm: ModelLike, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return fn(as_lm(lm), *args, **kwargs)

    return public
