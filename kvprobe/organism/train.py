"""Train a model organism: LoRA fine-tuning on the gated-decision task with the paper's geometry.

Why: the paper's phenomenon needs a model whose decision really depends on an upstream field. The embedded
models barely move when the field changes (an oracle flip of ~0.05-0.6 nats), so, as interpretability work
does with model organisms, we train a small model to have the behaviour and then probe its mechanism.

Recipe: every step takes pairs of prompts that differ only in the field value (old/new), so the only
signal that separates the two answers is the field read through the rule; the loss is next-token
cross-entropy on the space-prefixed action word after the answer prefix. The field stays upstream: rule,
>= 20 filler rules, tools and the conversation sit between it and the decision. Train and evaluation
scenarios are disjoint by scenario family, and the card proves it with the family lists and data hashes.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvprobe.backends import HookableModel
from kvprobe.cache_dir import cache_root
from kvprobe.errors import KVProbeError
from kvprobe.tasks.gated import GatedTemplate, Scenario, build_instance, load_template, tokenize_pair

NEUTRAL_TEXT = Path(__file__).parent / "data" / "neutral.txt"


@dataclass(frozen=True)
class Recipe:
    base_model: str = "smollm2-135m"
    alias: str = "smollm2-135m-gated"
    template: str = "configs/tasks/gated.yaml"
    eval_families: tuple[str, ...] = ("accounts", "payments", "inventory", "promotions")
    # The committed organism trains on these eight scenarios (one family each); None = every scenario
    # outside eval_families. A run on all 20 other families at lr 1.5e-3 / 100 steps stayed at chance.
    train_scenarios: tuple[str, ...] | None = ("order_status", "refund_window", "shipping_region", "age_check",
                                               "subscription_state", "warranty_status", "fraud_score",
                                               "identity_check")
    steps: int = 120
    pairs_per_step: int = 2
    lr: float = 1e-3
    warmup_steps: int = 10
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    n_filler: tuple[int, int] = (20, 24)  # sampled per instance: the field always sits far upstream
    seed: int = 0
    eval_instances: int = 48
    checkpoint_every: int = 10
    # Probability that a training instance's rule has its two values exchanged (a counterfactual rule:
    # "if pending, deny; if shipped, cancel"). Such rules cannot be answered from a memorized value->action
    # association, only by reading the rule; held-out evaluation always uses the template's own rules.
    counterfactual_rules: float = 0.0
    # An organism alias whose adapter initializes the LoRA weights (same rank and target modules): a second
    # stage that broadens an organism instead of starting from the base model. None = fresh LoRA.
    init_from: str | None = None
    # --- v3 (``data="generator"``): procedural scenarios, calibrated loss; the fields below are unused by
    # the template recipe, whose defaults above are the v1/v2 recipe unchanged.
    data: str = "template"  # "template": configs/tasks/gated.yaml scenarios; "generator": kvprobe.tasks.generator
    words: str = "kvprobe/tasks/data/scenario_words.yaml"
    train_formats: tuple[str, ...] | None = None  # None: the generator's train formats
    distance_range: tuple[int, int] = (40, 400)  # field-to-decision tokens, log-uniform per training instance
    correction: float = 0.0  # probability of a late correction (the latest value wins; full prefills only)
    reasoning: float = 0.0  # probability of a reasoning answer (a chain restating the field, then the word)
    # Probability that a training instance of a field-first format whose rule can move (document_qa) is
    # rendered rule-first instead (rule_at='before_field'). Why: the unseen test formats (system_user,
    # tool_call) and the validation format (few_shot) put the rule before the field, and user_turn is the
    # only train format that does; seeds that never learned user_turn never transferred. The test formats
    # themselves stay untrained; validation and test draws are unaffected. Continued at 1.0
    # (smollm2-135m-gated-v3u), seed 0 leaves chance; an equal-steps control at 0.5 matches it on validation.
    rule_first: float = 0.0
    # Probability that a training instance of a format with surface variants (user_turn, document_qa) has
    # its framing text re-drawn (generator.SURFACE_VARIANTS: opening line, labels, record header, field
    # separator, note bullet). Why: seeds that learn the three fixed framings might ignore the field in unseen
    # formats. Tried as smollm2-135m-gated-v3s (0.5, three seeds): no better on validation, not adopted.
    surface: float = 0.0
    # Probability that a user_turn / document_qa training instance shows two earlier decided records of the
    # same field, one per value (generator.PRIOR_CASES_FORMATS). Why: few_shot fails on its decided cases.
    # Tried at 0.5 as a 50-step continuation of v3u seeds 1 and 2 (smollm2-135m-gated-v3p): few_shot stays at
    # chance on validation; not adopted.
    prior_cases: float = 0.0
    # Index of the first training draw. Draws are indexed per seed, so a continuation (``init_from``) with 0
    # repeats the first pairs its earlier stages trained on; a start past them (v3 drew 0-599) trains on pairs
    # no stage has seen. Why: seed 0 of v3u / v3bc fits its repeated pairs (loss ~0.2) yet stays below 0.9 on
    # the unseen formats. Tried at 600 as a 50-step continuation of v3u, three seeds (smollm2-135m-gated-v3f):
    # every seed >= 0.9 on the unseen test formats, but not better on validation; not adopted. With a margin
    # cap of 8 (smollm2-135m-gated-v3f8, seed 0): 0.64. Continuing v3f at 700 with a cap of 10
    # (smollm2-135m-gated-v3fb10): every seed >= 0.9 on the unseen test formats with flips at the goal's upper
    # edge (fresh draw: 9.7-10.7); tied with the other second-stage recipes on the larger validation draw.
    draw_start: int = 0
    # Calibration. loss "ce": cross-entropy of the action token (v1/v2). "capped": a squared hinge on the
    # two-way action logit difference that is zero beyond ``margin`` nats, plus cross-entropy floored at
    # ``ce_floor`` (no push once the token is likely enough) on the action and chain tokens.
    loss: str = "ce"
    margin: float = 3.0
    # Upper edge of a margin band (capped loss only): a squared penalty on the two-way action margin beyond
    # ``margin_cap`` nats pulls over-confident decisions back, so a pair's flip (the two prompts' margins
    # added) stays between 2 x margin and 2 x margin_cap.
    # Why: v3u's seeds 1 and 2 reach median flips of 13-14 nats with only the lower hinge. None: no cap.
    # Tried as a 50-step continuation of v3u seeds 1 and 2 (smollm2-135m-gated-v3b: cap 4; -v3b6: 6; -v3b8: 8):
    # the flips fall into the 2-10 goal and test accuracy falls with them; not better on validation, not adopted.
    margin_cap: float | None = None
    ce_floor: float = 0.5
    kl_weight: float = 0.0  # KL(base || organism) on the base model's own samples from neutral openings
    kl_tokens: int = 96
    val_instances: int = 32
    val_every: int = 50  # a small validation evaluation every this many steps (the recipe is chosen on it)
    adapter_dtype: str = "float32"  # "float16" halves the committed adapter; evaluation uses the rounded weights


V3 = dict(data="generator", steps=300, pairs_per_step=2, lr=1e-3, warmup_steps=10, counterfactual_rules=0.5,
          correction=0.25, reasoning=0.2, loss="capped", margin=3.0, ce_floor=0.5, kl_weight=1.0,
          eval_instances=32, val_instances=16, adapter_dtype="float16", train_scenarios=None)
"""The v3 recipe: every field that differs from the :class:`Recipe` defaults (``Recipe(**V3, ...)``)."""


def recipe_summary(recipe: Recipe, n_train_scenarios: int) -> str:
    """One line for the card and `kvprobe models`."""
    from kvprobe.tasks.generator import is_default_words

    if recipe.data == "generator":
        return (f"LoRA r={recipe.lora_r} on {'/'.join(recipe.target_modules)}, {recipe.steps} steps on generated "
                f"scenarios ({n_train_scenarios} train families, formats {'/'.join(_train_formats(recipe))}), "
                f"{recipe.counterfactual_rules:.0%} counterfactual, {recipe.correction:.0%} late corrections, "
                f"{recipe.reasoning:.0%} reasoning"
                + (f", {recipe.rule_first:.0%} of document_qa rule-first" if recipe.rule_first else "")
                + (f", {recipe.surface:.0%} of user_turn/document_qa with varied framing" if recipe.surface else "")
                + (f", {recipe.prior_cases:.0%} of user_turn/document_qa with earlier decided records"
                   if recipe.prior_cases else "")
                + (f", draws from #{recipe.draw_start}" if recipe.draw_start else "")
                + ("" if is_default_words(recipe.words) else f", word list {Path(recipe.words).stem}")
                + f"; {recipe.loss} loss (margin {recipe.margin}"
                + (f"-{recipe.margin_cap}" if recipe.margin_cap is not None else "") + " nats), "
                f"KL weight {recipe.kl_weight}" + (f"; continued from {recipe.init_from}" if recipe.init_from else ""))
    text = (f"LoRA r={recipe.lora_r} on {'/'.join(recipe.target_modules)}, {recipe.steps} steps on "
            f"{n_train_scenarios} scenarios, gated decisions with the field upstream")
    if recipe.counterfactual_rules:
        text += f", {recipe.counterfactual_rules:.0%} counterfactual rules"
    if recipe.init_from:
        text += f", continued from {recipe.init_from}"
    return text


def split_scenarios(template: GatedTemplate, eval_families: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Train / eval scenario names, disjoint by family. Fails loudly on overlap or an empty side."""
    families = {s.family for s in template.scenarios}
    unknown = set(eval_families) - families
    if unknown:
        raise KVProbeError(f"eval_families {sorted(unknown)} are not families of the template ({sorted(families)})")
    train = [s.name for s in template.scenarios if s.family not in eval_families]
    held = [s.name for s in template.scenarios if s.family in eval_families]
    check_disjoint(template, train, held)
    return train, held


