from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.state import KVState

__all__ = ["KVState", "prefill", "read_logits"]
