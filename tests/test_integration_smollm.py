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


def test_locality_identities_on_smollm(smollm, tmp_path):
    cfg = load_config("configs/locality.yaml", {"task": {"n_instances": 2}, "output_dir": str(tmp_path)})
    _, record = run_experiment(cfg, lm=smollm, progress=False)
    for row in record["rows"]:
        assert abs(row["stale"]) < 1e-6 and abs(row["oracle"] - 1) < 1e-6
        assert abs(row["full_downstream"] - 1) < 0.05  # exact in theory; the flips here are tiny (~0.05 nats)
        assert abs(row["full_downstream_ld"] - row["oracle_ld"]) < 1e-3
    assert record["summary"]["gate"]["min_flip"] == 0.5


def test_rope_gate_on_smollm(smollm):
    result = run_gate(smollm, chunk_len=32, offsets=(17, 3000))
    assert result["passed"], result


def test_organism_alias_loads_offline_and_differs_from_base(smollm):
    from kvprobe.models.loading import load_model
    from kvprobe.organism.registry import organism_dirs

    if not any(d.name == "smollm2-135m-gated" for d in organism_dirs()):
        pytest.skip("no committed smollm2-135m-gated adapter")
    org = load_model("smollm2-135m-gated", device="cpu", dtype="float32")
    ids = torch.arange(100, 140)[None]
    with torch.no_grad():
        assert (org.model(ids).logits - smollm.model(ids).logits).abs().max() > 1e-3
    assert org.fingerprint != smollm.fingerprint