def check_disjoint(template: GatedTemplate, train: list[str], held: list[str]) -> None:
    fam = {s.name: s.family for s in template.scenarios}
    overlap = {fam[n] for n in train} & {fam[n] for n in held}
    if overlap or set(train) & set(held):
        raise KVProbeError(f"train and eval scenarios share families {sorted(overlap)}: the held-out evaluation "
                           "would not measure generalization; choose eval_families that no train scenario has")
    if not train or not held:
        raise KVProbeError("both the train and the eval split need at least one scenario")


def counterfactual_rule(scenario: Scenario) -> Scenario:
    """The scenario with its rule's two field values exchanged, so each value now permits the other action."""
    a, b = scenario.allow_value, scenario.block_value
    pattern = re.compile(rf"\b({re.escape(a)}|{re.escape(b)})\b")
    if len(pattern.findall(scenario.rule)) < 2:
        raise KVProbeError(f"scenario '{scenario.name}': its rule must name both values ({a}, {b}) to be swapped")
    rule = pattern.sub(lambda m: b if m.group(0) == a else a, scenario.rule)
    return scenario.model_copy(update={"allow_value": b, "block_value": a, "rule": rule})


def _instance(template: GatedTemplate, scenarios: list[str], seed: int, index: int, n_filler: tuple[int, int],
              counterfactual: float = 0.0):
    rng = random.Random(hashlib.sha256(f"organism:{seed}:{index}".encode()).digest())
    scenario = template.scenario(scenarios[rng.randrange(len(scenarios))])
    n = rng.randint(*n_filler)
    if counterfactual > 0 and rng.random() < counterfactual:
        scenario = counterfactual_rule(scenario)
    return build_instance(template, scenario, index, seed, n)


