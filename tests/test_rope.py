"""Re-rotated KV equals an offset prefill on every family and RoPE variant; inexact variants are refused."""

from dataclasses import replace

import pytest
import torch
import transformers as tf

from kvprobe.errors import KVProbeError
from kvprobe import prefill, read_logits  # the public functions: a bare transformers model is converted there
from kvprobe.kv.gate import run_gate
from kvprobe.kv.rope import rerotate, rope_layer_info, rotate_keys, shift
from kvprobe.models.tiny import _COMMON, tiny_config, write_config_dir
from kvprobe.app.cli import main

ROT_TOL = 1e-5  # the rotation itself (layer-0 keys), fp32
LOGIT_TOL = 1e-4
SMALL = dict(_COMMON, num_hidden_layers=2)
NO_GQA = {k: v for k, v in SMALL.items() if k not in ("num_key_value_heads", "head_dim")}


def _model(cls, **kwargs):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cls(**kwargs)).eval()


def _ids(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# MLA: 16-dim latent + 8-dim decoupled k_pe; one dense and one MoE layer
MLA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, max_position_embeddings=200_000, n_group=1, topk_group=1)
# M-RoPE text towers (head_dim 16: 8 frequencies split over temporal/height/width) with a one-block vision tower
VL_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=200_000)


def _vl_model(kind):
    if kind == "sectioned":
        cfg = tf.Qwen2VLConfig(text_config=dict(VL_TEXT, rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2))
    else:
        cfg = tf.Qwen3VLConfig(text_config=dict(VL_TEXT, rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               deepstack_visual_indexes=[0]))
    torch.manual_seed(0)
    return tf.AutoModelForImageTextToText.from_config(cfg).eval()


