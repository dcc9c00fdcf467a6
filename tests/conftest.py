from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvprobe.models.arch import arch_spec
from kvprobe.models.loading import LoadedModel, fingerprint_model
from kvprobe.models.tiny import TINY_FAMILIES, tiny_model, write_tiny_model_dir
from kvprobe.tasks.gated import generate_instances, load_template

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "configs" / "tasks" / "gated.yaml"

torch.set_num_threads(min(2, os.cpu_count() or 1))


def as_lm(model, tokenizer=None, name="tiny") -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tokenizer, spec=arch_spec(model.config), name=name, source="test",
                       fingerprint=fingerprint_model(model), has_chat_template=False)


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_lm(request) -> LoadedModel:
    return as_lm(tiny_model(request.param), name=f"tiny-{request.param}")


@pytest.fixture(scope="session")
def template():
    return load_template(TEMPLATE)


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory, template) -> Path:
    """A config-only Llama directory with a word-level tokenizer that covers the gated template."""
    insts = generate_instances(template, 24, seed=0)
    texts = [i.body(i.old_value) + " " + i.body(i.new_value) + " " + i.answer_prefix + " " +
             " ".join([i.old_action, i.new_action]) for i in insts]
    texts += [s.allow_action + " " + s.block_action + " " + s.allow_value + " " + s.block_value
              for s in template.scenarios]
    return write_tiny_model_dir("llama-default", tmp_path_factory.mktemp("tinytext"), texts)


@pytest.fixture(scope="session")
def smollm():
    from kvprobe.models.loading import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")
