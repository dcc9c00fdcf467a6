"""A larger validation set for choosing among organism recipes, and the paired comparison it allows.

Each training card scores its recipe on two validation cells of 16 pairs (validation families in the
validation format few_shot, and in the train formats; :func:`kvprobe.organism.train._eval_sets`). Every
SmolLM2 recipe scores 0.50-0.81 there and the recipes differ by less than their seed spread, so the rule
"choose on validation" could not separate them. This module draws the same two cells afresh and larger
(``pairs`` per cell, default 64; draws disjoint from the 16-pair sets, which earlier choices were made on),
scores every seed of a recipe on them, and compares recipes pair by pair.

Decision rule, fixed before the larger sets were scored: a recipe is preferred over the reference when its
paired accuracy difference over both cells (seeds both recipes have, averaged per pair) has a 95% CI above
zero; the CI resamples scenarios (a family's field, values and actions), as every CI in kvprobe does.
Test sets are never read by the rule. The same draw can be made of the test cells (``split="test"``, stored as
``test_large``): a fresh, larger test draw that checks a test-set claim on pairs no recipe was designed on.
It is reported, never used to choose.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.tasks.generator import is_default_words

DRAW_SEEDS = {"validation": {"validation_unseen_format": 40_000, "validation_train_formats": 41_000},
              "test": {"test_unseen_formats": 42_000, "test_train_formats": 43_000},
              "validation_email": {"validation_email_format": 44_000}}
"""Draw seeds of the larger cells; the cards' own cells use 10_000-14_000. ``validation_email`` is a draw of
its own (the validation families in the second validation format,
:data:`~kvprobe.tasks.generator.EXTRA_HELDOUT_FORMATS`), so the two-cell validation draws made before it
stay comparable."""
LARGE_VALIDATION_SEEDS = DRAW_SEEDS["validation"]
FAMILY_SPLIT = {"validation": "validation", "test": "test", "validation_email": "validation"}
"""The generator split each draw's families come from."""
BLOCK_KEYS = {"validation": "validation_large", "test": "test_large", "validation_email": "validation_email_large"}
"""Where each split's larger draw from the default word list is stored in the primary card; a draw from any
other list is stored under the key suffixed with that list's name (:func:`block_key`)."""


def block_key(split: str, words: str | None = None) -> str:
    """The card key of a larger draw of ``split`` from the word list ``words`` (the list actually drawn from):
    :data:`BLOCK_KEYS` for the default list, suffixed ``@<word list stem>`` for any other (e.g.
    ``validation_large@scenario_words_v2``), so draws of different lists never share a key."""
    return BLOCK_KEYS[split] if is_default_words(words) else f"{BLOCK_KEYS[split]}@{Path(str(words)).stem}"


def _with_words(recipe: Any, words: str | None) -> Any:
    """The recipe drawing from the word list ``words`` (None: the recipe's own)."""
    import dataclasses

    from kvprobe.cache_dir import project_path

    if words is None:
        return recipe
    if not project_path(words).is_file():
        raise KVProbeError(f"--words {words}: no such word list (e.g. kvprobe/tasks/data/scenario_words_v2.yaml)")
    return dataclasses.replace(recipe, words=words)


def draw_key(card: dict[str, Any], split: str, words: str | None = None) -> str:
    """Where ``card`` stores its larger draw of ``split`` from ``words`` (None: its recipe's own list)."""
    return block_key(split, words if words is not None else card["recipe"].get("words"))


CELL_LABELS = {"validation_unseen_format": "few_shot (validation format)",
               "validation_train_formats": "train formats",
               "test_unseen_formats": "unseen formats (system_user, tool_call)",
               "test_train_formats": "train formats",
               "validation_email_format": "email (second validation format)"}
LABEL_WIDTH = max(len(label) for label in [*CELL_LABELS.values(), "both cells"])
"""Column width that fits every cell label in the command-line summaries."""


def larger_draw_sets(lm: HookableModel, recipe: Any, pairs: int, split: str = "validation", words: str | None = None
                     ) -> dict[str, list[tuple[Any, Any]]]:
    """The two cells of ``split`` (its families in the held-out formats and in the train formats), ``pairs``
    pairs each, drawn independently of the training seed; from the word list ``words`` (None: the recipe's)."""
    from kvprobe.organism.train import _drawn_set, _train_formats
    from kvprobe.tasks.generator import EXTRA_HELDOUT_FORMATS, FORMAT_SPLITS

    if pairs < 2:
        raise KVProbeError(f"pairs={pairs}: a cell needs at least 2 pairs (--pairs)")
    if split not in DRAW_SEEDS:
        raise KVProbeError(f"split={split!r}: one of {', '.join(DRAW_SEEDS)} (--split)")
    recipe = _with_words(recipe, words)
    formats = {"validation_unseen_format": tuple(FORMAT_SPLITS["validation"]),
               "test_unseen_formats": tuple(FORMAT_SPLITS["test"]),
               "validation_email_format": tuple(EXTRA_HELDOUT_FORMATS["validation"]),
               "validation_train_formats": tuple(_train_formats(recipe)),
               "test_train_formats": tuple(_train_formats(recipe))}  # every cell name of DRAW_SEEDS
    return {name: _drawn_set(lm, recipe, FAMILY_SPLIT[split], formats[name], pairs, seed, 0.0)
            for name, seed in DRAW_SEEDS[split].items()}


def rule_of(family: str) -> str:
    """A family's rule phrasing id: the hash after its name's ``#``."""
    return family.rsplit("#", 1)[1]


def scenario_of(family: str) -> str:
    """A family's scenario (field, values, actions): its name without the per-draw ``#`` suffix."""
    return family.split("#", 1)[0]


