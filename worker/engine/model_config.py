"""A checkpoint's `config.json` as the engine reads it, without transformers.

transformers' config classes fill in what a `config.json` leaves out, but importing one costs a
worker start about a second of CPU (a Llama config pulls in transformers' activations, its
distributed tensors and sympy), more than the rest of a small model's start. The engine reads
a dozen fields, so they are read here, with the defaults transformers' classes give the four
families it serves, and the same normalisations (grouped-query heads default to all heads, RoPE
parameters under `rope_parameters` whatever key the file used, a Qwen window that is off is no
window). A RoPE variant other than the default still has its tables computed by transformers
(`worker/engine/checkpoint.py`), from the file's own fields kept in `raw`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# What transformers' config classes default each field to, per model type, where it differs from
# Llama's (`LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config` in transformers 5).
_COMMON: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "head_dim": None, "mlp_bias": False, "sliding_window": None,
    "use_sliding_window": True,
}
_BY_TYPE: dict[str, dict[str, Any]] = {
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768,
              "sliding_window": 4096, "use_sliding_window": False},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128,
              "sliding_window": 4096, "use_sliding_window": False},
}
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope: dict[str, Any]  # rope_type, rope_theta and the variant's own parameters
    mlp_bias: bool
    sliding_window: int | None  # None: full attention
    quantization_method: str | None  # None: plain weights
    raw: dict[str, Any]  # the fields as given, for transformers' RoPE functions

    @property
    def rope_type(self) -> str:
        return str(self.rope["rope_type"])

    @classmethod
    def read(cls, path: Path) -> ModelConfig:
        """The config of the checkpoint in directory `path`."""
        return cls.from_dict(orjson.loads((path / "config.json").read_bytes()))

    @classmethod
    def of(cls, config: Any) -> ModelConfig:
        """A transformers config's fields (a model loaded by transformers, tests)."""
        return cls.from_dict(config.to_dict())

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        model_type = str(fields.get("model_type", ""))
        given = {**_COMMON, **_BY_TYPE.get(model_type, {}),
                 **{k: v for k, v in fields.items() if k in _COMMON and v is not None}}
        heads = int(given["num_attention_heads"])
        window = given["sliding_window"] if given["use_sliding_window"] else None
        quantization = fields.get("quantization_config")
        method = None
        if quantization:
            method = str(quantization.get("quant_method") if isinstance(quantization, dict)
                         else getattr(quantization, "quant_method", None) or "unknown method")
        return cls(
            model_type=model_type,
            hidden_size=int(given["hidden_size"]),
            num_hidden_layers=int(given["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(given["num_key_value_heads"] or heads),
            head_dim=int(given["head_dim"] or given["hidden_size"] // heads),
            hidden_act=str(given["hidden_act"]),
            max_position_embeddings=int(given["max_position_embeddings"]),
            rms_norm_eps=float(given["rms_norm_eps"]),
            rope=_rope(fields, int(given["max_position_embeddings"])),
            mlp_bias=bool(given["mlp_bias"]),
            sliding_window=int(window) if window else None,
            quantization_method=method,
            raw=dict(fields),
        )


def _rope(fields: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """RoPE's parameters in one dict, as transformers standardises them: from `rope_parameters`
    or the older `rope_scaling`, the type under `rope_type` (older files say `type`), the base
    from the dict or the top level, and the pretraining length of the variants that scale from
    it."""
    rope = dict(fields.get("rope_scaling") or fields.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", fields.get("rope_theta") or DEFAULT_ROPE_THETA)
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in fields:
            rope["original_max_position_embeddings"] = fields["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", max_position_embeddings)
    return rope
