"""An organism as a GGUF file for llama.cpp: its base model's GGUF with the LoRA-merged tensors written in.

An organism is its base model plus a LoRA adapter, merged at load by peft (``kvprobe.models.loading``). The
engine needs the same weights as one GGUF. This builds it with the ``gguf`` package's reader and writer (the
library llama.cpp's own conversion scripts write with), from the base model's own GGUF:

- every metadata key and every tensor the adapter does not touch is copied byte for byte (same quantisation);
- each tensor the merge changed (the adapter's target projections) is written in F32, in GGUF's layout: the
  HF name is mapped with ``gguf.TensorNameMap`` for the file's architecture, and the HF->GGUF row order
  (llama.cpp's convert script permutes q/k rows of Llama-family models for its RoPE layout) is not assumed
  but found: the transform that maps the base model's HF tensor exactly onto the dequantised tensor already in
  the base GGUF is applied to the merged tensor. No transform matching exactly -> the export is refused.

So the exported file holds exactly the weights kvprobe's HF oracle runs for the organism (the base GGUF's
dequantised tensors, plus the merged projections in F32). It is built on demand into the kvprobe cache
(``<cache>/gguf/organisms/<alias>.<fingerprint>.gguf``), never into the package or the repository; the name
carries the organism's fingerprint, so a changed adapter gets a new file.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvprobe.cache_dir import cache_root
from kvprobe.errors import KVProbeError

log = logging.getLogger(__name__)


def _permute(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    """llama.cpp's HF->GGUF row permutation of a q/k projection with ``n_head`` heads (rotary halves
    interleaved per head)."""
    def f(w: np.ndarray) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return f


def _transforms(config) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    n_head = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_head)
    out = {"identity": lambda w: w}
    for n in sorted({n_head, n_kv}):
        out[f"rope-permute({n} heads)"] = _permute(n)
    return out


FLAVOURS = ("mixed", "f32")


def organism_gguf_path(alias: str, fingerprint: str, flavour: str = "mixed") -> Path:
    suffix = "" if flavour == "mixed" else f".{flavour}"
    return cache_root() / "gguf" / "organisms" / f"{alias}.{fingerprint}{suffix}.gguf"


def export_organism_gguf(alias: str, flavour: str = "mixed") -> Path:
    """The model's GGUF in the kvprobe cache, built once (see the module docstring). ``flavour``: ``mixed``
    (the base GGUF's quantised tensors kept byte for byte, the merged ones in F32) or ``f32`` (every tensor
    dequantised to F32: the exact fp32 weights the HF oracle runs, so llama.cpp multiplies them without
    quantising activations; what the engine check uses). An embedded base alias (no adapter) is accepted with
    ``f32`` only: its plain GGUF is already the mixed case."""
    import gguf

    from kvprobe.models.loading import embedded_gguf_path, load_model
    from kvprobe.models.registry import register_organisms, resolve

    register_organisms()

    if flavour not in FLAVOURS:
        raise KVProbeError(f"unknown GGUF flavour '{flavour}'; known: {', '.join(FLAVOURS)}")
    entry = resolve(alias)
    is_organism = not isinstance(entry, Path) and entry.kind == "organism"
    if not is_organism and (flavour != "f32" or isinstance(entry, Path) or entry.gguf_file is None):
        raise KVProbeError(f"'{alias}' is not an organism alias (see `kvprobe models`); a GGUF base model is "
                           "exported only as flavour 'f32'")
    organism = load_model(alias, device="cpu", dtype="float32")
    target = organism_gguf_path(alias, organism.fingerprint, flavour)
    if target.exists():
        return target
    base_alias = entry.source if is_organism else alias
    base = load_model(base_alias, device="cpu", dtype="float32") if is_organism else organism
    base_gguf = embedded_gguf_path(base_alias)
    log.warning("exporting %s to GGUF once (base %s + merged adapter) into the kvprobe cache", alias, base_gguf.name)

    merged_sd = organism.model.state_dict()
    base_sd = base.model.state_dict()
    changed = [n for n, t in merged_sd.items() if n in base_sd and not torch.equal(t, base_sd[n])]
    if is_organism and not changed:
        raise KVProbeError(f"merging {alias}'s adapter changed no tensor of {base_alias}: nothing to export")

    reader = gguf.GGUFReader(base_gguf)
    arch_name = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch_name not in archs:
        raise KVProbeError(f"{base_gguf.name}: architecture '{arch_name}' unknown to gguf {gguf.__name__}")
    n_blocks = int(organism.model.config.num_hidden_layers)
    names = gguf.get_tensor_name_map(archs[arch_name], n_blocks)
    tensors = {t.name: t for t in reader.tensors}
    transforms = _transforms(organism.model.config)

    replace: dict[str, np.ndarray] = {}
    for hf_name in changed:
        g_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if g_name is None or g_name not in tensors:
            raise KVProbeError(f"{hf_name} (changed by {alias}'s adapter) has no tensor in {base_gguf.name} "
                               f"(mapped to {g_name!r})")
        t = tensors[g_name]
        in_file = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        base_w = base_sd[hf_name].detach().cpu().float().numpy()
        chosen = None
        for label, fn in transforms.items():
            cand = fn(base_w)
            if cand.shape == in_file.shape and np.array_equal(cand, in_file):
                chosen = (label, fn)
                break
        if chosen is None:
            raise KVProbeError(f"no known layout maps {base_alias}'s HF tensor {hf_name} exactly onto {g_name} in "
                               f"{base_gguf.name} (tried {', '.join(transforms)}): refusing to guess")
        replace[g_name] = np.ascontiguousarray(chosen[1](merged_sd[hf_name].detach().cpu().float().numpy()))
    if flavour == "f32":  # every other tensor dequantised as it is (HF dequantises the same bytes the same way)
        for t in reader.tensors:
            if t.name not in replace:
                replace[t.name] = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)
                                                       .astype(np.float32))
    log.info("%s: %d tensors written in F32", alias, len(replace))

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch_name, endianess=reader.endianess)
        for f in reader.fields.values():
            if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
                continue
            if f.name == gguf.Keys.General.NAME:
                continue
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
        writer.add_name(alias)
        writer.add_string("kvprobe.organism.fingerprint", organism.fingerprint)
        writer.add_string("kvprobe.organism.base_gguf", base_gguf.name)
        for t in reader.tensors:
            if t.name in replace:
                w = replace[t.name]
                writer.add_tensor_info(t.name, w.shape, w.dtype, w.nbytes, gguf.GGMLQuantizationType.F32)
            else:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(replace.get(t.name, t.data), tensor_endianess=reader.endianess)
        writer.close()
        _verify(tmp, replace, tensors)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _verify(path: Path, replaced: dict[str, np.ndarray], base_tensors: dict) -> None:
    """Read the written file back: every replaced tensor as written, every other one the base's bytes."""
    import gguf

    out = {t.name: t for t in gguf.GGUFReader(path).tensors}
    if set(out) != set(base_tensors):
        raise KVProbeError(f"the exported GGUF holds {len(out)} tensors, its base {len(base_tensors)}")
    for name, t in out.items():
        if name in replaced:
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            if t.tensor_type != gguf.GGMLQuantizationType.F32 or not np.array_equal(got, replaced[name]):
                raise KVProbeError(f"the exported GGUF's {name} does not read back as written")
        elif t.tensor_type != base_tensors[name].tensor_type or not np.array_equal(t.data, base_tensors[name].data):
            raise KVProbeError(f"the exported GGUF's {name} differs from its base's bytes")


def gguf_path(alias: str) -> Path:
    """The GGUF file of a model alias: what the llama.cpp backend (``kvprobe.backends.llamacpp``) loads. An embedded
    alias gets the file kvprobe's HF loader dequantizes (:func:`kvprobe.models.loading.embedded_gguf_path`); an
    organism gets its base model's GGUF with the merged adapter written in, built once into the kvprobe cache
    (:func:`export_organism_gguf`)."""
    from kvprobe.models.loading import embedded_gguf_path
    from kvprobe.models.registry import register_organisms, resolve

    register_organisms()
    entry = resolve(alias)
    if not isinstance(entry, Path) and entry.kind == "organism":
        return export_organism_gguf(alias)
    return embedded_gguf_path(alias)