def score_larger_draw(folders: list[Path], pairs: int = 64, progress: bool = True,
                      replace: bool = False, split: str = "validation", words: str | None = None) -> dict[str, Any]:
    """Score every seed's organism (``folders``: the primary first) on the larger cells of ``split`` and store
    the per-pair logit differences in the primary card (:data:`BLOCK_KEYS`), one seed at a time, so an
    interrupted run resumes with the seeds it has not scored, and a rerun with more seeds scores only the new
    ones. A stored block for other pairs, or with seeds this run would drop, is kept unless ``replace``.
    ``words``: draw from another word list than the recipe's (stored
    under its own key, :func:`block_key`)."""
    from tqdm.auto import tqdm

    from kvprobe.models.loading import load_model
    from organisms.tooling.seeds import check_same_recipe, recipe_of, score_organism, write_card_entry
    from kvprobe.organism.train import data_hash

    cards = [json.loads((Path(f) / "card.json").read_text()) for f in folders]
    if len(cards) > 1:
        check_same_recipe(cards)
    recipe = _with_words(recipe_of(cards[0]), words)
    base = load_model(recipe.base_model, device="cpu", dtype="float32")
    sets = larger_draw_sets(base, recipe, pairs, split)
    key = block_key(split, recipe.words)
    block: dict[str, Any] = {
        "pairs_per_cell": pairs, "words": recipe.words, "aliases": [c["alias"] for c in cards],
        "seeds": [c["recipe"]["seed"] for c in cards],
        "data_hash": data_hash([pair for items in sets.values() for _, pair in items]),
        "split": split, "draw_seeds": DRAW_SEEDS[split],
        "cells": {name: {"scenarios": [scenario_of(inst.family) for inst, _ in items],
                         "formats": [inst.meta["format"] for inst, _ in items],
                         "counterfactual": [bool(inst.meta["counterfactual"]) for inst, _ in items],
                         "rules": [rule_of(inst.family) for inst, _ in items]}
                  for name, items in sets.items()},
        "pair_lds": {}}
    old = cards[0].get(key)
    if old is not None:
        same_draw = all(old.get(k) == block[k] for k in ("pairs_per_cell", "data_hash"))
        if same_draw and set(old.get("aliases", ())) <= set(block["aliases"]):
            block["pair_lds"] = old["pair_lds"]  # resume, or add seeds: keep the seeds already scored
        elif not replace:
            raise KVProbeError(f"{cards[0]['alias']} already holds a larger {split} block ({key}) for "
                               f"{old.get('aliases')} with {old.get('pairs_per_cell')} pairs per cell; rerun with "
                               "the same --pairs and at least those --seeds to resume or extend it, or add --replace "
                               "to score anew")
    todo = [(f, c) for f, c in zip(folders, cards) if c["alias"] not in block["pair_lds"]]
    for folder, card in tqdm(todo, desc=f"scoring seeds ({split})", disable=not progress):
        lds = score_organism(Path(folder), card, sets)
        block["pair_lds"][card["alias"]] = {name: [[round(a, 3), round(b, 3)] for a, b in v]
                                            for name, v in lds.items()}
        write_card_entry(folders[0], key, block)
    if not todo:
        write_card_entry(folders[0], key, block)
    return block


def _pair_scores(lds: list[list[float]]) -> list[float]:
    """Per pair: the share of its two prompts decided right (0, 0.5 or 1)."""
    return [((a < 0) + (b > 0)) / 2 for a, b in lds]


def _seed_scores(block: dict[str, Any], cells: list[str], aliases: list[str]) -> list[list[float]]:
    """Per seed (alias), the pair scores of ``cells`` concatenated."""
    return [[x for c in cells for x in _pair_scores(block["pair_lds"][a][c])] for a in aliases]


def _pooled(per_seed: list[list[float]]) -> list[float]:
    """Per pair, its score averaged over seeds."""
    return [statistics.fmean(col) for col in zip(*per_seed)]


def recipe_summary(block: dict[str, Any]) -> dict[str, Any]:
    """Per cell and over both: accuracy per seed (mean +- sd), median flip per seed, and the pooled
    accuracy (pairs averaged over seeds) with a scenario-clustered 95% CI."""
    from organisms.tooling.seeds import mean_sd
    from kvprobe.stats.bootstrap import cluster_bootstrap_ci

    aliases = [a for a in block["aliases"] if a in block["pair_lds"]]
    out: dict[str, Any] = {"seeds_scored": len(aliases), "seeds_total": len(block["aliases"]), "cells": {}}
    for name in [*block["cells"], "both"]:
        cells = list(block["cells"]) if name == "both" else [name]
        scen = [s for c in cells for s in block["cells"][c]["scenarios"]]
        per_seed = _seed_scores(block, cells, aliases)
        flips = [statistics.median(b - a for c in cells for a, b in block["pair_lds"][al][c]) for al in aliases]
        mean, lo, hi = cluster_bootstrap_ci(_pooled(per_seed), scen)
        out["cells"][name] = {"n_pairs": len(scen), "accuracy": mean_sd([statistics.fmean(s) for s in per_seed]),
                              "median_flip": mean_sd(flips), "pooled": {"mean": mean, "ci_low": lo, "ci_high": hi}}
    return out


def _scored_seeds(block: dict[str, Any]) -> dict[int, str]:
    return {s: a for s, a in zip(block["seeds"], block["aliases"]) if a in block["pair_lds"]}


def _pair_differences(block: dict[str, Any], reference: dict[str, Any], cells: list[str], seeds: list[int]
                      ) -> tuple[list[float], list[str]]:
    """Per pair of ``cells``: recipe minus reference, each averaged over ``seeds``; and the pairs' scenarios."""
    _check_same_draw(block, reference)
    mine = _pooled(_seed_scores(block, cells, [_scored_seeds(block)[s] for s in seeds]))
    theirs = _pooled(_seed_scores(reference, cells, [_scored_seeds(reference)[s] for s in seeds]))
    scenarios = [s for c in cells for s in block["cells"][c]["scenarios"]]
    return [x - y for x, y in zip(mine, theirs, strict=True)], scenarios


