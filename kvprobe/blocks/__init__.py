"""The seed's KV block store: write-once payloads (enforced: readers get copies, promotions check digests),
immutable identity, policy updated in place (packed, checked control records of 64 B), mechanism per tier; a RAM
tier over a crash-safe disk tier of memory-mapped safetensors that quarantines damaged blocks on open."""

from kvprobe.blocks.record import (RECORD_SIZE, Flags, Identity, Intent, Mechanism, Policy, QoS, RecordError, Tier,
                                   Transfer)
from kvprobe.blocks.store import BlockStore, Ledger
from kvprobe.blocks.tiers import CorruptBlockError, Quarantined

__all__ = ["RECORD_SIZE", "BlockStore", "CorruptBlockError", "Flags", "Identity", "Intent", "Ledger", "Mechanism",
           "Policy", "QoS", "Quarantined", "RecordError", "Tier", "Transfer"]
