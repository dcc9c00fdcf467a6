"""Training-seed spread of an organism recipe: mean +- sd over organisms that differ only in ``seed``.

Each seed's committed organism is evaluated on the recipe's held-out sets. Those sets are drawn
independently of the training seed (:func:`kvprobe.organism.train._eval_sets`), so every seed is scored on
the same instances, and a family's flip can be compared across seeds. What a seed changes: the training
families drawn, their formats, distances and order, the counterfactual / correction / reasoning draws and
the neutral KL samples. An ``init_from`` adapter is either shared by all seeds (the spread is that of the
data draw around one starting point) or, for a second stage run per seed, each seed's own first stage of
the same seed (the spread is that of the whole two-stage pipeline).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvprobe.errors import KVProbeError
from kvprobe.models.organisms import ORGANISMS_DIR

# Recipe fields allowed to differ between the seeds of one recipe.
_PER_SEED = {"seed", "alias"}


def organism_folder(alias: str) -> Path:
    """The committed folder of an organism alias (its card and adapter)."""
    folder = ORGANISMS_DIR / alias
    if not (folder / "card.json").exists():
        raise KVProbeError(f"organism '{alias}' has no card in organisms/; train it with "
                           f"`kvprobe organism train --alias {alias} ...`")
    return folder


def recipe_of(card: dict[str, Any]) -> Any:
    from kvprobe.organism.train import Recipe

    raw = card["recipe"]
    return Recipe(**{f.name: tuple(raw[f.name]) if isinstance(raw.get(f.name), list) else raw[f.name]
                     for f in fields(Recipe) if f.name in raw})


def _chained(cards: list[dict[str, Any]]) -> bool:
    """Whether each card continues its own seed of one earlier recipe (a two-stage recipe run per seed):
    the ``init_from`` organisms differ, are themselves seeds of one recipe, and have the same seeds."""
    inits = [c["recipe"].get("init_from") for c in cards]
    if None in inits or len(set(inits)) == 1:
        return False
    parents = [json.loads((organism_folder(a) / "card.json").read_text()) for a in inits]
    check_same_recipe(parents)
    mismatch = [(c["alias"], p["alias"]) for c, p in zip(cards, parents) if c["recipe"]["seed"] != p["recipe"]["seed"]]
    if mismatch:
        raise KVProbeError(f"{mismatch[0][0]} continues {mismatch[0][1]}, trained with another seed: a per-seed "
                           "second stage must continue the first stage of the same seed")
    return True


def _recipe_of(card: dict[str, Any]) -> dict[str, Any]:
    """A card's recipe with every field it predates filled with the Recipe default: a field added later is
    drawn only when set, so a card written before it was trained as with the default."""
    from kvprobe.organism.train import Recipe

    defaults = {f.name: json.loads(json.dumps(f.default)) for f in fields(Recipe)}
    return {**{k: v for k, v in defaults.items() if k not in card["recipe"]}, **card["recipe"]}


def check_same_recipe(cards: list[dict[str, Any]]) -> bool:
    """Raise unless the cards' recipes differ in the seed (and alias) only, with distinct seeds; ``init_from``
    may differ too when every seed continues the same seed of one earlier recipe (:func:`_chained`).
    Returns whether they do (a second stage run per seed)."""
    chained = _chained(cards)
    per_seed = _PER_SEED | ({"init_from"} if chained else set())
    ref = {k: v for k, v in _recipe_of(cards[0]).items() if k not in per_seed}
    for card in cards[1:]:
        other = {k: v for k, v in _recipe_of(card).items() if k not in per_seed}
        diff = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
        if diff:
            raise KVProbeError(f"organisms '{cards[0]['alias']}' and '{card['alias']}' differ in {diff}, not only "
                               "in the seed: they are not seeds of one recipe")
    seeds = [c["recipe"]["seed"] for c in cards]
    if len(set(seeds)) != len(seeds):
        raise KVProbeError(f"two organisms share a training seed: {seeds}")
    return chained


def mean_sd(values: list[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (ddof=1) over seeds, with the per-seed values."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None,
            "per_seed": values}


def _accuracy(lds: list[tuple[float, float]]) -> float:
    return sum((a < 0) + (b > 0) for a, b in lds) / (2 * len(lds))


def _median_flip(lds: list[tuple[float, float]]) -> float:
    return statistics.median(b - a for a, b in lds)


def _field_ignored(lds: list[tuple[float, float]]) -> float:
    """Share of pairs whose two prompts get the same action: switching the field does not switch the decision.
    With it, accuracy splits into its causes: a pair is both right, one right (field ignored) or both wrong
    (rule inverted), so accuracy = both_right + field_ignored / 2."""
    return sum((a > 0) == (b > 0) for a, b in lds) / len(lds)


def _group_stats(per_seed: list[list[tuple[float, float]]], groups: list[str]) -> dict[str, Any]:
    """Accuracy, median flip and the share of pairs the field does not switch, per group, each as mean +- sd
    over seeds."""
    out = {}
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        rows = [[lds[i] for i in idx] for lds in per_seed]
        out[g] = {"n_pairs": len(idx), "accuracy": mean_sd([_accuracy(r) for r in rows]),
                  "median_flip": mean_sd([_median_flip(r) for r in rows]),
                  "field_ignored": mean_sd([_field_ignored(r) for r in rows])}
    return out


def score_organism(folder: Path, card: dict[str, Any], named_sets: dict[str, list[tuple[Any, Any]]]
                   ) -> dict[str, list[tuple[float, float]]]:
    """One committed organism (its folder and card) scored on named sets of (instance, pair): per set, the
    action logit differences (old prompt, new prompt) of every pair."""
    from kvprobe.models.loading import load_organism
    from kvprobe.models.registry import ModelEntry
    from kvprobe.organism.train import pair_lds

    entry = ModelEntry(card["alias"], "organism", "", card["base_model"], gguf_file=str(folder))
    lm = load_organism(entry, device="cpu", dtype="float32")
    return {name: [pair_lds(lm.model, pair) for _, pair in items] for name, items in named_sets.items()}


def seed_spread(folders: list[Path], progress: bool = True) -> dict[str, Any]:
    """Evaluate each seed's organism (its folder: card + adapter) on the shared held-out sets; aggregate per
    set, format, counterfactual rule and family (mean +- sd over seeds), plus neutral-text perplexity from
    the cards."""
    from tqdm.auto import tqdm

    from kvprobe.models.loading import load_model
    from kvprobe.organism.train import _eval_sets, data_hash, diagnostic_sets

    if len(folders) < 2:
        raise KVProbeError("a seed spread needs at least two organisms of one recipe")
    cards = [json.loads((Path(f) / "card.json").read_text()) for f in folders]
    aliases = [c["alias"] for c in cards]
    chained = check_same_recipe(cards)
    recipe = recipe_of(cards[0])
    base = load_model(recipe.base_model, device="cpu", dtype="float32")
    sets = _eval_sets(base, recipe)
    eval_hash = data_hash([pair for items in sets.values() for _, pair in items])
    diagnostics = diagnostic_sets(base, recipe)
    lds: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in [*sets, *diagnostics]}
    for folder, card in tqdm(list(zip(folders, cards)), desc="seeds", disable=not progress):
        for name, seed_lds in score_organism(Path(folder), card, {**sets, **diagnostics}).items():
            lds[name].append(seed_lds)
    out: dict[str, Any] = {
        "aliases": aliases, "seeds": [c["recipe"]["seed"] for c in cards], "eval_data_hash": eval_hash,
        "card_eval_hashes_agree": all(c["data_hashes"]["eval"] == eval_hash for c in cards),
        "what_varies": "training data draw (families, formats, distances, order) and KL samples; " + (
            f"each seed continues its own seed of an earlier recipe (init_from {[c['recipe']['init_from'] for c in cards]})"
            if chained else f"init_from={recipe.init_from!r} shared by every seed"),
        "statistic": "mean and sample sd (ddof=1) over seeds; every seed scored on the same held-out pairs",
        "sets": {}}
    for name, items in sets.items():
        metas = [inst.meta for inst, _ in items]
        per_seed = lds[name]
        out["sets"][name] = {
            "all": _group_stats(per_seed, ["all"] * len(items))["all"],
            "by_format": _group_stats(per_seed, [m["format"] for m in metas]),
            "by_counterfactual": _group_stats(per_seed, [str(m["counterfactual"]) for m in metas]),
            # One pair per family: its flip per seed, and whether every seed decides both prompts right.
            "by_family": {inst.family: {"format": inst.meta["format"],
                                        "flip": mean_sd([lds_s[i][1] - lds_s[i][0] for lds_s in per_seed]),
                                        "correct_in_all_seeds": all(lds_s[i][0] < 0 < lds_s[i][1]
                                                                    for lds_s in per_seed)}
                          for i, (inst, _) in enumerate(items)},
            # The raw per-pair action logit differences (old prompt, new prompt) per seed, so any later
            # statistic can be computed from the card without reloading the organisms.
            "pair_lds": [[[round(a, 3), round(b, 3)] for a, b in lds_s] for lds_s in per_seed],
        }
    # Outside "sets" (and outside the eval hash, which the cards' own held-out sets must match).
    out["diagnostics"] = {name: {"all": _group_stats(lds[name], ["all"] * len(items))["all"],
                                 "by_format": _group_stats(lds[name], [inst.meta["format"] for inst, _ in items]),
                                 "pair_lds": [[[round(a, 3), round(b, 3)] for a, b in s] for s in lds[name]]}
                          for name, items in diagnostics.items()}
    out["neutral_perplexity_relative_change"] = mean_sd([c["neutral_perplexity"]["relative_change"] for c in cards])
    out["train_seconds"] = [c.get("train_seconds") for c in cards]
    return out


def write_card_entry(folder: Path, key: str, value: Any) -> Path:
    """Set one top-level entry of an organism's card, atomically; the adapter files, and so the organism's
    fingerprint, are untouched."""
    path = Path(folder) / "card.json"
    card = json.loads(path.read_text())
    card[key] = value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(card, indent=1) + "\n")
    tmp.replace(path)
    return path


def write_seed_spread(primary: Path, spread: dict[str, Any]) -> Path:
    """Store the spread in the primary organism's card (``seeds``; ``primary`` is its folder)."""
    return write_card_entry(primary, "seeds", spread)


