"""The same patch gives the same numbers through kvprobe, a TransformerLens bridge and an nnsight trace.

Every backend gets its own freshly built model: booting a TransformerLens bridge replaces the Hugging Face
model's modules in place, so the session's shared tiny models must never be wrapped.
"""

import pytest
import torch

import kvprobe
from kvprobe.errors import KVProbeError
from kvprobe.interop import as_lm
from kvprobe.interop import kv as ikv
from kvprobe.interop import nnsight as inn
from kvprobe.interop import tl as itl
from kvprobe.interop.sites import site_of_tl_hook, tl_hook_name
from kvprobe.kv import prefill
from kvprobe.models.tiny import tiny_model
from kvprobe.patching.hooks import capture, run_patched
from kvprobe.patching.sites import Site
from kvprobe.patching.sweep import KVPatch, kv_sweep

FAMILIES = ("llama", "qwen3", "gemma2", "gemma3")  # plain, q/k-norm, soft-capped + post-norms, sliding window
TOL = 1e-4


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """TransformerLens re-creates the tokenizer from its saved name, so it must come from a directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(512)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(path)
    return AutoTokenizer.from_pretrained(str(path))


def boot_bridge(model, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(f"local/{model.config.model_type}", hf_model=model, tokenizer=tokenizer,
                                               hf_config_overrides={"architectures": [type(model).__name__]})


@pytest.fixture(scope="module", params=FAMILIES)
def backends(request, word_tokenizer):
    import nnsight

    family = request.param
    native = as_lm(tiny_model(family), word_tokenizer)
    bridge = boot_bridge(tiny_model(family), word_tokenizer)
    nn_model = nnsight.LanguageModel(tiny_model(family), tokenizer=word_tokenizer)
    g = torch.Generator().manual_seed(0)
    old = torch.randint(0, 512, (20,), generator=g)
    new = old.clone()
    new[4:7] = torch.randint(0, 512, (3,), generator=g)
    return native, bridge, nn_model, old, new, 18


def test_unwrapped_models_prefill_like_native(backends):
    native, bridge, nn_model, old, _, ctx = backends
    ref = prefill(native, old[:ctx])
    assert prefill(as_lm(bridge), old[:ctx]).max_abs_diff(ref) < TOL
    assert prefill(as_lm(nn_model), old[:ctx]).max_abs_diff(ref) < TOL
    assert as_lm(bridge) is as_lm(bridge)  # the parameter-sharing view is built once per bridge
    view = as_lm(bridge).model
    assert view.get_input_embeddings().weight.data_ptr() == bridge.original_model.get_input_embeddings().weight.data_ptr()


def test_kvstate_from_each_backends_cache(backends):
    native, bridge, nn_model, old, _, ctx = backends
    ref = prefill(native, old[:ctx])
    _, cache = bridge.run_with_cache(old[:ctx].unsqueeze(0), names_filter=ikv.tl_kv_hook_filter)
    assert ikv.from_tl_cache(cache, native.spec.n_layers).max_abs_diff(ref) < TOL  # hook_rot_k = the cached key
    _, pre_rope = bridge.run_with_cache(old[:ctx].unsqueeze(0), names_filter=lambda n: n.endswith("attn.hook_k"))
    k1 = pre_rope["blocks.1.attn.hook_k"].transpose(1, 2)
    assert (k1 - ref.keys[1]).abs().max() > 1e-2  # hook_k is before RoPE: not what the cache holds
    assert ikv.from_nnsight(nn_model, old[:ctx]).max_abs_diff(ref) < TOL
    again = ikv.from_hf_cache(ikv.to_hf_cache(ref), ref.positions)
    assert again.max_abs_diff(ref) == 0 and torch.equal(again.positions, ref.positions)


def test_site_patches_agree_across_backends(backends):
    native, bridge, nn_model, old, new, _ = backends
    sites = [Site("resid_post", 1, 7), Site("attn_out", 2, 9), Site("attn_out", 0, 12, 1), Site("mlp_out", 3, 15),
             Site("resid_pre", 2, 3)]
    acts = capture(native, new.tolist(), sites)
    patches = {s: acts[s][0] for s in sites}
    _, ref = run_patched(native, old.tolist(), patches)
    _, unpatched = run_patched(native, old.tolist(), {})
    assert (ref - unpatched).abs().max() > 1e-3  # the patch does something
    assert (itl.run_patched(bridge, old, patches, lm=native) - ref).abs().max() < TOL
    assert (inn.run_patched(nn_model, as_lm(nn_model), old, patches) - ref).abs().max() < TOL
    shift = {Site("resid_post", 2, 10): torch.full((native.spec.d_model,), 0.5)}
    _, ref_add = run_patched(native, old.tolist(), shift, add=True)
    assert (itl.run_patched(bridge, old, shift, lm=native, add=True) - ref_add).abs().max() < TOL
    assert (inn.run_patched(nn_model, as_lm(nn_model), old, shift, add=True) - ref_add).abs().max() < TOL


def test_kv_cells_agree_across_backends(backends):
    native, bridge, nn_model, old, new, ctx = backends
    base, donor = prefill(native, old[:ctx]), prefill(native, new[:ctx])
    cells = [KVPatch.of([]), KVPatch.of([4]), KVPatch.of([5], [1]), KVPatch.of([4, 6, 9], [0, 3]),
             KVPatch.of(range(4, ctx), [2])]
    ref = kv_sweep(native, base, donor, cells, old[ctx:].tolist(), engine="mix")
    assert (ref[1:] - ref[0]).abs().max() > 1e-2
    assert (kv_sweep(native, base, donor, cells, old[ctx:].tolist(), engine="shared") - ref).abs().max() < TOL
    assert (itl.KVCellPatcher(bridge, old, new[:ctx], ctx).sweep(cells) - ref).abs().max() < TOL
    assert (inn.KVCellPatcher(nn_model, as_lm(nn_model), old, new[:ctx], ctx).sweep(cells) - ref).abs().max() < TOL
    # one cell's logits own their storage: a view into the [1, seq, vocab] output would hold it all (a 200-cell
    # peer sweep on a 673-token prompt ran out of memory that way)
    vocab_bytes = ref.shape[1] * 4
    for one in (itl.KVCellPatcher(bridge, old, new[:ctx], ctx).logits([4]),
                inn.KVCellPatcher(nn_model, as_lm(nn_model), old, new[:ctx], ctx).logits([4])):
        assert one.untyped_storage().nbytes() == vocab_bytes
    # kvprobe's public functions take the peers' objects directly (converted at that boundary)
    view = as_lm(bridge)
    via_bridge = kvprobe.kv_sweep(bridge, prefill(view, old[:ctx]), prefill(view, new[:ctx]), cells, old[ctx:].tolist())
    assert (via_bridge - ref).abs().max() < TOL


def test_hook_name_table_round_trips():
    lm = as_lm(tiny_model("llama"))
    gemma = as_lm(tiny_model("gemma2"))
    for site in [Site("resid_pre", 2, 5), Site("resid_post", 0), Site("attn_out", 1, 3), Site("mlp_out", 3, 1)]:
        assert site_of_tl_hook(tl_hook_name(site, lm), site.position, lm=lm) == site
        assert site_of_tl_hook(tl_hook_name(site, gemma), site.position, lm=gemma) == site
    assert tl_hook_name(Site("attn_out", 1), lm) == "blocks.1.hook_attn_out"
    assert tl_hook_name(Site("attn_out", 1), gemma) == "blocks.1.attn.hook_out"  # before Gemma's post-norm
    assert tl_hook_name(Site("attn_out", 4, 2, head=3)) == "blocks.4.attn.hook_z"
    assert site_of_tl_hook("blocks.4.attn.hook_z", 2, head=3) == Site("attn_out", 4, 2, 3)
    assert tl_hook_name(Site("kv", 2, 7)) == ("blocks.2.attn.hook_rot_k", "blocks.2.attn.hook_v")
    with pytest.raises(KVProbeError, match="post-norm"):
        site_of_tl_hook("blocks.1.hook_attn_out", lm=gemma)
    with pytest.raises(KVProbeError, match="before RoPE"):
        site_of_tl_hook("blocks.1.attn.hook_k")


def test_hooked_transformer_and_unknown_objects_are_refused():
    with pytest.raises(KVProbeError, match="cannot use"):
        as_lm(object())


@pytest.mark.slow
def test_smollm_kv_cells_and_sites_agree_across_backends():
    import nnsight

    from kvprobe.models.loading import load_model

    native = load_model("smollm2-135m", device="cpu", dtype="float32")
    bridge = boot_bridge(load_model("smollm2-135m", device="cpu", dtype="float32").model, native.tokenizer)
    nn_model = nnsight.LanguageModel(native.model, tokenizer=native.tokenizer)  # nnsight leaves the model as it is
    old = native.tokenizer("The gate is closed, so the robot must wait before it can move on.")["input_ids"]
    new = native.tokenizer("The gate is open, so the robot must wait before it can move on.")["input_ids"]
    assert len(old) == len(new)
    ctx = len(old) - 1
    base, donor = prefill(native, old[:ctx]), prefill(native, new[:ctx])
    cells = [KVPatch.of([3], [layer]) for layer in (0, 9, 21, 29)] + [KVPatch.of([3, 4])]
    ref = kv_sweep(native, base, donor, cells, old[ctx:], engine="mix")
    assert (kv_sweep(native, base, donor, cells, old[ctx:]) - ref).abs().max() < TOL
    assert (itl.KVCellPatcher(bridge, old, new[:ctx], ctx).sweep(cells) - ref).abs().max() < TOL
    assert (inn.KVCellPatcher(nn_model, native, old, new[:ctx], ctx).sweep(cells) - ref).abs().max() < TOL
    sites = [Site("resid_post", 10, 3), Site("attn_out", 20, 5, head=4)]
    acts = capture(native, new, sites)
    patches = {s: acts[s][0] for s in sites}
    _, want = run_patched(native, old, patches)
    assert (itl.run_patched(bridge, old, patches, lm=native) - want).abs().max() < TOL
    assert (inn.run_patched(nn_model, native, old, patches) - want).abs().max() < TOL


def test_interop_notebook_gives_the_native_numbers(tiny_text_dir, tmp_path, monkeypatch):
    """notebooks/interop.ipynb: the locality probe through nnsight and TL equals kvprobe's (it asserts <= 1e-4)."""
    import json
    from pathlib import Path

    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    monkeypatch.setenv("KVPROBE_INTEROP_MODEL", str(tiny_text_dir))
    monkeypatch.setenv("KVPROBE_INTEROP_N", "2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / "interop.ipynb", as_version=4)
    ExecutePreprocessor(timeout=300, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs), outputs
    text = json.dumps(outputs)
    assert "max |difference|" in text and "transformer_lens" in text and "field_only" in text
