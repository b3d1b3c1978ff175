"""Layer selection: class names, exact and suffix names, re: patterns, ignore."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compress.targets import select_modules, unused_patterns


def tiny_llama():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    return LlamaForCausalLM(cfg)


def test_linear_minus_lm_head():
    m = tiny_llama()
    chosen = select_modules(m, ["Linear"], ["lm_head"])
    assert len(chosen) == 2 * 7 and "lm_head" not in chosen


def test_regex_and_suffix():
    m = tiny_llama()
    assert list(select_modules(m, ["re:.*q_proj$"], [])) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert list(select_modules(m, ["mlp.down_proj"], ["re:model\\.layers\\.1\\."])) == ["model.layers.0.mlp.down_proj"]
    assert list(select_modules(m, ["model.layers.1.mlp.up_proj"], [])) == ["model.layers.1.mlp.up_proj"]
    # a suffix matches only at a dot boundary
    assert select_modules(m, ["proj"], []) == {}


def test_unused_patterns_reported():
    m = tiny_llama()
    assert unused_patterns(m, ["Linear", "re:.*qproj", "lm_head", "Conv2d"]) == ["re:.*qproj", "Conv2d"]
