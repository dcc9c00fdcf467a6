"""The KV core in bfloat16 on the accelerator (CUDA where there is one, else the CPU).

Every other test runs float32 on the CPU. These run the same identities in the dtype and on the device a
user with a GPU gets (``device: auto`` -> CUDA, ``dtype: auto`` -> bfloat16), on a tiny random model of
every family, so a tensor left on the CPU, a dtype mismatch or a bf16-only shape bug fails here.
Tolerances are relative to the logits' scale: bf16 keeps 8 bits of mantissa, so identities that are exact
in float32 hold to about 1e-2 here; identities that copy tensors (no arithmetic) stay exact.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvprobe.kv import edit, prefill, read_logits
from kvprobe.kv.compose import Live, Spliced, assemble, precompile
from kvprobe.kv.rope import rerotate
from kvprobe.models.loading import load_model
from kvprobe.models.tiny import TINY_FAMILIES, tiny_model, write_config_dir
from kvprobe.patching.hooks import capture, run_patched
from kvprobe.patching.sites import Site
from kvprobe.app.cli import main
from tests.conftest import as_lm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 0.05) -> bool:
    """Equal up to bf16 rounding: the difference is small against the reference's scale. (read_logits
    returns float32 logits on the CPU; the states stay on the device.)"""
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    return (got - ref).abs().max().item() <= rel * ref.abs().max().item() + 1e-2


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def bf16_lm(request):
    return as_lm(tiny_model(request.param).to(device=DEVICE, dtype=DTYPE), name=f"tiny-{request.param}")


def test_prefill_readout_and_mix_on_the_device(bf16_lm):
    ids = _ids(40, 0)  # past the tiny Gemma sliding window (8)
    full = bf16_lm.model(torch.tensor([ids], device=DEVICE)).logits[0, -1]
    state = prefill(bf16_lm, ids[:-1])
    assert state.keys[0].device.type == DEVICE.type and state.keys[0].dtype == DTYPE
    assert _close(read_logits(bf16_lm, state, ids[-1:])[0], full)
    new = list(ids)
    new[10:12] = _ids(2, 3)
    s_old, s_new = state, prefill(bf16_lm, new[:-1])
    assert s_old.slice(0, 10).max_abs_diff(s_new.slice(0, 10)) == 0.0  # same prefix, same kernels: exact
    lg = read_logits(bf16_lm, [s_old.mix(s_new, range(10, s_old.length)), s_new, s_old.mix(s_new, []), s_old],
                     ids[-1:])
    assert _close(lg[0], lg[1]) and torch.equal(lg[2], lg[3])


def test_rerotated_state_reads_like_an_offset_prefill(bf16_lm):
    ids, suffix = _ids(20, 2), _ids(2, 3)
    target = torch.arange(700, 720)
    moved = rerotate(prefill(bf16_lm, ids), target, bf16_lm)
    assert moved.keys[0].dtype == DTYPE and moved.keys[0].device.type == DEVICE.type and moved.positions.tolist() == target.tolist()
    lg = read_logits(bf16_lm, [moved, prefill(bf16_lm, ids, positions=target)], suffix,
                     suffix_positions=range(720, 722))
    assert _close(lg[0], lg[1])


def test_sliding_window_policies_compare_on_the_device(bf16_lm):
    from kvprobe.kv.sliding import compare_window_policies

    cmp = compare_window_policies(bf16_lm.model, chunk_len=24, suffix_len=3, offset=700)
    if cmp is None:  # no sliding layers in this family
        assert bf16_lm.spec.sliding_window is None
        return
    full, trunc = cmp["full_kv"], cmp["truncating"]
    assert cmp["window"] == 8 and full["slots_per_sliding_layer"] == 24
    assert full["append_logit_rel"] <= 0.05 and full["prefix_splice_logit_rel"] <= 0.05


def test_identity_patch_and_donor_patch(bf16_lm):
    ids, donor = _ids(16, 0), _ids(16, 5)
    sites = [Site("resid_pre", 1, 5), Site("resid_post", 2, 7), Site("attn_out", 1, 3), Site("mlp_out", 0, 9),
             Site("attn_out", 2, 4, head=1)]
    acts = capture(bf16_lm, ids, sites)
    assert all(a.device.type == DEVICE.type for a in acts.values())
    clean_state, clean_logits = run_patched(bf16_lm, ids, {})
    state, logits = run_patched(bf16_lm, ids, acts)
    assert _close(logits, clean_logits) and state.max_abs_diff(clean_state) < 0.1
    site = Site("resid_post", 1, 6)
    patched, _ = run_patched(bf16_lm, ids, {site: capture(bf16_lm, donor, [site])[site]})
    # KV written before the patched residual is read is untouched, bit for bit
    assert patched.keys[1].sub(clean_state.keys[1]).abs().max() == 0
    assert patched.keys[2][:, :, :6].sub(clean_state.keys[2][:, :, :6]).abs().max() == 0


def test_edit_recompute_and_splice_on_the_device(bf16_lm):
    old = _ids(24, 0)
    new = list(old)
    new[8:10] = [(t + 1) % 512 for t in old[8:10]]
    e = edit.FieldEdit(prefill(bf16_lm, old), old, new, [8, 9], [5])
    fresh = prefill(bf16_lm, new)
    want = read_logits(bf16_lm, e.stale.mix(fresh, range(8, 24)), [7])[0]
    assert _close(read_logits(bf16_lm, edit.full_downstream(bf16_lm, e).state, [7])[0], want)
    head, chunk, tail = _ids(7, 0), _ids(12, 1), _ids(5, 2)
    full = read_logits(bf16_lm, prefill(bf16_lm, head + chunk + tail[:-1]), tail[-1:])[0]
    repaired = assemble(bf16_lm, [Live(tuple(head)), Spliced(tuple(chunk), precompile(bf16_lm, chunk),
                                                                    seam=len(chunk)), Live(tuple(tail[:-1]))])
    assert _close(read_logits(bf16_lm, repaired, tail[-1:])[0], full)


def test_auto_dtype_and_device_load_a_config_dir(tmp_path):
    lm = load_model(str(write_config_dir("qwen2", tmp_path / "qwen2")), device=DEVICE.type, dtype="auto")
    param = next(lm.model.parameters())
    assert param.device.type == DEVICE.type
    assert param.dtype == (torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)


_SAE = ["params.layer=1", "params.sites=[v]", "params.width=16", "params.k=2", "params.steps=5", "params.batch=32",
        "params.n_task_prompts=1", "params.n_neutral_tokens=128", "params.n_dead_tokens=2048",
        "params.eval_families=[orders]"]
# fit_on=all: a random model flips no pair, and the fit (DAS included) must run
_DIRECTIONS = ["params.layers=[1,2]", "params.das.layers=[2]", "params.eval_families=[orders]", "params.das.steps=3",
               "params.fit_on=all", "task.n_instances=8"]
EXTRA = {"locality": [], "suffix": [], "sae": _SAE, "directions": _DIRECTIONS, "knockout": [], "specificity": [],
         "writability": [], "scrubbing": [], "timing": [], "dissociation": [], "probes": [], "heads": [],
         "edit_frontier": [], "edit_wording": [], "edit_cot": [], "long_horizon": [], "transplant": [],
         "write_share": []}
# On the CPU (CI) three experiments keep the suite short; on an accelerator (or with
# KVPROBE_TEST_ALL_EXPERIMENTS=1) every one runs.
EVERY = DEVICE.type == "cuda" or os.environ.get("KVPROBE_TEST_ALL_EXPERIMENTS") == "1"
ON_THIS_DEVICE = list(EXTRA) if EVERY else ["locality", "suffix", "sae"]


@pytest.mark.parametrize("exp", ON_THIS_DEVICE)
def test_experiments_run_in_bf16_on_the_device(exp, tiny_text_dir, tmp_path, monkeypatch):
    """The runner end to end in the GPU user's dtype: a record is written and every number is finite."""
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "cache"))
    sets = [f"device={DEVICE.type}", "dtype=bfloat16", "task.n_instances=4", *EXTRA[exp]]
    args = ["run", f"configs/{exp}.yaml", "--model", str(tiny_text_dir), "--output-dir", str(tmp_path / "out"),
            *[x for s in sets for x in ("--set", s)], "--quiet"]
    assert main(args) == 0
    record = json.loads(next((tmp_path / "out").rglob("*.json")).read_text())
    assert record["config"]["dtype"] == "bfloat16" and record["config"]["device"] == DEVICE.type
    flat = json.dumps(record["summary"])
    assert "NaN" not in flat and "Infinity" not in flat
    if exp == "directions":  # the direction fits and DAS ran, not only the pair loop
        assert record["summary"]["sites"] and record["summary"]["das_seconds_total"] >= 0
