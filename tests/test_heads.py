"""Read/write heads under GQA: against an ungrouped reference model, and per-head KV vs per-head output patches."""

import json

import pytest
import torch

from kvprobe.figures import render_all
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.models.arch import arch_spec
from kvprobe.models.loading import LoadedModel, fingerprint_model
from kvprobe.models.tiny import tiny_model
from kvprobe.patching.hooks import capture, run_patched
from kvprobe.patching.pairs import Anchors, PairPrefill
from kvprobe.patching.sites import Site
from kvprobe.probes import Case, sweep_logits
from kvprobe.probes.heads import kv_head_of, query_group, read_patch, write_heads, write_patch
from kvprobe.app.cli import main
from kvprobe.runner.experiment import get_experiment
from kvprobe.tasks.gated import TokenizedPair


def as_lm(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, spec=arch_spec(model.config), name="tiny", source="test",
                       fingerprint=fingerprint_model(model), has_chat_template=False)


def ungrouped_copy(model):
    """The same model with every KV head repeated for each query head it serves (num_kv_heads = num_heads):
    the reference a GQA result must agree with."""
    from transformers import AutoModelForCausalLM

    cfg = model.config.__class__.from_dict(model.config.to_dict())
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    cfg.num_key_value_heads = cfg.num_attention_heads
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = model.state_dict()
    d = cfg.head_dim
    for name, t in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = t.reshape(-1, d, t.shape[-1]).repeat_interleave(g, dim=0).reshape(-1, t.shape[-1])
    ref.load_state_dict(state)
    return ref


def toy_case(lm, seed=0, n=24, field=(5, 6)):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(3, lm.model.config.vocab_size, (n,), generator=g).tolist()
    new = list(old)
    for s in field:
        new[s] = (old[s] + 7) % lm.model.config.vocab_size
    pair = TokenizedPair(old, new, list(field), old_action_id=11, new_action_id=12)
    pp = PairPrefill(pair, prefill(lm, old[:-1]), prefill(lm, new[:-1]), old[-1:])
    lds = [float(read_logits(lm, s, pp.suffix)[0, 12] - read_logits(lm, s, pp.suffix)[0, 11]) for s in (pp.old, pp.new)]
    return Case(pair, pp, Anchors(*lds), {}, {})


@pytest.fixture(scope="module")
def gqa_pair():
    model = tiny_model("llama")  # 4 query heads, 2 KV heads
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    gqa, ref = as_lm(model), as_lm(ungrouped_copy(model))
    return gqa, ref, toy_case(gqa), toy_case(ref)


def test_ungrouped_reference_has_same_outputs(gqa_pair):
    gqa, ref, c_gqa, c_ref = gqa_pair
    assert torch.allclose(read_logits(gqa, c_gqa.pp.old, c_gqa.pp.suffix),
                          read_logits(ref, c_ref.pp.old, c_ref.pp.suffix), atol=1e-4)
    assert c_gqa.anchor.stale_ld == pytest.approx(c_ref.anchor.stale_ld, abs=1e-4)


def test_write_head_equals_its_query_group_in_the_ungrouped_model(gqa_pair):
    gqa, ref, c_gqa, c_ref = gqa_pair
    spec = gqa.spec
    slots = [5, 6, 10, 15]
    assert len(write_heads(spec)) == spec.n_layers * 2  # per KV head, never padded to 4 query heads
    got = sweep_logits(gqa, c_gqa, {f"{ly}.{h}": write_patch([(ly, h)], slots) for ly, h in write_heads(spec)})
    want = sweep_logits(ref, c_ref, {f"{ly}.{h}": write_patch([(ly, q) for q in query_group(spec, h)], slots)
                                     for ly, h in write_heads(spec)})
    for label in got:
        assert torch.allclose(got[label], want[label], atol=1e-4), label
    joint = [(1, 0), (3, 1)]
    a = sweep_logits(gqa, c_gqa, {"j": write_patch(joint, slots)})["j"]
    b = sweep_logits(ref, c_ref, {"j": write_patch([(ly, q) for ly, h in joint for q in query_group(spec, h)],
                                                   slots)})["j"]
    assert torch.allclose(a, b, atol=1e-4)


def test_read_head_is_the_same_query_head_in_both_models(gqa_pair):
    gqa, ref, c_gqa, c_ref = gqa_pair
    spec = gqa.spec
    assert [kv_head_of(spec, q) for q in range(4)] == [0, 0, 1, 1] and query_group(spec, 1) == [2, 3]
    heads = [(ly, q) for ly in range(spec.n_layers) for q in range(spec.n_heads)]
    got = sweep_logits(gqa, c_gqa, {f"{ly}.{q}": read_patch([(ly, q)]) for ly, q in heads})
    want = sweep_logits(ref, c_ref, {f"{ly}.{q}": read_patch([(ly, q)]) for ly, q in heads})
    for label in got:
        assert torch.allclose(got[label], want[label], atol=1e-4), label


def test_without_gqa_a_kv_head_patch_equals_that_heads_output_patch():
    lm = as_lm(ungrouped_copy(tiny_model("llama")))  # 4 query heads, 4 KV heads: no grouping
    case = toy_case(lm, seed=3)
    pp, last = case.pp, len(case.pp.suffix) - 1
    every = list(range(pp.context_length))
    for h in range(lm.spec.n_heads):
        # Layer 0: the decision token's query is the same in both runs, so the oracle's K/V on head h at every
        # slot gives exactly the oracle's head-h output, and nothing else changes at that layer.
        kv = sweep_logits(lm, case, {"kv": write_patch([(0, h)], every)})["kv"]
        site = Site("attn_out", 0, last, h)
        _, out = run_patched(lm, pp.suffix, capture(lm, pp.suffix, [site], prior=pp.new), prior=pp.old)
        assert torch.allclose(kv, out[0], atol=1e-4), h
        assert torch.allclose(kv, sweep_logits(lm, case, {"o": read_patch([(0, h)])})["o"], atol=1e-4)


def test_heads_cli_record_and_figure(tiny_text_dir, tmp_path):
    assert main(["run", "configs/heads.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path),
                 "--set", "task.n_instances=2", "--set", "gate.min_flip=0", "--set", "params.ks=[1,3]",
                 "--set", "params.random_draws=2", "--quiet"]) == 0
    rec = json.loads(next(tmp_path.glob("heads/*/*.json")).read_text())
    s, row = rec["summary"], rec["rows"][0]
    assert len(row["write"]) == 4 * 2 and len(row["read"]) == 4 * 4  # per KV head and per query head
    assert all(e["query_group"] == query_group_of(e["kv_head"]) for e in s["write_heads"])
    assert all(e["kv_head"] == e["q_head"] // 2 for e in s["read_heads"])
    assert row["identity"]["read_all"] == pytest.approx(1.0, abs=1e-3)
    assert s["cells_per_second"] > 0
    assert list(s)[-2:] == ["row_measures", "crossfit"]  # the declared shape, cross-fitted or not
    get_experiment("heads").summary_model.model_validate(s)
    assert any(p.name == "fig15a_heads.png" for p in render_all(tmp_path, tmp_path / "figs"))


def query_group_of(kv_head: int) -> list[int]:
    return [2 * kv_head, 2 * kv_head + 1]
