"""Sub-commands beyond run/models/figures/report register here, so the CLI core stays small."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from kvprobe.app import claims_cli
    from kvprobe.features import cli as features_cli
    from kvprobe.kv import gate_cli
    from kvprobe.organism import cli as organism_cli

    gate_cli.register(sub)
    organism_cli.register(sub)
    claims_cli.register(sub)
    features_cli.register(sub)
