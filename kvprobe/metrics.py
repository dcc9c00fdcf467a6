"""Decision metrics of the paper (Section 3 Setup).

- ``logit_diff``: logit(action correct under the new value) - logit(action correct under the old value);
- ``recovery``: ``(x - stale) / (oracle - stale)``: 0 behaves like stale, 1 like the oracle;
- ``logit_cosine``: cosine between two full next-token logit vectors;
- ``decision_agreement``: whether two logit vectors pick the same of the candidate actions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def logit_diff(logits: torch.Tensor, target_id: int, other_id: int) -> torch.Tensor:
    """``logits[..., target] - logits[..., other]`` in nats (log-odds of the two actions)."""
    return logits[..., target_id] - logits[..., other_id]


def recovery(x: torch.Tensor | float, stale: torch.Tensor | float, oracle: torch.Tensor | float) -> torch.Tensor:
    """Fraction of the oracle's flip a state reproduces; NaN where the oracle does not move the decision."""
    x, stale, oracle = (torch.as_tensor(v, dtype=torch.float64) for v in (x, stale, oracle))
    flip = oracle - stale
    return torch.where(flip.abs() > 0, (x - stale) / flip, torch.full_like(flip, float("nan")))


def logit_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def decision(logits: torch.Tensor, candidate_ids: Sequence[int]) -> torch.Tensor:
    """Index (into ``candidate_ids``) of the highest-logit candidate action."""
    return logits[..., list(candidate_ids)].argmax(dim=-1)


def decision_agreement(a: torch.Tensor, b: torch.Tensor, candidate_ids: Sequence[int]) -> torch.Tensor:
    return (decision(a, candidate_ids) == decision(b, candidate_ids)).double()
