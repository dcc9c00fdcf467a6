"""ROME, LoRA and the weight_edit experiment on a tiny model; ROME's canonical factual edit on smollm2 (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from kvprobe.edits import lora, rome
from kvprobe.edits.weights import weights_checksum
from tests.conftest import as_lm
from kvprobe.models.tiny import tiny_model


@pytest.fixture()
def lm():
    return as_lm(tiny_model("llama-default"))


def test_rank_one_update_maps_the_key_to_the_value_and_rolls_back_exactly(lm):
    layer = 1
    cov = rome.key_covariance(lm, layer, [list(range(5, 60)), list(range(100, 180))])
    prompt = rome.SubjectPrompt(tuple(range(20, 32)), 5)
    k = rome.subject_key(lm, layer, [prompt])
    v = torch.randn(lm.model.config.hidden_size)
    before = weights_checksum(lm)
    e = rome.apply(lm, rome.rank_one_update(lm, layer, k, v, cov))
    w = rome.down_proj(lm, layer).weight.detach()
    assert torch.allclose(w @ k, v, atol=1e-3)  # the closed form hits v* exactly at k*
    assert weights_checksum(lm) != before
    e.rollback(lm)
    assert weights_checksum(lm) == before


def test_rome_and_lora_raise_the_target_on_a_tiny_model(lm):
    ids = list(range(30, 50))
    target, other = 7, 9

    def gap():
        with torch.no_grad():
            lo = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
        return float(lo[target] - lo[other])

    g0, before = gap(), weights_checksum(lm)
    cov = rome.key_covariance(lm, 1, [list(range(60, 200))])
    e = rome.rome_edit(lm, 1, [rome.SubjectPrompt(tuple(ids), 10)], [target], cov, steps=15, lr=0.5)
    assert gap() > g0 + 0.05  # the edited weights favour the target after the prompt
    e.rollback(lm)
    le = lora.lora_edit(lm, [ids], target, other, lr=1e-2, max_steps=30, margin=0.5)
    assert le.detail["flipped"] and gap() >= 0.5
    le.rollback()
    assert weights_checksum(lm) == before and abs(gap() - g0) < 1e-5


def test_weight_edit_experiment_end_to_end(tiny_text_dir, tmp_path):
    from kvprobe.runner.cli import main

    args = ["run", "configs/weight_edit.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
            "--set", "task.n_instances=2", "--set", "params.format=null", "--set", "params.n_heldout=2",
            "--set", "params.n_collateral=2", "--set", "params.rome_steps=2", "--set", "params.lora_max_steps=2",
            "--set", "inclusion.min_flip=0", "--set", "inclusion.require_oracle_correct=false", "--quiet"]
    main(args)
    rec = json.loads(next(tmp_path.rglob("*.json")).read_text())
    m = rec["summary"]["methods"]
    assert set(m) == {"in_place", "erratum", "field_erratum", "rome", "lora"}
    for name in ("in_place", "erratum", "field_erratum"):
        assert m[name]["weights_unchanged"] and m[name]["identity"] and m[name]["contamination"]["mean"] == 0
    for name in ("rome", "lora"):
        assert m[name]["rollback_exact"] and not m[name]["weights_unchanged"]
        assert 0 <= m[name]["contamination"]["mean"] <= 1 and 0 <= m[name]["collateral"]["mean"] <= 1
    from kvprobe.figures import FIGURES

    FIGURES["table1_weight_edit"][1]([rec], tmp_path / "t1.png")
    assert (tmp_path / "t1.png").stat().st_size > 0


@pytest.mark.slow
def test_rome_moves_the_eiffel_tower_to_rome_with_locality_intact(smollm):
    """The canonical factual edit (paper App. I) on pretrained smollm2-135m: Paris -> Rome, paraphrase moved,
    unrelated landmarks unchanged. Can fail: a wrong key, covariance or update leaves Paris or breaks Berlin."""
    from pathlib import Path

    tok = smollm.tokenizer

    def top(text):
        with torch.no_grad():
            lo = smollm.model(input_ids=tok(text, return_tensors="pt")["input_ids"]).logits[0, -1]
        return tok.decode(int(lo.argmax()))

    prompt = "The Eiffel Tower is located in the city of"
    others = {"The Colosseum is located in the city of": " Rome", "The capital of Germany is": " Berlin",
              "The Brandenburg Gate is located in the city of": " Berlin"}
    assert top(prompt) == " Paris" and all(top(p) == a for p, a in others.items())
    text = (Path(__file__).resolve().parents[1] / "kvprobe/organism/data/neutral.txt").read_text()
    cov = rome.key_covariance(smollm, 8, [tok(text)["input_ids"]])
    e = rome.rome_edit(smollm, 8, [rome.subject_prompt(tok, prompt, "Eiffel Tower")],
                       tok(" Rome", add_special_tokens=False)["input_ids"], cov,
                       [rome.subject_prompt(tok, "The Eiffel Tower is a", "Eiffel Tower")])
    try:
        assert top(prompt) == " Rome"
        assert top("The Eiffel Tower, in the city of") == " Rome"  # generalises to a paraphrase
        assert all(top(p) == a for p, a in others.items())  # locality
    finally:
        e.rollback(smollm)
    assert top(prompt) == " Paris"
