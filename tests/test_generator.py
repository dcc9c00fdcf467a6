"""The procedural scenario generator (splits, determinism, distances, equal-length pairs) and the organism
v3 recipe that trains on it (tiny model: a few steps, resume, fp16 adapter)."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.tasks.generator import (FORMAT_SPLITS, FORMATS, SPLITS, Family, InfeasibleDistance, build_generated,
                                     check_splits, distance_tolerance, family_space, field_to_decision_tokens,
                                     generate, load_words, sample_family, split_list, tokenize_generated)

REAL_TOKENIZERS = ("smollm2-135m", "qwen2.5-coder-0.5b")


def _tokenizer(alias: str):
    from transformers import AutoTokenizer

    from kvprobe.models.loading import _dequantized_dir, weights_available
    from kvprobe.models.registry import REGISTRY

    if not weights_available(REGISTRY[alias]):
        pytest.skip(f"{alias} weights are not installed")
    return AutoTokenizer.from_pretrained(str(_dequantized_dir(REGISTRY[alias])))


@pytest.fixture(scope="module", params=REAL_TOKENIZERS)
def real_tokenizer(request):
    return _tokenizer(request.param)


def test_splits_are_disjoint_by_word_and_by_format():
    words = load_words()
    sizes = check_splits(words)
    assert all(sizes[s]["value_pairs"] >= 8 and sizes[s]["rules"] >= 2 for s in SPLITS)
    assert family_space("train") > 100_000 and family_space("test") > 1_000  # thousands of combinations
    assert not set(FORMAT_SPLITS["train"]) & set(FORMAT_SPLITS["test"]) and len(FORMAT_SPLITS["test"]) >= 2
    fams = {s: {sample_family(random.Random(i), s).name for i in range(300)} for s in SPLITS}
    assert not fams["train"] & fams["test"] and not fams["train"] & fams["validation"]
    train_words = {w for i in range(300) for w in sample_family(random.Random(i), "train").words()}
    for i in range(100):
        fam = sample_family(random.Random(i), "test")
        assert fam.subject not in split_list(words.subjects, "train")
        assert not set(fam.values) & train_words and not set(fam.actions) & train_words
    # a word moved into a second split is a leak, and check_splits names it
    leaky = dataclasses.replace(words, value_pairs=(words.value_pairs[0], *words.value_pairs[1:4],
                                                    (words.value_pairs[0][0], "zzz"), *words.value_pairs[5:]))
    with pytest.raises(KVProbeError, match="both the train and test splits"):
        check_splits(leaky)


def test_word_list_v2_adds_heldout_rule_phrasings_and_keeps_the_train_draws(tmp_path):
    from kvprobe.tasks.generator import WORDS_FILE, split_words

    v1, v2 = load_words(), load_words(WORDS_FILE.with_name("scenario_words_v2.yaml"))
    sizes = check_splits(v2)
    assert sizes["train"] == check_splits(v1)["train"]
    assert sizes["validation"]["rules"] == sizes["test"]["rules"] == 6
    for i in range(200):  # the train split draws exactly as version 1; held-out splits reach the added rules
        assert sample_family(random.Random(i), "train", v2) == sample_family(random.Random(i), "train", v1)
    for split in ("validation", "test"):
        added = set(split_words(v2, "rules", split)) - set(split_words(v1, "rules", split))
        assert len(added) == 4 and added == set(dict(v2.heldout_rules)[split])
        assert added & {sample_family(random.Random(i), split, v2).rule for i in range(200)}
        # each held-out split now holds negated and plain phrasings alike
        negated = [r for r in split_words(v2, "rules", split)
                   if re.search(r"\b(not|never|unless|only|forbid\w*)\b", r, re.I)]
        assert len(negated) == 3
    vocabulary = {w.lower() for e in (*v2.value_pairs, *v2.action_pairs) for w in e}
    for rule in (r for _, rules in v2.heldout_rules for r in rules):
        assert set(re.findall(r"\{(\w+)\}", rule)) == {"field", "a", "b", "x", "y"}
        assert not set(re.findall(r"[a-z]+", re.sub(r"\{\w+\}", "", rule).lower())) & vocabulary
    bad = tmp_path / "w.yaml"
    bad.write_text(WORDS_FILE.read_text() + "heldout_rules:\n  train: ['{field} {a} {b} {x} {y}']\n")
    with pytest.raises(KVProbeError, match="heldout_rules maps 'validation' and/or 'test'"):
        load_words(bad)


def test_word_list_v3_adds_negated_train_phrasings_and_keeps_the_heldout_draws(tmp_path):
    from organisms.tooling.validation import block_key, draw_key
    from kvprobe.tasks.generator import WORDS_FILE, split_words

    v2, v3 = (load_words(WORDS_FILE.with_name(f"scenario_words_v{n}.yaml")) for n in (2, 3))
    sizes = check_splits(v3)  # the added phrasings are disjoint from every held-out one
    assert {s: sizes[s] for s in ("validation", "test")} == {s: check_splits(v2)[s] for s in ("validation", "test")}
    assert sizes["train"]["rules"] == 6 + len(v3.train_rules) and len(v3.train_rules) == 7
    for split in ("validation", "test"):  # held-out draws are version 2's, draw for draw
        for i in range(200):
            assert sample_family(random.Random(i), split, v3) == sample_family(random.Random(i), split, v2)
    assert set(v3.train_rules) & {sample_family(random.Random(i), "train", v3).rule for i in range(200)}
    for rule in v3.train_rules:  # negated, naming all five slots, and built on none of the held-out negations
        assert set(re.findall(r"\{(\w+)\}", rule)) == {"field", "a", "b", "x", "y"}
        assert re.search(r"\b(not|cannot|rules out|prohibited|refrain|exception)\b", rule, re.I)
        assert not re.search(r"\b(only|unless|otherwise|never|do not|forbidden|permitted)\b", rule, re.I)
    assert split_words(v3, "rules", "validation") == split_words(v2, "rules", "validation")
    bad = tmp_path / "w.yaml"
    bad.write_text(WORDS_FILE.read_text() + "train_rules: {train: x}\n")
    with pytest.raises(KVProbeError, match="train_rules is a list"):
        load_words(bad)
    # larger draws are keyed by the list actually drawn from: the recipe's own, or --words
    v1_path, v3_path = "kvprobe/tasks/data/scenario_words.yaml", "kvprobe/tasks/data/scenario_words_v3.yaml"
    assert block_key("test") == block_key("test", v1_path) == "test_large"
    assert block_key("test", v3_path) == "test_large@scenario_words_v3"
    card = {"recipe": {"words": v3_path}}
    assert draw_key(card, "validation") == "validation_large@scenario_words_v3"
    assert draw_key(card, "validation", v1_path) == "validation_large"
    assert draw_key({"recipe": {"words": v1_path}}, "validation") == "validation_large"


def test_same_seed_same_instances_other_seed_others():
    a = generate(12, seed=3, split="train")
    b = generate(12, seed=3, split="train")
    c = generate(12, seed=4, split="train")
    key = lambda i: (i.system, i.before_field, i.after_field, i.old_value, i.new_value, i.old_action)  # noqa: E731
    assert [key(x) for x in a] == [key(x) for x in b]
    assert [key(x) for x in a] != [key(x) for x in c]
    assert {x.meta["format"] for x in a} == set(FORMAT_SPLITS["train"])
    assert len({x.family for x in a}) == 12  # a fresh family per instance


def test_instances_decide_by_the_rule_including_counterfactual_and_corrections():
    seen = set()
    for i in range(60):
        inst = build_generated(i, 0, "test", FORMATS[i % len(FORMATS)], counterfactual=0.5, correction=0.5)
        pos, neg = inst.meta["value_pair"]
        permit, block = inst.meta["action_pair"]
        cf = inst.meta["counterfactual"]
        expected = {pos: block if cf else permit, neg: permit if cf else block}
        assert (inst.old_action, inst.new_action) == (expected[inst.old_value], expected[inst.new_value])
        assert inst.old_value != inst.new_value and inst.old_action != inst.new_action
        if inst.meta["correction"]:  # the varied value is the later correction; the record keeps the early one
            assert f"{inst.field}: {inst.meta['early_value']}" in inst.before_field
            assert inst.before_field.rstrip().endswith("has changed to")
        seen.add((cf, inst.meta["correction"]))
    assert seen == {(False, False), (False, True), (True, False), (True, True)}


def test_template_scenarios_as_families_keep_their_own_rules(template):
    from kvprobe.tasks.generator import template_family

    for sc in template.scenarios:
        fam = template_family(sc)
        assert fam.field == sc.field and fam.values == (sc.allow_value, sc.block_value)
        inst = build_generated(0, 0, "test", "system_user", family=fam, counterfactual=0.0)
        assert sc.rule in inst.before_field
        assert {inst.old_action, inst.new_action} == {sc.allow_action, sc.block_action}
    with pytest.raises(KVProbeError, match="counterfactual=0"):
        build_generated(1, 0, "test", "user_turn", family=template_family(template.scenarios[0]), counterfactual=1.0)


@pytest.mark.slow
def test_distance_is_measured_and_within_tolerance(real_tokenizer):
    for fmt in FORMATS:
        for target in (50, 300, 1200):
            try:
                inst = build_generated(7, 0, "test", fmt, tokenizer=real_tokenizer, chat=True, distance=target)
            except InfeasibleDistance:
                assert (fmt, target) in {("document_qa", 50), ("gated_template", 50), ("gated_template", 300)}
                continue
            pair = tokenize_generated(real_tokenizer, inst, chat=True)
            assert inst.meta["distance_tokens"] == field_to_decision_tokens(pair)
            assert abs(inst.meta["distance_tokens"] - target) <= distance_tolerance(target), (fmt, target)
    with pytest.raises(InfeasibleDistance):
        build_generated(0, 0, "test", "gated_template", tokenizer=real_tokenizer, chat=True, distance=100)


@pytest.mark.slow
def test_every_value_and_action_pair_tokenizes_to_equal_length_pairs(real_tokenizer):
    """Both values of every pair take the same tokens in every format (the pair machinery's check), and
    every action pair's first tokens differ."""
    words = load_words()
    base = sample_family(random.Random(0), "train")
    for split in SPLITS:
        for k, vp in enumerate(split_list(words.value_pairs, split)):
            for fmt in FORMATS:
                fam = dataclasses.replace(base, values=tuple(vp), actions=("proceed", "halt"))
                inst = build_generated(k, 1, split, fmt, family=fam, correction=float(k % 2))
                pair = tokenize_generated(real_tokenizer, inst, chat=True)
                assert len(pair.ids_old) == len(pair.ids_new) and pair.field_slots
        for ap in split_list(words.action_pairs, split):
            fam = dataclasses.replace(base, values=("low", "high"), actions=tuple(ap))
            tokenize_generated(real_tokenizer, build_generated(0, 1, split, "user_turn", family=fam), chat=True)


@pytest.mark.slow
def test_system_user_puts_the_policy_in_the_system_message(real_tokenizer):
    inst = build_generated(2, 0, "test", "system_user", tokenizer=real_tokenizer, chat=True)
    pair = tokenize_generated(real_tokenizer, inst, chat=True)
    text = real_tokenizer.decode(pair.ids_old)
    policy_at, field_at = text.index("Policy:"), text.index(f"{inst.field}: {inst.old_value}")
    assert "system" in text[:policy_at] and "user" in text[policy_at:field_at]
    assert text.rstrip().endswith("Decision:")
    # without a chat template the system text leads the body instead
    plain = build_generated(2, 0, "test", "system_user")
    assert plain.system == "" and plain.before_field.startswith("You are an operations assistant")
    with pytest.raises(KVProbeError, match="system message"):
        tokenize_generated(real_tokenizer, dataclasses.replace(plain, system="x"), chat=False)
    # a rule that quotes the field as the record writes it ("booking_flag: renewed leads to ..."): the
    # field slots are the user turn's value, not the first match in the system message
    fam = Family("booking", "flag", ("renewed", "cancelled"), ("continue", "halt"),
                 "{field}: {a} leads to {x}, {b} leads to {y}.", "validation")
    quoting = build_generated(0, 0, "validation", "system_user", family=fam, counterfactual=0.0, chat=True,
                              tokenizer=real_tokenizer)
    assert "booking_flag: renewed" in quoting.system and quoting.before_field == "booking_flag: "
    pair = tokenize_generated(real_tokenizer, quoting, chat=True)
    text = real_tokenizer.decode(pair.ids_old[:pair.field_slots[0]])
    assert text.rindex("booking_flag:") > text.index("user")
    assert real_tokenizer.decode(pair.ids_old[pair.field_slots[0]:pair.field_slots[-1] + 1]).strip() == quoting.old_value


# -- organism v3 on a tiny model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_generator_dir(tmp_path_factory):
    """A tiny Llama whose word-level tokenizer covers the generator's word lists and formats."""
    from kvprobe.models.tiny import write_tiny_model_dir
    from kvprobe.organism.train import NEUTRAL_OPENINGS, NEUTRAL_TEXT

    words = load_words()
    texts = [json.dumps(dataclasses.asdict(words)), NEUTRAL_TEXT.read_text(), *NEUTRAL_OPENINGS]
    for split in SPLITS:
        for fmt in FORMATS:
            for inst in generate(4, 0, split, [fmt], correction=0.5, reasoning=0.5):
                texts += [inst.body(inst.old_value), inst.chain(inst.old_value), inst.answer_prefix,
                          inst.old_action, inst.new_action, "Decision: Reasoning:"]
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("tinygen"), texts)