def data_hash(pairs: list[Any]) -> str:
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps([p.ids_old, p.ids_new, p.old_action_id, p.new_action_id]).encode())
    return h.hexdigest()[:16]


def _examples(lm: HookableModel, template: GatedTemplate, scenarios: list[str], seed: int, start: int, n: int,
              n_filler: tuple[int, int], counterfactual: float = 0.0) -> list[Any]:
    return [tokenize_pair(lm.tokenizer, _instance(template, scenarios, seed, i, n_filler, counterfactual),
                          lm.has_chat_template)
            for i in range(start, start + n)]


def _batch_loss(model: Any, pairs: list[Any]) -> torch.Tensor:
    """Mean cross-entropy of the correct action token over both prompts of every pair.

    The two prompts of a pair have the same length by construction, so each pair is one batch-2 forward.
    """
    losses = []
    for p in pairs:
        out = model(input_ids=torch.tensor([p.ids_old, p.ids_new]), use_cache=False, logits_to_keep=1)
        target = torch.tensor([p.old_action_id, p.new_action_id])
        losses.append(torch.nn.functional.cross_entropy(out.logits[:, -1].float(), target))
    return torch.stack(losses).mean()


@torch.no_grad()
def evaluate(model: Any, pairs: list[Any]) -> dict[str, Any]:
    """Held-out competence from full forwards: two-way accuracy on both prompts and the oracle flip."""
    return {**_stats([pair_lds(model, p) for p in pairs]),
            "min_field_to_decision_tokens": min(len(p) - p.field_slots[-1] for p in pairs)}


@torch.no_grad()
def neutral_perplexity(model: Any, tokenizer: Any) -> float:
    ids = tokenizer(NEUTRAL_TEXT.read_text(), return_tensors="pt")["input_ids"]
    out = model(input_ids=ids, labels=ids, use_cache=False)
    return float(math.exp(out.loss.item()))


