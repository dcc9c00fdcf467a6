"""Re-rotated KV equals an offset prefill on every family and RoPE variant; inexact variants are refused."""

import pytest
import torch
import transformers as tf

from kvprobe.errors import KVProbeError
from kvprobe.kv import prefill
from kvprobe.kv.gate import run_gate
from kvprobe.kv.rope import rerotate
from kvprobe.models.tiny import _COMMON, write_config_dir
from kvprobe.runner.cli import main


def _llama(rope_parameters, cls=tf.LlamaConfig, **extra):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cls(**_COMMON, rope_parameters=rope_parameters, **extra)).eval()


VARIANTS = {
    "linear": lambda: _llama({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    "yarn": lambda: _llama({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                            "original_max_position_embeddings": 1024}),
    "partial-rotary (phi3)": lambda: _llama({"rope_type": "default", "rope_theta": 1e4}, tf.Phi3Config,
                                            partial_rotary_factor=0.5, pad_token_id=0),
}


def _assert_gate(model):
    result = run_gate(model, chunk_len=24, offsets=(17, 3000, 20000))
    assert result["passed"], result
    for row in result["rows"]:
        assert row["key_rel_layer0"] <= 1e-5
        assert row["no_rotation_logit_rel"] > 50 * max(row["logit_rel"], 1e-7)  # the control really fails


def test_gate_passes_on_every_family(tiny_lm):
    _assert_gate(tiny_lm.model)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gate_passes_on_rope_variants(name):
    model = VARIANTS[name]()
    if name == "yarn":
        assert model.model.rotary_emb.attention_scaling > 1.1  # scaling is baked in once, not twice
    if name.startswith("partial"):
        assert model.model.rotary_emb.inv_freq.numel() * 2 < model.config.head_dim
    _assert_gate(model)


def test_rerotate_is_write_once_and_values_are_shared(tiny_lm):
    state = prefill(tiny_lm, torch.arange(10))
    before = state.clone()
    moved = rerotate(state, torch.arange(100, 110), tiny_lm)
    assert state.max_abs_diff(before) == 0.0
    assert moved.values[0] is state.values[0] and moved.keys[0] is not state.keys[0]
    assert moved.positions.tolist() == list(range(100, 110))


def test_inexact_variants_are_refused():
    dyn = _llama({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(KVProbeError, match="dynamic"):
        rerotate(prefill(dyn, torch.arange(8)), torch.arange(10_000, 10_008), dyn)


def test_gate_cli_on_config_only_dir(tmp_path, capsys):
    d = write_config_dir("gemma3", tmp_path / "g3")
    assert main(["gate", "--model", str(d), "--chunk-len", "16", "--offsets", "5", "900"]) == 0
    assert "PASSED" in capsys.readouterr().out
    # A tolerance no float computation meets makes the gate fail and the command exit non-zero.
    assert main(["gate", "--model", str(d), "--chunk-len", "16", "--offsets", "900", "--key-tol", "0"]) == 1