def _v3(tiny_dir, **kw):
    from kvprobe.organism.train import V3, Recipe

    base = {**V3, "base_model": str(tiny_dir), "alias": "tiny-v3", "steps": 3, "pairs_per_step": 1, "lr": 5e-3,
            "eval_instances": 2, "val_instances": 2, "kl_tokens": 6, "checkpoint_every": 1, "val_every": 2,
            "distance_range": (20, 80)}
    return Recipe(**{**base, **kw})


def test_v3_trains_on_generated_data_and_reports_per_format(tiny_generator_dir, tmp_path, monkeypatch):
    from peft import PeftModel

    from kvprobe.models.loading import load_model
    from kvprobe.models.registry import ModelEntry
    from kvprobe.organism.train import train_organism

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    card = train_organism(_v3(tiny_generator_dir, reasoning=0.5), tmp_path / "org", progress=False).card
    assert set(card["train_families"]).isdisjoint(card["eval_families"])
    after = card["heldout_eval"]["after"]
    # training scores validation cells only: test cells are scored by `kvprobe organism test` alone (logged)
    assert "validation_unseen_format" in after and not any(k.startswith("test") for k in after)
    assert set(after["validation_unseen_format"]["by_format"]) <= set(FORMAT_SPLITS["validation"])
    assert card["data"]["train_reasoning_pairs"] >= 1 and len(card["validation_curve"]) == 1
    assert card["neutral_perplexity"]["after"] > 0 and len(card["kl_curve"]) == 3
    weights = tmp_path / "org" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    assert all(t.dtype == torch.float16 for t in load_file(str(weights)).values())
    # the fp16 adapter loads onto the fp32 base and merges to the same logits as the adapter on
    from kvprobe.models.loading import load_organism

    merged = load_organism(ModelEntry("tiny-v3", "organism", "llama", str(tiny_generator_dir),
                                      gguf_file=str(tmp_path / "org")))
    on = PeftModel.from_pretrained(load_model(str(tiny_generator_dir)).model, str(tmp_path / "org")).eval()
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        assert (merged.model(ids).logits - on(ids).logits).abs().max() < 1e-4


