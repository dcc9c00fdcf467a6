"""locomo on a tiny model over a small archive in LoCoMo's release layout, the loader (evidence sessions, the
adversarial category unanswerable, a missing file named by its config key) and LoCoMo's token F1."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.runner.cli import main
from kvprobe.tasks.locomo import load_locomo, locomo_f1, normalize_answer, token_f1

WORDS = ["apple", "river", "guitar", "garden", "museum", "bicycle", "painting", "concert", "kitten", "library"]


def _conversation(c: int) -> dict:
    a, b = f"Ann{c}", f"Bob{c}"
    raw: dict = {"speaker_a": a, "speaker_b": b}
    for s in range(1, 5):
        w = WORDS[(c + s) % len(WORDS)]
        raw[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
        raw[f"session_{s}"] = [{"speaker": a, "dia_id": f"D{s}:1", "text": f"I saw a {w} today near the {WORDS[s]}."},
                               {"speaker": b, "dia_id": f"D{s}:2", "text": f"Nice, tell me more about the {w}!",
                                "blip_caption": f"a photo of a {w}"},
                               {"speaker": a, "dia_id": f"D{s}:3",
                                "text": f"It was red and my {WORDS[s + 1]} liked it."}]
    raw["session_5_date_time"] = "2:00 pm on 9 May, 2023"  # a date without a session, as in the release
    raw["qa"] = [
        {"question": f"What did {a} see?", "answer": f"{WORDS[(c + 1) % 10]}, {WORDS[(c + 2) % 10]}",
         "evidence": ["D1:1", "D2:1"], "category": 1},
        {"question": f"When did {a} see the {WORDS[(c + 3) % 10]}?", "answer": "3 May 2023", "evidence": ["D3:1"],
         "category": 2},
        {"question": f"Would {a} like a {WORDS[(c + 4) % 10]}?", "answer": "yes; likely", "evidence": ["D4:3"],
         "category": 3},
        {"question": f"What colour was the {WORDS[(c + 1) % 10]}?", "answer": "red", "evidence": ["D1:3"],
         "category": 4},
        {"question": f"What did {b} see?", "adversarial_answer": "a kitten", "evidence": ["D2:1"], "category": 5},
    ]
    return raw


def _archive(path: Path, n: int = 5) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for c in range(n):
            z.writestr(f"data/multimodal_dialog/locomo10_v2/{c + 10}.json", json.dumps(_conversation(c)))
    return path


@pytest.fixture(scope="module")
def tiny_locomo(tmp_path_factory):
    """A tiny Llama whose word-level tokenizer covers the rendered archive, and the archive."""
    from kvprobe.models.tiny import write_tiny_model_dir

    root = tmp_path_factory.mktemp("tinylocomo")
    zpath = _archive(root / "locomo10.zip")
    texts = []
    for conv in load_locomo(zpath):
        texts.append(conv.system() + "".join(s.render() for s in conv.sessions))
        texts += [q.render() for q in conv.qa]
    return write_tiny_model_dir("llama-default", root / "model", texts), zpath


def test_loader_and_f1(tmp_path):
    convs = load_locomo(_archive(tmp_path / "x.zip", 2))
    assert [c.sample_id for c in convs] == ["10", "11"] and len(convs[0].sessions) == 4  # the dateless one dropped
    qa = convs[0].qa
    assert [q.answerable for q in qa] == [True, True, True, True, False]
    assert qa[0].evidence_sessions == (1, 2) and qa[4].category_name == "adversarial"
    assert "and shared a photo of a" in convs[0].session(1).render()
    assert "Use DATE of CONVERSATION" in qa[1].render() and "Use DATE" not in qa[3].render()
    with pytest.raises(KVProbeError, match="params.data"):
        load_locomo(tmp_path / "missing.zip")
    assert normalize_answer("The cat, and a Dog!") == "cat dog"
    assert token_f1("red apple", "a red apple") == 1.0 and token_f1("blue", "red") == 0.0
    assert token_f1("red car", "red") == pytest.approx(2 / 3)
    assert locomo_f1("apple", "apple, river", 1) == pytest.approx(0.5)  # mean over the gold parts
    assert locomo_f1("yes", "yes; likely", 3) == 1.0  # the first ';' alternative


def test_real_archive_counts():
    path = Path(__file__).resolve().parents[1] / "../shared/data/locomo/locomo10.zip"
    if not path.exists():
        pytest.skip("the shared LoCoMo archive is not beside this checkout")
    convs = load_locomo(path)
    qa = [q for c in convs for q in c.qa]
    assert len(convs) == 10 and len(qa) == 1986 and sum(q.answerable for q in qa) == 1540
    assert all(q.evidence_sessions for q in qa if q.category in (1, 2, 4))


def test_locomo_end_to_end(tiny_locomo, tmp_path):
    from kvprobe.figures.locomo import fig11_locomo

    model_dir, zpath = tiny_locomo
    assert main(["run", "configs/locomo.yaml", "--model", str(model_dir), "--output-dir", str(tmp_path), "--set",
                 "task.n_instances=8", "--set", f"params.data={zpath}", "--set", "params.memory_tokens=120",
                 "--set", "params.max_answer_tokens=3", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("locomo/*/*.json")).read_text())
    rows = rec["rows"]
    assert sorted(r["category"] for r in rows) == [1, 1, 2, 2, 3, 3, 4, 4]  # stratified, adversarial skipped
    assert len({r["scenario"] for r in rows}) >= 4  # round-robin over the conversations
    for r in rows:
        assert set(r["evidence_sessions"]) <= set(r["memory_sessions"]) and r["memory_tokens"] <= 120
        if len(r["evidence_sessions"]) == 1:  # a distractor fits beside one evidence session
            assert len(r["memory_sessions"]) > 1
        assert all(-1.0001 <= r[k] <= 1.0001 for k in ("cosine", "no_rotation_cosine"))
        assert 0.0 <= r["full"]["f1"] <= 1.0 and "seconds" in r
    s = rec["summary"]
    assert s["n_instances"] == 8 and set(s["by_category"]) == {"multi_hop", "temporal", "open_domain", "single_hop"}
    assert s["coverage"]["single_hop"]["answerable"] == 5 and s["tost_f1"]["unit"] == "conversation means"
    fig11_locomo([rec], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000

