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

    from kvprobe.runner.cli import main

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
