"""SAEs on sae-lens: deterministic training, save/load through the kvprobe cache, splice, AUCs, clamping."""

import numpy as np
import pytest
import torch

from kvprobe.features import sae as saelib
from kvprobe.models.loading import load_model


@pytest.fixture(scope="module")
def lm(tiny_text_dir):
    return load_model(str(tiny_text_dir))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path))
    return tmp_path


SPEC = dict(width=32, k=4, steps=30, batch=64, lr=1e-3, n_task_prompts=2, n_neutral_tokens=256, window=64)


def test_train_is_sae_lens_and_deterministic():
    from sae_lens import TopKTrainingSAE

    x = torch.randn(600, 16, generator=torch.Generator().manual_seed(0))
    a = saelib.train(x, 64, 4, 20, 64, 1e-3, seed=3)
    b = saelib.train(x, 64, 4, 20, 64, 1e-3, seed=3)
    c = saelib.train(x, 64, 4, 20, 64, 1e-3, seed=4)
    assert isinstance(a, TopKTrainingSAE)
    assert torch.equal(a.W_dec, b.W_dec) and torch.equal(a.W_enc, b.W_enc)
    assert not torch.equal(a.W_dec, c.W_dec)
    z = saelib.encode(a, x[:10])
    assert ((z > 0).sum(-1) <= 4).all()


@pytest.mark.parametrize("site", ["resid", "v"])
def test_build_saves_to_cache_and_loads_back(lm, cache, site):
    from sae_lens import SAE

    spec = saelib.SAESpec(site=site, layer=1, **SPEC)
    sae, info = saelib.build(lm, spec)
    path = saelib.cache_dir(lm, spec)
    assert path.is_relative_to(cache) and (path / "sae_weights.safetensors").exists()
    assert isinstance(sae, SAE) and sae.cfg.d_in == saelib.site_dim(lm, site) and sae.cfg.d_sae == 32
    again, info2 = saelib.build(lm, spec)  # from the cache
    assert torch.equal(sae.W_dec, again.W_dec) and info2["weights_sha256"] == info["weights_sha256"]
    rebuilt, info3 = saelib.build(lm, spec, retrain=True)  # the CLI's retrain: bit-identical weights
    assert info3["weights_sha256"] == info["weights_sha256"] and torch.equal(rebuilt.W_dec, sae.W_dec)


def test_collect_matches_hidden_states(lm):
    ids = list(range(5, 25))
    got = saelib.collect(lm, [ids], "resid", 1)[0]
    ref = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0]
    assert torch.allclose(got, ref.float(), atol=1e-5)
    v = saelib.collect(lm, [ids], "v", 1)[0]
    from kvprobe.kv.readout import prefill
    state = prefill(lm, ids)
    vals = state.values[1][0].permute(1, 0, 2).reshape(len(ids), -1)  # [seq, kv * hd]
    assert torch.allclose(v, vals.float(), atol=1e-5)


def test_reconstruction_and_identity_splice(lm, cache):
    spec = saelib.SAESpec(site="resid", layer=1, **SPEC)
    sae, _ = saelib.build(lm, spec)
    seqs = [list(range(3, 40)), list(range(40, 80))]
    rep = saelib.reconstruction(lm, sae, "resid", 1, seqs)
    assert rep["explained_variance"] <= 1.0 and 0 <= rep["dead_features"] <= 32 and rep["l0"] <= 4
    assert rep["n_tokens"] == 37 + 40
    assert rep["delta_ce"] == pytest.approx(rep["ce_spliced"] - rep["ce_clean"])
    # the clean CE equals the model's own loss
    with torch.no_grad():
        ref = np.mean([float(lm.model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss) * (len(s) - 1)
                       for s in seqs]) * 2 / (36 + 39)
    assert rep["ce_clean"] == pytest.approx(ref, rel=1e-4)


def test_feature_aucs_match_sklearn():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    feats = torch.rand(40, 5, generator=g)
    feats[:, 3] = 0.0  # a constant feature
    labels = [i % 2 for i in range(40)]
    feats[:, 1] += torch.tensor(labels, dtype=torch.float32)  # separates perfectly
    aucs = saelib.feature_aucs(feats, labels)
    assert np.isnan(aucs[3]) and aucs[1] == 1.0
    assert aucs[0] == pytest.approx(roc_auc_score(labels, feats[:, 0].numpy()))


def test_clamp_moves_only_the_clamped_features():
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(1))
    sae = saelib.train(x, 48, 6, 15, 64, 1e-3, seed=0)
    acts = x[:3]
    z = saelib.encode(sae, acts)
    f = int(z[0].argmax())
    same = saelib.clamp_acts(sae, acts, [f], z[0, f:f + 1])
    assert torch.allclose(same[0], acts[0], atol=1e-5)  # target = its own value: no change on that row
    out = saelib.clamp_acts(sae, acts, [f], torch.tensor([0.0]))
    # the change is exactly minus the feature's decoder row times its activation (error term kept)
    assert torch.allclose(out - acts, -z[:, f:f + 1] * sae.W_dec[f][None, :], atol=1e-5)
    assert torch.equal(saelib.clamp_acts(sae, acts, [], torch.tensor([])), acts)


def test_neutral_text_is_a_package_resource(lm):
    seqs = saelib.neutral_sequences(lm.tokenizer, 128, 64)
    later = saelib.neutral_sequences(lm.tokenizer, 128, 64, skip_tokens=128)
    assert [len(s) for s in seqs] == [64, 64] and seqs != later


def test_sae_train_cli_rebuilds_the_experiment_saes(tiny_text_dir, cache, capsys):
    """``kvprobe sae train`` builds exactly the SAE the experiment's config names (same cache entry)."""
    import argparse
    import json

    from kvprobe.features import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    sets = ["params.layer=1", "params.sites=[v]", "params.width=16", "params.k=2", "params.steps=5",
            "params.batch=32", "params.n_task_prompts=1", "params.n_neutral_tokens=128"]
    args = parser.parse_args(["sae", "train", "configs/sae.yaml", "--model", str(tiny_text_dir),
                              *[x for s in sets for x in ("--set", s)]])
    assert args.func(args) == 0
    info = json.loads(capsys.readouterr().out)["v"]
    assert info["spec"]["width"] == 16 and info["spec"]["layer"] == 1
    lm = load_model(str(tiny_text_dir))
    spec = saelib.SAESpec(site="v", layer=1, width=16, k=2, steps=5, batch=32, lr=5e-4, seed=0,
                          n_task_prompts=1, n_neutral_tokens=128)
    assert saelib.cache_dir(lm, spec).name == info["cached_at"]


def test_task_prompts_fill_the_polarity_trigger(lm):
    """SAE training prompts from the polarity template are its 2x2 pairs: no rule keeps a raw {trigger}."""
    from kvprobe.features.sae import task_instances, task_sequences

    insts = task_instances("configs/tasks/polarity.yaml", 2, seed=0)
    assert all(i.meta["varied"] == "trigger" for i in insts)
    assert all("{trigger}" not in i.before_field + i.after_field for i in insts)
    assert "varied" not in task_instances("configs/tasks/gated.yaml", 1, seed=0)[0].meta
    assert len(task_sequences(lm, "configs/tasks/polarity.yaml", 2, seed=0)) == 4