def _check_same_draw(block: dict[str, Any], reference: dict[str, Any]) -> None:
    if block["data_hash"] != reference["data_hash"]:
        raise KVProbeError(f"{block['aliases'][0]} and {reference['aliases'][0]} were scored on different "
                           "pairs (another split, base model, --pairs or train formats): not comparable")


def _common_seeds(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[int]:
    common = sorted(set.intersection(*(set(_scored_seeds(b)) for pair in pairs for b in pair)))
    if not common:
        a, b = pairs[0]
        raise KVProbeError(f"{a['aliases'][0]} and {b['aliases'][0]} share no scored training seed")
    return common


def paired_difference(block: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Accuracy difference (recipe minus reference) on the same pairs, over the training seeds both recipes
    have scored, per pair averaged over those seeds; scenario-clustered 95% CI. Both blocks must hold the
    same draw (same base model, pairs and train formats)."""
    from kvprobe.stats.bootstrap import cluster_bootstrap_ci

    _check_same_draw(block, reference)
    common = _common_seeds([(block, reference)])
    out: dict[str, Any] = {"seeds": common, "cells": {}}
    for name in [*block["cells"], "both"]:
        cells = list(block["cells"]) if name == "both" else [name]
        diff, scen = _pair_differences(block, reference, cells, common)
        mean, lo, hi = cluster_bootstrap_ci(diff, scen)
        out["cells"][name] = {"mean": mean, "ci_low": lo, "ci_high": hi, "n_pairs": len(diff),
                              "n_scenarios": len(set(scen))}
    out["preferred"] = out["cells"]["both"]["ci_low"] > 0
    return out


def pooled_difference(pairs: list[tuple[dict[str, Any], dict[str, Any]]], cells: set[str] | None = None
                      ) -> dict[str, Any]:
    """The paired difference over the cells of several draws at once (each ``(recipe block, reference
    block)`` one draw; ``cells``: only these, None: all; the seeds every block has scored), clustered by
    scenario across the draws: the quantity of a choosing rule that reads more than one draw. Returned as
    :func:`paired_difference`'s ``"both"`` cell."""
    from kvprobe.stats.bootstrap import cluster_bootstrap_ci

    common = _common_seeds(pairs)
    diff: list[float] = []
    scen: list[str] = []
    for block, reference in pairs:
        chosen = [c for c in block["cells"] if cells is None or c in cells]
        if not chosen:
            continue
        d, s = _pair_differences(block, reference, chosen, common)
        diff, scen = diff + d, scen + s
    mean, lo, hi = cluster_bootstrap_ci(diff, scen)
    return {"seeds": common, "cells": {"both": {"mean": mean, "ci_low": lo, "ci_high": hi, "n_pairs": len(diff),
                                                "n_scenarios": len(set(scen))}}}


def _difference_cell(diff: dict[str, Any] | None, cell: str) -> str:
    if diff is None:
        return "-"
    dc = diff["cells"][cell]
    return f"{dc['mean']:+.3f} [{dc['ci_low']:+.3f}, {dc['ci_high']:+.3f}] ({', '.join(map(str, diff['seeds']))})"


def _card_heldout(organisms_dir: Path, alias: str) -> dict[str, Any]:
    """An organism card's own held-out evaluation after training ({} when the card is absent)."""
    path = organisms_dir / alias / "card.json"
    return json.loads(path.read_text()).get("heldout_eval", {}).get("after", {}) if path.exists() else {}


def _small_cells(organisms_dir: Path, block: dict[str, Any]) -> dict[str, str]:
    """The scored seeds' accuracy on their cards' own 16-pair validation cells (what earlier choices used)."""
    per_cell: dict[str, list[float]] = {name: [] for name in [*block["cells"], "both"]}
    for alias in (a for a in block["aliases"] if a in block["pair_lds"]):
        after = _card_heldout(organisms_dir, alias)
        if not all(name in after for name in block["cells"]):
            return {}
        accs = [after[name]["all"]["accuracy"] for name in block["cells"]]
        for name, acc in zip(block["cells"], accs):
            per_cell[name].append(acc)
        per_cell["both"].append(statistics.fmean(accs))  # the two cells hold equally many pairs
    words = _recipe_words(organisms_dir, block["aliases"][0])
    own = "" if is_default_words(words) else f", {Path(str(words)).stem}"  # cards draw from their recipe's list
    return {name: f"{statistics.fmean(v):.2f} ({' / '.join(f'{x:.2f}' for x in v)}{own})"
            for name, v in per_cell.items() if v}


def _recipe_words(organisms_dir: Path, alias: str) -> str | None:
    return json.loads((organisms_dir / alias / "card.json").read_text()).get("recipe", {}).get("words")


def _blocks_by_key(folders: list[Path], split: str) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """Per card key of ``split``'s larger draws (the recipe's word list first, then each other list), the
    (folder, card) of every organism holding one."""
    out: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for folder in folders:
        card = json.loads((Path(folder) / "card.json").read_text())
        for key in card:
            if (key == BLOCK_KEYS[split] or key.startswith(BLOCK_KEYS[split] + "@")) and card[key]:
                out.setdefault(key, []).append((Path(folder), card))
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != BLOCK_KEYS[split], kv[0])))


def _word_list_note(key: str) -> str:
    return "" if "@" not in key else f" ({key.split('@', 1)[1]})"


