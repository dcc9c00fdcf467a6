"""Sub-commands beyond run/models/figures register here, so the CLI core stays small."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    for module_name in ("kvprobe.kv.gate_cli", "kvprobe.organism.cli"):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)
