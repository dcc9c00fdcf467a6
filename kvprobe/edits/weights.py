"""Weight checksums: whether an edit left a model's weights untouched (an identity for KV edits, which live
in a per-request cache) and whether a rollback restored them exactly."""

from __future__ import annotations

import hashlib

import torch

from kvprobe.backends import HookableModel


@torch.no_grad()
def weights_checksum(lm: HookableModel) -> str:
    """SHA-256 over every parameter and buffer's name, dtype, shape and bytes, in state-dict order."""
    model = lm.model if hasattr(lm, "model") and not isinstance(lm, torch.nn.Module) else lm
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]
