"""Composition (Section 5): precompile a chunk, re-rotate its RoPE keys and splice it anywhere. The same as
:mod:`kvprobe.kv.compose`, except that the model may be any :data:`~kvprobe.interop.unwrap.ModelLike` (a kvprobe
model, a TransformerLens bridge, an nnsight model or a transformers model), converted once here.

    from kvprobe import compose
    block = compose.precompile(nn_model, chunk_ids)
    state = compose.assemble(nn_model, [compose.Live(system_ids), compose.Spliced(chunk_ids, block)])
"""

from kvprobe.interop.unwrap import at_boundary
from kvprobe.kv import compose as _core
from kvprobe.kv.compose import Live, Spliced

precompile = at_boundary(_core.precompile)
splice = at_boundary(_core.splice)
assemble = at_boundary(_core.assemble)
splice_spans = at_boundary(_core.splice_spans)

__all__ = ["Live", "Spliced", "assemble", "precompile", "splice", "splice_spans"]
