"""A decision read after a bounded greedy reasoning chain (paper Section 4 Fig. 2c, Section 7 E1/E3).

A cue is run over the cache, :func:`kvprobe.kv.decode.greedy_chain` generates up to a budget of tokens, and
the decision is the last action word the chain names; a chain that names neither falls back to the argmax
of the two action tokens after an answer cue appended to it ("forced"). The forced read is kept either way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kvprobe.backends import HookableModel, KVState
from kvprobe.kv.decode import greedy_chain
from kvprobe.kv.readout import read_logits


def last_action(text: str, actions: tuple[str, str]) -> str | None:
    """The action word the text names last (whole word, case-insensitive), or None."""
    hits = [(m.start(), a) for a in actions for m in re.finditer(rf"\b{re.escape(a)}\b", text, re.IGNORECASE)]
    return max(hits)[1] if hits else None


def chain_decision(lm: HookableModel, state: KVState, cue_ids: Sequence[int], answer_ids: Sequence[int],
                   max_tokens: int, actions: tuple[str, str], action_tokens: tuple[int, int]) -> dict[str, Any]:
    """The decision after a greedy chain over ``state``: ``decision`` (one of ``actions``), ``decided_by``
    ('chain' or 'forced'), ``forced_ld`` (logit of ``action_tokens[0]`` minus ``[1]`` after ``answer_ids``),
    the chain's ``text`` and ``n_tokens``."""
    tok = lm.tokenizer
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    after, chain = greedy_chain(lm, state, cue_ids, max_tokens, stops)
    text = tok.decode(chain, skip_special_tokens=True)
    logits = read_logits(lm, after, list(answer_ids))[0]
    forced_ld = float(logits[action_tokens[0]] - logits[action_tokens[1]])
    parsed = last_action(text, actions)
    return {"decision": parsed or (actions[0] if forced_ld > 0 else actions[1]), "parsed": parsed,
            "decided_by": "chain" if parsed else "forced", "forced_ld": forced_ld, "text": text,
            "n_tokens": len(chain)}
