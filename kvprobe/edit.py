"""The paper's cache edits (Section 4, App. E) as public functions: the same as :mod:`kvprobe.kv.edit`, except
that the model may be any :data:`~kvprobe.interop.unwrap.ModelLike` (a kvprobe model, a TransformerLens bridge,
an nnsight model or a transformers model), converted once here.

    from kvprobe import edit
    e = edit.FieldEdit.from_pair(case.pp)
    result = edit.field_erratum(bridge, e, erratum_ids, readout_tokens=1)
"""

from kvprobe.interop.unwrap import at_boundary
from kvprobe.kv import edit as _core
from kvprobe.kv.edit import EditResult, FieldEdit, stale
from kvprobe.patching import ranking as _ranking

in_place = at_boundary(_core.in_place)
field_selective = at_boundary(_core.field_selective)
full_downstream = at_boundary(_core.full_downstream)
full_reprefill = at_boundary(_core.full_reprefill)
cacheblend = at_boundary(_core.cacheblend)
erratum = at_boundary(_core.erratum)
field_erratum = at_boundary(_core.field_erratum)
hoist_to_end = at_boundary(_core.hoist_to_end)
append_edit = at_boundary(_core.append_edit)
recompute_slots = at_boundary(_core.recompute_slots)
rank_downstream_by_effect = at_boundary(_ranking.rank_downstream_by_effect)

__all__ = ["EditResult", "FieldEdit", "append_edit", "cacheblend", "erratum", "field_erratum", "field_selective",
           "full_downstream", "full_reprefill", "hoist_to_end", "in_place", "rank_downstream_by_effect",
           "recompute_slots", "stale"]