def test_v3_resume_reproduces_an_uninterrupted_run(tiny_generator_dir, tmp_path, monkeypatch):
    import kvprobe.organism.train as train_mod

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "c1"))
    full = train_mod.train_organism(_v3(tiny_generator_dir), tmp_path / "a", resume=False, progress=False).card
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "c2"))
    real, calls = train_mod._example_loss, {"n": 0}

    def interrupted(model, examples, recipe):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # dies during step 3, after step 2's checkpoint
        return real(model, examples, recipe)

    monkeypatch.setattr(train_mod, "_example_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_organism(_v3(tiny_generator_dir), tmp_path / "b", resume=False, progress=False)
    monkeypatch.setattr(train_mod, "_example_loss", real)
    resumed = train_mod.train_organism(_v3(tiny_generator_dir), tmp_path / "b", resume=True, progress=False).card
    assert resumed["loss_curve"] == full["loss_curve"] and resumed["kl_curve"] == full["kl_curve"]
    assert resumed["heldout_eval"]["after"] == full["heldout_eval"]["after"]


def test_base_reference_is_computed_once_per_base_and_pairs_and_changes_no_number(tiny_generator_dir, tmp_path,
                                                                                   monkeypatch):
    """A second seed on the same held-out pairs reads the base model's scores from the cache (the card is the
    one an uncached run writes); other pairs are scored afresh."""
    import kvprobe.organism.train as train_mod

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "fresh"))
    uncached = train_mod.train_organism(_v3(tiny_generator_dir, seed=1), tmp_path / "u", progress=False).card
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "shared"))
    train_mod.train_organism(_v3(tiny_generator_dir), tmp_path / "a", progress=False)
    base_calls = {"n": 0}
    real = train_mod.neutral_perplexity

    def counted(model, tokenizer):
        base_calls["n"] += 1
        return real(model, tokenizer)

    monkeypatch.setattr(train_mod, "neutral_perplexity", counted)
    cached = train_mod.train_organism(_v3(tiny_generator_dir, seed=1), tmp_path / "b", progress=False).card
    assert base_calls["n"] == 1  # the trained model's perplexity only: the base's came from the cache
    assert cached["heldout_eval"] == uncached["heldout_eval"]
    assert cached["neutral_perplexity"] == uncached["neutral_perplexity"]
    train_mod.train_organism(_v3(tiny_generator_dir, val_instances=3), tmp_path / "c", progress=False)
    assert base_calls["n"] == 3  # other (validation) pairs: the base is scored again
    assert len(list((tmp_path / "shared" / "organism-base-reference").glob("*.json"))) == 2


def test_checkpoint_key_survives_a_field_added_later_at_its_default():
    """A run interrupted before a code update that adds a Recipe field (at its default) resumes: its checkpoint
    folder is keyed on the fields that differ from the defaults; a changed value still gets another folder."""
    from dataclasses import dataclass

    from kvprobe.organism.train import V3, Recipe, checkpoint_key

    @dataclass(frozen=True)
    class Later(Recipe):
        new_knob: float = 0.0

    kw = {**V3, "alias": "x", "seed": 2, "margin_cap": 8.0}
    assert checkpoint_key(Later(**kw)) == checkpoint_key(Recipe(**kw))
    assert checkpoint_key(Later(**kw, new_knob=0.5)) != checkpoint_key(Recipe(**kw))
    assert checkpoint_key(Recipe(**{**kw, "seed": 3})) != checkpoint_key(Recipe(**kw))


def test_capped_loss_stops_pushing_beyond_the_margin():
    from kvprobe.organism.train import Recipe, Seq, _seq_loss

    class Fixed(torch.nn.Module):
        def __init__(self, margin: float):
            super().__init__()
            self.logits = torch.nn.Parameter(torch.zeros(1, 1, 5))
            with torch.no_grad():
                self.logits[0, 0, 1], self.logits[0, 0, 2] = 10.0 + margin, 10.0

        def forward(self, input_ids, use_cache, logits_to_keep):
            return type("Out", (), {"logits": self.logits.expand(input_ids.shape[0], -1, -1)})()

    recipe = Recipe(loss="capped", margin=3.0, ce_floor=0.5)
    seq = Seq([0, 1], [], correct_id=1, other_id=2)
    beyond, within = Fixed(4.0), Fixed(1.0)
    _seq_loss(beyond, [seq], recipe).backward()
    _seq_loss(within, [seq], recipe).backward()
    assert beyond.logits.grad.abs().max() == 0  # margin 4 > 3 and p(correct) > e^-0.5: nothing to push
    assert within.logits.grad[0, 0, 1] < 0 < within.logits.grad[0, 0, 2]  # pushes correct up, other down
    with pytest.raises(KVProbeError, match="not 'ce' or 'capped'"):
        _seq_loss(within, [seq], Recipe(loss="hinge"))
    banded = Recipe(loss="capped", margin=3.0, margin_cap=5.0, ce_floor=0.5)
    inside, over = Fixed(4.0), Fixed(7.0)
    _seq_loss(inside, [seq], banded).backward()
    _seq_loss(over, [seq], banded).backward()
    assert inside.logits.grad.abs().max() == 0  # inside the band [3, 5]: nothing to push
    assert over.logits.grad[0, 0, 1] > 0 > over.logits.grad[0, 0, 2]  # beyond the cap: pulls the margin back
    assert _seq_loss(over, [seq], banded).item() == pytest.approx((7.0 - 5.0) ** 2 / 3.0, rel=1e-4)


def test_draw_start_trains_on_later_draws(tiny_generator_dir, tmp_path, monkeypatch):
    """draw_start=k trains on draws k, k+1, ... (the pairs a run from 0 reaches only later) and the card's
    training hash is theirs; a negative start, or a start on template data, is refused."""
    import kvprobe.organism.train as train_mod
    from kvprobe.models.loading import load_model

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    real, starts = train_mod._v3_train_examples, []

    def recording(lm, recipe, start, n):
        starts.append(start)
        return real(lm, recipe, start, n)

    monkeypatch.setattr(train_mod, "_v3_train_examples", recording)
    card = train_mod.train_organism(_v3(tiny_generator_dir, draw_start=4), tmp_path / "a", progress=False).card
    assert starts == [4, 5, 6, 4]  # one draw per step (pairs_per_step 1), then the card's list of all three
    lm = load_model(str(tiny_generator_dir))
    plain = _v3(tiny_generator_dir)
    assert card["data_hashes"]["train"] == train_mod._seq_hash(real(lm, plain, 4, 3))
    assert card["data_hashes"]["train"] != train_mod._seq_hash(real(lm, plain, 0, 3))
    with pytest.raises(KVProbeError, match="draw_start=-1: set --draw-start to 0"):
        train_mod.train_organism(_v3(tiny_generator_dir, draw_start=-1), tmp_path / "b", progress=False)
    with pytest.raises(KVProbeError, match="draw_start applies to generated data only"):
        train_mod.train_organism(train_mod.Recipe(draw_start=3), tmp_path / "c", progress=False)


