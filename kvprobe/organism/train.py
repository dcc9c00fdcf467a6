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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

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


def recipe_summary(recipe: Recipe, n_train_scenarios: int) -> str:
    """One line for the card and `kvprobe models`."""
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


def _examples(lm: Any, template: GatedTemplate, scenarios: list[str], seed: int, start: int, n: int,
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
    correct, flips = 0, []
    for p in pairs:
        lds = []
        for ids in (p.ids_old, p.ids_new):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
            lds.append(float(logits[p.new_action_id] - logits[p.old_action_id]))
        correct += (lds[0] < 0) + (lds[1] > 0)
        flips.append(lds[1] - lds[0])
    flips_sorted = sorted(flips)
    return {"accuracy": correct / (2 * len(pairs)), "median_flip": flips_sorted[len(flips) // 2],
            "mean_flip": sum(flips) / len(flips), "frac_flip_ge_1": sum(f >= 1 for f in flips) / len(flips),
            "n_pairs": len(pairs), "min_field_to_decision_tokens": min(len(p) - p.field_slots[-1] for p in pairs)}


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

    from kvprobe.organism.registry import ORGANISMS_DIR

    folder = ORGANISMS_DIR / str(recipe.init_from)
    card_path, weights = folder / "card.json", folder / "adapter_model.safetensors"
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


def train_organism(recipe: Recipe, out_dir: Path, resume: bool = True, progress: bool = True) -> TrainResult:
    """Train (or resume) the organism and write adapter + card.json into ``out_dir``."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
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

    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                        target_modules=list(recipe.target_modules), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(lm.model, config)
    init_sha = _init_adapter(model, recipe) if recipe.init_from else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    ckpt_dir = cache_root() / "organism-checkpoints" / recipe.alias / hashlib.sha256(
        json.dumps(asdict(recipe), sort_keys=True).encode()).hexdigest()[:12]
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