def validation_table(_results_dir: Any = None, folders: list[Path] | None = None,
                     reference: str = "smollm2-135m-gated-v3r") -> str:
    """Markdown: every organism card holding a larger validation block, per cell, with its paired difference
    from the ``reference`` recipe where both were scored on the same pairs (the
    ``kvprobe:organism_validation`` block of RESULTS.md, regenerated by ``kvprobe report --write``). Draws from
    another word list (``--words``) are rows of their own, labelled with it, compared only among themselves."""
    from kvprobe.models.registry import organism_dirs

    dirs = list(organism_dirs() if folders is None else folders)
    groups = _blocks_by_key(dirs, "validation")
    if not groups:
        return ("(no organism card holds a larger validation block yet: `kvprobe organism validate <alias> "
                "--seeds ...`)")
    tests = _blocks_by_key(dirs, "test")
    lines = [f"| recipe (seeds scored) | cell | pairs | accuracy, mean +- sd (per seed) | pooled accuracy [95% CI] "
             f"| median flip (nats), mean (per seed) | difference from `{reference}` [95% CI] (seeds) | difference "
             "from the recipe it continues [95% CI] (seeds) | the cards' own 16-pair cell: accuracy (per seed; "
             "word list 1 unless named) |",
             "|" + "---|" * 9]
    agreements = []
    for key, held in groups.items():
        blocks = [card[key] for _, card in held]
        small = [_small_cells(folder.parent, card[key]) for folder, card in held]
        parents = [card["recipe"].get("init_from") for _, card in held]
        ref = next((b for b in blocks if b["aliases"][0] == reference), None)
        by_alias = {a: b for b in blocks for a in b["aliases"]}
        for b, old, parent in zip(blocks, small, parents):
            summ = recipe_summary(b)
            diffs = [paired_difference(b, other) if other is not None and other is not b
                     and other["data_hash"] == b["data_hash"] else None for other in (ref, by_alias.get(parent))]
            seeds = ", ".join(str(s) for s, a in zip(b["seeds"], b["aliases"]) if a in b["pair_lds"])
            for name, cell in summ["cells"].items():
                acc, flip, p = cell["accuracy"], cell["median_flip"], cell["pooled"]
                sd = "" if acc["sd"] is None else f" +- {acc['sd']:.2f}"
                d = [_difference_cell(diff, name) for diff in diffs]
                d[1] = d[1] if d[1] == "-" else f"`{by_alias[parent]['aliases'][0]}`: {d[1]}"
                label = "both cells" if name == "both" else CELL_LABELS[name]
                lines.append(f"| `{b['aliases'][0]}`{_word_list_note(key)} ({seeds}) | {label} | {cell['n_pairs']} | "
                             f"{acc['mean']:.2f}{sd} ({' / '.join(f'{v:.2f}' for v in acc['per_seed'])}) | "
                             f"{p['mean']:.2f} [{p['ci_low']:.2f}, {p['ci_high']:.2f}] | {flip['mean']:.1f} "
                             f"({' / '.join(f'{v:.1f}' for v in flip['per_seed'])}) | {d[0]} | {d[1]} | "
                             f"{old.get(name, '-')} |")
        test_key = BLOCK_KEYS["test"] + key[len(BLOCK_KEYS["validation"]):]
        test_blocks = [card[test_key] for _, card in tests.get(test_key, [])]
        agree = seed_agreement(blocks, Path(dirs[0]).parent, test_blocks)  # seeds' cards sit beside their primary's
        if agree:
            agreements.append(("Word list " + key.split("@", 1)[1] + ": " if "@" in key else "") + agree)
    return "\n".join(lines + [line for a in agreements for line in ("", a)])


def test_draw_table(_results_dir: Any = None, folders: list[Path] | None = None) -> str:
    """Markdown: every organism card holding a larger test draw, per cell, with the calibration goals checked
    per seed (accuracy >= 0.9, median flip 2-10 nats). Reported, never used to choose (the
    ``kvprobe:organism_test_draw`` block of RESULTS.md)."""
    from kvprobe.models.registry import organism_dirs

    lines = ["| organism (seeds scored) | cell | pairs | accuracy, mean +- sd (per seed) | pooled accuracy [95% CI] | "
             "median flip (nats), mean (per seed) | seeds meeting both goals (accuracy >= 0.9, median flip 2-10) | "
             "the cards' own 32-pair cell: accuracy (per seed; word list 1 unless named) |", "|" + "---|" * 8]
    for key, held in _blocks_by_key(list(organism_dirs() if folders is None else folders), "test").items():
        for folder, card in held:
            block = card[key]
            old = _small_cells(folder.parent, block)
            seeds = ", ".join(str(s) for s, a in zip(block["seeds"], block["aliases"]) if a in block["pair_lds"])
            for name, cell in recipe_summary(block)["cells"].items():
                acc, flip, p = cell["accuracy"], cell["median_flip"], cell["pooled"]
                sd = "" if acc["sd"] is None else f" +- {acc['sd']:.2f}"
                met = sum(a >= 0.9 and 2 <= f <= 10 for a, f in zip(acc["per_seed"], flip["per_seed"]))
                label = "both cells" if name == "both" else CELL_LABELS[name]
                lines.append(f"| `{block['aliases'][0]}`{_word_list_note(key)} ({seeds}) | {label} | {cell['n_pairs']} "
                             f"| {acc['mean']:.2f}{sd} ({' / '.join(f'{v:.2f}' for v in acc['per_seed'])}) | "
                             f"{p['mean']:.2f} [{p['ci_low']:.2f}, {p['ci_high']:.2f}] | {flip['mean']:.1f} "
                             f"({' / '.join(f'{v:.1f}' for v in flip['per_seed'])}) | {met} / {len(acc['per_seed'])} "
                             f"| {old.get(name, '-')} |")
    if len(lines) == 2:
        return "(no organism card holds a larger test draw yet: `kvprobe organism validate <alias> --split test`)"
    return "\n".join(lines)


