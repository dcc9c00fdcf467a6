"""The selection study's commands: ``python -m organisms.tooling seeds|validate|compare|choose|agreement|test``
(in a checkout also ``kvprobe organism ...``, which adds them to its own through :func:`register`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _seeds(args: argparse.Namespace) -> int:
    from organisms.tooling.seeds import organism_folder, seed_spread, write_seed_spread

    folders = [organism_folder(a) for a in [args.primary, *args.seeds.split(",")]]
    spread = seed_spread(folders)
    path = write_seed_spread(folders[0], spread)
    rows = [(name, s["all"]) for name, s in spread["sets"].items()]
    for name, a in rows:
        sd = a["accuracy"]["sd"]
        print(f"{name:<26} accuracy {a['accuracy']['mean']:.2f} +- {sd:.2f}  median flip "
              f"{a['median_flip']['mean']:.2f} +- {a['median_flip']['sd']:.2f}  ({a['n_pairs']} pairs)")
    ppl = spread["neutral_perplexity_relative_change"]
    print(f"neutral perplexity change {ppl['mean']:+.3f} +- {ppl['sd']:.3f}; written to {path.name} of {args.primary}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from organisms.tooling.seeds import organism_folder
    from organisms.tooling.validation import (CELL_LABELS, LABEL_WIDTH, block_key, recipe_summary,
                                             score_larger_draw)

    if args.split == "test":
        from kvprobe.errors import KVProbeError

        raise KVProbeError("test draws are scored by `kvprobe organism test ALIAS --draw NAME` (each scoring "
                           "logged in organisms/test_log.jsonl); validate scores validation draws only")
    folders = [organism_folder(a) for a in [args.primary, *(args.seeds.split(",") if args.seeds else [])]]
    block = score_larger_draw(folders, pairs=args.pairs, replace=args.replace, split=args.split, words=args.words)
    for name, cell in recipe_summary(block)["cells"].items():
        if name == "both" and len(block["cells"]) == 1:
            continue  # a one-cell draw (validation_email): "both" is that cell
        acc, p = cell["accuracy"], cell["pooled"]
        label = "both cells" if name == "both" else CELL_LABELS[name]
        flips = ' / '.join(f'{v:.1f}' for v in cell['median_flip']['per_seed'])
        print(f"{label:<{LABEL_WIDTH}} accuracy per seed {' / '.join(f'{v:.2f}' for v in acc['per_seed'])}  pooled "
              f"{p['mean']:.2f} [{p['ci_low']:.2f}, {p['ci_high']:.2f}]  median flip per seed {flips}  "
              f"({cell['n_pairs']} pairs)")
    print(f"written to card.json of {args.primary} ({block_key(args.split, block['words'])})")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from organisms.tooling.seeds import organism_folder
    from organisms.tooling.validation import CELL_LABELS, LABEL_WIDTH, draw_key, paired_difference

    blocks = []
    for alias in (args.recipe, args.reference):
        card = json.loads((organism_folder(alias) / "card.json").read_text())
        key = draw_key(card, args.split, args.words)
        block = card.get(key)
        if block is None:
            from kvprobe.errors import KVProbeError

            raise KVProbeError(f"{alias} holds no larger {args.split} block ({key}): run `kvprobe organism validate "
                               f"{alias} --seeds ...{'' if args.split == 'validation' else ' --split ' + args.split}"
                               f"{' --words ' + args.words if args.words else ''}` first")
        blocks.append(block)
    diff = paired_difference(*blocks)
    for name, c in diff["cells"].items():
        if name == "both" and len(blocks[0]["cells"]) == 1:
            continue
        label = "both cells" if name == "both" else CELL_LABELS[name]
        print(f"{label:<{LABEL_WIDTH}} {args.recipe} - {args.reference}: {c['mean']:+.3f} [{c['ci_low']:+.3f}, "
              f"{c['ci_high']:+.3f}]  ({c['n_pairs']} pairs, {c['n_scenarios']} scenarios, seeds "
              f"{', '.join(map(str, diff['seeds']))})")
    if args.split == "validation":
        print(f"preferred over {args.reference} (95% CI of both cells above 0): {diff['preferred']}")
    elif args.split == "validation_email":
        print("the second validation format: judged against the test draws before it joins the choosing rule")
    else:
        print("test draws: reported, not a choosing rule (the older ones were read during the search; sealed-1 "
              "is the held-out draw)")
    return 0


def _choose(args: argparse.Namespace) -> int:
    from organisms.tooling.seeds import organism_folder
    from organisms.tooling.validation import BLOCK_KEYS, CHOOSING_CELLS, CELL_LABELS, choose, draw_key

    folders = [organism_folder(a) for a in (args.recipe, args.reference)]
    cards = [json.loads((f / "card.json").read_text()) for f in folders]
    suffix = draw_key(cards[0], "validation", args.words)[len(BLOCK_KEYS["validation"]):]
    out = choose(*cards, {c["alias"]: f.parent for c, f in zip(cards, folders)}, suffix)
    d = out["difference"]
    print(f"{' + '.join(CELL_LABELS[c] for c in CHOOSING_CELLS)}: {args.recipe} - {args.reference} "
          f"{d['mean']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] ({d['n_pairs']} pairs, {d['n_scenarios']} "
          f"scenarios, seeds {', '.join(map(str, out['seeds']))})")
    for alias, seeds in out["calibration"].items():
        rows = ", ".join(f"seed {s['seed']}: flip {s['median_flip']:.1f}, perplexity "
                         + ("n/a" if s["perplexity_change"] is None else f"{100 * s['perplexity_change']:+.1f}%")
                         + (" (meets both)" if s["meets_goals"] else "") for s in seeds)
        print(f"{alias}: {out['seeds_meeting_goals'][alias]} seed(s) meet both calibration goals on validation ({rows})")
    print(f"chosen: {out['chosen']}, {out['reason']}")
    return 0


def _agreement(args: argparse.Namespace) -> int:
    from kvprobe.models.registry import organism_dirs
    from organisms.tooling.seeds import organism_folder
    from organisms.tooling.validation import block_key, cell_agreement

    folders = [organism_folder(a) for a in args.recipes.split(",")] if args.recipes else list(organism_dirs())
    cards = [json.loads((Path(f) / "card.json").read_text()) for f in folders]
    suffix = block_key("validation", args.words)[len(block_key("validation")):]
    line = cell_agreement(cards, suffix)
    if not line:
        from kvprobe.errors import KVProbeError

        raise KVProbeError("fewer than 4 organism seeds hold the validation, validation_email and test draws of "
                           "this word list among these recipes: `kvprobe organism validate <primary> --seeds "
                           "... --split validation_email` (and --split test) first")
    print(line[0].upper() + line[1:])
    return 0


def _test(args: argparse.Namespace) -> int:
    from organisms.tooling.seeds import organism_folder
    from organisms.tooling.draws import score_test_draw
    from organisms.tooling.validation import CELL_LABELS, LABEL_WIDTH

    folders = [organism_folder(a) for a in [args.alias, *(args.seeds.split(",") if args.seeds else [])]]
    _, entry = score_test_draw(folders, args.draw, pairs=args.pairs)
    for name, c in entry["cells"].items():
        label = "both cells" if name == "both" else CELL_LABELS[name]
        p = c["pooled"]
        print(f"{label:<{LABEL_WIDTH}} accuracy per seed {' / '.join(f'{v:.3f}' for v in c['accuracy_per_seed'])}  "
              f"pooled {p['mean']:.3f} [{p['ci_low']:.3f}, {p['ci_high']:.3f}]  median flip per seed "
              f"{' / '.join(f'{v:.2f}' for v in c['median_flip_per_seed'])}  ({c['n_pairs']} pairs)")
    print(f"draw {args.draw}{' (sealed: scored once)' if entry['sealed'] else ''}: logged in organisms/test_log.jsonl, "
          f"pairs stored in card.json of {args.alias} ({entry['card_key']})")
    return 0


def register(osub: argparse._SubParsersAction) -> None:
    """Add the selection study's sub-commands to an ``organism`` command's sub-parsers."""
    from organisms.tooling.validation import DRAW_SEEDS

    sd = osub.add_parser("seeds", help="mean +- sd over training seeds of one recipe, stored in the first card")
    sd.add_argument("primary", help="the organism whose card receives the spread (e.g. smollm2-135m-gated-v3)")
    sd.add_argument("--seeds", required=True, help="comma-separated aliases of the same recipe with other seeds")
    sd.set_defaults(func=_seeds)
    va = osub.add_parser("validate", help="score a recipe's seeds on the larger validation cells (stored in the "
                         "first card) to choose between recipes")
    va.add_argument("primary", help="the organism whose card receives the scores (e.g. smollm2-135m-gated-v3r)")
    va.add_argument("--seeds", default=None, help="comma-separated aliases of the same recipe with other seeds")
    va.add_argument("--pairs", type=int, default=64, help="pairs per validation cell (default 64)")
    va.add_argument("--replace", action="store_true", help="discard a stored block for other pairs or seeds")
    va.add_argument("--split", choices=list(DRAW_SEEDS), default="validation",
                    help="test: refused (`kvprobe organism test` scores test draws); validation_email: the "
                    "validation families in the second validation "
                    "format (one cell)")
    va.add_argument("--words", default=None, help="draw from another word list than the recipe's (e.g. "
                    "kvprobe/tasks/data/scenario_words_v2.yaml: more held-out rule phrasings); stored under its own "
                    "key")
    va.set_defaults(func=_validate)
    cp = osub.add_parser("compare", help="paired accuracy difference of two recipes on the larger validation cells")
    cp.add_argument("recipe", help="primary alias of the recipe judged")
    cp.add_argument("reference", help="primary alias of the recipe it is judged against")
    cp.add_argument("--split", choices=list(DRAW_SEEDS), default="validation",
                    help="test: the fresh test draws (reported, never used to choose)")
    cp.add_argument("--words", default=None, help="compare the draws made with this word list (validate --words)")
    cp.set_defaults(func=_compare)
    ch = osub.add_parser("choose", help="the pre-registered choosing rule: email + train formats pooled, ties "
                         "broken by the calibration goals read on validation (never a test set)")
    ch.add_argument("recipe", help="primary alias of the recipe judged")
    ch.add_argument("reference", help="primary alias of the recipe it is judged against (kept on a tie)")
    ch.add_argument("--words", default=None, help="the word list the draws were made with (validate --words)")
    ch.set_defaults(func=_choose)
    ag = osub.add_parser("agreement", help="per organism seed, how each validation cell ranks the seeds against the "
                         "test draw's unseen formats (Spearman's rho; reported, never used to choose)")
    ag.add_argument("--recipes", default=None, help="comma-separated primary aliases (default: every organism)")
    ag.add_argument("--words", default=None, help="the word list the draws were made with (validate --words)")
    ag.set_defaults(func=_agreement)
    from organisms.tooling.draws import TEST_DRAWS

    te = osub.add_parser("test", help="score organisms on a test draw (the only command that does; each scoring is "
                         "logged, a sealed draw is scored once)")
    te.add_argument("alias", help="the organism whose card receives the scores")
    te.add_argument("--draw", required=True, choices=list(TEST_DRAWS),
                    help="; ".join(f"{k}: {d.note}" for k, d in TEST_DRAWS.items()))
    te.add_argument("--seeds", default=None, help="comma-separated aliases of the same recipe with other seeds")
    te.add_argument("--pairs", type=int, default=None, help="pairs per cell (unsealed draws; default 32)")
    te.set_defaults(func=_test)


def main(argv: Sequence[str] | None = None) -> int:
    from kvprobe.errors import KVProbeError

    parser = argparse.ArgumentParser(prog="python -m organisms.tooling", description=__doc__.split("\n\n")[0])
    register(parser.add_subparsers(dest="organism_command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVProbeError as exc:
        print(f"organisms.tooling: error: {exc}", file=sys.stderr)
        return exc.exit_code
