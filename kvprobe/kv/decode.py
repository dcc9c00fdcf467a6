"""Bounded greedy decoding over a cache state (the reasoning chain of the CoT edit probe, Section 4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvprobe.backends import HookableModel
from kvprobe.kv.readout import prefill
from kvprobe.kv.state import KVState


@torch.no_grad()
def greedy_chain(lm: HookableModel, state: KVState, cue_ids: Sequence[int], max_tokens: int,
                 stop_ids: Sequence[int] = ()) -> tuple[KVState, list[int]]:
    """Run ``cue_ids`` over ``state``, then generate up to ``max_tokens`` tokens greedily (stopping after a
    token in ``stop_ids``). Returns the state holding cue and chain, and the chain's token ids."""
    stops = {int(t) for t in stop_ids}
    state, logits = prefill(lm, list(cue_ids), prior=state, return_logits=True)
    chain: list[int] = []
    for i in range(max_tokens):
        chain.append(int(logits[0].argmax()))
        if chain[-1] in stops or i == max_tokens - 1:
            break
        state, logits = prefill(lm, [chain[-1]], prior=state, return_logits=True)
    if chain:  # the last token chosen has not been run yet
        state = prefill(lm, [chain[-1]], prior=state)
    return state, chain