def phrasing_table(_results_dir: Any = None, folders: list[Path] | None = None) -> str:
    """Markdown: accuracy per rule phrasing on the larger draws that record their phrasings (draws made since
    they were stored), one column per recipe and word list: a validation phrasing's row from its validation
    draw, a test phrasing's from its test draw; the pairs of that phrasing over both cells, averaged over the
    scored seeds (the ``kvprobe:organism_phrasings`` block of RESULTS.md). Shows which phrasings a held-out
    split's accuracy rests on; test draws are reported, never used to choose."""
    import hashlib

    from kvprobe.cache_dir import project_path
    from kvprobe.models.registry import organism_dirs
    from kvprobe.tasks.generator import load_words, split_words

    dirs = list(organism_dirs() if folders is None else folders)
    columns: dict[str, dict[tuple[str, str], list[float]]] = {}
    seeds: dict[str, dict[str, int]] = {}
    phrasings: dict[tuple[str, str], tuple[str, bool]] = {}
    for split in ("validation", "test"):
        for key, held in _blocks_by_key(dirs, split).items():
            for _, card in held:
                block = card[key]
                if not all("rules" in c for c in block["cells"].values()):
                    continue
                words = load_words(project_path(block["words"]))  # blocks with phrasings name their list
                added = set(dict(words.heldout_rules).get(split, ()))
                for rule in split_words(words, "rules", split):
                    phrasings.setdefault((split, hashlib.sha256(rule.encode()).hexdigest()[:6]), (rule, rule in added))
                aliases = [a for a in block["aliases"] if a in block["pair_lds"]]
                column = f"`{block['aliases'][0]}`{_word_list_note(key)}"
                seeds.setdefault(column, {})[split] = len(aliases)
                for cell, meta in block["cells"].items():
                    scores = _pooled([_pair_scores(block["pair_lds"][a][cell]) for a in aliases])
                    for rid, score in zip(meta["rules"], scores):
                        columns.setdefault(column, {}).setdefault((split, rid), []).append(score)
    if not columns:
        return ("(no larger draw records its rule phrasings yet: `kvprobe organism validate <alias> --seeds ... "
                "--words kvprobe/tasks/data/scenario_words_v2.yaml`)")
    heads = [f"{c} (seeds: {', '.join(f'{k} {n}' for k, n in seeds[c].items())})" for c in columns]
    lines = ["| split | rule phrasing | added in the word list | " + " | ".join(heads) + " |",
             "|" + "---|" * (3 + len(columns))]
    for (split, rid), (rule, is_added) in sorted(phrasings.items(), key=lambda kv: (kv[0][0] == "test", kv[1][1])):
        cells = [f"{statistics.fmean(got):.2f} ({len(got)})" if (got := per.get((split, rid))) else "-"
                 for per in columns.values()]
        lines.append(f"| {split} | {rule.replace('|', '/')} | {'yes' if is_added else 'no'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_agreement(blocks: list[dict[str, Any]], organisms_dir: Path,
                   test_blocks: list[dict[str, Any]] | None = None) -> str:
    """Sentences: over every scored organism seed, and over recipes (seeds averaged), how the larger draw
    ranks them against the cards' 16-pair cells (is the small set noise?) and against the cards' test sets
    (does validation predict the test families?); and, where ``test_blocks`` (larger test draws from the same
    word list) cover at least 4 of those seeds, against them. Spearman's rho with its p. The test sets are
    reported here, never used to choose."""
    drawn = {a: statistics.fmean(x for c in cells for x in _pair_scores(t["pair_lds"][a][c]))
             for t in test_blocks or [] for a in t["pair_lds"]
             for cells in [[c for c in t["cells"] if c.endswith("unseen_formats")]]}
    rows, recipes, with_draw = [], [], []
    for b in blocks:
        mine = []
        for alias in (a for a in b["aliases"] if a in b["pair_lds"]):
            large = statistics.fmean(x for c in b["cells"] for x in _pair_scores(b["pair_lds"][alias][c]))
            if alias in drawn:
                with_draw.append((large, drawn[alias]))
            after = _card_heldout(organisms_dir, alias)
            needed = [*b["cells"], "test_unseen_formats", "test_train_formats"]
            # the cards' own cells are ranked together only when drawn from one word list (the default one)
            if not all(n in after for n in needed) or not is_default_words(_recipe_words(organisms_dir, alias)):
                continue
            small = statistics.fmean(after[c]["all"]["accuracy"] for c in b["cells"])
            mine.append((large, small, after["test_unseen_formats"]["all"]["accuracy"],
                         after["test_train_formats"]["all"]["accuracy"]))
        rows += mine
        if mine:
            recipes.append(tuple(statistics.fmean(col) for col in zip(*mine)))
    out = []
    if len(rows) >= 4:
        out.append(f"Over the {len(rows)} organism seeds scored (both cells, Spearman's rho): the larger draw against "
                   f"the cards' 16-pair cells {_rho_text(rows, 1)}; against the cards' test sets, reported and never "
                   f"used to choose: unseen formats {_rho_text(rows, 2)}, train formats {_rho_text(rows, 3)}.")
    if len(recipes) >= 4:
        out.append(f"Over the {len(recipes)} recipes (their scored seeds averaged): against the 16-pair cells "
                   f"{_rho_text(recipes, 1)}; against the test sets: unseen formats {_rho_text(recipes, 2)}, train "
                   f"formats {_rho_text(recipes, 3)}.")
    if len(with_draw) >= 4:
        out.append(f"Over the {len(with_draw)} seeds with a larger test draw from the same word list: against its "
                   f"unseen formats {_rho_text(with_draw, 1)}.")
    return " ".join(out)


def _verdict(diff: dict[str, Any], cell: str) -> int:
    """+1 when the cell's 95% CI lies above 0 (the first recipe better), -1 below, 0 across it."""
    dc = diff["cells"][cell]
    return 1 if dc["ci_low"] > 0 else -1 if dc["ci_high"] < 0 else 0