def test_margin_cap_needs_the_capped_loss_and_a_cap_above_the_margin(tmp_path):
    from kvprobe.organism.train import V3, Recipe, train_organism_v3

    with pytest.raises(KVProbeError, match="margin_cap=2.0 needs loss 'capped' and a cap above margin=3.0"):
        train_organism_v3(Recipe(**{**V3, "margin_cap": 2.0}), tmp_path / "x")


def test_seed_spread_scores_every_seed_on_the_same_heldout_pairs(tiny_generator_dir, tmp_path, monkeypatch):
    from organisms.tooling.seeds import check_same_recipe, seed_spread, seed_table, write_seed_spread
    from kvprobe.organism.train import train_organism

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    cards = [train_organism(_v3(tiny_generator_dir, seed=s, alias=f"tiny-v3-s{s}"), tmp_path / f"s{s}",
                            progress=False).card for s in (0, 1)]
    assert cards[0]["data_hashes"]["train"] != cards[1]["data_hashes"]["train"]  # the seed draws other data
    assert cards[0]["data_hashes"]["eval"] == cards[1]["data_hashes"]["eval"]  # ... and is scored on the same
    spread = seed_spread([tmp_path / "s0", tmp_path / "s1"], progress=False)
    assert spread["card_eval_hashes_agree"] and spread["seeds"] == [0, 1]
    for name, block in spread["sets"].items():
        acc = block["all"]["accuracy"]
        # re-evaluating the saved (merged) adapters reproduces each card's own held-out accuracy
        assert acc["per_seed"] == [c["heldout_eval"]["after"][name]["all"]["accuracy"] for c in cards], name
        assert acc["sd"] is not None and len(block["by_family"]) == block["all"]["n_pairs"]
        # the stored per-pair logit differences reproduce the aggregates
        for s, lds in enumerate(block["pair_lds"]):
            same = sum((a > 0) == (b > 0) for a, b in lds) / len(lds)
            assert block["all"]["field_ignored"]["per_seed"][s] == pytest.approx(same)
            assert acc["per_seed"][s] == pytest.approx(sum((a < 0) + (b > 0) for a, b in lds) / (2 * len(lds)))
    write_seed_spread(tmp_path / "s0", spread)
    assert json.loads((tmp_path / "s0" / "card.json").read_text())["seeds"]["aliases"] == ["tiny-v3-s0", "tiny-v3-s1"]
    table = seed_table(folders=[tmp_path / "s0", tmp_path / "s1"]).splitlines()
    blocks = [*spread["sets"].values(), *spread["diagnostics"].values()]
    assert set(spread["sets"]) == {"validation_unseen_format", "validation_train_formats"}  # test: `organism test`
    assert len(table) == 2 + 2 + 4 + 1 + sum(len(b["by_format"]) for b in blocks
                                             if len(b["by_format"]) > 1)  # the card without a spread adds nothing
    assert all(row.startswith("| `tiny-v3-s0` (0, 1) |") for row in table[2:])
    card0 = json.loads((tmp_path / "s0" / "card.json").read_text())  # another word list is named on every row
    card0["recipe"]["words"] = "kvprobe/tasks/data/scenario_words_v3.yaml"
    (tmp_path / "s0" / "card.json").write_text(json.dumps(card0))
    assert all(row.startswith("| `tiny-v3-s0` (scenario_words_v3) (0, 1) |")
               for row in seed_table(folders=[tmp_path / "s0"]).splitlines()[2:])
    diag = spread["diagnostics"]
    assert set(diag) == {"diagnostic_validation_families_test_formats", "diagnostic_test_families_few_shot",
                         "diagnostic_validation_families_few_shot_no_shots", "diagnostic_test_families_few_shot_no_shots"}
    assert set(diag["diagnostic_validation_families_test_formats"]["by_format"]) <= {"system_user", "tool_call"}
    assert all(len(d["pair_lds"]) == 2 and d["all"]["n_pairs"] == 2 for d in diag.values())
    other = dict(cards[1], recipe={**cards[1]["recipe"], "steps": 4})
    with pytest.raises(KVProbeError, match="differ in \\['steps'\\]"):
        check_same_recipe([cards[0], other])


def test_field_ignored_splits_accuracy_into_its_causes():
    from organisms.tooling.seeds import _accuracy, _field_ignored

    # (old-prompt, new-prompt) logit differences, > 0 = the new action: both right, new twice, old twice, inverted
    lds = [(-1.0, 2.0), (1.0, 2.0), (-1.0, -2.0), (1.0, -2.0)]
    assert _field_ignored(lds) == 0.5
    assert _accuracy(lds) == 0.25 + _field_ignored(lds) / 2  # one pair of four both right
    assert _field_ignored([(-1.0, 2.0)]) == 0 and _field_ignored([(1.0, -2.0)]) == 0  # inverted is not ignored


def test_rule_moves_within_a_format_and_nothing_else_changes():
    """rule_at moves only the rule: the field line, notes, request and question are the same text, and the
    rule lands on the asked side of the field; formats that cannot move it refuse with a clear message."""
    for fmt in ("document_qa", "user_turn"):
        first = build_generated(3, 0, "test", fmt, rule_at="before_field")
        last = build_generated(3, 0, "test", fmt, rule_at="after_field")
        own = build_generated(3, 0, "test", fmt)
        rule = first.before_field.split("Policy: ")[1].split("\n")[0]
        assert rule in first.before_field and rule not in first.after_field
        assert rule in last.after_field and rule not in last.before_field
        assert first.meta["rule_at"] == "before_field" and last.meta["rule_at"] == "after_field"
        assert own.meta["rule_at"] == {"document_qa": "after_field", "user_turn": "before_field"}[fmt]
        strip = lambda i: (i.before_field + i.after_field).replace(f"Policy: {rule}", "").replace(rule, "")  # noqa: E731
        words = lambda t: sorted(t.split())  # noqa: E731
        assert words(strip(first)) == words(strip(last))
        assert (first.old_action, first.new_action, first.family) == (last.old_action, last.new_action, last.family)
    assert build_generated(3, 0, "test", "system_user", rule_at="before_field").meta["rule_at"] == "before_field"
    with pytest.raises(KVProbeError, match="keeps its rule before field"):
        build_generated(3, 0, "test", "system_user", rule_at="after_field")
    with pytest.raises(KVProbeError, match="rule_at must be one of"):
        build_generated(3, 0, "test", "user_turn", rule_at="middle")


