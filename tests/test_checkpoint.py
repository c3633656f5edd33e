"""The worker's checkpoint reading (worker/engine/checkpoint.py) against transformers' own
modules: the rotary tables of every RoPE variant it serves, bit for bit; a checkpoint that
lacks a tensor is refused by name. (Loading weights
from safetensors shards, and from a `.bin` checkpoint, is checked token for token against
`generate` in tests/test_engine.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from worker.engine.checkpoint import (
    STATIC_ROPE_TYPES,
    Checkpoint,
    UnsupportedCheckpoint,
    check_config,
    rotary_tables,
)
from worker.engine.model_config import ModelConfig
from worker.engine.model_runner import ModelRunner

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},
}


def test_every_served_rope_variant_is_covered() -> None:
    assert set(ROPE) == set(STATIC_ROPE_TYPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_type", sorted(ROPE))
def test_rotary_tables_are_transformers_own(rope_type: str, dtype: torch.dtype) -> None:
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                         max_position_embeddings=256, rope_parameters=ROPE[rope_type])
    check_config(ModelConfig.of(config))
    module = LlamaRotaryEmbedding(config)
    positions = torch.arange(256)[None]
    want_cos, want_sin = module(torch.zeros(1, dtype=dtype), positions)
    cos, sin = rotary_tables(ModelConfig.of(config), 256, torch.device("cpu"), dtype)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight",
                                     "model.layers.0.input_layernorm.weight"])
def test_a_checkpoint_without_a_tensor_is_refused_by_its_name(missing: str) -> None:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                         max_position_embeddings=64)
    checkpoint = Checkpoint.of(LlamaForCausalLM(config))
    del checkpoint.tensors[missing]
    with pytest.raises(UnsupportedCheckpoint, match=missing.replace(".", r"\.")):
        ModelRunner(checkpoint, kernels="torch", release_modules=True)


@pytest.mark.parametrize("fields", [
    {"model_type": "llama"},
    {"model_type": "llama", "num_key_value_heads": 2, "rope_theta": 500000.0,
     "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "mistral"},  # transformers' default window: refused
    {"model_type": "qwen2", "sliding_window": 2048, "use_sliding_window": False},
    {"model_type": "qwen2", "sliding_window": 2048, "use_sliding_window": True},
    {"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                "rope_theta": 1e6}},
    {"model_type": "llama", "quantization_config": {"quant_method": "awq", "bits": 4}},
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_config_json_reads_as_transformers_reads_it(fields: dict[str, object],
                                                     tmp_path: Path) -> None:
    """The worker reads `config.json` itself (`worker/engine/model_config.py`): what a file
    leaves out takes transformers' defaults for its model type, and what it says is normalised
    as transformers normalises it."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 256, "num_attention_heads": 8, "num_hidden_layers": 2, **fields}))
    ours = ModelConfig.read(tmp_path)
    theirs = ModelConfig.of(AutoConfig.from_pretrained(str(tmp_path)))
    assert replace(ours, raw={}) == replace(theirs, raw={})
