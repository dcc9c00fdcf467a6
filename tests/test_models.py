import os

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


# -- fingerprints depend on weights and architecture only --------------------------------------------------

def test_fingerprint_is_the_same_from_two_directories_and_changes_with_one_weight(tmp_path):
    from kvprobe.models.tiny import tiny_model

    model = tiny_model("qwen2")
    for name in ("a", "b"):
        model.save_pretrained(tmp_path / name)
    a, b = load_model(str(tmp_path / "a")), load_model(str(tmp_path / "b"))
    assert a.model.config._name_or_path != b.model.config._name_or_path  # the paths really differ
    assert a.fingerprint == b.fingerprint
    with torch.no_grad():
        b.model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-6  # one value, below any print precision
    from kvprobe.models.loading import fingerprint_model

    assert fingerprint_model(b.model) != a.fingerprint


@pytest.mark.slow
def test_smollm_fingerprint_is_the_same_under_two_cache_dirs(tmp_path, monkeypatch):
    """The embedded default, loaded from two kvprobe caches (as under two HOMEs), has one fingerprint, and an
    organism trained on it loads from either."""
    import shutil

    from kvprobe.cache_dir import cache_root
    from kvprobe.models.registry import REGISTRY
    from kvprobe.models.loading import _dequantized_dir

    first = load_model("smollm2-135m", device="cpu", dtype="float32")
    src = _dequantized_dir(REGISTRY["smollm2-135m"])
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path / "other-cache"))
    shutil.copytree(src, cache_root() / "dequantized" / "smollm2-135m")  # a dequantization costs ~15 s more
    second = load_model("smollm2-135m", device="cpu", dtype="float32")
    assert second.model.config._name_or_path != first.model.config._name_or_path
    assert second.fingerprint == first.fingerprint
    for alias in ("smollm2-135m-gated-v3n2-seed2",):  # the load checks its card's base fingerprint (a recommended
        # organism: history organisms' weights are in git, tests/test_organism_registry.py checks them there)
        org = load_model(alias, device="cpu", dtype="float32")
        assert org.fingerprint not in (first.fingerprint, "")


# -- paper aliases: local cache, download, offline -----------------------------------------------------------

class _FakeHub:
    """Stands in for transformers' from_pretrained: nothing in the local cache; a download returns a tiny model."""

    def __init__(self, download_fails: bool = False) -> None:
        self.calls: list[dict] = []
        self.download_fails = download_fails

    def model(self, source, **kw):
        from kvprobe.models.tiny import tiny_model

        self.calls.append({"what": "model", "source": source, **kw})
        if kw.get("local_files_only") or self.download_fails:
            raise OSError(f"{source} is not in the cache" if kw.get("local_files_only") else "connection refused")
        return tiny_model("llama")

    def tokenizer(self, source, **kw):
        self.calls.append({"what": "tokenizer", "source": source, **kw})
        if kw.get("local_files_only") or self.download_fails:
            raise OSError("not in the cache")
        return None


@pytest.fixture
def fake_hub(monkeypatch):
    import transformers

    hub = _FakeHub()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", hub.model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub.tokenizer)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub


def test_paper_alias_downloads_when_online(fake_hub):
    lm = load_model("llama-3.1-8b", device="cpu", dtype="bfloat16")
    downloads = [c for c in fake_hub.calls if c["what"] == "model" and not c.get("local_files_only")]
    assert len(downloads) == 1 and downloads[0]["source"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert downloads[0]["dtype"] == torch.bfloat16 and "device_map" not in downloads[0]
    assert lm.name == "llama-3.1-8b" and lm.dtype == torch.float32  # the fake returns fp32; no cast was asked


@pytest.mark.parametrize("how", ["env", "flag"])
def test_paper_alias_offline_never_downloads(fake_hub, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KVProbeError, match="offline mode is on") as err:
        load_model("qwen3-8b", offline=True if how == "flag" else None)
    assert "Qwen/Qwen3-8B" in str(err.value) and "--model" in str(err.value)
    assert all(c.get("local_files_only") for c in fake_hub.calls)


def test_paper_alias_failed_download_is_one_clear_error(fake_hub):
    fake_hub.download_fails = True
    with pytest.raises(KVProbeError, match="download failed") as err:
        load_model("mistral-7b")
    assert "mistralai/Mistral-7B-Instruct-v0.3" in str(err.value) and "hf download" in str(err.value)


def test_cuda_loads_stream_bf16_onto_the_device():
    from kvprobe.models.loading import _hub_kwargs, _pick_dtype

    dev = torch.device("cuda", 1)
    kw = _hub_kwargs(_pick_dtype("auto", dev), dev)
    assert kw == {"dtype": torch.bfloat16, "device_map": {"": 1}, "low_cpu_mem_usage": True}
    assert _hub_kwargs(torch.float32, torch.device("cpu")) == {"dtype": torch.float32}


def test_cli_offline_flag_reaches_the_loader(monkeypatch, tmp_path):
    from kvprobe.app import cli

    seen = {}

    def fake_run(cfg, **kw):
        seen.update(kw, hf_env=os.environ.get("HF_HUB_OFFLINE"))
        raise KVProbeError("stop here")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test, whatever the CLI sets
    monkeypatch.setattr("kvprobe.runner.experiment.run_experiment", fake_run)
    assert cli.main(["run", "configs/locality.yaml", "--model", "llama-3.1-8b", "--offline",
                     "--output-dir", str(tmp_path)]) == 2
    assert seen["offline"] is True and seen["hf_env"] == "1"