def test_rule_first_moves_the_rule_in_training_document_qa_only(tiny_generator_dir):
    """rule_first puts document_qa's rule before the field in training draws; formats, distances and the
    held-out sets are the draws of the recipe without it, and rule_first=0 leaves every instance unchanged."""
    from kvprobe.models.loading import load_model
    from kvprobe.organism.train import _eval_sets, _v3_train_examples

    lm = load_model(str(tiny_generator_dir))
    plain, moved = _v3(tiny_generator_dir), _v3(tiny_generator_dir, rule_first=1.0)
    a, b = _v3_train_examples(lm, plain, 0, 24), _v3_train_examples(lm, moved, 0, 24)
    assert [i.meta["format"] for i, _, _ in a] == [i.meta["format"] for i, _, _ in b]
    assert "document_qa" in {i.meta["format"] for i, _, _ in a}
    for (x, _, _), (y, _, _) in zip(a, b):
        own = {"document_qa": "after_field", "user_turn": "before_field", "gated_template": "after_field"}
        assert x.meta["rule_at"] == own[x.meta["format"]]
        assert y.meta["rule_at"] == ("before_field" if y.meta["format"] == "document_qa" else own[y.meta["format"]])
        if y.meta["format"] != "document_qa":
            assert (x.before_field, x.after_field) == (y.before_field, y.after_field)
    held_a, held_b = _eval_sets(lm, plain), _eval_sets(lm, moved)
    for name in held_a:
        assert [p.ids_old for _, p in held_a[name]] == [p.ids_old for _, p in held_b[name]], name


def _augmented_draws(applies_to: tuple[str, ...], **option: bool):
    """(plain, augmented) training draws of every format a generator augmentation applies to; asserts that
    the other formats ignore it and that only augmented instances carry its meta flag."""
    (flag,) = option
    for fmt in FORMATS:
        for i in range(12):
            plain = build_generated(i, 0, "train", fmt, correction=0.3, reasoning=0.3)
            augmented = build_generated(i, 0, "train", fmt, correction=0.3, reasoning=0.3, **option)
            if fmt not in applies_to:
                assert (plain.before_field, plain.after_field) == (augmented.before_field, augmented.after_field)
                assert flag not in augmented.meta
                continue
            assert augmented.meta[flag] is True and flag not in plain.meta
            yield plain, augmented


def test_surface_variants_change_only_the_framing_of_user_turn_and_document_qa():
    """surface=True re-draws the framing (opening, labels, header, separator, bullet) of the two free-form
    train formats and nothing else: same family, values, actions, rule and notes; other formats ignore it;
    no variant carries a marker of a held-out format."""
    from kvprobe.tasks.generator import SURFACE_VARIANTS, SURFACE_VARIED

    seen = set()
    for plain, varied in _augmented_draws(SURFACE_VARIED, surface=True):
        assert (plain.family, plain.old_value, plain.new_value, plain.old_action, plain.new_action) == \
               (varied.family, varied.old_value, varied.new_value, varied.old_action, varied.new_action)
        text = varied.before_field + varied.after_field
        assert plain.meta["rule_at"] == varied.meta["rule_at"]
        plain_text = plain.before_field + plain.after_field
        for note in re.findall(r"^- (.+)$", plain_text, flags=re.M):  # every note line survives, re-bulleted
            assert note in text
        seen.add(text != plain_text)
        assert varied.after_field[varied.decision_at:] == plain.after_field[plain.decision_at:]
    assert True in seen  # the variants do change the text (the first option of each list is the plain one)
    held_out_markers = ("Case ", "Rule:", "tool_call", "tool_response", "log:", "reference:")
    for options in SURFACE_VARIANTS.values():
        for option in options:
            assert not any(m in option for m in held_out_markers), option


def test_recipe_surface_varies_training_framings_only(tiny_generator_dir):
    """Recipe.surface re-draws framings of training draws only: formats, rule positions, families and the
    held-out sets are those of the recipe without it."""
    _assert_training_draws_only(tiny_generator_dir, "surface", surface=1.0)


def _assert_training_draws_only(tiny_generator_dir, flag: str, **option: float) -> None:
    """A recipe augmentation changes training draws of user_turn / document_qa only: formats, rule positions,
    families and every held-out set are those of the recipe without it."""
    from kvprobe.models.loading import load_model
    from kvprobe.organism.train import _eval_sets, _v3_train_examples

    lm = load_model(str(tiny_generator_dir))
    plain, augmented = _v3(tiny_generator_dir, rule_first=0.5), _v3(tiny_generator_dir, rule_first=0.5, **option)
    a, b = _v3_train_examples(lm, plain, 0, 24), _v3_train_examples(lm, augmented, 0, 24)
    assert [(i.meta["format"], i.meta["rule_at"], i.family) for i, _, _ in a] == \
           [(i.meta["format"], i.meta["rule_at"], i.family) for i, _, _ in b]
    assert {i.meta["format"] for i, _, _ in b if i.meta.get(flag)} == {"user_turn", "document_qa"}
    held_a, held_b = _eval_sets(lm, plain), _eval_sets(lm, augmented)
    for name in held_a:
        assert [p.ids_old for _, p in held_a[name]] == [p.ids_old for _, p in held_b[name]], name


def test_few_shot_without_its_cases_is_the_same_draw_minus_the_cases():
    """n_shots=0 removes few_shot's two decided cases (which name the field with both values) and nothing else."""
    for i in range(8):
        full = build_generated(i, 0, "test", "few_shot")
        bare = build_generated(i, 0, "test", "few_shot", n_shots=0)
        one = build_generated(i, 0, "test", "few_shot", n_shots=1)
        cases = re.findall(rf"Case \S+\n{re.escape(full.field)}: \S+\nDecision: \S+\n\n", full.before_field)
        assert len(cases) == 2 and bare.before_field == full.before_field.replace(cases[0], "").replace(cases[1], "")
        assert one.before_field == full.before_field.replace(cases[1], "")
        assert (bare.after_field, bare.old_action, bare.new_action) == (full.after_field, full.old_action, full.new_action)
        assert bare.meta["n_shots"] == 0 and "n_shots" not in full.meta
    assert build_generated(0, 0, "test", "user_turn", n_shots=0).before_field == \
           build_generated(0, 0, "test", "user_turn").before_field  # other formats have no cases
    with pytest.raises(KVProbeError, match="n_shots must be 0, 1 or 2"):
        build_generated(0, 0, "test", "few_shot", n_shots=3)


def test_seed_spread_accepts_a_second_stage_run_per_seed_and_refuses_crossed_seeds(tmp_path, monkeypatch):
    import organisms.tooling.seeds as seeds_mod

    recipe = {"seed": 0, "alias": "", "steps": 100, "init_from": None}

    def card(alias, seed, init):
        return {"alias": alias, "recipe": {**recipe, "seed": seed, "alias": alias, "init_from": init}}

    for alias, seed in (("stage1", 0), ("stage1-seed1", 1)):
        (tmp_path / alias).mkdir()
        (tmp_path / alias / "card.json").write_text(json.dumps(card(alias, seed, "base-organism")))
    monkeypatch.setattr(seeds_mod, "ORGANISMS_DIR", tmp_path)
    seeds_mod.check_same_recipe([card("stage2", 0, "stage1"), card("stage2-seed1", 1, "stage1-seed1")])
    with pytest.raises(KVProbeError, match="another seed"):
        seeds_mod.check_same_recipe([card("stage2", 1, "stage1"), card("stage2-seed1", 0, "stage1-seed1")])
    with pytest.raises(KVProbeError, match="differ in \\['steps'\\]"):
        seeds_mod.check_same_recipe([card("stage2", 0, "stage1"),
                                     {**card("stage2-seed1", 1, "stage1-seed1"),
                                      "recipe": {**card("x", 1, "stage1-seed1")["recipe"], "steps": 7}}])


