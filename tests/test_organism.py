"""Organism training end to end on a tiny random model (a few steps), reload, and the disjointness check."""

import json

import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.models.registry import ModelEntry
from kvprobe.models.loading import load_organism
from kvprobe.organism.train import Recipe, check_disjoint, counterfactual_rule, split_scenarios, train_organism


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


def test_counterfactual_rule_exchanges_the_values_of_every_template_rule(template):
    for sc in template.scenarios:
        cf = counterfactual_rule(sc)
        assert (cf.allow_value, cf.block_value, cf.allow_action) == (sc.block_value, sc.allow_value, sc.allow_action)
        # the first value the rule names is now the other one; swapping twice gives the rule back
        first = min((sc.rule.index(v), v) for v in (sc.allow_value, sc.block_value))[1]
        other = sc.block_value if first == sc.allow_value else sc.allow_value
        assert cf.rule.index(other) == sc.rule.index(first)
        assert counterfactual_rule(cf).rule == sc.rule
    broken = template.scenarios[0].model_copy(update={"rule": "No values named here."})
    with pytest.raises(KVProbeError, match="must name both values"):
        counterfactual_rule(broken)


def test_init_from_starts_where_the_named_organism_ends(tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    import kvprobe.models.organisms as registry

    monkeypatch.setattr(registry, "ORGANISMS_DIR", tmp_path / "organisms")
    kw = dict(base_model=str(tiny_text_dir), pairs_per_step=1, eval_instances=2, lr=5e-3)
    first = train_organism(Recipe(alias="tiny-a", steps=2, **kw), tmp_path / "organisms" / "tiny-a", progress=False)
    # zero further steps: the second organism is the first one, so its held-out evaluation is identical
    second = train_organism(Recipe(alias="tiny-b", steps=0, init_from="tiny-a", **kw), tmp_path / "b", progress=False)
    assert second.card["heldout_eval"]["after"] == first.card["heldout_eval"]["after"]
    assert second.card["heldout_eval"]["after"] != second.card["heldout_eval"]["before"]
    assert second.card["init_adapter_sha256"]
    with pytest.raises(KVProbeError, match="differs from this recipe"):
        train_organism(Recipe(alias="tiny-c", steps=0, init_from="tiny-a", lora_r=4, **kw), tmp_path / "c",
                       progress=False)
    trained_on = first.card["train_families"][0]
    with pytest.raises(KVProbeError, match="holds out"):  # held out now, but seen by the first stage
        train_organism(Recipe(alias="tiny-e", steps=0, init_from="tiny-a", eval_families=(trained_on,),
                              train_scenarios=None, **kw),
                       tmp_path / "e", progress=False)
    with pytest.raises(KVProbeError, match="no organism adapter"):
        train_organism(Recipe(alias="tiny-d", steps=0, init_from="nope", **kw), tmp_path / "d", progress=False)
