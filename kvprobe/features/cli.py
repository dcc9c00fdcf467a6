"""``kvprobe sae train``: rebuild the SAEs an ``sae`` config uses (deterministic for a config and seed)."""

from __future__ import annotations

import argparse
import json


def _train(args: argparse.Namespace) -> int:
    from kvprobe.features.sae import SAESpec, build
    from kvprobe.models.loading import load_model
    from kvprobe.runner.config import load_config, parse_overrides, validate_params
    from kvprobe.runner.experiment import get_experiment

    cfg = load_config(args.config, parse_overrides(args.set or []))
    if args.model:
        cfg = cfg.model_copy(update={"model": args.model})
    p = validate_params(get_experiment("sae").params, cfg.params, args.config)  # the experiment, loaded by name
    lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed)
    out = {}
    for site in p.sites:
        spec = SAESpec(site=site, layer=p.layer, width=p.width, k=p.k, steps=p.steps, batch=p.batch, lr=p.lr,
                       seed=cfg.seed, task_template=cfg.task.template, n_task_prompts=p.n_task_prompts,
                       n_neutral_tokens=p.n_neutral_tokens, skip_first=p.skip_first)
        _, info = build(lm, spec, retrain=args.retrain)
        out[site] = info
    print(json.dumps(out, indent=1))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sae = sub.add_parser("sae", help="sparse autoencoders (sae-lens) of the sae experiment")
    ssub = sae.add_subparsers(dest="sae_command", required=True)
    tr = ssub.add_parser("train", help="train (or load from the kvprobe cache) the SAEs a config names")
    tr.add_argument("config", nargs="?", default="configs/sae.yaml")
    tr.add_argument("--model", default=None, help="alias or model directory (default: the config's)")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted)")
    tr.add_argument("--retrain", action="store_true", help="train again even when the cache holds the SAE")
    tr.set_defaults(func=_train)