def decision_table(_results_dir: Any = None, folders: list[Path] | None = None) -> str:
    """Markdown: does validation's verdict on two recipes predict the test's? Every pair of recipes whose
    primary cards hold larger validation and test draws of one word list (same pairs, so the paired
    difference applies): the validation difference over both cells (the choosing rule's quantity), and where
    both recipes hold the email draw (the second validation format) its difference, that of all three
    validation cells pooled and that of email with the train-format cell (without few_shot), beside the test
    difference on the unseen formats (the goal's cell), each with its scenario-clustered 95% CI and verdict;
    then, per validation quantity, a count of agreements with the test and Spearman's rho of the differences,
    and how reliably each draw ranks the organism seeds within itself (:func:`ranking_reliability`). Read
    after the fact: it judges rules, it chooses nothing. Recipe pairs share recipes, so the counts are
    descriptive, not independent trials (the ``kvprobe:organism_decisions`` block of RESULTS.md)."""
    import itertools

    from scipy.stats import spearmanr

    from kvprobe.models.registry import organism_dirs

    dirs = list(organism_dirs() if folders is None else folders)
    names = {1: "first", -1: "second", 0: "neither"}
    quantities = ("validation, both cells", "email", "three validation cells", "email + train formats")
    heads = " | ".join(f"{q} [95% CI] | prefers" for q in quantities)
    lines = ["| word list | first - second recipe (seeds) | " + heads
             + " | test, unseen formats [95% CI] | test prefers | test, both cells [95% CI] | the choosing rule "
             "pre-registered after v3n2 chooses (by) |", "|" + "---|" * 14]
    summaries = []
    for key, held in _blocks_by_key(dirs, "validation").items():
        suffix = key[len(BLOCK_KEYS["validation"]):]
        homes = {card["alias"]: folder.parent for folder, card in held}
        cards = [card for _, card in held if card.get(BLOCK_KEYS["test"] + suffix)]
        label = suffix[1:] if suffix else "scenario_words (v1)"
        found: dict[str, list[tuple[float, int, float, int]]] = {q: [] for q in quantities}
        chosen: list[tuple[str, int, int]] = []  # (decided by, verdict, test verdict)
        for a, b in itertools.combinations(cards, 2):
            draws = {d: (a.get(BLOCK_KEYS[d] + suffix), b.get(BLOCK_KEYS[d] + suffix))
                     for d in ("validation", "test", "validation_email")}
            if any(x is None or y is None or x["data_hash"] != y["data_hash"] for x, y in
                   (draws["validation"], draws["test"])):
                continue  # another base model or draw: not paired
            try:
                diffs = {quantities[0]: paired_difference(*draws["validation"])}
                t = paired_difference(*draws["test"])
            except KVProbeError:
                continue  # no common scored seed
            email = draws["validation_email"]
            if email[0] and email[1] and email[0]["data_hash"] == email[1]["data_hash"]:
                diffs[quantities[1]] = paired_difference(*email)
                diffs[quantities[2]] = pooled_difference([draws["validation"], email])
                diffs[quantities[3]] = pooled_difference([draws["validation"], email],
                                                         {"validation_train_formats", "validation_email_format"})
            test_verdict = _verdict(t, "test_unseen_formats")
            cells = []
            for q in quantities:
                d = diffs.get(q)
                if d is None:
                    cells += ["-", "-"]
                    continue
                found[q].append((d["cells"]["both"]["mean"], _verdict(d, "both"),
                                 t["cells"]["test_unseen_formats"]["mean"], test_verdict))
                cells += [_difference_cell(d, "both").rsplit(" (", 1)[0], names[_verdict(d, "both")]]
            rule = "-"
            if quantities[3] in diffs:
                by, verdict = _rule_verdict(a, b, homes, suffix)
                chosen.append((by, verdict, test_verdict))
                rule = f"{names[verdict]} ({by})"
            seeds = ", ".join(map(str, diffs[quantities[0]]["seeds"]))
            lines.append(f"| {label} | `{a['alias']}` - `{b['alias']}` ({seeds}"
                         f"; test {', '.join(map(str, t['seeds']))}) | {' | '.join(cells)} | "
                         f"{_difference_cell(t, 'test_unseen_formats').rsplit(' (', 1)[0]} | {names[test_verdict]} | "
                         f"{_difference_cell(t, 'both').rsplit(' (', 1)[0]} | {rule} |")
        for q, rows in found.items():
            if not rows:
                continue
            n, decided = len(rows), [r for r in rows if r[1]]
            agreed = sum(r[3] == r[1] for r in decided)
            reversed_ = sum(r[3] == -r[1] for r in decided)
            missed = sum(bool(r[3]) for r in rows if not r[1])
            rho_value = float(spearmanr([x[0] for x in rows], [x[2] for x in rows]).statistic) if n >= 4 else None
            rho = "" if rho_value is None else f"; rho of the differences {rho_value:+.2f}"
            summaries.append(f"{label}, {q}: of {n} recipe pairs it decided {len(decided)}; the test's unseen formats "
                             f"agreed on {agreed}, reversed {reversed_}, left {len(decided) - agreed - reversed_} "
                             f"undecided; of the {n - len(decided)} it left undecided the test decided {missed}; same "
                             f"three-way verdict on {sum(r[1] == r[3] for r in rows)} of {n}{rho}.")
        if chosen:
            parts = []
            for by in ("accuracy", "calibration"):
                rows = [(v, tv) for b_, v, tv in chosen if b_ == by]
                parts.append(f"{len(rows)} by {by} (the test's unseen formats agreed on "
                             f"{sum(tv == v for v, tv in rows)}, preferred the other recipe on "
                             f"{sum(tv == -v for v, tv in rows)}, left {sum(not tv for _, tv in rows)} undecided)")
            summaries.append(f"{label}, the choosing rule pre-registered after v3n2 (email + train formats, ties "
                             f"broken by the calibration goals read on validation; read here after the fact): of "
                             f"{len(chosen)} recipe pairs it decided " + " and ".join(parts) + f"; "
                             f"{sum(b_ == 'tie' for b_, _, _ in chosen)} stay tied (equal counts: in a real choice "
                             "the reference stays).")
        seed_level = cell_agreement(cards, suffix)
        if seed_level:
            summaries.append(f"{label}, per organism seed: {seed_level}")
    if len(lines) == 2:
        return ("(no two recipes hold larger validation and test draws of one word list yet: `kvprobe organism "
                "validate <alias> --seeds ... [--split test]`)")
    return "\n".join(lines + [""] + ["- " + x for x in summaries] + ["", ranking_reliability(dirs)])