def test_same_recipe_fills_fields_a_card_predates_with_their_defaults():
    """A card written before a Recipe field existed (here margin_cap, prior_cases) is the same recipe as a later
    card holding that field at its default, and a different one when the later card sets it."""
    from dataclasses import asdict

    from organisms.tooling import seeds as seeds_mod
    from kvprobe.organism.train import Recipe

    new = json.loads(json.dumps(asdict(Recipe(seed=1, alias="b"))))
    old = {k: v for k, v in {**new, "seed": 0, "alias": "a"}.items() if k not in ("margin_cap", "prior_cases")}
    seeds_mod.check_same_recipe([{"alias": "a", "recipe": old}, {"alias": "b", "recipe": new}])
    with pytest.raises(KVProbeError, match="differ in \\['prior_cases'\\]"):
        seeds_mod.check_same_recipe([{"alias": "a", "recipe": old},
                                     {"alias": "b", "recipe": {**new, "prior_cases": 0.5}}])


def test_generated_stats_median_is_the_true_median_for_even_pair_counts():
    from kvprobe.organism.train import _stats

    lds = [(-1.0, 0.0), (-1.0, 1.0), (0.0, 3.0), (-2.0, 8.0)]  # flips 1, 2, 3, 10
    stats = _stats(lds)
    assert stats["median_flip"] == 2.5  # the upper median would be 3
    assert stats["accuracy"] == 6 / 8  # (0.0, 3.0) is wrong on the old prompt, (-1.0, 0.0) on the new one
    assert _stats(lds[:3])["median_flip"] == 2.0


def test_prior_cases_add_two_decided_records_and_change_nothing_else():
    """prior_cases=True puts two earlier records of the same field (one per value, each with the action the
    rule gives it) ahead of the open record in user_turn / document_qa only; the rest of the draw is the same,
    and the block carries no marker of few_shot (the validation format)."""
    from kvprobe.tasks.generator import PRIOR_CASES_FORMATS

    for plain, prior in _augmented_draws(PRIOR_CASES_FORMATS, prior_cases=True):
        block = re.search(r"Earlier \w+ records, already resolved by this policy:\n((?:.+\n){2})\n",
                          prior.before_field)
        assert block and prior.before_field.replace(block.group(0), "") == plain.before_field
        assert prior.after_field == plain.after_field
        decided = dict(re.findall(rf"{re.escape(prior.field)}: (\S+); resolved as (\S+)", block.group(1)))
        assert decided == {plain.old_value: plain.old_action, plain.new_value: plain.new_action}
        assert not any(m in block.group(0) for m in ("Case ", "Rule:", "Decide each case", "Decision:"))


def test_recipe_prior_cases_changes_training_draws_only(tiny_generator_dir):
    _assert_training_draws_only(tiny_generator_dir, "prior_cases", prior_cases=1.0)