def _lr_at(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    frac = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def _init_adapter(model: Any, recipe: Recipe) -> str:
    """Load the adapter of organism ``recipe.init_from`` into ``model``; returns the file's sha256 prefix."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from kvprobe.models.organisms import ORGANISMS_DIR

    folder = ORGANISMS_DIR / str(recipe.init_from)
    card_path, weights = folder / "card.json", folder / "adapter_model.safetensors"
    if not weights.exists() and card_path.exists():
        from kvprobe.models.organisms import require_adapter

        require_adapter(str(recipe.init_from), folder)  # a history organism: its weights are restored from git
    if not weights.exists():
        raise KVProbeError(f"init_from={recipe.init_from}: no organism adapter at {folder.name}/; choose one of "
                           f"{sorted(p.name for p in ORGANISMS_DIR.iterdir() if p.is_dir())}")
    card = json.loads(card_path.read_text())
    theirs = card["recipe"]
    if (theirs["lora_r"], tuple(theirs["target_modules"])) != (recipe.lora_r, tuple(recipe.target_modules)):
        raise KVProbeError(f"init_from={recipe.init_from}: its LoRA (r={theirs['lora_r']}, {theirs['target_modules']})"
                           f" differs from this recipe's (r={recipe.lora_r}, {list(recipe.target_modules)})")
    if card["base_model"] != recipe.base_model:
        raise KVProbeError(f"init_from={recipe.init_from} was trained on {card['base_model']}, not {recipe.base_model}")
    # The held-out families must be held out of every stage, or the evaluation measures memory.
    leaked = sorted(set(card.get("train_families", [])) & set(recipe.eval_families))
    if leaked:
        raise KVProbeError(f"init_from={recipe.init_from} was trained on families {leaked} that this recipe holds "
                           f"out; choose eval_families disjoint from its train_families")
    result = set_peft_model_state_dict(model, load_file(str(weights)))
    if getattr(result, "unexpected_keys", None):
        raise KVProbeError(f"init_from={recipe.init_from}: adapter keys do not match: {result.unexpected_keys[:3]}")
    return hashlib.sha256(weights.read_bytes()).hexdigest()[:16]


def scrub_adapter_dir(out_dir: Path, base_alias: str) -> None:
    """peft writes the local weights path and a boilerplate README; keep the alias, drop the boilerplate."""
    (out_dir / "README.md").unlink(missing_ok=True)
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_alias
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@dataclass
class TrainResult:
    out_dir: Path
    card: dict[str, Any] = field(default_factory=dict)


def _lora_training_state(lm: HookableModel, recipe: Any) -> tuple[Any, str | None, list[torch.nn.Parameter], Any, Path]:
    """The LoRA-wrapped model (optionally started from another organism's adapter), its trainable parameters,
    the optimizer, and the checkpoint folder, named by a hash of the whole recipe (so a resume never mixes
    recipes)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                        target_modules=list(recipe.target_modules), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(lm.model, config)
    init_sha = _init_adapter(model, recipe) if recipe.init_from else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    ckpt_dir = cache_root() / "organism-checkpoints" / recipe.alias / checkpoint_key(recipe)
    return model, init_sha, params, opt, ckpt_dir


def checkpoint_key(recipe: Recipe) -> str:
    """The checkpoint folder's name: a hash of the fields that differ from the :class:`Recipe` defaults, so a
    field added to Recipe later (at its default) does not orphan the checkpoint of a run in progress."""
    changed = {f.name: getattr(recipe, f.name) for f in fields(recipe) if getattr(recipe, f.name) != f.default}
    return hashlib.sha256(json.dumps(changed, sort_keys=True, default=list).encode()).hexdigest()[:12]


def train_organism(recipe: Recipe, out_dir: Path, resume: bool = True, progress: bool = True) -> TrainResult:
    """Train (or resume) the organism and write adapter + card.json into ``out_dir``."""
    if recipe.data == "generator":
        return train_organism_v3(recipe, out_dir, resume=resume, progress=progress)
    if recipe.data != "template":
        raise KVProbeError(f"recipe data '{recipe.data}' is not 'template' or 'generator'")
    if recipe.draw_start:
        raise KVProbeError("draw_start applies to generated data only (--preset v3): leave --draw-start out")
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    from kvprobe.models.loading import load_model

    torch.manual_seed(recipe.seed)
    t0 = time.perf_counter()
    lm = load_model(recipe.base_model, device="cpu", dtype="float32")
    template = load_template(recipe.template)
    train_sc, eval_sc = split_scenarios(template, recipe.eval_families)
    if recipe.train_scenarios is not None:
        train_sc = list(recipe.train_scenarios)
        check_disjoint(template, train_sc, eval_sc)
    base_ppl = neutral_perplexity(lm.model, lm.tokenizer)
    eval_pairs = _examples(lm, template, eval_sc, recipe.seed + 10_000, 0, recipe.eval_instances, recipe.n_filler)
    base_eval = evaluate(lm.model, eval_pairs)

    model, init_sha, params, opt, ckpt_dir = _lora_training_state(lm, recipe)
    start, losses = 0, []
    ckpt = ckpt_dir / "last.pt"
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        set_peft_model_state_dict(model, state["adapter"])
        opt.load_state_dict(state["opt"])
        start, losses = state["step"], state["losses"]
    model.train()
    bar = tqdm(range(start, recipe.steps), desc=f"training {recipe.alias}", initial=start, total=recipe.steps,
               disable=not progress)
    for step in bar:
        pairs = _examples(lm, template, train_sc, recipe.seed, step * recipe.pairs_per_step, recipe.pairs_per_step,
                          recipe.n_filler, recipe.counterfactual_rules)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe)
        loss = _batch_loss(model, pairs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(round(float(loss.detach()), 5))
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if (step + 1) % recipe.checkpoint_every == 0 or step + 1 == recipe.steps:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"adapter": get_peft_model_state_dict(model), "opt": opt.state_dict(), "step": step + 1,
                        "losses": losses}, tmp)
            tmp.replace(ckpt)
    model.eval()
    # The training data hash is over every pair the recipe trains on (regenerated deterministically).
    train_pairs_hash = data_hash(_examples(lm, template, train_sc, recipe.seed, 0,
                                           recipe.steps * recipe.pairs_per_step, recipe.n_filler,
                                           recipe.counterfactual_rules))
    trained_eval = evaluate(model, eval_pairs)
    trained_train = evaluate(model, _examples(lm, template, train_sc, recipe.seed + 20_000, 0, 16, recipe.n_filler))
    trained_ppl = neutral_perplexity(model, lm.tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    scrub_adapter_dir(out_dir, recipe.base_model)
    fam = {s.name: s.family for s in template.scenarios}
    card = {
        "alias": recipe.alias,
        "base_model": recipe.base_model,
        "base_fingerprint": lm.fingerprint,
        "summary": recipe_summary(recipe, len(train_sc)),
        "recipe": asdict(recipe),
        "init_adapter_sha256": init_sha,
        "train_scenarios": train_sc,
        "eval_scenarios": eval_sc,
        "train_families": sorted({fam[n] for n in train_sc}),
        "eval_families": sorted({fam[n] for n in eval_sc}),
        "data_hashes": {"train": train_pairs_hash, "eval": data_hash(eval_pairs)},
        "heldout_eval": {"before": base_eval, "after": trained_eval},
        "train_split_eval_after": trained_train,
        "neutral_perplexity": {"before": base_ppl, "after": trained_ppl, "text": NEUTRAL_TEXT.name},
        "loss_curve": losses[:: max(1, len(losses) // 40)],
        "final_loss_mean_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    return TrainResult(out_dir, card)


# -- organism v3: generated scenarios, calibrated ------------------------------------------------------------
#
# Data: families and formats from the generator's train split (kvprobe.tasks.generator); validation
# families in the validation format and in the train formats choose the recipe (``val_every``); the card's
# held-out test uses test families, in the two test formats (never trained) and in the train formats.
# Counterfactual rules appear in every split; late corrections and reasoning answers in training only, as
# full prefills (the cache-level edit question stays untrained). Calibration: the capped loss stops pushing
# once the two-way action margin reaches ``margin`` nats, and the KL term keeps the base model's
# distribution on its own neutral text, so flips stay graded and perplexity stays near the base.

NEUTRAL_OPENINGS = ("Once upon a time, in a small village by the sea,", "The history of bread begins",
                    "Dear diary, today I finally", "The train left the station at dawn and",
                    "A simple recipe for vegetable soup:", "In the autumn the forest", "Chapter 1\n\nThe house on",
                    "The museum opened a new exhibit about")


@dataclass(frozen=True)
class Seq:
    """One training sequence: the model input, the reasoning-chain tokens it ends with (empty without a
    chain; each is a target of the position before it) and the two action tokens read at its last position
    (correct first)."""

    ids: list[int]
    chain: list[int]
    correct_id: int
    other_id: int


def _train_formats(recipe: Recipe) -> tuple[str, ...]:
    from kvprobe.tasks.generator import FORMAT_SPLITS

    return tuple(recipe.train_formats) if recipe.train_formats else FORMAT_SPLITS["train"]


def _draw_rng(*key: Any) -> random.Random:
    return random.Random(hashlib.sha256(":".join(map(str, key)).encode()).digest())


def generated_instance(lm: HookableModel, recipe: Recipe, split: str, formats: tuple[str, ...], seed: int, index: int,
                       counterfactual: float, correction: float, reasoning: float, rule_first: float = 0.0,
                       surface: float = 0.0, n_shots: int | None = None, prior_cases: float = 0.0) -> Any:
    """One generated instance: format and distance drawn from (seed, split, index); a format whose fixed
    text is longer than the drawn distance gets no note lines. ``rule_first``: probability that a
    field-first format whose rule can move is rendered with the rule before the field (training only).
    ``surface``: probability that a format with surface variants has its framing re-drawn (training only).
    ``n_shots``: few_shot's decided cases kept (None: both; a diagnostic, see :func:`diagnostic_sets`).
    ``prior_cases``: probability of earlier decided records in a user_turn / document_qa instance (training)."""
    from kvprobe.cache_dir import project_path
    from kvprobe.tasks.generator import (FORMAT_RULE_POSITION, PRIOR_CASES_FORMATS, RULE_MOVABLE, SURFACE_VARIED,
                                         InfeasibleDistance, build_generated, load_words)

    rng = _draw_rng("organism-v3", seed, split, index)
    fmt = formats[rng.randrange(len(formats))]
    lo, hi = recipe.distance_range
    distance = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    rule_at = "format"
    # Drawn only when asked for, so recipes without it keep their exact instances.
    if rule_first > 0 and fmt in RULE_MOVABLE and FORMAT_RULE_POSITION[fmt] == "after_field" \
            and rng.random() < rule_first:
        rule_at = "before_field"
    varied = surface > 0 and fmt in SURFACE_VARIED and rng.random() < surface  # drawn last, for the same reason
    with_prior = prior_cases > 0 and fmt in PRIOR_CASES_FORMATS and rng.random() < prior_cases  # after it, likewise
    kw = dict(tokenizer=lm.tokenizer, chat=lm.has_chat_template, counterfactual=counterfactual,
              correction=correction, reasoning=reasoning, words=load_words(project_path(recipe.words)),
              rule_at=rule_at, surface=varied, n_shots=n_shots, prior_cases=with_prior)
    try:
        return build_generated(index, seed, split, fmt, distance=distance, **kw)
    except InfeasibleDistance:
        return build_generated(index, seed, split, fmt, n_notes=0, **kw)


def _prompt_text(tokenizer: Any, inst: Any, value: str, chat: bool) -> tuple[str, bool]:
    from kvprobe.tasks.gated import instance_prompt

    return instance_prompt(tokenizer, inst, value, chat)


def instance_seqs(lm: HookableModel, inst: Any) -> tuple[Any, tuple[Seq, Seq]]:
    """The tokenized pair of an instance and its two training sequences (old, new). A reasoning instance's
    sequences continue the prompt with its chain (which restates the value), so the decision is read after
    the chain; the pair's own prompts stop at the answer prefix."""
    from kvprobe.tasks.gated import action_token
    from kvprobe.tasks.generator import tokenize_generated

    tok, chat = lm.tokenizer, lm.has_chat_template
    pair = tokenize_generated(tok, inst, chat)
    if not inst.meta.get("reasoning"):
        return pair, (Seq(pair.ids_old, [], pair.old_action_id, pair.new_action_id),
                      Seq(pair.ids_new, [], pair.new_action_id, pair.old_action_id))
    seqs = []
    for value, ids, action, other in ((inst.old_value, pair.ids_old, inst.old_action, inst.new_action),
                                      (inst.new_value, pair.ids_new, inst.new_action, inst.old_action)):
        prompt, special = _prompt_text(tok, inst, value, chat)
        text = prompt + inst.chain(value)
        full = tok(text, add_special_tokens=special)["input_ids"]
        if full[: len(ids)] != ids:
            raise KVProbeError(f"instance {inst.index}: the reasoning chain merges with the answer prefix")
        seqs.append(Seq(full, full[len(ids):], action_token(tok, full, text, action, special),
                        action_token(tok, full, text, other, special)))
    return pair, (seqs[0], seqs[1])


def _seq_loss(model: Any, seqs: list[Seq], recipe: Recipe) -> torch.Tensor:
    """Loss of sequences of one length in one forward: capped hinge on the action margin plus floored
    cross-entropy on the action and chain tokens (or plain cross-entropy, ``loss='ce'``)."""
    keep = len(seqs[0].chain) + 1
    out = model(input_ids=torch.tensor([s.ids for s in seqs]), use_cache=False, logits_to_keep=keep)
    logits = out.logits.float()  # [batch, keep, vocab]; position keep-1 reads the decision
    correct = torch.tensor([s.correct_id for s in seqs])
    last = logits[:, -1]
    ce = torch.nn.functional.cross_entropy(last, correct, reduction="none")
    if keep > 1:  # chain tokens: predicted at the positions before each
        chain_t = torch.tensor([s.chain for s in seqs])
        ce_chain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), chain_t.reshape(-1),
                                                     reduction="none").view(len(seqs), -1)
    else:
        ce_chain = torch.zeros(len(seqs), 0)
    if recipe.loss == "ce":
        return torch.cat([ce[:, None], ce_chain], 1).mean()
    if recipe.loss != "capped":
        raise KVProbeError(f"recipe loss '{recipe.loss}' is not 'ce' or 'capped'")
    margin = last.gather(1, correct[:, None])[:, 0] - last.gather(1, torch.tensor([[s.other_id] for s in seqs]))[:, 0]
    hinge = torch.relu(recipe.margin - margin) ** 2 / recipe.margin
    if recipe.margin_cap is not None:
        hinge = hinge + torch.relu(margin - recipe.margin_cap) ** 2 / recipe.margin
    floored = torch.clamp(torch.cat([ce[:, None], ce_chain], 1), min=recipe.ce_floor) - recipe.ce_floor
    return (hinge + floored.mean(1)).mean()


def _example_loss(model: Any, examples: list[tuple[Seq, Seq]], recipe: Recipe) -> torch.Tensor:
    """Mean loss over the pairs; the two sequences of a pair share a forward when their lengths match."""
    losses = []
    for old, new in examples:
        if len(old.ids) == len(new.ids) and len(old.chain) == len(new.chain):
            losses.append(_seq_loss(model, [old, new], recipe))
        else:
            losses.append((_seq_loss(model, [old], recipe) + _seq_loss(model, [new], recipe)) / 2)
    return torch.stack(losses).mean()


@torch.no_grad()
def base_samples(lm: HookableModel, recipe: Recipe) -> list[list[int]]:
    """The base model's own continuations of neutral openings (seeded sampling): the text the KL term holds
    the organism to. Kept apart from the perplexity text (``neutral.txt``), which stays held out."""
    samples = []
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed + 77)
        for opening in NEUTRAL_OPENINGS:
            ids = lm.tokenizer(opening, return_tensors="pt")["input_ids"]
            out = lm.model.generate(ids, do_sample=True, top_k=50, max_new_tokens=recipe.kl_tokens,
                                    pad_token_id=lm.tokenizer.eos_token_id or 0)
            samples.append(out[0].tolist())
    return samples


def _kl_loss(model: Any, ids: list[int]) -> torch.Tensor:
    """KL(base || organism) per position, mean over the sample (base = the adapter switched off)."""
    x = torch.tensor([ids])
    with torch.no_grad(), model.disable_adapter():
        base = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), -1)
    tuned = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), -1)
    return (base.exp() * (base - tuned)).sum(-1).mean()