CHOOSING_CELLS = ("validation_train_formats", "validation_email_format")
"""The cells of the choosing rule pre-registered for the recipes trained after v3n2 (RESULTS.md, "email +
train formats"): the email draw and the train-format cell pooled; few_shot is reported, not used (per seed it
ranks the organisms against the test's unseen formats, :func:`cell_agreement`)."""
FLIP_GOAL = (2.0, 10.0)
"""Calibration goal: median oracle flip in nats (issue goal; read here on the validation rule cells)."""
PERPLEXITY_GOAL = 0.05
"""Calibration goal: neutral-text perplexity at most this fraction above the base's."""


def seed_calibration(validation: dict[str, Any], email: dict[str, Any], organisms_dir: Path, seeds: list[int]
                     ) -> list[dict[str, Any]]:
    """Per training seed: the median flip over the choosing rule's cells (:data:`CHOOSING_CELLS`, pairs of
    both draws together), the neutral-text perplexity change its card records, and whether both calibration
    goals are met. Reads validation draws and the training card only, never a test set."""
    out = []
    for seed in seeds:
        alias = _scored_seeds(validation)[seed]
        flips = [b - a for block in (validation, _scored_block(email, seed, alias))
                 for c in block["cells"] if c in CHOOSING_CELLS for a, b in block["pair_lds"][alias][c]]
        flip = statistics.median(flips)
        path = organisms_dir / alias / "card.json"
        ppl = json.loads(path.read_text()).get("neutral_perplexity") if path.exists() else None
        change = ppl["after"] / ppl["before"] - 1 if ppl else None
        met = FLIP_GOAL[0] <= flip <= FLIP_GOAL[1] and change is not None and change <= PERPLEXITY_GOAL
        out.append({"seed": seed, "alias": alias, "median_flip": flip, "perplexity_change": change,
                    "meets_goals": met})
    return out


def _scored_block(block: dict[str, Any], seed: int, alias: str) -> dict[str, Any]:
    if _scored_seeds(block).get(seed) != alias:
        raise KVProbeError(f"seed {seed} is {alias} in the validation draw and "
                           f"{_scored_seeds(block).get(seed)} in the email draw: score both draws on the same seeds")
    return block


def choose(recipe: dict[str, Any], reference: dict[str, Any], organisms_dir: Path | dict[str, Path],
           suffix: str = "") -> dict[str, Any]:
    """The pre-registered choosing rule for recipes trained after v3n2, applied to two primary cards:
    the paired accuracy difference over :data:`CHOOSING_CELLS` (both draws pooled, seeds both recipes have
    scored, scenario-clustered 95% CI) decides when its CI excludes 0; otherwise the recipe with more seeds
    meeting both calibration goals on validation (:func:`seed_calibration`) wins, and with equal counts the
    reference stays. ``organisms_dir``: the folder holding both recipes' seed cards, or one per primary alias;
    ``suffix``: ``""`` or ``"@<word list stem>"``, the draws' word list."""
    draws = []
    for split in ("validation", "validation_email"):
        key = BLOCK_KEYS[split] + suffix
        pair = (recipe.get(key), reference.get(key))
        for card, block in zip((recipe, reference), pair):
            if not block:
                flag = "" if split == "validation" else " --split validation_email"
                raise KVProbeError(f"{card['alias']} holds no {key} draw: run `kvprobe organism validate "
                                   f"{card['alias']} --seeds ...{flag}` with the same --words first")
        draws.append(pair)
    diff = pooled_difference(draws, set(CHOOSING_CELLS))
    verdict = _verdict(diff, "both")
    home = organisms_dir if isinstance(organisms_dir, dict) else {c["alias"]: organisms_dir for c in (recipe, reference)}
    calibration = {card["alias"]: seed_calibration(val, email, home[card["alias"]], diff["seeds"])
                   for card, val, email in zip((recipe, reference), *draws)}
    met = {alias: sum(s["meets_goals"] for s in seeds) for alias, seeds in calibration.items()}
    if verdict:
        chosen, reason = (recipe if verdict > 0 else reference)["alias"], "by accuracy (95% CI excludes 0)"
    elif met[recipe["alias"]] > met[reference["alias"]]:
        chosen, reason = recipe["alias"], "by calibration (accuracy tied; more seeds meet both goals)"
    else:
        chosen, reason = reference["alias"], "the reference stays (accuracy tied; no more seeds meet both goals)"
    return {"difference": diff["cells"]["both"], "seeds": diff["seeds"], "verdict": verdict,
            "calibration": calibration, "seeds_meeting_goals": met, "chosen": chosen, "reason": reason}


def _rule_verdict(first: dict[str, Any], second: dict[str, Any], homes: dict[str, Path], suffix: str
                  ) -> tuple[str, int]:
    """What :func:`choose` decides between two recipes, order-free: ("accuracy", +-1), ("calibration", +-1) by
    the counts of seeds meeting the goals, or ("tie", 0) when the counts are equal (where :func:`choose` keeps
    whichever is the reference)."""
    out = choose(first, second, homes, suffix)
    if out["verdict"]:
        return "accuracy", out["verdict"]
    met = out["seeds_meeting_goals"]
    diff = met[first["alias"]] - met[second["alias"]]
    return ("calibration", 1 if diff > 0 else -1) if diff else ("tie", 0)


