"""Tiny random-init models built from each family's real config class, with its real RoPE settings.

Used by the tests and by correctness checks of architectures we have no weights for: write one to a
directory with :func:`write_config_dir` and any kvprobe command accepts that directory as ``--model``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)


def tiny_config(family: str, vocab_size: int = 512) -> Any:
    """A small config of the named family: llama (llama3 RoPE scaling), qwen2, qwen3, mistral, gemma2, gemma3."""
    import transformers as tf

    common = dict(_COMMON, vocab_size=vocab_size)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    if family == "llama-default":
        return tf.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return tf.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":
        return tf.Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "gemma2":
        return tf.Gemma2Config(**common, sliding_window=8, query_pre_attn_scalar=16,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                                "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "default",
                                                                       "rope_theta": 1000000.0}})
    raise ValueError(f"no tiny config for family '{family}'")


TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def tiny_model(family: str, seed: int = 0, vocab_size: int = 512) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size), dtype=torch.float32)
    return model.eval()


def write_config_dir(family: str, path: Path, vocab_size: int = 512) -> Path:
    """A config-only model directory that asks for random weights (its ``kvprobe-random-init.json`` marker):
    kvprobe builds seeded random weights from it and marks every record of it ``random_init``."""
    import json

    from kvprobe.models.loading import RANDOM_INIT_MARKER

    path.mkdir(parents=True, exist_ok=True)
    tiny_config(family, vocab_size).save_pretrained(path)
    (path / RANDOM_INIT_MARKER).write_text(json.dumps({"random_init": True, "why": "kvprobe.models.tiny test model: "
                                                       "seeded random weights on purpose"}) + "\n")
    return path


def write_tiny_model_dir(family: str, path: Path, texts: list[str]) -> Path:
    """A config-only model directory plus a word-level tokenizer covering ``texts``.

    Lets the whole text pipeline (tasks, runner, CLI) run on a random-init model of any family, offline.
    """
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]+", t)})
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    write_config_dir(family, path, vocab_size=len(vocab))
    return path
