"""The decision-read API of the probe layer: a two-choice decision read over a cache, directly or after a
bounded chain; the two-action logit difference of several caches in one batch; the teacher-forced
log-probability of an answer. Every application experiment (and the competence screen; paper App. H: a model
enters the memory tests only where its full-recompute decision is competent) reads its decisions here.

- :func:`read_actions`: next-token logits after a suffix (the answer prefix) over each of several caches, and
  the two-action logit difference ``ld`` of each (``tokens[0]`` minus ``tokens[1]``, nats): the graded measure
  behind every binary decision (a decision is ``ld > 0``);
- :func:`decide`: one decision over a cache, ``direct`` (the sign of ``ld``) or after a bounded greedy ``chain``
  (:class:`ChainSpec`: cue, token budget, answer cue; the last action the chain names, else the forced read);
- :func:`answer_logprob`: the teacher-forced log-probability of an answer's tokens after a prefix over a cache
  (LoCoMo's gold answer; candidates of several tokens);
- :func:`next_logits`: the whole next-token distribution (a free-form answer's first token);
- :func:`answer_prefix_len`: how many trailing prompt tokens are the answer prefix (a cache ends before them).

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

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


@dataclass(frozen=True)
class ActionReads:
    """Next-token ``logits`` ``[n_states, vocab]`` after one suffix over each of several caches, read for the two
    action ``tokens``: ``ld(i)`` = logit of ``tokens[0]`` minus ``tokens[1]`` (nats) over cache ``i``."""

    logits: torch.Tensor
    tokens: tuple[int, int]

    def ld(self, i: int = 0) -> float:
        return float(self.logits[i, self.tokens[0]] - self.logits[i, self.tokens[1]])

    @property
    def lds(self) -> list[float]:
        return [self.ld(i) for i in range(self.logits.shape[0])]

    def choice(self, i: int = 0) -> int:
        """0 where ``tokens[0]`` wins (ties go to 1, as a strict argmax of the two)."""
        return 0 if self.logits[i, self.tokens[0]] > self.logits[i, self.tokens[1]] else 1


def read_actions(lm: HookableModel, states: KVState | Sequence[KVState], suffix: Sequence[int],
                 tokens: Sequence[int], batch_size: int = 16) -> ActionReads:
    """The two-action read of ``suffix`` (e.g. the answer prefix) over each cache (caches of equal length and
    positions go through the model as one batch)."""
    if len(tokens) != 2 or tokens[0] == tokens[1]:
        raise KVProbeError(f"a two-action read needs two distinct action tokens; got {list(tokens)}")
    return ActionReads(read_logits(lm, states, list(suffix), batch_size=batch_size),
                       (int(tokens[0]), int(tokens[1])))


def next_logits(lm: HookableModel, states: KVState | Sequence[KVState], suffix: Sequence[int],
                batch_size: int = 16) -> torch.Tensor:
    """Next-token logits ``[n_states, vocab]`` after ``suffix`` over each cache: the read of a free-form answer's
    first token (its argmax, its full-vocabulary cosine), where no two actions are named."""
    return read_logits(lm, states, list(suffix), batch_size=batch_size)


def read_named(lm: HookableModel, states: Mapping[str, KVState], suffix: Sequence[int], tokens: Sequence[int],
               batch_size: int = 16) -> dict[str, ActionReads]:
    """Each named cache's two-action read (a one-row :class:`ActionReads`); caches of one length and one start
    position go through the model as one batch (caches that differ there, e.g. a memory left out or a context
    moved up, in batches of their own)."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for name, st in states.items():
        groups.setdefault((st.length, int(st.positions[0]), st.next_position), []).append(name)
    out: dict[str, ActionReads] = {}
    for names in groups.values():
        r = read_actions(lm, [states[n] for n in names], suffix, tokens, batch_size)
        out.update({n: ActionReads(r.logits[i:i + 1], r.tokens) for i, n in enumerate(names)})
    return {n: out[n] for n in states}


