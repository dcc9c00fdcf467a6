"""A LoRA edit: fine-tune low-rank adapters on the stale-context decision until it flips (paper Table 1,
Appendix I: r = 8 on the q, v and down projections).

The adapter is injected into the loaded model in place (``peft``), so every request the model instance
serves afterwards reads the edited weights; :meth:`LoraEdit.rollback` removes the adapter and gives back
the original modules.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError


@dataclass
class LoraEdit:
    peft_model: Any
    detail: dict[str, Any] = field(default_factory=dict)

    def rollback(self) -> None:
        if self.peft_model is None:
            raise KVProbeError("this LoRA edit was already rolled back")
        self.peft_model.unload()  # the base modules back, the adapter weights dropped (nothing was merged)
        self.peft_model = None


def _model(lm: HookableModel) -> torch.nn.Module:
    return lm.model if hasattr(lm, "model") and not isinstance(lm, torch.nn.Module) else lm


def lora_edit(lm: HookableModel, prompts: Sequence[Sequence[int]], target_id: int, other_id: int, r: int = 8,
              alpha: int = 16, target_modules: Sequence[str] = ("q_proj", "v_proj", "down_proj"), lr: float = 1e-3,
              max_steps: int = 50, margin: float = 1.0, seed: int = 0) -> LoraEdit:
    """Train a rank-``r`` adapter (Adam, cross-entropy on ``target_id`` as the next token after each prompt)
    until every prompt prefers ``target_id`` over ``other_id`` by ``margin`` nats, or ``max_steps``."""
    from peft import LoraConfig, get_peft_model

    model = _model(lm)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules), bias="none")
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    batch = [torch.as_tensor([list(p)], device=device) for p in prompts]
    steps, flipped, gaps = 0, False, []
    peft_model.train()
    while steps < max_steps:
        opt.zero_grad()
        loss, gaps = 0.0, []
        for ids in batch:
            logits = peft_model(input_ids=ids, use_cache=False).logits[0, -1].float()
            gaps.append(float((logits[target_id] - logits[other_id]).detach()))
            loss = loss + F.cross_entropy(logits[None], torch.as_tensor([target_id], device=device)) / len(batch)
        if min(gaps) >= margin:  # checked on the forward that would train next: no extra pass
            flipped = True
            break
        loss.backward()
        opt.step()
        steps += 1
    peft_model.eval()
    if not flipped:
        with torch.no_grad():
            gaps = [float((lambda lo: lo[target_id] - lo[other_id])(peft_model(input_ids=ids, use_cache=False)
                                                                      .logits[0, -1].float())) for ids in batch]
        flipped = min(gaps) >= margin
    return LoraEdit(peft_model, {"steps": steps, "flipped": flipped, "final_gap": min(gaps), "r": r,
                                 "target_modules": list(target_modules), "lr": lr,
                                 "edit_s": time.perf_counter() - t0})