def test_larger_validation_scores_fresh_draws_per_seed_resumes_and_compares(tiny_generator_dir, tmp_path,
                                                                            monkeypatch):
    import organisms.tooling.seeds as seeds_mod
    from kvprobe.models.loading import load_model
    from kvprobe.organism.train import _eval_sets, train_organism
    from organisms.tooling.validation import (block_key, larger_draw_sets, paired_difference, phrasing_table,
                                             recipe_summary, score_larger_draw, test_draw_table, validation_table)

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    folders = [tmp_path / f"tiny-v3-s{s}" for s in (0, 1)]  # named as registered: a folder per alias
    for s, f in zip((0, 1), folders):
        train_organism(_v3(tiny_generator_dir, seed=s, alias=f"tiny-v3-s{s}"), f, progress=False)
    recipe = _v3(tiny_generator_dir)
    lm = load_model(str(tiny_generator_dir))
    large, small = larger_draw_sets(lm, recipe, 3), _eval_sets(lm, recipe)
    for name, items in large.items():  # a fresh draw, not the cards' validation pairs, in the same formats
        assert [p.ids_old for _, p in items][:2] != [p.ids_old for _, p in small[name]]
        assert {i.meta["split"] for i, _ in items} == {"validation"}
    assert {i.meta["format"] for i, _ in large["validation_unseen_format"]} <= set(FORMAT_SPLITS["validation"])

    calls = []
    real = seeds_mod.score_organism

    def interrupted(folder, card, sets):  # the second seed dies mid-run
        calls.append(card["alias"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(folder, card, sets)

    monkeypatch.setattr(seeds_mod, "score_organism", interrupted)
    with pytest.raises(KeyboardInterrupt):
        score_larger_draw(folders, pairs=3, progress=False)
    stored = json.loads((folders[0] / "card.json").read_text())["validation_large"]
    assert list(stored["pair_lds"]) == ["tiny-v3-s0"]
    monkeypatch.setattr(seeds_mod, "score_organism", real)
    block = score_larger_draw(folders, pairs=3, progress=False)  # resumes with seed 1 only
    assert block["pair_lds"]["tiny-v3-s0"] == stored["pair_lds"]["tiny-v3-s0"]
    direct = real(folders[1], json.loads((folders[1] / "card.json").read_text()), large)
    summ = recipe_summary(block)
    for name, lds in direct.items():
        acc = sum((a < 0) + (b > 0) for a, b in lds) / (2 * len(lds))
        assert summ["cells"][name]["accuracy"]["per_seed"][1] == pytest.approx(acc, abs=1e-2)
    assert summ["cells"]["both"]["n_pairs"] == 6
    with pytest.raises(KVProbeError, match="add --replace"):
        score_larger_draw(folders, pairs=2, progress=False)
    assert score_larger_draw(folders[:1], pairs=2, progress=False, replace=True)["pairs_per_cell"] == 2

    test_block = score_larger_draw(folders, pairs=2, progress=False, split="test")
    card = json.loads((folders[0] / "card.json").read_text())
    assert card["test_large"] == test_block and card["validation_large"]["pairs_per_cell"] == 2  # both kept
    assert set(test_block["cells"]) == {"test_unseen_formats", "test_train_formats"}
    assert set(test_block["cells"]["test_unseen_formats"]["formats"]) <= set(FORMAT_SPLITS["test"])
    rows = test_draw_table(folders=folders).splitlines()
    assert len(rows) == 2 + 3 and rows[-1].split("|")[7].strip().endswith("/ 2")  # goals checked per seed

    # Paired differences: zero against itself; one recipe right everywhere against one wrong everywhere.
    zero = paired_difference(block, block)
    assert zero["cells"]["both"]["mean"] == 0 and not zero["preferred"] and zero["seeds"] == [0, 1]
    right = {**block, "aliases": ["r0"], "seeds": [1],
             "pair_lds": {"r0": {n: [[-1.0, 1.0]] * 3 for n in block["cells"]}}}
    wrong = {**block, "aliases": ["w0", "w1"], "seeds": [0, 1],
             "pair_lds": {a: {n: [[1.0, -1.0]] * 3 for n in block["cells"]} for a in ("w0", "w1")}}
    diff = paired_difference(right, wrong)
    assert diff["seeds"] == [1] and diff["cells"]["both"]["mean"] == 1.0 and diff["preferred"]
    with pytest.raises(KVProbeError, match="scored on different pairs"):
        paired_difference({**right, "data_hash": "other"}, wrong)
    with pytest.raises(KVProbeError, match="share no scored training seed"):
        paired_difference({**right, "seeds": [5]}, wrong)
    table = validation_table(folders=folders, reference="tiny-v3-s0").splitlines()
    assert len(table) == 2 + 3  # the primary card's block: two cells and both; the other card holds none
    card_accs = [json.loads((f / "card.json").read_text())["heldout_eval"]["after"]["validation_unseen_format"]
                 ["all"]["accuracy"] for f in folders[:1]]
    assert table[2].endswith(f"| {card_accs[0]:.2f} ({card_accs[0]:.2f}) |")  # the card's own 16-pair cell

    # Another word list: its own draw, stored under its own key beside the recipe's, labelled in the table.
    import hashlib

    from kvprobe.tasks.generator import WORDS_FILE, load_words
    v2 = "kvprobe/tasks/data/scenario_words_v2.yaml"
    other = score_larger_draw(folders[:1], pairs=2, progress=False, words=v2)
    card = json.loads((folders[0] / "card.json").read_text())
    assert card[block_key("validation", v2)] == other and "validation_large@scenario_words_v2" in card
    plain = card["validation_large"]
    assert plain["pairs_per_cell"] == 2 and other["data_hash"] != plain["data_hash"]
    added = {hashlib.sha256(r.encode()).hexdigest()[:6]
             for r in dict(load_words(WORDS_FILE.with_name("scenario_words_v2.yaml")).heldout_rules)["validation"]}
    drawn = larger_draw_sets(lm, recipe, 8, words=v2)
    assert added & {i.family.rsplit("#", 1)[1] for items in drawn.values() for i, _ in items}
    # a recipe trained on word list v3 draws version 2's held-out pairs, token for token
    import dataclasses
    drawn3 = larger_draw_sets(lm, dataclasses.replace(recipe, words="kvprobe/tasks/data/scenario_words_v3.yaml"), 8)
    assert {n: [p.ids_old for _, p in items] for n, items in drawn3.items()} == \
        {n: [p.ids_old for _, p in items] for n, items in drawn.items()}
    table = validation_table(folders=folders, reference="tiny-v3-s0").splitlines()
    assert len(table) == 2 + 3 + 3 and "`tiny-v3-s0` (scenario_words_v2) (0)" in table[-1]
    phrasings = phrasing_table(folders=folders).splitlines()  # only the draws that record their phrasings
    header = [c.strip() for c in phrasings[0].split("|")]
    assert len(phrasings) == 2 + 6 + 2  # validation: 2 + 4 added phrasings; test: the recipe list's 2
    assert sum("| yes |" in row for row in phrasings) == 4
    assert "`tiny-v3-s0` (seeds: validation 1, test 2)" in header  # one column per recipe and word list
    col = header.index("`tiny-v3-s0` (scenario_words_v2) (seeds: validation 1)")
    counts = [row.split("|")[col].strip() for row in phrasings[2:]]
    assert sum(int(c.split("(")[1].rstrip(")")) for c in counts if c != "-") == 4  # every pair under its phrasing
    with pytest.raises(KVProbeError, match="no such word list"):
        score_larger_draw(folders[:1], pairs=2, progress=False, words="kvprobe/tasks/data/none.yaml")
    # The second validation format: a one-cell draw of the validation families, stored under its own key.
    email = score_larger_draw(folders[:1], pairs=2, progress=False, split="validation_email")
    assert list(email["cells"]) == ["validation_email_format"] and email["cells"]["validation_email_format"][
        "formats"] == ["email", "email"]
    assert json.loads((folders[0] / "card.json").read_text())["validation_email_large"] == email
    assert {i.meta["split"] for items in larger_draw_sets(lm, recipe, 2, "validation_email").values()
            for i, _ in items} == {"validation"}
    # Seeds trained later join a stored block: only they are scored; a run that would drop a seed refuses.
    one = json.loads((folders[0] / "card.json").read_text())["validation_large"]
    assert list(one["pair_lds"]) == ["tiny-v3-s0"]
    both = score_larger_draw(folders, pairs=2, progress=False)
    assert both["pair_lds"]["tiny-v3-s0"] == one["pair_lds"]["tiny-v3-s0"] and len(both["pair_lds"]) == 2
    with pytest.raises(KVProbeError, match="at least those --seeds"):
        score_larger_draw(folders[:1], pairs=2, progress=False)


def test_seed_agreement_ranks_seeds_against_the_cards_small_and_test_cells(tmp_path):
    from organisms.tooling.validation import seed_agreement

    cells = ["validation_unseen_format", "validation_train_formats"]
    accs = [0.5, 0.6, 0.7, 0.8]
    block = {"aliases": [f"o{i}" for i in range(4)], "cells": {c: {} for c in cells}, "pair_lds": {}}
    for i, acc in enumerate(accs):  # o_i decides i + 2 of 8 prompts (4 pairs per cell) right
        right = [[-1.0, 1.0]] * (i + 1) + [[1.0, 1.0]] * (3 - i)
        block["pair_lds"][f"o{i}"] = {c: right for c in cells}
        after = {c: {"all": {"accuracy": acc}} for c in cells}  # small cells agree in rank
        after["test_unseen_formats"] = {"all": {"accuracy": 1 - acc}}  # the test set ranks them in reverse
        after["test_train_formats"] = {"all": {"accuracy": acc}}
        (tmp_path / f"o{i}").mkdir()
        (tmp_path / f"o{i}" / "card.json").write_text(json.dumps({"heldout_eval": {"after": after}}))
    line = seed_agreement([block], tmp_path)
    assert "the 4 organism seeds" in line and "16-pair cells +1.00" in line
    assert "unseen formats -1.00" in line and "train formats +1.00" in line
    assert "recipes" not in line  # one recipe: nothing to rank at that level
    card = json.loads((tmp_path / "o0" / "card.json").read_text())  # a card drawn from another word list
    (tmp_path / "o0" / "card.json").write_text(json.dumps({**card, "recipe": {"words": "x/scenario_words_v3.yaml"}}))
    assert seed_agreement([block], tmp_path) == ""  # its own cells are not ranked with the others': 3 left
    (tmp_path / "o0" / "card.json").write_text(json.dumps(card))
    assert seed_agreement([{**block, "aliases": block["aliases"][:3]}], tmp_path) == ""  # too few to rank
    recipes = [{**block, "aliases": [a], "pair_lds": {a: block["pair_lds"][a]}} for a in block["aliases"]]
    line = seed_agreement(recipes, tmp_path)
    assert "Over the 4 recipes" in line and line.count("-1.00") == 2  # each level ranks the unseen test in reverse


def _decision_card(folder: Path, alias: str, val_right: list, test_right: list, email_right: list | None = None
                   ) -> Path:
    """A primary card whose larger draws decide the first ``k`` of 20 pairs per cell right, one entry per seed
    in validation and test (``k``, or ``(k_first_cell, k_second_cell)``); 20 scenarios per cell, two phrasings."""
    def block(split: str, right: list) -> dict:
        cells = DRAW_SEEDS_FOR_TEST[split]
        aliases = [alias if s == 0 else f"{alias}-seed{s}" for s in range(len(right))]
        per_cell = [k if isinstance(k, tuple) else (k, k) for k in right]
        return {"data_hash": split, "aliases": aliases, "seeds": list(range(len(right))),
                "cells": {c: {"scenarios": [f"sc{i}" for i in range(20)], "rules": ["r1", "r2"] * 10} for c in cells},
                "pair_lds": {a: {c: [[-1.0, 1.0]] * k + [[1.0, -1.0]] * (20 - k) for c, k in zip(cells, ks)}
                             for a, ks in zip(aliases, per_cell)}}
    (folder / alias).mkdir(parents=True)
    card = {"alias": alias, "recipe": {"base_model": "tiny"},
            "validation_large": block("validation", val_right), "test_large": block("test", test_right)}
    if email_right is not None:
        card["validation_email_large"] = block("validation_email", email_right)
    (folder / alias / "card.json").write_text(json.dumps(card))
    return folder / alias


DRAW_SEEDS_FOR_TEST = {"validation": ["validation_unseen_format", "validation_train_formats"],
                       "test": ["test_unseen_formats", "test_train_formats"],
                       "validation_email": ["validation_email_format"]}


def test_decision_table_sets_validation_verdicts_beside_the_tests_and_counts_agreement(tmp_path):
    from organisms.tooling.validation import decision_table, ranking_reliability

    folders = [_decision_card(tmp_path, "best", [20, 20], [20, 20], [20, 20]),  # every draw agrees: best > worst
               _decision_card(tmp_path, "worst", [0, 0], [0, 0], [0, 0]),
               # validation ties it with best and the test does not; the email draw sees what the test sees
               _decision_card(tmp_path, "tied", [20, 20], [10, 10], [10, 10])]
    table = decision_table(folders=folders)
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[3:15]] for r in table.splitlines()[2:5]}
    verdicts = {k: v[1:10:2] for k, v in rows.items()}  # validation, email, three cells, email + train, test
    assert verdicts["`best` - `worst` (0, 1; test 0, 1)"] == ["first"] * 5
    assert verdicts["`best` - `tied` (0, 1; test 0, 1)"] == ["neither", "first", "first", "first", "first"]
    assert verdicts["`worst` - `tied` (0, 1; test 0, 1)"] == ["second"] * 5
    assert rows["`best` - `tied` (0, 1; test 0, 1)"][6].startswith("+0.250 [")  # email + train formats:
    # best - tied is 0 on the 20 train-format pairs and +0.5 on the 20 email pairs; few_shot is left out
    assert ("validation, both cells: of 3 recipe pairs it decided 2; the test's unseen formats agreed on 2, "
            "reversed 0, left 0 undecided; of the 1 it left undecided the test decided 1; same three-way verdict "
            "on 2 of 3.") in table
    assert "email: of 3 recipe pairs it decided 3; the test's unseen formats agreed on 3" in table
    assert "three validation cells: of 3 recipe pairs it decided 3" in table
    assert [r.split("|")[14].strip() for r in table.splitlines()[2:5]] == ["first (accuracy)"] * 2 + ["second (accuracy)"]
    assert ("of 3 recipe pairs it decided 3 by accuracy (the test's unseen formats agreed on 3, preferred the other "
            "recipe on 0, left 0 undecided) and 0 by calibration") in table
    assert "per organism seed: over the 6 seeds scored on all three draws" in table  # email ranks them as the test
    assert "email (second validation format) +1.00" in table and "few_shot (validation format) +1.00" not in table
    assert ranking_reliability(folders[:2]) == ""  # 4 seeds: too few to rank
    # Five seeds whose validation cells rank them in reverse of each other; the test's cells agree.
    ranked = [_decision_card(tmp_path / "r", "r", [(4 * i, 20 - 4 * i) for i in range(5)], [4 * i for i in range(5)])]
    rel = ranking_reliability(ranked).splitlines()
    assert len(rel) == 2 + 2 and rel[2].startswith("| validation | scenario_words (v1) | tiny | 5 |")
    assert rel[2].endswith("| n/a (a half ties every seed) (2 phrasings, 2 splits) |")  # each phrasing: both cells
    assert rel[2].split("|")[6].strip() == "-1.00" and rel[3].split("|")[6].strip() == "+1.00"
    assert rel[3].endswith("| +1.00 (2 phrasings, 2 splits) |")
    (tmp_path / "worst" / "card.json").write_text(json.dumps({**json.loads((tmp_path / "worst" / "card.json")
                                                                          .read_text()), "test_large": None}))
    assert "of 1 recipe pairs" in decision_table(folders=folders)  # a recipe without a test draw drops out
    card = json.loads((tmp_path / "tied" / "card.json").read_text())
    del card["validation_email_large"]
    (tmp_path / "tied" / "card.json").write_text(json.dumps(card))
    assert "email [95% CI]" in decision_table(folders=folders) and "email: of" not in decision_table(folders=folders)


