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


@pytest.fixture(scope="session")
def tiny_formats_dir(tmp_path_factory, template) -> Path:
    """A config-only Llama whose word-level tokenizer covers the gated template's scenarios rendered in every
    generator format (the generator's word lists and surface variants included), with digits split one per token
    as SmolLM2 splits them, so an entity id such as "E4312" ends in its own last-digit token."""
    import dataclasses
    import json
    import re
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvprobe.models.tiny import write_config_dir
    from kvprobe.tasks.edits import erratum_line
    from kvprobe.tasks.generator import FORMATS, SURFACE_VARIANTS, build_generated, load_words, template_family

    texts = [" ".join(string.ascii_uppercase), " ".join(string.digits), json.dumps(dataclasses.asdict(load_words())),
             json.dumps(SURFACE_VARIANTS)]
    for s in template.scenarios:
        for fmt in FORMATS:
            for notes in (0, 2):
                inst = build_generated(notes, 0, "test", fmt, counterfactual=0.0, family=template_family(s),
                                       n_notes=notes, surface=True)
                texts += [inst.body(inst.old_value), inst.body(inst.new_value), inst.system, inst.answer_prefix,
                          inst.old_action, inst.new_action, erratum_line(template, inst, inst.new_value)]
    words = sorted({p for t in texts for w in re.findall(r"\w+|[^\w\s]+", t) for p in re.findall(r"\d|\D+", w)})
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")
    path = tmp_path_factory.mktemp("tinyformats")
    fast.save_pretrained(path)
    return write_config_dir("llama-default", path, vocab_size=len(vocab))
