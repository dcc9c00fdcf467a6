"""Integration on the embedded default model (marked slow: loads smollm2-135m; first load dequantizes)."""

import pytest
import torch

from kvprobe.kv import prefill, read_logits
from kvprobe.kv.gate import run_gate
from kvprobe.runner.config import load_config
from kvprobe.runner.experiment import run_experiment

pytestmark = pytest.mark.slow


def test_readout_matches_full_forward_on_smollm(smollm):
    ids = smollm.tokenizer("The quick brown fox jumps over the lazy dog because it wants to",
                           return_tensors="pt")["input_ids"][0]
    full = smollm.model(ids[None]).logits[0, -1]
    got = read_logits(smollm, prefill(smollm, ids[:-1]), ids[-1:])[0]
    assert (got - full).abs().max() < 1e-3


# fp32 noise between two reads of the same cache state (another batch slot, another prefill of an identical
# prefix, another CPU's SIMD reduction order) is ~1e-5 nats on this model's ~10-30-nat logits; 1e-4 nats leaves
# a margin and is still far below any effect we report. Compared in nats, not as recovery ratios: a ratio over a
# 0.03-nat flip would magnify the same noise 30-fold.
IDENTITY_TOL_NATS = 1e-4


def test_locality_identities_on_smollm(smollm, tmp_path):
    cfg = load_config("configs/locality.yaml", {"task": {"n_instances": 2}, "output_dir": str(tmp_path)})
    _, record = run_experiment(cfg, lm=smollm, progress=False)
    for row in record["rows"]:
        flip = row["flip"]  # the anchors' oracle minus stale logit difference
        # each state's distance in nats from the anchor it equals by construction: (recovery - target) * flip
        assert abs(row["stale"] * flip) < IDENTITY_TOL_NATS
        assert abs((row["oracle"] - 1) * flip) < IDENTITY_TOL_NATS
        # full-downstream replaces every slot from the field on; the prefix is the same tokens in both prompts
        assert abs((row["full_downstream"] - 1) * flip) < IDENTITY_TOL_NATS
        assert abs(row["full_downstream_ld"] - row["oracle_ld"]) < IDENTITY_TOL_NATS
    assert record["summary"]["gate"]["min_flip"] == 0.5


def test_rope_gate_on_smollm(smollm):
    result = run_gate(smollm, chunk_len=32, offsets=(17, 3000))
    assert result["passed"], result


def test_organism_alias_loads_offline_and_differs_from_base(smollm):
    from kvprobe.models.loading import load_model
    from kvprobe.models.organisms import load_registry

    org = load_model(load_registry().recommended()["llama"], device="cpu", dtype="float32")  # its adapter is committed
    ids = torch.arange(100, 140)[None]
    with torch.no_grad():
        assert (org.model(ids).logits - smollm.model(ids).logits).abs().max() > 1e-3
    assert org.fingerprint != smollm.fingerprint
