"""A two-choice decision read over a cache, directly or after a bounded chain (the competence screen's read;
paper App. H: a model enters the memory tests only where its full-recompute decision is competent).

A :class:`TwoChoice` is one decision prompt cut where the answer prefix begins: the ``context`` a cache holds,
the ``answer_prefix`` read over it, and two candidate continuations (one token each for an action word; several
for a free-form answer, e.g. LoCoMo's gold phrase). The score of a candidate is its teacher-forced log-probability
after the prefix, so the logit difference ``ld`` (candidate 0 minus candidate 1, in nats) is the two-action
logit difference when both are single tokens.

- ``direct``: ``ld`` after the answer prefix; the decision is candidate 0 when ``ld > 0``.
- ``chain``: a cue is run over the cache and a bounded greedy chain generated
  (:func:`kvprobe.probes.chain.chain_decision`); the decision is the last candidate the chain names as a word,
  else the forced read (``ld`` after the answer cue appended to the chain).

:class:`PrefixReuse` prefills a run of contexts that share long prefixes (one policy or memory and two field
values) once per shared prefix: causally the same computation as a full prefill of each context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvprobe.backends import HookableModel, KVState
from kvprobe.errors import KVProbeError
from kvprobe.kv.decode import greedy_chain
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.probes.chain import chain_decision, last_action

Mode = Literal["direct", "chain"]
MODES: tuple[Mode, ...] = ("direct", "chain")


@dataclass(frozen=True)
class TwoChoice:
    """One decision prompt: ``context`` (token ids the cache holds), ``answer_prefix`` (read over it), the two
    candidates' token ids and names, and which candidate is correct (0 or 1)."""

    context: tuple[int, ...]
    answer_prefix: tuple[int, ...]
    candidates: tuple[tuple[int, ...], tuple[int, ...]]
    actions: tuple[str, str]
    correct: int

    def __post_init__(self) -> None:
        if self.correct not in (0, 1):
            raise KVProbeError(f"TwoChoice.correct must be 0 or 1; got {self.correct}")
        if not self.context or not self.answer_prefix:
            raise KVProbeError("a TwoChoice needs a non-empty context and answer prefix")
        if not all(self.candidates) or self.candidates[0] == self.candidates[1]:
            raise KVProbeError(f"the candidates {self.actions} must be non-empty and differ as token ids")


@dataclass(frozen=True)
class ChainSpec:
    """A bounded greedy chain: ``cue`` run over the cache (after ``lead``, tokens the prompt itself ends with,
    if any), at most ``max_tokens`` greedy tokens, then ``answer_cue`` before the forced read."""

    cue: tuple[int, ...]
    answer_cue: tuple[int, ...]
    max_tokens: int
    lead: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecisionRead:
    """A read: ``choice`` (0 or 1), ``ld`` (score of candidate 0 minus candidate 1, nats), how the choice was
    made (``direct``, ``chain``: the chain named it, ``forced``: the read after the answer cue), and the chain."""

    choice: int
    ld: float
    decided_by: str
    chain_tokens: int = 0
    chain_text: str = ""

    def correct(self, tc: TwoChoice) -> bool:
        return self.choice == tc.correct


def candidate_ld(lm: HookableModel, state: KVState, prefix: Sequence[int],
                 candidates: tuple[Sequence[int], Sequence[int]]) -> float:
    """Teacher-forced log-probability of candidate 0 minus candidate 1 after ``prefix`` over ``state``; for two
    single-token candidates, the logit difference of the two tokens."""
    import torch

    if len(candidates[0]) == 1 and len(candidates[1]) == 1:
        lg = read_logits(lm, state, list(prefix))[0]
        return float(lg[candidates[0][0]] - lg[candidates[1][0]])
    after, logits = prefill(lm, list(prefix), prior=state, return_logits=True)
    first = torch.log_softmax(logits[0].float(), -1)
    scores = []
    for cand in candidates:
        total, st, lp = 0.0, after, first
        for i, t in enumerate(cand):
            total += float(lp[t])
            if i < len(cand) - 1:
                st, lg = prefill(lm, [t], prior=st, return_logits=True)
                lp = torch.log_softmax(lg[0].float(), -1)
        scores.append(total)
    return scores[0] - scores[1]


def read_decision(lm: HookableModel, state: KVState, tc: TwoChoice, mode: Mode,
                  chain: ChainSpec | None = None) -> DecisionRead:
    """The decision of ``tc`` over ``state`` (a cache of ``tc.context``) in ``mode``."""
    if mode == "direct":
        ld = candidate_ld(lm, state, tc.answer_prefix, tc.candidates)
        return DecisionRead(0 if ld > 0 else 1, ld, "direct")
    if mode != "chain":
        raise KVProbeError(f"decision mode must be one of {list(MODES)}; got {mode!r}")
    if chain is None:
        raise KVProbeError("mode 'chain' needs a ChainSpec (cue, answer cue, token budget)")
    cue = list(chain.lead) + list(chain.cue)
    if len(tc.candidates[0]) == 1 and len(tc.candidates[1]) == 1:
        out = chain_decision(lm, state, cue, chain.answer_cue, chain.max_tokens, tc.actions,
                             (tc.candidates[0][0], tc.candidates[1][0]))
        choice = tc.actions.index(out["decision"])
        return DecisionRead(choice, out["forced_ld"], out["decided_by"], out["n_tokens"], out["text"])
    tok = lm.tokenizer
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    after, ids = greedy_chain(lm, state, cue, chain.max_tokens, stops)
    text = tok.decode(ids, skip_special_tokens=True)
    ld = candidate_ld(lm, after, chain.answer_cue, tc.candidates)
    named = last_action(text, tc.actions)
    choice = tc.actions.index(named) if named else (0 if ld > 0 else 1)
    return DecisionRead(choice, ld, "chain" if named else "forced", len(ids), text)


class PrefixReuse:
    """Prefill contexts one after another, reusing the last context's cache for the longest token prefix they
    share (at least ``min_shared`` tokens; otherwise a fresh prefill). ``prefilled`` counts the tokens run."""

    def __init__(self, lm: HookableModel, min_shared: int = 16) -> None:
        self.lm, self.min_shared = lm, min_shared
        self._ids: tuple[int, ...] = ()
        self._state: KVState | None = None
        self.prefilled = 0

    def state(self, context: Sequence[int]) -> KVState:
        ids = tuple(context)
        cut = 0
        for a, b in zip(self._ids, ids):
            if a != b:
                break
            cut += 1
        cut = min(cut, len(ids) - 1)  # keep at least one token to run: the cache then ends on a fresh forward
        if self._state is not None and cut >= self.min_shared:
            state = prefill(self.lm, list(ids[cut:]), prior=self._state.slice(0, cut))
        else:
            cut, state = 0, prefill(self.lm, list(ids))
        self.prefilled += len(ids) - cut
        self._ids, self._state = ids, state
        return state
