"""The seed's KV block store: write-once payloads, immutable identity, policy updated in place (packed
control records of 64 B), mechanism per tier; a RAM tier over a disk tier of memory-mapped safetensors."""

from kvprobe.blocks.record import RECORD_SIZE, Flags, Identity, Intent, Mechanism, Policy, QoS, Tier, Transfer
from kvprobe.blocks.store import BlockStore, Ledger

__all__ = ["RECORD_SIZE", "BlockStore", "Flags", "Identity", "Intent", "Ledger", "Mechanism", "Policy", "QoS", "Tier",
           "Transfer"]
