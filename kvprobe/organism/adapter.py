"""Load an organism alias offline: the base model + its committed LoRA adapter, merged.

Merging gives a plain transformers model, so every site, hook and KV operation of kvprobe applies
unchanged; the merged logits equal the adapter-on logits to float error (tested).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvprobe.errors import KVProbeError


def load_organism(entry: Any, device: str = "cpu", dtype: str = "float32") -> Any:
    from peft import PeftModel

    from kvprobe.models.arch import arch_spec
    from kvprobe.models.loading import LoadedModel, fingerprint_model, load_model

    folder = Path(entry.gguf_file)
    card_path = folder / "card.json"
    if not card_path.exists():
        raise KVProbeError(f"organism '{entry.alias}' has no card.json in {folder.name}; retrain it with "
                           f"`kvprobe organism train`")
    card = json.loads(card_path.read_text())
    base = load_model(card["base_model"], device=device, dtype=dtype)
    if card.get("base_fingerprint") and card["base_fingerprint"] != base.fingerprint:
        raise KVProbeError(f"organism '{entry.alias}' was trained on base fingerprint {card['base_fingerprint']} "
                           f"but {card['base_model']} here has {base.fingerprint}; retrain the organism")
    merged = PeftModel.from_pretrained(base.model, str(folder)).merge_and_unload()
    merged.eval()
    return LoadedModel(model=merged, tokenizer=base.tokenizer, spec=arch_spec(merged.config), name=entry.alias,
                       source=f"organism: {card['base_model']} + LoRA adapter ({card.get('summary', '')})",
                       fingerprint=fingerprint_model(merged), has_chat_template=base.has_chat_template)