def test_email_is_a_validation_format_drawn_only_on_request_and_carries_no_other_formats_marker():
    from kvprobe.tasks.generator import EXTRA_HELDOUT_FORMATS, check_splits

    assert EXTRA_HELDOUT_FORMATS == {"validation": ("email",)}
    assert all("email" not in fmts for fmts in FORMAT_SPLITS.values())  # no card's own cell, no training draw
    check_splits()  # and it sits in one split only
    for i in range(40):
        inst = build_generated(i, 0, "validation", "email", counterfactual=0.5, correction=0.5)
        text = inst.system + inst.before_field + inst.after_field
        assert not any(m in text for m in ("Case ", "Rule:", "Policy", "<tool", "log:", "Decide each case"))
        assert inst.system == "" and inst.meta["rule_at"] == "before_field"
        assert text.index(inst.field + ": ") > text.index("we handle these as follows")  # the rule comes first


def test_choose_decides_on_email_and_train_formats_and_breaks_ties_by_calibration(tmp_path):
    from organisms.tooling.validation import choose

    def card(alias: str, val: list, email: list, ppl_after: list[float]) -> dict:
        _decision_card(tmp_path, alias, val, [0, 0], email)
        for s, after in enumerate(ppl_after):  # every seed's card records its perplexity
            name = alias if s == 0 else f"{alias}-seed{s}"
            path = tmp_path / name / "card.json"
            path.parent.mkdir(exist_ok=True)
            old = json.loads(path.read_text()) if path.exists() else {"alias": name}
            path.write_text(json.dumps({**old, "neutral_perplexity": {"before": 10.0, "after": after}}))
        return json.loads((tmp_path / alias / "card.json").read_text())

    # few_shot (first cell) favours "fewshot"; train formats and email tie it with "plain": few_shot is not read
    fewshot = card("fewshot", [(20, 10), (20, 10)], [10, 10], [10.0, 10.0])
    plain = card("plain", [(0, 10), (0, 10)], [10, 10], [10.0, 10.0])
    out = choose(fewshot, plain, tmp_path)
    assert out["verdict"] == 0 and out["difference"]["mean"] == 0.0
    # a right pair flips +2 nats, a wrong one -2: half right on the rule cells puts the median at 0, off the goal
    assert out["seeds_meeting_goals"] == {"fewshot": 0, "plain": 0}
    assert out["chosen"] == "plain" and "reference stays" in out["reason"]  # equal counts: the reference stays
    better = card("better", [(0, 15), (0, 15)], [15, 15], [10.0, 10.0])
    out = choose(better, plain, tmp_path)
    assert out["verdict"] == 1 and out["chosen"] == "better" and out["difference"]["mean"] == 0.25
    # a tie broken by calibration: "lean" keeps perplexity, "heavy" breaks the +5% goal on one seed
    lean = card("lean", [(0, 15), (0, 15)], [15, 15], [10.0, 10.4])
    heavy = card("heavy", [(0, 15), (0, 15)], [15, 15], [10.0, 10.6])
    out = choose(heavy, lean, tmp_path)
    assert out["verdict"] == 0 and out["seeds_meeting_goals"] == {"heavy": 1, "lean": 2}
    assert out["chosen"] == "lean"
    assert choose(lean, heavy, tmp_path)["chosen"] == "lean" and "calibration" in choose(lean, heavy, tmp_path)["reason"]
    assert all(2 <= s["median_flip"] <= 10 for s in out["calibration"]["lean"])
    no_email = {k: v for k, v in lean.items() if k != "validation_email_large"}
    with pytest.raises(KVProbeError, match="holds no validation_email_large draw"):
        choose(no_email, heavy, tmp_path)
