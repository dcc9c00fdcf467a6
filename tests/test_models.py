import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.models.arch import arch_spec
from kvprobe.models.loading import load_model
from kvprobe.models.tiny import tiny_config, write_config_dir


def test_arch_spec_reads_gqa_rope_and_layer_types():
    g3 = arch_spec(tiny_config("gemma3"))
    assert g3.n_heads == 4 and g3.n_kv_heads == 2 and g3.head_dim == 16 and g3.sliding_window == 8
    assert g3.is_sliding == (True, True, True, False)
    assert [r.theta for r in g3.rope] == [1e4, 1e4, 1e4, 1e6]
    ll = arch_spec(tiny_config("llama"))
    assert ll.rope[0].rope_type == "llama3" and ll.rope[0].params["factor"] == 8.0 and ll.sliding_window is None


def test_paper_alias_without_weights_names_id_and_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(KVProbeError) as err:
        load_model("llama-3.1-8b")
    msg = str(err.value)
    assert "meta-llama/Llama-3.1-8B-Instruct" in msg and "llama-3.1-8b" in msg and "--model" in msg


def test_config_only_dir_is_seeded_random_init(tmp_path):
    d = write_config_dir("qwen3", tmp_path / "q3")
    a, b = load_model(str(d), seed=1), load_model(str(d), seed=1)
    c = load_model(str(d), seed=2)
    assert a.tokenizer is None and a.fingerprint == b.fingerprint != c.fingerprint
    ids = torch.arange(10)[None]
    assert torch.equal(a.model(ids).logits, b.model(ids).logits)


def test_arch_spec_reads_partial_rotary_from_rope_parameters():
    import transformers as tf

    from kvprobe.models.tiny import _COMMON

    cfg = tf.Phi3Config(**_COMMON, partial_rotary_factor=0.5, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert arch_spec(cfg).rope[0].partial_rotary_factor == 0.5