_SHORT = [1.0 + 0.05 * i for i in range(8)]
_LONG = [1.5 + 0.5 * i for i in range(8)]
VARIANTS = {
    "linear": lambda: _model(tf.LlamaConfig, **SMALL, rope_parameters={
        "rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    "yarn": lambda: _model(tf.LlamaConfig, **SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024}),
    "longrope (phi3)": lambda: _model(tf.Phi3Config, **SMALL, pad_token_id=0, original_max_position_embeddings=1024,
                                      rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                       "short_factor": _SHORT, "long_factor": _LONG,
                                                       "original_max_position_embeddings": 1024}),
    "partial rotary 0.5 (phi)": lambda: _model(tf.PhiConfig, **NO_GQA, partial_rotary_factor=0.5),
    "partial rotary 0.25 (stablelm)": lambda: _model(tf.StableLmConfig, **NO_GQA, num_key_value_heads=2,
                                                              partial_rotary_factor=0.25),
    "interleaved (cohere)": lambda: _model(tf.CohereConfig, **SMALL, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2),
    "interleaved partial (glm)": lambda: _model(tf.GlmConfig, **SMALL, pad_token_id=0, eos_token_id=2),
    "no-rope layers (smollm3)": lambda: _model(tf.SmolLM3Config, **SMALL, pad_token_id=0, no_rope_layers=[1, 0]),
    "M-RoPE sectioned (qwen2-vl)": lambda: _vl_model("sectioned"),
    "M-RoPE interleaved (qwen3-vl)": lambda: _vl_model("interleaved"),
    "MLA k_pe (deepseek-v2)": lambda: _model(tf.DeepseekV2Config, **MLA),
    "MLA k_pe (deepseek-v3, rope_interleave)": lambda: _model(tf.DeepseekV3Config, **MLA, rope_interleave=True),
    "MLA k_pe (deepseek-v3, yarn)": lambda: _model(tf.DeepseekV3Config, **MLA, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def _assert_gate(model, offsets=(0, 17, 3000, 100_000)):
    result = run_gate(model, chunk_len=16, offsets=offsets, suffix_len=2)
    assert result["passed"], result
    assert not result["refused_offsets"]
    for row in result["rows"]:
        assert row["key_rel_layer0"] <= ROT_TOL
        if row["offset"] <= 3000:  # past that the reference's own float32 angles drift (see kvprobe.kv.gate)
            assert row["key_rel_all"] <= LOGIT_TOL and row["logit_rel"] <= LOGIT_TOL
        if row["offset"]:  # the no-rotation control really fails
            assert row["no_rotation_key_rel"] > 0.1
            assert row["no_rotation_logit_rel"] > 20 * max(row["logit_rel"], 1e-7)
    return result


def test_gate_passes_on_every_family(tiny_lm):
    result = _assert_gate(tiny_lm.model)
    infos = rope_layer_info(tiny_lm)
    family = tiny_lm.name.removeprefix("tiny-")
    if family == "llama":
        assert {i.rope_type for i in infos} == {"llama3"}
    if family == "gemma3":  # sliding layers theta 1e4, full-attention layer theta 1e6
        assert infos[0].inv_freq is infos[1].inv_freq and not torch.equal(infos[0].inv_freq, infos[3].inv_freq)
        assert len(result["rope"]) == 1 and infos[3].layer_type == "full_attention"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gate_passes_on_rope_variants(name):
    model = VARIANTS[name]()
    infos = rope_layer_info(model)
    if name.startswith("partial"):
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        assert infos[0].rotary_dim == int(head_dim * model.config.rope_parameters["partial_rotary_factor"])
    if name.startswith("interleaved"):
        assert infos[0].layout == "interleaved"
    if name.startswith("no-rope"):
        assert [i.layout for i in infos] == ["half", "none"]
    if name.startswith("MLA"):  # only k_pe (the value slot) moves; the latent (key slot) is shared, not copied
        assert {i.rotated_slot for i in infos} == {"values"} and infos[0].rotary_dim == 8
        state = prefill(model, _ids(6))
        moved = shift(state, 40, model)
        assert all(a is b for a, b in zip(moved.keys, state.keys))
        assert _rel(moved.values[0], state.values[0]) > 0.1
        other = "half" if infos[0].layout == "interleaved" else "interleaved"  # the layout matters
        wrong = rerotate(state, torch.arange(40, 46), [replace(i, layout=other) for i in infos])
        assert _rel(wrong.values[0], prefill(model, _ids(6), positions=torch.arange(40, 46)).values[0]) > 1e-2
    offsets = (0, 17, 900) if name.startswith("longrope") else (0, 17, 3000, 100_000)
    _assert_gate(model, offsets)


@pytest.mark.parametrize("kind,components", [("sectioned", (0, 0, 1, 1, 1, 2, 2, 2)),
                                             ("interleaved", (0, 1, 2, 0, 1, 2, 0, 0))])
def test_mrope_moves_the_temporal_component_alone(kind, components):
    """An image-like chunk (height/width offsets of its own) moved along time only equals the model's own
    keys at the moved (t, h, w) positions; rotating every channel by the time shift does not."""
    from transformers.cache_utils import DynamicCache

    model = _vl_model(kind)
    info = rope_layer_info(model)[0]
    assert info.mrope == kind and info.mrope_components == components
    ids, base = _ids(10, seed=1)[None], torch.arange(10)

    def layer0_keys(pos3):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos3[:, None, :], cache=cache, use_cache=True)
        return cache.layers[0].keys

    src = torch.stack([base, base + 3, base + 5])
    dst = torch.stack([base + 700, base + 3, base + 5])
    ref = layer0_keys(dst)
    assert _rel(rotate_keys(layer0_keys(src), src, dst, info), ref) <= ROT_TOL
    assert _rel(rotate_keys(layer0_keys(src), base, base + 700, info), ref) > 0.1
    with pytest.raises(KVProbeError, match="for M-RoPE models"):
        rotate_keys(ref, src, dst, rope_layer_info(VARIANTS["linear"]())[0])


def test_yarn_attention_scaling_is_carried_once():
    model = VARIANTS["yarn"]()
    (info, *_) = rope_layer_info(model)
    assert info.attention_scaling > 1.1 and info.attention_scaling == model.model.rotary_emb.attention_scaling
    ids, target = _ids(12), torch.arange(500, 512)
    moved = rerotate(prefill(model, ids), target, model)
    ref = prefill(model, ids, positions=target)
    assert _rel(moved.keys[0], ref.keys[0]) <= ROT_TOL
    # Applying the scaling a second time (what a rotate-by-cos/sin-of-delta with scaled cos/sin does) is wrong.
    assert _rel(moved.keys[0] * info.attention_scaling, ref.keys[0]) > 0.1


def test_longrope_within_each_regime_is_exact_and_across_the_switch_refused():
    model = VARIANTS["longrope (phi3)"]()
    (info, *_) = rope_layer_info(model)
    assert info.original_max_position == 1024 and not torch.equal(info.inv_freq, info.long_inv_freq)
    ids = _ids(16, 1)
    long_src = prefill(model, ids, positions=range(2000, 2016))  # a call past 1024: long factors
    target = torch.arange(5000, 5016)
    moved, ref = rerotate(long_src, target, model), prefill(model, ids, positions=target)
    assert _rel(moved.keys[0], ref.keys[0]) <= ROT_TOL
    assert max(_rel(a, b) for a, b in zip(moved.keys, ref.keys)) <= LOGIT_TOL
    with pytest.raises(KVProbeError, match="longrope .* short regime .* long regime"):
        rerotate(prefill(model, ids), target, model)
    result = run_gate(model, chunk_len=8, offsets=(17, 3000), suffix_len=1)
    assert result["passed"] and result["refused_offsets"] == [3000]


def test_rerotate_is_write_once_and_values_are_shared(tiny_lm):
    state = prefill(tiny_lm, _ids(10))
    keys_before = [k.clone() for k in state.keys]
    values_before = [v.clone() for v in state.values]
    pos_before = state.positions.clone()
    moved = rerotate(state, torch.arange(100, 110), tiny_lm)
    assert all(torch.equal(k, b) for k, b in zip(state.keys, keys_before))
    assert all(torch.equal(v, b) for v, b in zip(state.values, values_before))
    assert torch.equal(state.positions, pos_before)
    assert all(mv is v for mv, v in zip(moved.values, state.values))
    assert all(mk is not k and mk.data_ptr() != k.data_ptr() for mk, k in zip(moved.keys, state.keys))
    assert moved.positions.tolist() == list(range(100, 110))
    assert torch.equal(shift(state, 100, tiny_lm).keys[1], moved.keys[1])


def test_rotation_composes_and_inverts():
    model = VARIANTS["yarn"]()
    (info, *_) = rope_layer_info(model)
    keys = torch.randn(1, 2, 6, 16, dtype=torch.float32)
    p0, p1, p2 = torch.arange(6), torch.arange(40_000, 40_006), torch.arange(99_990, 99_996)
    there = rotate_keys(keys, p0, p2, info)
    via = rotate_keys(rotate_keys(keys, p0, p1, info), p1, p2, info)
    assert _rel(via, there) <= ROT_TOL
    assert _rel(rotate_keys(there, p2, p0, info), keys) <= ROT_TOL
    assert torch.equal(rotate_keys(keys, p0, p0, info), keys)


def test_no_rotation_fails_the_gate():
    model = VARIANTS["linear"]()
    result = run_gate(model, chunk_len=8, offsets=(0, 17), suffix_len=1, rotate=False)
    assert not result["passed"]
    assert result["rows"][0]["passed"] and not result["rows"][1]["passed"]  # offset 0 needs no rotation


def test_readout_over_rerotated_state_equals_offset_prefill(tiny_lm):
    ids, suffix = _ids(20, 2), _ids(2, 3)
    target = torch.arange(700, 720)
    moved = rerotate(prefill(tiny_lm, ids), target, tiny_lm)
    lg = read_logits(tiny_lm, [moved, prefill(tiny_lm, ids, positions=target)], suffix,
                     suffix_positions=range(720, 722))
    assert _rel(lg[0], lg[1]) <= LOGIT_TOL


def test_config_path_matches_model_path():
    for family in ("llama", "gemma3"):
        from kvprobe.models.tiny import tiny_model

        from_model, from_config = rope_layer_info(tiny_model(family)), rope_layer_info(tiny_config(family))
        assert [i.rope_type for i in from_model] == [i.rope_type for i in from_config]
        assert all(torch.equal(a.inv_freq, b.inv_freq) for a, b in zip(from_model, from_config))


def test_inexact_and_unsupported_variants_are_refused():
    dyn = _model(tf.LlamaConfig, **SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(KVProbeError, match="dynamic NTK"):
        rerotate(prefill(dyn, _ids(8)), torch.arange(10_000, 10_008), dyn)
    with pytest.raises(KVProbeError, match="dynamic NTK"):
        run_gate(dyn, chunk_len=4, offsets=(5,))
    odd = VARIANTS["linear"]()
    odd.model.rotary_emb.rope_type = "made_up"
    with pytest.raises(KVProbeError, match="rope_type 'made_up'"):
        rope_layer_info(odd)
    vl = _vl_model("sectioned")
    rot = vl.model.language_model.rotary_emb
    rot.__class__ = type("UnverifiedRotaryEmbedding", (type(rot),), {})  # an M-RoPE whose channel map is unknown
    with pytest.raises(KVProbeError, match="M-RoPE in UnverifiedRotaryEmbedding"):
        rope_layer_info(vl)
    with pytest.raises(KVProbeError, match="MLA cache whose k_pe layout"):
        rope_layer_info(tf.Glm4MoeLiteConfig())  # MLA too, but its k_pe layout is not verified here
    with pytest.raises(KVProbeError, match="GPT-J"):
        rope_layer_info(tf.GPTJConfig())


def test_gate_cli_on_config_only_dir(tmp_path, capsys):
    d = write_config_dir("gemma3", tmp_path / "g3")
    args = ["gate", "--model", str(d), "--chunk-len", "12", "--suffix-len", "1", "--offsets", "0", "5", "900"]
    assert main(args) == 0
    assert "PASSED" in capsys.readouterr().out
    # The no-rotation control (positions relabelled, keys not rotated) fails, so the command exits non-zero.
    assert main(args + ["--no-rotate"]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert main(["gate", "--model", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("name", ["MLA k_pe (deepseek-v2)", "M-RoPE sectioned (qwen2-vl)"])
def test_gate_cli_on_config_only_mla_and_mrope_dirs(name, tmp_path, capsys):
    d = tmp_path / "cfg"
    VARIANTS[name]().config.save_pretrained(d)  # config.json only: --random-init builds seeded random weights
    assert main(["gate", "--model", str(d), "--random-init", "--chunk-len", "8", "--suffix-len", "1", "--offsets", "0", "900"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and ("MLA" in out or "M-RoPE" in out)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_full_kv_splices_past_the_window_where_the_truncating_cache_cannot(family):
    from kvprobe.kv.sliding import compare_window_policies
    from kvprobe.models.tiny import tiny_config

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    cmp = compare_window_policies(model, chunk_len=24, offset=700)
    full, trunc = cmp["full_kv"], cmp["truncating"]
    assert cmp["window"] == 8 and full["slots_per_sliding_layer"] == 24
    assert trunc["slots_per_sliding_layer"] < cmp["window"] and trunc["kv_bytes"] < full["kv_bytes"]
    # appending after the block: both policies match an uncached forward
    assert full["append_logit_rel"] <= LOGIT_TOL and trunc["append_logit_rel"] <= LOGIT_TOL
    # a sub-block older than the window, sliced out and re-rotated: exact with full KV, impossible truncated
    assert full["prefix_splice_tokens"] == 16 and full["prefix_splice_logit_rel"] <= LOGIT_TOL
    assert trunc["prefix_splice_logit_rel"] is None and "unavailable" in trunc["prefix_splice"]
    with pytest.raises(KVProbeError, match="must exceed the sliding window"):
        compare_window_policies(model, chunk_len=8, offset=0)
    assert compare_window_policies(_model(tf.LlamaConfig, **SMALL), chunk_len=24, offset=0) is None
