"""Any Hugging Face id loads like a paper alias (fake hub), and no directory silently runs on random weights."""

from __future__ import annotations

import json

import pytest

from kvprobe.errors import KVProbeError
from kvprobe.models.loading import RANDOM_INIT_MARKER, load_model
from kvprobe.models.tiny import tiny_config, write_config_dir
from tests.test_models import _FakeHub


class _FakeConfigHub:
    """AutoConfig.from_pretrained: nothing in the local cache; online it returns ``config`` or raises ``error``."""

    def __init__(self, config=None, error: BaseException | None = None) -> None:
        self.config, self.error, self.calls = config or tiny_config("llama"), error, []

    def __call__(self, source, **kw):
        self.calls.append({"source": source, **kw})
        if kw.get("local_files_only"):
            raise OSError(f"{source} is not in the cache")
        if self.error is not None:
            raise self.error
        return self.config


@pytest.fixture
def hub(monkeypatch):
    import transformers

    models, configs = _FakeHub(), _FakeConfigHub()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", models.model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", models.tokenizer)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", configs)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return models, configs


def test_any_hf_id_loads_through_the_alias_path(hub):
    models, configs = hub
    lm = load_model("some-org/Some-Llama-1B", device="cpu", dtype="float32")
    downloads = [c for c in models.calls if c["what"] == "model" and not c.get("local_files_only")]
    assert [c["source"] for c in downloads] == ["some-org/Some-Llama-1B"]
    assert any(c.get("local_files_only") for c in models.calls)  # the local HF cache is tried first
    assert configs.calls[0]["local_files_only"] and lm.name == "some-org/Some-Llama-1B"
    assert lm.describe()["source"] == "Hugging Face id some-org/Some-Llama-1B" and not lm.random_init


def test_hf_id_offline_never_downloads(hub, monkeypatch):
    models, configs = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KVProbeError, match="offline mode is on") as err:
        load_model("some-org/Some-Llama-1B")
    assert "hf download some-org/Some-Llama-1B" in str(err.value)
    assert all(c.get("local_files_only") for c in configs.calls) and not models.calls


def test_gated_hf_id_names_the_licence_and_the_token(hub):
    import httpx
    from huggingface_hub.errors import GatedRepoError

    _, configs = hub
    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/meta-llama/X"))
    try:
        raise GatedRepoError("401 Client Error: access to model meta-llama/X is restricted", response=response)
    except GatedRepoError as gated:
        try:
            raise OSError("You are trying to access a repository you have no access to") from gated
        except OSError as wrapped:
            configs.error = wrapped
    with pytest.raises(KVProbeError) as err:
        load_model("meta-llama/X")
    msg = str(err.value)
    assert "gated" in msg and "licence" in msg and "HF_TOKEN" in msg and "hf auth login" in msg


def test_hf_id_of_an_unsupported_architecture_is_refused_before_weights(hub):
    import transformers

    models, configs = hub
    configs.config = transformers.T5Config()
    with pytest.raises(KVProbeError, match="not a decoder language model"):
        load_model("google-t5/t5-small")
    configs.config = transformers.GPT2Config()
    with pytest.raises(KVProbeError, match="no rotary position embeddings"):
        load_model("openai-community/gpt2")
    assert not models.calls  # no weights were fetched


def test_unknown_alias_suggests_the_closest():
    with pytest.raises(KVProbeError, match=r"did you mean 'smollm2-135m'") as err:
        load_model("smollm2-13m")
    assert str(err.value).count(",") < 10  # suggestions, not the whole alias list


def test_weightless_directory_is_refused_without_random_init(tmp_path):
    d = tmp_path / "q3"
    tiny_config("qwen3").save_pretrained(d)  # a config.json and nothing else, as a failed download leaves it
    with pytest.raises(KVProbeError, match="no weights") as err:
        load_model(str(d))
    assert "--random-init" in str(err.value)
    lm = load_model(str(d), random_init=True, seed=3)
    assert lm.random_init and lm.describe()["random_init"] is True and "random init" in lm.source
    assert load_model(str(d), random_init=True, seed=3).fingerprint == lm.fingerprint


def test_tiny_test_directories_ask_for_random_init_themselves(tmp_path):
    d = write_config_dir("llama", tmp_path / "tiny")
    assert json.loads((d / RANDOM_INIT_MARKER).read_text())["random_init"] is True
    assert load_model(str(d)).random_init


def test_a_directory_with_weights_is_not_random_init(tmp_path):
    from kvprobe.models.tiny import tiny_model

    tiny_model("qwen2").save_pretrained(tmp_path / "w")
    lm = load_model(str(tmp_path / "w"), random_init=True)  # allowed, but the weights are real
    assert not lm.random_init and "random_init" not in lm.describe()


def test_cli_random_init_run_is_marked_in_record_and_table(tiny_text_dir, tmp_path, capsys):
    import shutil

    from kvprobe.app.cli import main

    plain = tmp_path / "plain"
    shutil.copytree(tiny_text_dir, plain)
    (plain / RANDOM_INIT_MARKER).unlink()  # as a user's directory: config and tokenizer, no weights, no marker
    base = ["run", "configs/locality.yaml", "--model", str(plain), "--set", "task.n_instances=2",
            "--output-dir", str(tmp_path / "results"), "--quiet"]
    assert main(base) == 2
    assert "no weights" in capsys.readouterr().err
    assert main([*base, "--random-init"]) == 0
    out = capsys.readouterr().out
    assert out.count("RANDOM-INIT MODEL") == 2  # above and below the table
    rec = json.loads(next((tmp_path / "results").rglob("*.json")).read_text())
    assert rec["model"]["random_init"] is True


def test_models_shows_first_load_time_and_cache_disk_measured_from_the_cache(tmp_path, monkeypatch, capsys):
    from kvprobe.models.loading import FIRST_LOAD_FILE
    from kvprobe.app.cli import main

    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path))
    smol = tmp_path / "dequantized" / "smollm2-135m"
    smol.mkdir(parents=True)
    (smol / "model.safetensors").write_bytes(b"\0" * 2_500_000)
    (smol / FIRST_LOAD_FILE).write_text(json.dumps({"seconds": 12.4}))
    (smol / ".complete").write_text("x.gguf")
    gemma = tmp_path / "dequantized" / "gemma3-270m"
    gemma.mkdir(parents=True)
    (gemma / ".complete").write_text("x.gguf")  # a cache built before first loads were timed
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"\0" * 1_000_000)  # assembled: it counts
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "12 s" in lines["smollm2-135m"] and "0.00 GB" in lines["smollm2-135m"]
    assert "not timed" in lines["gemma3-270m"] and "0.00 GB" in lines["gemma3-270m"]
    assert "not yet" in lines["qwen2.5-coder-0.5b"]
    from kvprobe.models.loading import cache_usage
    from kvprobe.models.registry import REGISTRY

    assert cache_usage(REGISTRY["gemma3-270m"])["bytes"] == 1_000_000 + len("x.gguf")
    assert cache_usage(REGISTRY["smollm2-135m"]) == {"bytes": 2_500_000 + len("x.gguf") + len(json.dumps(
        {"seconds": 12.4})), "first_load_s": 12.4}
