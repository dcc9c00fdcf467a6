"""Organism training end to end on a tiny random model (a few steps), reload, and the disjointness check."""

import json

import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.models.registry import ModelEntry
from kvprobe.organism.adapter import load_organism
from kvprobe.organism.train import Recipe, check_disjoint, split_scenarios, train_organism


def test_train_save_reload_identical_logits(tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    recipe = Recipe(base_model=str(tiny_text_dir), alias="tiny-gated", steps=3, pairs_per_step=1, eval_instances=2,
                    checkpoint_every=2, lr=5e-3)
    result = train_organism(recipe, tmp_path / "org", progress=False)
    card = json.loads((tmp_path / "org" / "card.json").read_text())
    assert (tmp_path / "org" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "org" / "README.md").exists()  # no boilerplate card with machine paths
    adapter_cfg = json.loads((tmp_path / "org" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(tiny_text_dir)
    assert set(card["train_families"]).isdisjoint(card["eval_families"])
    assert len(card["loss_curve"]) == 3 and card["data_hashes"]["train"] and card["data_hashes"]["eval"]
    assert {"before", "after"} <= set(card["neutral_perplexity"]) and "accuracy" in card["heldout_eval"]["after"]

    entry = ModelEntry("tiny-gated", "organism", "llama", str(tiny_text_dir), gguf_file=str(tmp_path / "org"))
    merged = load_organism(entry)
    ids = torch.arange(3, 40)[None]
    from peft import PeftModel

    from kvprobe.models.loading import load_model

    adapter_on = PeftModel.from_pretrained(load_model(str(tiny_text_dir)).model, str(tmp_path / "org")).eval()
    with torch.no_grad():
        a, b = merged.model(ids).logits, adapter_on(ids).logits
        base = load_model(str(tiny_text_dir)).model(ids).logits
    assert (a - b).abs().max() < 1e-4
    assert (a - base).abs().max() > 1e-4  # the adapter really changed the model
    assert result.card["alias"] == "tiny-gated"


def test_resume_reproduces_an_uninterrupted_run(tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    kw = dict(base_model=str(tiny_text_dir), alias="tiny-r", pairs_per_step=1, eval_instances=1, checkpoint_every=1,
              lr=5e-3)
    full = train_organism(Recipe(steps=3, **kw), tmp_path / "a", resume=False, progress=False).card["loss_curve"]
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache2"))
    import kvprobe.organism.train as train_mod

    real_loss, calls = train_mod._batch_loss, {"n": 0}

    def interrupted(model, pairs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the run dies during step 3, after step 2's checkpoint
        return real_loss(model, pairs)

    monkeypatch.setattr(train_mod, "_batch_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_organism(Recipe(steps=3, **kw), tmp_path / "b", resume=False, progress=False)
    monkeypatch.setattr(train_mod, "_batch_loss", real_loss)
    resumed = train_organism(Recipe(steps=3, **kw), tmp_path / "b", resume=True, progress=False).card["loss_curve"]
    assert resumed == full


def test_disjointness_check_fails_loudly(template):
    train, held = split_scenarios(template, ("accounts", "payments"))
    assert {"account_role", "payment_check"} == set(held) and not set(train) & set(held)
    with pytest.raises(KVProbeError, match="share families"):
        check_disjoint(template, train + ["account_role"], held)
    with pytest.raises(KVProbeError, match="not families"):
        split_scenarios(template, ("no-such-family",))
