"""Loading a checkpoint this engine can run, and refusing one it cannot, before serving it.

The forward pass in `worker/engine/model_runner.py` is written for Llama-family decoders: SiLU-gated
MLPs without bias, rotary embeddings whose tables depend only on the position, full causal
attention. A checkpoint outside that (quantized weights, another activation, a RoPE variant
whose frequencies change with the sequence length, sliding windows) would load without error
and then produce wrong text, so each of those is refused at start with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from shared.models import ModelInfo

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ACTIVATIONS = ("silu",)
# RoPE variants whose cos/sin tables are a fixed function of the position: computed once at
# start. "dynamic" and "longrope" rescale with the current length, so a table cannot serve.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedCheckpoint(ValueError):
    """The checkpoint would load but this engine cannot compute it correctly."""


def check_config(config: Any) -> None:  # a transformers PretrainedConfig (typed loosely)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpoint(
            f"model type {config.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None))
        raise UnsupportedCheckpoint(f"quantized weights ({method or 'unknown method'}) are "
                                    "not supported: serve an unquantized checkpoint")
    if config.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedCheckpoint(f"activation {config.hidden_act!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedCheckpoint("MLP biases are not supported")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if rope:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedCheckpoint(
                f"RoPE scaling {rope_type!r} is not supported (supported: "
                f"{', '.join(STATIC_ROPE_TYPES)})")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        if window < config.max_position_embeddings:
            raise UnsupportedCheckpoint("sliding-window attention is not supported")


def load(info: ModelInfo, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The checkpoint's model in `dtype` on `device`, once its config passed `check_config`."""
    check_config(AutoConfig.from_pretrained(str(info.path)))
    model = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=dtype)
    model.to(device)  # type: ignore[arg-type]
    return model
