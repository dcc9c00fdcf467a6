"""The backend protocol: what the core needs from a model, checked structurally, and the import layering."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvprobe
from kvprobe.backends import HookableModel, KVBackend, KVState
from kvprobe.errors import KVProbeError
from kvprobe.kv import edit
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.tiny import tiny_model
from tests.conftest import as_lm

REPO = Path(__file__).resolve().parents[1]


class RecordingBackend:
    """A second implementation of the protocol: delegates the forwards to a LoadedModel and records each call.
    It inherits nothing, so passing it through the core shows the core asks for the protocol only."""

    def __init__(self, inner: HookableModel) -> None:
        self.inner = inner
        self.name, self.fingerprint = "recording", inner.fingerprint
        self.tokenizer, self.has_chat_template = inner.tokenizer, False
        self.calls: list[str] = []

    def prefill(self, ids, positions=None, prior=None, return_logits=False):
        self.calls.append("prefill")
        return self.inner.prefill(ids, positions, prior, return_logits)

    def read_logits(self, states, suffix_ids, batch_size=16, suffix_positions=None):
        self.calls.append("read_logits")
        return self.inner.read_logits(states, suffix_ids, batch_size, suffix_positions)

    def slot_kv(self, state, slots):
        self.calls.append("slot_kv")
        return self.inner.slot_kv(state, slots)

    def recompute(self, state, ids, slots):
        self.calls.append("recompute")
        return self.inner.recompute(state, ids, slots)

    def describe(self):
        return {"name": self.name}


def test_loaded_model_implements_both_protocols():
    lm = as_lm(tiny_model("llama"))
    assert isinstance(lm, KVBackend) and isinstance(lm, HookableModel)
    assert not isinstance(object(), KVBackend)
    engine_only = RecordingBackend(lm)
    assert isinstance(engine_only, KVBackend) and not isinstance(engine_only, HookableModel)  # no modules to hook


def test_core_runs_on_any_backend_and_equals_the_hf_oracle():
    lm = as_lm(tiny_model("qwen2"))
    other = RecordingBackend(lm)
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    ref, got = prefill(lm, ids), prefill(other, ids)
    assert got.max_abs_diff(ref) == 0
    assert torch.equal(read_logits(other, got, [5]), read_logits(lm, ref, [5]))
    edited = list(ids)
    edited[3] = 7
    recomputed = edit.recompute_slots(other, ref, edited, [3, 4, 5])
    # recomputing every slot from the field on equals prefilling the edited context (the identity the edits rest on)
    tail = edit.recompute_slots(lm, ref, edited, range(3, 12))
    assert tail.max_abs_diff(prefill(lm, edited)) < 1e-4
    assert recomputed.max_abs_diff(ref) > 0  # the edit reached the cache
    assert other.calls == ["prefill", "read_logits", "recompute"]
    assert other.slot_kv(ref, [1, 2]).max_abs_diff(ref.select([1, 2])) == 0
    assert torch.equal(other.slot_kv(ref, [1, 2]).positions, torch.tensor([1, 2]))


def test_the_core_takes_the_protocol_and_the_boundary_takes_wrappers():
    model = tiny_model("llama")
    ids = list(range(3, 11))
    with pytest.raises(AttributeError):
        prefill(model, ids)  # a bare transformers model is not a backend: the core does not guess
    via_boundary = kvprobe.prefill(model, ids)  # the public function converts it once
    assert isinstance(via_boundary, KVState)
    assert via_boundary.max_abs_diff(prefill(kvprobe.as_lm(model), ids)) == 0
    with pytest.raises(KVProbeError, match="cannot use a"):
        kvprobe.prefill(object(), ids)


def test_import_layering_holds():
    """DESIGN.md's layering (`.importlinter`): imports point down only; the wrappers stay at the boundary."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is missing: it comes with the dev extra (import-linter); run `make install`")
    run = subprocess.run([exe, "--config", str(REPO / ".importlinter")], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_no_untyped_model_parameter():
    """A model parameter is typed with the backend protocol (HookableModel / KVBackend / LoadedModel), never
    ``lm: Any``: scans every module of the package and the experiments."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*sorted((root / "kvprobe").rglob("*.py")), *sorted((root / "experiments").rglob("*.py"))]
    assert len(files) > 20 and any(f.name == "weight_edit.py" for f in files)
    pattern = re.compile(r"\blm\s*:\s*Any\b")
    hits = [f"{f.relative_to(root)}:{i}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"lm: Any (use kvprobe.backends.HookableModel): {hits}"