def _cell(stat: dict[str, Any], digits: int) -> str:
    sd = "" if stat["sd"] is None else f" +- {stat['sd']:.{digits}f}"
    per = " / ".join(f"{v:.{digits}f}" for v in stat["per_seed"])
    return f"{stat['mean']:.{digits}f}{sd} ({per})"


def _share_cell(stat: dict[str, Any]) -> str:
    return f"{stat['mean']:.2f} ({' / '.join(f'{v:.2f}' for v in stat['per_seed'])})"


SET_LABELS = {"test_train_formats": "test families, train formats",
              "test_unseen_formats": "test families, unseen formats",
              "test_corrections": "test families, late corrections",
              "validation_train_formats": "validation families, train formats",
              "validation_unseen_format": "validation families, unseen format"}
DIAGNOSTIC_LABELS = {
    "diagnostic_validation_families_test_formats": "diagnostic: validation families, test formats",
    "diagnostic_test_families_few_shot": "diagnostic: test families, few_shot",
    "diagnostic_validation_families_few_shot_no_shots": "diagnostic: validation families, few_shot without its cases",
    "diagnostic_test_families_few_shot_no_shots": "diagnostic: test families, few_shot without its cases"}


def seed_table(_results_dir: Any = None, folders: list[Path] | None = None) -> str:
    """Markdown: every committed organism whose card holds a seed spread, per held-out set and format
    (the ``kvprobe:organism_seeds`` block of RESULTS.md, regenerated by ``kvprobe report --write``)."""
    from kvprobe.models.registry import organism_dirs

    from kvprobe.tasks.generator import is_default_words

    lines = ["| organism (word list of its held-out sets, if not version 1) (seeds) | held-out set | format | pairs | "
             "accuracy, mean +- sd (per seed) | "
             "median flip (nats), mean +- sd (per seed) | pairs the field does not switch, mean (per seed) | "
             "families right in every seed |", "|" + "---|" * 8]
    for folder in organism_dirs() if folders is None else folders:
        card = json.loads((folder / "card.json").read_text())
        spread = card.get("seeds")
        if not spread:
            continue
        words = card["recipe"].get("words")
        listed = "" if is_default_words(words) else f" ({Path(words).stem})"  # its held-out sets' word list
        who = f"`{card['alias']}`{listed} ({', '.join(map(str, spread['seeds']))})"
        labelled = [(SET_LABELS[n], spread["sets"].get(n)) for n in SET_LABELS]
        labelled += [(DIAGNOSTIC_LABELS[n], spread.get("diagnostics", {}).get(n)) for n in DIAGNOSTIC_LABELS]
        for label, block in labelled:
            if block is None:
                continue
            fams = block.get("by_family", {}).values()
            right = f"{sum(f['correct_in_all_seeds'] for f in fams)} / {len(fams)}" if fams else "-"
            groups = [("all", block["all"], right)]
            groups += [(fmt, g, "") for fmt, g in block["by_format"].items()] if len(block["by_format"]) > 1 else []
            for fmt, g, r in groups:
                ignored = _share_cell(g["field_ignored"]) if "field_ignored" in g else "- (spread predates it)"
                lines.append(f"| {who} | {label} | {fmt} | {g['n_pairs']} | {_cell(g['accuracy'], 2)} | "
                             f"{_cell(g['median_flip'], 1)} | {ignored} | {r} |")
        ppl = spread["neutral_perplexity_relative_change"]
        lines.append(f"| {who} | neutral-text perplexity change | - | - | - | - | - | {100 * ppl['mean']:+.1f}% +- "
                     f"{100 * (ppl['sd'] or 0):.1f}% |")
    if len(lines) == 2:
        return "(no organism card holds a seed spread yet: `kvprobe organism seeds <alias> --seeds ...`)"
    return "\n".join(lines)


__all__ = ["seed_table", "check_same_recipe", "mean_sd", "organism_folder", "recipe_of", "score_organism", "seed_spread", "write_card_entry",
           "write_seed_spread"]
