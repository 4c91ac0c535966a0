"""Loading HF models for training (rlcore.training.models): configs left as given."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlcore.training import models


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_load_causal_lm_from_a_config_leaves_the_config_alone():
    """``load_causal_lm(config)``: transformers' ``from_config`` writes ``attn_implementation`` (and ``dtype``)
    into the config it is given, so the sdpa fallback of an architecture that refuses sdpa (Gemma 2 with attention
    soft-capping) saw the sdpa it had just been refused and failed again; and the caller's config changed."""
    cfg = transformers.Gemma2Config(
        vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=5.0, sliding_window=4)
    before, impl = cfg.to_dict(), cfg._attn_implementation
    model = models.load_causal_lm(cfg, dtype=torch.float32)
    assert model.config is not cfg
    assert cfg._attn_implementation == impl
    assert cfg.to_dict() == before
    qwen = transformers.Qwen2Config(vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=4, num_key_value_heads=2)
    before = qwen.to_dict()
    model = models.load_causal_lm(qwen, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert qwen._attn_implementation != "eager" and qwen.to_dict() == before