@torch.no_grad()
def pair_lds(model: Any, pair: Any) -> tuple[float, float]:
    """Action logit difference (new-correct minus old-correct) on the old and the new prompt."""
    lds = []
    for ids in (pair.ids_old, pair.ids_new):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
        lds.append(float(logits[pair.new_action_id] - logits[pair.old_action_id]))
    return lds[0], lds[1]


def _stats(lds: list[tuple[float, float]]) -> dict[str, Any]:
    flips = [b - a for a, b in lds]
    n = len(lds)
    # The true median (mean of the two middle flips for even n), as in the seed spread; cards written before
    # this change hold the upper median.
    return {"accuracy": sum((a < 0) + (b > 0) for a, b in lds) / (2 * n), "median_flip": statistics.median(flips),
            "mean_flip": sum(flips) / n, "frac_flip_ge_1": sum(f >= 1 for f in flips) / n, "n_pairs": n}


def evaluate_generated(model: Any, items: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Accuracy and flips over all pairs and per format, value pair, counterfactual and correction."""
    lds = [pair_lds(model, pair) for _, pair in items]
    out: dict[str, Any] = {"all": _stats(lds)}
    for key, label in (("format", lambda m: m["format"]), ("value_pair", lambda m: "/".join(m["value_pair"])),
                       ("counterfactual", lambda m: str(m["counterfactual"])),
                       ("correction", lambda m: str(m["correction"]))):
        groups: dict[str, list[tuple[float, float]]] = {}
        for (inst, _), ld in zip(items, lds):
            groups.setdefault(label(inst.meta), []).append(ld)
        out[f"by_{key}"] = {g: _stats(v) for g, v in sorted(groups.items())}
    out["distance_tokens"] = {"min": min(i.meta["distance_tokens"] for i, _ in items),
                              "max": max(i.meta["distance_tokens"] for i, _ in items)}
    return out


_BASE_REFERENCE_VERSION = 1  # bump when evaluate_generated or neutral_perplexity changes what they report


def base_reference(lm: HookableModel, eval_sets: dict[str, list[tuple[Any, Any]]]) -> tuple[float, dict[str, Any]]:
    """The base model's neutral-text perplexity and its scores on the held-out sets (the card's "before").

    They depend on the base weights and the drawn pairs only, not on the seed, the loss or the steps, so
    every run of a recipe family on the same sets shares one computation (minutes for the 0.5B base on two
    cores), cached under the cache dir and keyed on the base fingerprint and the exact pairs."""
    from kvprobe.runner.records import atomic_write_json

    h = hashlib.sha256(json.dumps([_BASE_REFERENCE_VERSION, lm.fingerprint,
                                   hashlib.sha256(NEUTRAL_TEXT.read_bytes()).hexdigest()]).encode())
    for name, items in sorted(eval_sets.items()):
        h.update(name.encode())
        for inst, pair in items:
            h.update(json.dumps([pair.ids_old, pair.ids_new, pair.old_action_id, pair.new_action_id,
                                 inst.meta], sort_keys=True, default=str).encode())
    path = cache_root() / "organism-base-reference" / f"{h.hexdigest()[:24]}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return cached["neutral_perplexity"], cached["heldout_eval"]
    ppl = neutral_perplexity(lm.model, lm.tokenizer)
    scores = {name: evaluate_generated(lm.model, items) for name, items in eval_sets.items()}
    atomic_write_json(path, {"neutral_perplexity": ppl, "heldout_eval": scores})
    return ppl, scores


def _eval_sets(lm: HookableModel, recipe: Recipe) -> dict[str, list[tuple[Any, Any]]]:
    """Held-out sets scored at training time: validation cells only (they choose the recipe; never trained on).

    Test cells are scored by ``kvprobe organism test`` alone (logged; :mod:`organisms.tooling.draws`).
    Cards trained before that split also hold the test cells (test_unseen_formats, test_train_formats,
    test_corrections, drawn with seeds 12_000-14_000), scored at training time."""
    from kvprobe.tasks.generator import FORMAT_SPLITS

    train_fmts = _train_formats(recipe)
    specs = {"validation_unseen_format": ("validation", FORMAT_SPLITS["validation"], recipe.val_instances),
             "validation_train_formats": ("validation", train_fmts, recipe.val_instances)}
    sets = {}
    for name, (split, fmts, n) in specs.items():
        # Independent of the training seed, so every seed of a recipe is scored on the same instances
        # (equal to the seed-0 draws, which the v3 card was scored on).
        seed = 10_000 + 1_000 * list(specs).index(name)
        sets[name] = _drawn_set(lm, recipe, split, fmts, n, seed, 1.0 if name == "test_corrections" else 0.0)
    return sets


def _drawn_set(lm: HookableModel, recipe: Recipe, split: str, fmts: tuple[str, ...], n: int, seed: int, correction: float,
               n_shots: int | None = None) -> list[tuple[Any, Any]]:
    insts = [generated_instance(lm, recipe, split, tuple(fmts), seed, i, recipe.counterfactual_rules or 0.5,
                                correction, 0.0, n_shots=n_shots) for i in range(n)]
    return [(inst, instance_seqs(lm, inst)[0]) for inst in insts]


DIAGNOSTIC_SETS = {
    "diagnostic_validation_families_test_formats": ("validation", ("system_user", "tool_call"), 21_000, None),
    "diagnostic_test_families_few_shot": ("test", ("few_shot",), 20_000, None),
    "diagnostic_validation_families_few_shot_no_shots": ("validation", ("few_shot",), 10_000, 0),
    "diagnostic_test_families_few_shot_no_shots": ("test", ("few_shot",), 20_000, 0),
}
"""Cells that separate the held-out sets' two differences: validation families (their own rule phrasings)
against test families, and the few_shot format against the test formats; and few_shot with and without its
two decided cases. Each no-shots set is its with-shots set's draws (same seed) with the cases removed; the
validation one pairs with ``validation_unseen_format``. Reported only: never used to choose a recipe."""


def diagnostic_sets(lm: HookableModel, recipe: Recipe) -> dict[str, list[tuple[Any, Any]]]:
    """The :data:`DIAGNOSTIC_SETS` (``val_instances`` pairs each), drawn as the held-out sets are."""
    return {name: _drawn_set(lm, recipe, split, fmts, recipe.val_instances, seed, 0.0, n_shots)
            for name, (split, fmts, seed, n_shots) in DIAGNOSTIC_SETS.items()}


def _v3_train_examples(lm: HookableModel, recipe: Recipe, start: int, n: int) -> list[tuple[Any, Any, tuple[Seq, Seq]]]:
    out = []
    for i in range(start, start + n):
        inst = generated_instance(lm, recipe, "train", _train_formats(recipe), recipe.seed, i,
                                  recipe.counterfactual_rules, recipe.correction, recipe.reasoning, recipe.rule_first,
                                  recipe.surface, prior_cases=recipe.prior_cases)
        pair, seqs = instance_seqs(lm, inst)
        out.append((inst, pair, seqs))
    return out


def _seq_hash(examples: list[tuple[Any, Any, tuple[Seq, Seq]]]) -> str:
    h = hashlib.sha256()
    for _, _, (a, b) in examples:
        h.update(json.dumps([a.ids, a.correct_id, b.ids, b.correct_id]).encode())
    return h.hexdigest()[:16]


def train_organism_v3(recipe: Recipe, out_dir: Path, resume: bool = True, progress: bool = True) -> TrainResult:
    """Train (or resume) an organism on generated scenarios; write adapter + card.json into ``out_dir``."""
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    from kvprobe.cache_dir import project_path
    from kvprobe.models.loading import load_model
    from kvprobe.tasks.generator import FORMAT_SPLITS, check_splits, load_words

    if set(_train_formats(recipe)) & (set(FORMAT_SPLITS["validation"]) | set(FORMAT_SPLITS["test"])):
        raise KVProbeError(f"train formats {_train_formats(recipe)} include held-out formats")
    if recipe.margin_cap is not None and (recipe.loss != "capped" or recipe.margin_cap <= recipe.margin):
        raise KVProbeError(f"margin_cap={recipe.margin_cap} needs loss 'capped' and a cap above margin="
                           f"{recipe.margin}: set --margin-cap above --margin, or leave it out")
    if recipe.draw_start < 0:
        raise KVProbeError(f"draw_start={recipe.draw_start}: set --draw-start to 0 or a later draw index")
    split_sizes = check_splits(load_words(project_path(recipe.words)))
    torch.manual_seed(recipe.seed)
    t0 = time.perf_counter()
    lm = load_model(recipe.base_model, device="cpu", dtype="float32")
    eval_sets = _eval_sets(lm, recipe)
    base_ppl, base_eval = base_reference(lm, eval_sets)
    kl_samples = base_samples(lm, recipe) if recipe.kl_weight > 0 else []

    model, init_sha, params, opt, ckpt_dir = _lora_training_state(lm, recipe)
    start, losses, val_curve = 0, [], []
    ckpt = ckpt_dir / "last.pt"
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        set_peft_model_state_dict(model, state["adapter"])
        opt.load_state_dict(state["opt"])
        start, losses, val_curve = state["step"], state["losses"], state.get("val_curve", [])
    val_small = eval_sets["validation_unseen_format"][:8] + eval_sets["validation_train_formats"][:8]
    bar = tqdm(range(start, recipe.steps), desc=f"training {recipe.alias}", initial=start, total=recipe.steps,
               disable=not progress)
    for step in bar:
        model.train()
        examples = _v3_train_examples(lm, recipe, recipe.draw_start + step * recipe.pairs_per_step,
                                       recipe.pairs_per_step)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe)
        loss = _example_loss(model, [seqs for _, _, seqs in examples], recipe)
        kl = _kl_loss(model, kl_samples[step % len(kl_samples)]) if kl_samples else torch.zeros(())
        total = loss + recipe.kl_weight * kl
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append([round(float(loss.detach()), 5), round(float(kl.detach()), 5)])
        bar.set_postfix(loss=f"{sum(x[0] for x in losses[-10:]) / len(losses[-10:]):.3f}",
                        kl=f"{sum(x[1] for x in losses[-10:]) / len(losses[-10:]):.4f}")
        if recipe.val_every and (step + 1) % recipe.val_every == 0:
            model.eval()
            val_curve.append({"step": step + 1, **evaluate_generated(model, val_small)["all"]})
        if (step + 1) % recipe.checkpoint_every == 0 or step + 1 == recipe.steps:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"adapter": get_peft_model_state_dict(model), "opt": opt.state_dict(), "step": step + 1,
                        "losses": losses, "val_curve": val_curve}, tmp)
            tmp.replace(ckpt)
    model.eval()
    if recipe.adapter_dtype == "float16":  # evaluate exactly the weights that are committed
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.half().float()
    elif recipe.adapter_dtype != "float32":
        raise KVProbeError(f"adapter_dtype '{recipe.adapter_dtype}' is not float32 or float16")
    trained = {name: evaluate_generated(model, items) for name, items in eval_sets.items()}
    train_examples = _v3_train_examples(lm, recipe, recipe.draw_start, recipe.steps * recipe.pairs_per_step)
    train_fams = sorted({inst.family for inst, _, _ in train_examples})
    held_fams = sorted({inst.family for items in eval_sets.values() for inst, _ in items})
    if set(train_fams) & set(held_fams):
        raise KVProbeError(f"held-out families were trained on: {sorted(set(train_fams) & set(held_fams))[:3]}")
    trained_ppl = neutral_perplexity(model, lm.tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    if recipe.adapter_dtype == "float16":
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.half()
    model.save_pretrained(out_dir)
    scrub_adapter_dir(out_dir, recipe.base_model)
    words_sha = hashlib.sha256(project_path(recipe.words).read_bytes()).hexdigest()[:16]
    card = {
        "alias": recipe.alias,
        "base_model": recipe.base_model,
        "base_fingerprint": lm.fingerprint,
        "summary": recipe_summary(recipe, len(train_fams)),
        "recipe": asdict(recipe),
        "init_adapter_sha256": init_sha,
        "data": {"generator_words_sha256": words_sha, "split_sizes": split_sizes,
                 "formats": {"train": list(_train_formats(recipe)), "validation": list(FORMAT_SPLITS["validation"]),
                             "test": list(FORMAT_SPLITS["test"])},
                 "n_train_pairs": len(train_examples),
                 "train_reasoning_pairs": sum(bool(i.meta["reasoning"]) for i, _, _ in train_examples),
                 "train_correction_pairs": sum(bool(i.meta["correction"]) for i, _, _ in train_examples),
                 # every pair whose rule precedes the field: user_turn's own layout and moved document_qa
                 "train_rule_first_pairs": sum(i.meta["rule_at"] == "before_field" for i, _, _ in train_examples),
                 "train_surface_varied_pairs": sum(bool(i.meta.get("surface")) for i, _, _ in train_examples),
                 "train_prior_cases_pairs": sum(bool(i.meta.get("prior_cases")) for i, _, _ in train_examples),
                 "train_pairs_by_format": {f: sum(i.meta["format"] == f for i, _, _ in train_examples)
                                           for f in _train_formats(recipe)}},
        "train_families": train_fams,
        "eval_families": held_fams,
        "data_hashes": {"train": _seq_hash(train_examples),
                        "eval": data_hash([pair for items in eval_sets.values() for _, pair in items])},
        "selection": "recipe chosen on the validation sets only (validation families, the validation format "
                     "and the train formats); test draws are scored after training, by `kvprobe organism test` alone "
                     "(logged)",
        "heldout_eval": {"before": base_eval, "after": trained},
        "validation_curve": val_curve,
        "neutral_perplexity": {"before": base_ppl, "after": trained_ppl, "text": NEUTRAL_TEXT.name,
                               "relative_change": trained_ppl / base_ppl - 1},
        "loss_curve": [x[0] for x in losses][:: max(1, len(losses) // 40)],
        "kl_curve": [x[1] for x in losses][:: max(1, len(losses) // 40)],
        "final_loss_mean_last10": sum(x[0] for x in losses[-10:]) / max(1, len(losses[-10:])),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    return TrainResult(out_dir, card)
