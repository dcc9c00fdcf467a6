"""LoCoMo (Maharana et al., 2024, "Evaluating Very Long-Term Conversational Memory of LLM Agents", ACL 2024;
snap-research/locomo): ten very long multi-session conversations between two speakers, with QA annotations.

The dataset is read at run time from its release archive (``locomo10.zip``: one JSON file per conversation,
``data/multimodal_dialog/locomo10_v2/<id>.json``), never copied into the package. This module parses it into
typed objects, renders sessions and questions the way LoCoMo's own QA evaluation prompts do (a dated
transcript per session, ``<speaker> said, "<text>"`` with `` and shared <caption>.`` for shared photos), and
scores answers with LoCoMo's token F1.

Categories, as the released annotations number them: 1 multi-hop, 2 temporal, 3 open-domain (commonsense),
4 single-hop, 5 adversarial. The adversarial questions have no gold answer (only ``adversarial_answer``, the
trap an unfaithful model would give), so they are not answerable QA: 1,986 questions, 1,540 answerable.

Where our scoring differs from LoCoMo's evaluation script: no Porter stemming (it needs nltk, which kvprobe
does not depend on); the rest is LoCoMo's rule: lower-case, commas, punctuation and the words a/an/the/and
removed, whitespace collapsed; multi-hop gold answers are split at commas (mean over gold parts of the best
match over predicted parts); open-domain gold answers keep the part before the first ';'.
"""

from __future__ import annotations

import json
import re
import string
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvprobe.errors import KVProbeError

CATEGORIES = {1: "multi_hop", 2: "temporal", 3: "open_domain", 4: "single_hop", 5: "adversarial"}
ANSWERABLE = (1, 2, 3, 4)  # category 5 carries no gold answer
SYSTEM = ("Below is a conversation between two people: {a} and {b}. The conversation takes place over multiple "
          "days and the date of each conversation is written at the beginning of the conversation.\n\n")
QUESTION = ("Based on the above context, write an answer in the form of a short phrase for the following question. "
            "Answer with exact words from the context whenever possible.\n\nQuestion: {q} Short answer:")
TEMPORAL_HINT = " Use DATE of CONVERSATION to answer with an approximate date."  # LoCoMo's own, category 2
_MEMBER = re.compile(r"(?:^|/)(\w+)\.json$")
_EVIDENCE = re.compile(r"D\s*:?\s*(\d+)\s*:")


@dataclass(frozen=True)
class Turn:
    speaker: str
    dia_id: str
    text: str
    caption: str | None = None  # the BLIP caption of a shared photo

    def render(self) -> str:
        shared = f" and shared {self.caption}." if self.caption else ""
        return f'{self.speaker} said, "{self.text}"{shared}\n'


@dataclass(frozen=True)
class Session:
    number: int
    date_time: str
    turns: tuple[Turn, ...]

    def render(self) -> str:
        """The session as one memory block: its date header, its turns, a blank line after."""
        return f"DATE: {self.date_time}\nCONVERSATION:\n" + "".join(t.render() for t in self.turns) + "\n"


@dataclass(frozen=True)
class QA:
    question: str
    answer: str | None  # None for the adversarial category
    category: int
    evidence: tuple[str, ...]  # dialogue ids, "D<session>:<turn>"

    @property
    def category_name(self) -> str:
        return CATEGORIES.get(self.category, f"category_{self.category}")

    @property
    def answerable(self) -> bool:
        return self.category in ANSWERABLE and self.answer is not None

    @property
    def evidence_sessions(self) -> tuple[int, ...]:
        return tuple(sorted({int(m.group(1)) for e in self.evidence if (m := _EVIDENCE.match(e.strip()))}))

    def render(self) -> str:
        return QUESTION.format(q=self.question + (TEMPORAL_HINT if self.category == 2 else ""))


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    speaker_a: str
    speaker_b: str
    sessions: tuple[Session, ...]  # in session order; sessions without turns are dropped
    qa: tuple[QA, ...]

    def session(self, number: int) -> Session:
        return next(s for s in self.sessions if s.number == number)

    def system(self) -> str:
        return SYSTEM.format(a=self.speaker_a, b=self.speaker_b)


def _conversation(sample_id: str, raw: dict[str, object]) -> Conversation:
    sessions = []
    for key, turns in raw.items():
        m = re.fullmatch(r"session_(\d+)", key)
        if m and isinstance(turns, list) and turns:
            n = int(m.group(1))
            sessions.append(Session(n, str(raw.get(f"session_{n}_date_time", "")), tuple(
                Turn(str(t["speaker"]), str(t["dia_id"]), str(t["text"]), t.get("blip_caption") or None)
                for t in turns)))
    qa = tuple(QA(str(q["question"]), None if q.get("category") == 5 or "answer" not in q else str(q["answer"]),
                  int(q["category"]), tuple(str(e) for e in q.get("evidence", [])))
               for q in raw.get("qa", []))  # type: ignore[union-attr]
    return Conversation(sample_id, str(raw["speaker_a"]), str(raw["speaker_b"]),
                        tuple(sorted(sessions, key=lambda s: s.number)), qa)


def load_locomo(path: str | Path, key: str = "params.data") -> list[Conversation]:
    """The conversations of ``locomo10.zip`` (or of an unpacked folder of its JSON files), by sample id.
    ``key`` names the config key that gave ``path``, for the error when the file is missing."""
    p = Path(path)
    if not p.exists():
        raise KVProbeError(f"config key '{key}': no LoCoMo data at {p}. Put the release archive locomo10.zip "
                           "(snap-research/locomo, data/locomo10.zip) there, or set that key to its path")
    raws: dict[str, dict[str, object]] = {}
    if p.is_dir():
        for f in sorted(p.rglob("*.json")):
            raws[f.stem] = json.loads(f.read_text())
    else:
        with zipfile.ZipFile(p) as z:
            for name in sorted(z.namelist()):
                m = _MEMBER.search(name)
                if m and not name.startswith("__MACOSX"):
                    raws[m.group(1)] = json.loads(z.read(name))
    convs = [_conversation(sid, raw) for sid, raw in sorted(raws.items()) if "qa" in raw]
    if not convs:
        raise KVProbeError(f"config key '{key}': {p} holds no LoCoMo conversation (JSON files with 'qa')")
    return convs


# -- LoCoMo's token F1 --------------------------------------------------------------------------------------

def normalize_answer(text: str) -> str:
    text = text.replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def locomo_f1(prediction: str, gold: str, category: int) -> float:
    """LoCoMo's per-category F1: multi-hop averages over comma-separated gold parts (best predicted part each);
    open-domain scores against the gold's first ';' alternative; the others are plain token F1."""
    if category == 3:
        gold = gold.split(";")[0].strip()
    if category == 1:
        preds = [p.strip() for p in prediction.split(",")]
        golds = [g.strip() for g in gold.split(",")]
        return sum(max(token_f1(p, g) for p in preds) for g in golds) / len(golds)
    return token_f1(prediction, gold)
