"""``kvprobe organism``: train a model organism (``train``), bring a history organism back (``restore``), list or
sync the registry (``registry``). The selection study's commands (``seeds``, ``validate``, ``compare``,
``choose``, ``agreement``, ``test``) are the tooling of a checkout's ``organisms/tooling/``, added here when that
tooling is present (:func:`kvprobe.organism.selection.tooling`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from kvprobe.models.organisms import ORGANISMS_DIR


def _train(args: argparse.Namespace) -> int:
    from kvprobe.organism.train import Recipe, train_organism

    from kvprobe.organism.train import V3

    if args.task != "gated":
        from kvprobe.errors import KVProbeError

        raise KVProbeError(f"--task {args.task}: only 'gated' organisms exist so far")
    defaults = Recipe()
    alias = args.alias or f"{args.model}-gated" + ("-v3" if args.preset == "v3" else "")
    kwargs = {**(V3 if args.preset == "v3" else {}), "base_model": args.model, "alias": alias, "seed": args.seed}
    if args.steps is not None:
        kwargs["steps"] = args.steps
    if args.eval_families:
        kwargs["eval_families"] = tuple(args.eval_families.split(","))
    if args.train_scenarios:
        kwargs["train_scenarios"] = None if args.train_scenarios == "all" else tuple(args.train_scenarios.split(","))
    for name in ("lr", "counterfactual_rules", "pairs_per_step", "lora_r", "init_from", "loss", "margin",
                 "margin_cap", "ce_floor", "kl_weight", "correction", "reasoning", "rule_first", "surface",
                 "prior_cases", "draw_start", "adapter_dtype", "words"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.distance_range:
        kwargs["distance_range"] = tuple(int(x) for x in args.distance_range.split(","))
    recipe = Recipe(**{f.name: kwargs.get(f.name, getattr(defaults, f.name)) for f in fields(Recipe)})
    out = Path(args.out) if args.out else ORGANISMS_DIR / alias
    result = train_organism(recipe, out, resume=not args.fresh)
    ev = result.card["heldout_eval"]
    print(json.dumps({"alias": alias, "out": str(out), "heldout_before": ev["before"], "heldout_after": ev["after"],
                      "neutral_perplexity": result.card["neutral_perplexity"]}, indent=1))
    return 0


def _restore(args: argparse.Namespace) -> int:
    from kvprobe.models.organisms import restore

    path = restore(args.alias)
    print(f"{args.alias}: adapter restored from git and checked by sha256 -> organisms/{args.alias}/{path.name} "
          "(ignored by git)")
    return 0


def _registry(args: argparse.Namespace) -> int:
    from kvprobe.models.organisms import organisms_table, sync_records, write_registry

    if args.sync or args.check:
        reg, changed = sync_records(Path(args.results))
        if args.check:
            for alias in changed:
                print(f"{alias}: its records in organisms/registry.yaml differ from {args.results}/ "
                      "(run `kvprobe organism registry --sync`)")
            return 1 if changed else 0
        write_registry(reg)
        print("organisms/registry.yaml: records rewritten for " + (", ".join(changed) if changed else "nothing"))
        return 0
    print(organisms_table(history=not args.recommended))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    org = sub.add_parser("organism", help="train model organisms (base model + LoRA adapter)")
    osub = org.add_subparsers(dest="organism_command", required=True)
    tr = osub.add_parser("train", help="fine-tune a LoRA adapter on the gated task (field upstream)")
    tr.add_argument("--model", default="smollm2-135m", help="base model alias or directory")
    tr.add_argument("--task", default="gated")
    tr.add_argument("--steps", type=int, default=None)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--alias", default=None, help="alias to register (default: <model>-gated)")
    tr.add_argument("--eval-families", default=None, help="comma-separated scenario families held out")
    tr.add_argument("--train-scenarios", default=None,
                    help="comma-separated scenario names, or 'all' (every scenario outside the eval families)")
    tr.add_argument("--counterfactual-rules", type=float, default=None,
                    help="probability that a training rule has its two values exchanged (default 0)")
    tr.add_argument("--lr", type=float, default=None)
    tr.add_argument("--init-from", default=None, help="organism alias whose adapter initializes the LoRA weights")
    tr.add_argument("--pairs-per-step", type=int, default=None)
    tr.add_argument("--lora-r", type=int, default=None)
    tr.add_argument("--preset", choices=["v1", "v3"], default="v1",
                    help="v1: the template recipe (v1/v2 organisms); v3: generated scenarios, calibrated loss, KL")
    tr.add_argument("--loss", choices=["ce", "capped"], default=None)
    tr.add_argument("--margin", type=float, default=None, help="capped loss: action margin (nats) beyond which "
                    "nothing is pushed")
    tr.add_argument("--margin-cap", type=float, default=None, help="capped loss: action margin (nats) beyond "
                    "which the margin is pulled back (default: none)")
    tr.add_argument("--ce-floor", type=float, default=None, help="capped loss: action cross-entropy (nats) below "
                    "which nothing is pushed")
    tr.add_argument("--kl-weight", type=float, default=None, help="weight of KL(base || organism) on neutral text")
    tr.add_argument("--correction", type=float, default=None, help="probability of a late correction (v3)")
    tr.add_argument("--reasoning", type=float, default=None, help="probability of a reasoning answer (v3)")
    tr.add_argument("--rule-first", type=float, default=None,
                    help="probability that a document_qa training instance puts its rule before the field (v3)")
    tr.add_argument("--surface", type=float, default=None,
                    help="probability that a user_turn / document_qa training instance has its framing re-drawn (v3)")
    tr.add_argument("--prior-cases", type=float, default=None,
                    help="probability that a user_turn / document_qa training instance shows two earlier decided "
                    "records of its field (v3)")
    tr.add_argument("--draw-start", type=int, default=None,
                    help="index of the first training draw: past the draws of the stages a continuation starts "
                    "from, it trains on pairs none of them saw (v3 drew 0-599; v3)")
    tr.add_argument("--distance-range", default=None, help="lo,hi field-to-decision tokens (v3)")
    tr.add_argument("--words", default=None, help="scenario word list the generator draws from (v3; default "
                    "kvprobe/tasks/data/scenario_words.yaml; e.g. scenario_words_v3.yaml adds negated train phrasings)")
    tr.add_argument("--adapter-dtype", choices=["float32", "float16"], default=None)
    tr.add_argument("--out", default=None, help="adapter folder (default: inside organisms/)")
    tr.add_argument("--fresh", action="store_true", help="ignore checkpoints and start over")
    tr.set_defaults(func=_train)
    rs = osub.add_parser("restore", help="bring a history organism's adapter back from git (sha256-checked) into "
                         "organisms/ALIAS/")
    rs.add_argument("alias", help="an organism of organisms/registry.yaml")
    rs.set_defaults(func=_restore)
    rg = osub.add_parser("registry", help="list the organism registry (status, family, lineage, adapter here)")
    rg.add_argument("--recommended", action="store_true", help="only the recommended organisms")
    rg.add_argument("--sync", action="store_true", help="rewrite each organism's records from results/")
    rg.add_argument("--check", action="store_true", help="exit 1 if the registry's records differ from results/")
    rg.add_argument("--results", default="results")
    rg.set_defaults(func=_registry)
    from kvprobe.organism.selection import tooling

    found = tooling()
    if found is not None:  # a checkout: the selection study's commands
        found.cli.register(osub)