def decide(lm: HookableModel, state: KVState, suffix: Sequence[int], tokens: Sequence[int],
           actions: tuple[str, str], mode: Mode = "direct", chain: ChainSpec | None = None) -> DecisionRead:
    """One decision over ``state``: ``direct``, the sign of the two-action ``ld`` after ``suffix`` (the answer
    prefix); ``chain``, the chain's cue (after ``chain.lead``) run over the cache, a bounded greedy chain, and
    the last action it names, else the forced read after ``chain.answer_cue`` (``ld`` is that forced read's)."""
    if mode == "direct":
        r = read_actions(lm, state, suffix, tokens)
        return DecisionRead(r.choice(), r.ld(), "direct")
    if mode != "chain":
        raise KVProbeError(f"decision mode must be one of {list(MODES)}; got {mode!r}")
    if chain is None:
        raise KVProbeError("mode 'chain' needs a ChainSpec (cue, answer cue, token budget)")
    out = chain_decision(lm, state, list(chain.lead) + list(chain.cue), chain.answer_cue, chain.max_tokens,
                         actions, (int(tokens[0]), int(tokens[1])))
    return DecisionRead(actions.index(out["decision"]), out["forced_ld"], out["decided_by"], out["n_tokens"],
                        out["text"])


def _continuations(lm: HookableModel, state: KVState, prefix: Sequence[int],
                   continuations: Sequence[Sequence[int]]) -> list[float]:
    """Teacher-forced log-probability (summed over tokens) of each continuation after ``prefix`` over ``state``;
    the prefix is run once."""
    if not prefix:
        raise KVProbeError("an answer is scored after a non-empty prefix (at least the token before it)")
    after, logits = prefill(lm, list(prefix), prior=state, return_logits=True)
    first = torch.log_softmax(logits[0].float(), -1)
    scores = []
    for cand in continuations:
        if not cand:
            raise KVProbeError("an answer to score needs at least one token")
        total, st, lp = 0.0, after, first
        for i, t in enumerate(cand):
            total += float(lp[int(t)])
            if i < len(cand) - 1:
                st, lg = prefill(lm, [int(t)], prior=st, return_logits=True)
                lp = torch.log_softmax(lg[0].float(), -1)
        scores.append(total)
    return scores


def answer_logprob(lm: HookableModel, state: KVState, prefix: Sequence[int], answer: Sequence[int]) -> float:
    """The teacher-forced log-probability (nats, summed over its tokens) of ``answer`` after ``prefix`` over
    ``state``: a graded read of a free-form answer (e.g. LoCoMo's gold answer) that needs no generation."""
    return _continuations(lm, state, prefix, [answer])[0]


def candidate_ld(lm: HookableModel, state: KVState, prefix: Sequence[int],
                 candidates: tuple[Sequence[int], Sequence[int]]) -> float:
    """Teacher-forced log-probability of candidate 0 minus candidate 1 after ``prefix`` over ``state``; for two
    single-token candidates, the logit difference of the two tokens."""
    if len(candidates[0]) == 1 and len(candidates[1]) == 1:
        return read_actions(lm, state, prefix, (candidates[0][0], candidates[1][0])).ld()
    a, b = _continuations(lm, state, prefix, candidates)
    return a - b


def answer_prefix_len(tokenizer: object, ids: Sequence[int], text: str, special: bool) -> int:
    """How many trailing tokens of ``ids`` (a prompt ending in its answer prefix) come after the tokens of
    ``text`` (the same prompt rendered without the answer prefix): the suffix a decision runs over a cache
    that ends before it."""
    head = tokenizer(text, add_special_tokens=special)["input_ids"]  # type: ignore[operator]
    shared = next((i for i, (x, y) in enumerate(zip(ids, head)) if x != y), min(len(ids), len(head)))
    return len(ids) - shared


def read_decision(lm: HookableModel, state: KVState, tc: TwoChoice, mode: Mode,
                  chain: ChainSpec | None = None) -> DecisionRead:
    """The decision of ``tc`` over ``state`` (a cache of ``tc.context``) in ``mode``."""
    if len(tc.candidates[0]) == 1 and len(tc.candidates[1]) == 1:
        return decide(lm, state, tc.answer_prefix, (tc.candidates[0][0], tc.candidates[1][0]), tc.actions, mode,
                      chain)
    if mode == "direct":
        ld = candidate_ld(lm, state, tc.answer_prefix, tc.candidates)
        return DecisionRead(0 if ld > 0 else 1, ld, "direct")
    if mode != "chain":
        raise KVProbeError(f"decision mode must be one of {list(MODES)}; got {mode!r}")
    if chain is None:
        raise KVProbeError("mode 'chain' needs a ChainSpec (cue, answer cue, token budget)")
    cue = list(chain.lead) + list(chain.cue)
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