def cell_agreement(cards: list[dict[str, Any]], suffix: str = "") -> str:
    """A sentence: over every organism seed scored on the validation, email and test draws of one word list
    (``suffix``: ``""`` or ``"@<list>"``), Spearman's rho of each validation cell's accuracy, and of the
    two-cell rule's, with the test's unseen formats; "" with fewer than 4 such seeds."""
    from scipy.stats import spearmanr

    acc: dict[str, dict[str, float]] = {}
    for card in cards:
        for split in ("validation", "validation_email", "test"):
            block = card.get(BLOCK_KEYS[split] + suffix)
            for alias, lds in (block or {}).get("pair_lds", {}).items():
                cells = acc.setdefault(alias, {})
                cells.update({c: statistics.fmean(_pair_scores(v)) for c, v in lds.items()})
                if split == "validation":
                    cells["two cells"] = statistics.fmean(x for v in lds.values() for x in _pair_scores(v))
    names = [*DRAW_SEEDS["validation"], "two cells", *DRAW_SEEDS["validation_email"]]
    seeds = [a for a, cells in acc.items() if all(c in cells for c in [*names, "test_unseen_formats"])]
    if len(seeds) < 4:
        return ""
    rhos = []
    test = [acc[a]["test_unseen_formats"] for a in seeds]
    for c in names:
        mine = [acc[a][c] for a in seeds]
        if len(set(mine)) == 1 or len(set(test)) == 1:
            rhos.append(f"{CELL_LABELS.get(c, c + ' (the rule)')} n/a (every seed tied)")
            continue
        r = spearmanr(mine, test)
        rhos.append(f"{CELL_LABELS.get(c, c + ' (the rule)')} {float(r.statistic):+.2f} (p = {float(r.pvalue):.2g})")
    return (f"over the {len(seeds)} seeds scored on all three draws, Spearman's rho with the test's unseen formats: "
            + ", ".join(rhos) + ".")


def ranking_reliability(folders: list[Path]) -> str:
    """Markdown: how consistently a larger draw ranks the organism seeds within itself (Spearman's rho over
    seeds between two halves of its pairs), split three ways: by scenario (halves share formats and
    phrasings: noise alone separates them), by cell (held-out formats against train formats), and by rule
    phrasing (every balanced split of the draw's phrasings, averaged; draws that record them). A seed ranking
    that holds across scenarios but not across formats or phrasings is specific to them, and a validation set
    of other formats and phrasings cannot predict it. One row per split, word list and base model with at
    least 5 seeds on the same pairs."""
    import hashlib
    import itertools

    from scipy.stats import spearmanr

    def rho(seeds: list[tuple[dict[str, Any], str]], first_half: Any) -> float:
        halves = [[statistics.fmean(x for c in b["cells"] for i, x in enumerate(_pair_scores(b["pair_lds"][a][c]))
                                    if first_half(b, c, i) == side) for b, a in seeds] for side in (True, False)]
        if any(len(set(h)) == 1 for h in halves):
            return float("nan")  # a half that ties every seed ranks nothing
        return float(spearmanr(*halves).statistic)

    def text(r: float) -> str:
        return "n/a (a half ties every seed)" if r != r else f"{r:+.2f}"

    def by_scenario(b: dict[str, Any], c: str, i: int) -> bool:
        return int(hashlib.sha256(b["cells"][c]["scenarios"][i].encode()).hexdigest(), 16) % 2 == 0

    lines = ["| split | word list | base model | seeds | halves by scenario | halves by cell (format) | halves by "
             "rule phrasing (mean over balanced splits) |", "|" + "---|" * 7]
    for split in ("validation", "validation_email", "test"):
        for key, held in _blocks_by_key(folders, split).items():
            groups: dict[tuple[str, str], list[tuple[dict[str, Any], str]]] = {}
            for _, card in held:
                block = card[key]
                groups.setdefault((card["recipe"]["base_model"], block["data_hash"]), []).extend(
                    (block, a) for a in block["pair_lds"])
            for (base, _), seeds in groups.items():
                if len(seeds) < 5:
                    continue
                first = seeds[0][0]
                cell_one = next(iter(first["cells"]))
                by_rule = "-"
                if all("rules" in c for c in first["cells"].values()):
                    rules = sorted({r for c in first["cells"].values() for r in c["rules"]})
                    rhos = [rho(seeds, lambda b, c, i, s=frozenset(s): b["cells"][c]["rules"][i] in s)
                            for s in itertools.combinations(rules, len(rules) // 2)]
                    by_rule = f"{text(statistics.fmean(rhos))} ({len(rules)} phrasings, {len(rhos)} splits)"
                by_cell = text(rho(seeds, lambda b, c, i: c == cell_one)) if len(first["cells"]) > 1 else "- (one cell)"
                lines.append(f"| {split} | {key.split('@', 1)[1] if '@' in key else 'scenario_words (v1)'} | {base} "
                             f"| {len(seeds)} | {text(rho(seeds, by_scenario))} | "
                             f"{by_cell} | "
                             f"{by_rule} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _rho_text(rows: list[tuple[float, ...]], column: int) -> str:
    """Spearman's rho of column 0 (the larger draw) against ``column``, with its p."""
    from scipy.stats import spearmanr

    r = spearmanr([row[0] for row in rows], [row[column] for row in rows])
    return f"{float(r.statistic):+.2f} (p = {float(r.pvalue):.2g})"


__all__ = ["block_key", "BLOCK_KEYS", "cell_agreement", "CELL_LABELS", "choose", "CHOOSING_CELLS", "FLIP_GOAL",
           "PERPLEXITY_GOAL", "seed_calibration", "decision_table", "DRAW_SEEDS",
           "LABEL_WIDTH", "LARGE_VALIDATION_SEEDS", "draw_key", "larger_draw_sets", "paired_difference",
           "phrasing_table", "pooled_difference", "ranking_reliability", "recipe_summary", "rule_of", "scenario_of",
           "score_larger_draw", "seed_agreement", "test_draw_table", "validation_table"]
