"""Loading a checkpoint this engine can run, and refusing one it cannot, before serving it.

The engine needs a checkpoint's config and its tensors by name, never transformers' model
classes: building one imports transformers' whole modelling stack (about 1.5 s of CPU on the
development machine, most of a tiny model's worker start) and allocates modules only to copy
their weights out. So the config comes from `config.json` (`worker/engine/model_config.py`),
the tensors straight from the safetensors files (one file or shards with an index); a checkpoint
in another format (pytorch `.bin`) goes through transformers' loader instead. Tests and
benchmarks that already hold a model wrap it with `Checkpoint.of`.

The forward pass in `worker/engine/model_runner.py` is written for Llama-family decoders: SiLU-gated
MLPs without bias, rotary embeddings whose tables depend only on the position, full causal
attention. A checkpoint outside that (quantized weights, another activation, a RoPE variant
whose frequencies change with the sequence length, sliding windows) would load without error
and then produce wrong text, so each of those is refused at start with the reason.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from safetensors import safe_open

from worker.engine.model_config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ACTIVATIONS = ("silu",)
# RoPE variants whose cos/sin tables are a fixed function of the position: computed once at
# start. "dynamic" and "longrope" rescale with the current length, so a table cannot serve.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedCheckpoint(ValueError):
    """The checkpoint would load but this engine cannot compute it correctly."""


def check_config(config: ModelConfig) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpoint(
            f"model type {config.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if config.quantization_method:
        raise UnsupportedCheckpoint(f"quantized weights ({config.quantization_method}) are "
                                    "not supported: serve an unquantized checkpoint")
    if config.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedCheckpoint(f"activation {config.hidden_act!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    if config.mlp_bias:
        raise UnsupportedCheckpoint("MLP biases are not supported")
    if config.rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedCheckpoint(
            f"RoPE scaling {config.rope_type!r} is not supported (supported: "
            f"{', '.join(STATIC_ROPE_TYPES)})")
    if config.sliding_window and config.sliding_window < config.max_position_embeddings:
        raise UnsupportedCheckpoint("sliding-window attention is not supported")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's config and its tensors under transformers' parameter names
    (`model.layers.0.self_attn.q_proj.weight`). The runner takes the tensors out of `tensors` as
    it lays them out, so their memory is freed layer by layer."""

    config: ModelConfig
    tensors: MutableMapping[str, torch.Tensor]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Checkpoint:
        """A loaded transformers model's config and parameters (shared, not copied)."""
        return cls(ModelConfig.of(model.config), dict(model.state_dict()))

    def optional(self, name: str, release: bool = False) -> torch.Tensor | None:
        """Tensor `name` or None, taken out of the checkpoint with `release`."""
        return self.tensors.pop(name, None) if release else self.tensors.get(name)

    def tensor(self, name: str, release: bool = False) -> torch.Tensor:
        """Tensor `name`, taken out of the checkpoint with `release`; a checkpoint without it
        is refused by its name."""
        found = self.optional(name, release)
        if found is None:
            raise UnsupportedCheckpoint(f"the checkpoint has no tensor {name}")
        return found

    def lm_head(self) -> torch.Tensor:
        """The vocabulary projection's weight: the embedding itself where the checkpoint ties
        them and stores it once."""
        head = self.tensors.get("lm_head.weight")
        return head if head is not None else self.tensor("model.embed_tokens.weight")


def load(path: Path, device: torch.device, dtype: torch.dtype) -> Checkpoint:
    """The checkpoint's tensors in `dtype` on `device`, once its config passed `check_config`."""
    config = ModelConfig.read(path)
    check_config(config)
    files = _safetensors_files(path)
    if files is None:  # not safetensors: transformers' loader reads the other formats
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model.to(device)  # type: ignore[arg-type]
        return Checkpoint.of(model)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(device=device, dtype=dtype)
                tensors[name] = tensor
    return Checkpoint(config, tensors)


def _safetensors_files(path: Path) -> list[Path] | None:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = orjson.loads(index.read_bytes())["weight_map"].values()
        return [path / name for name in sorted(set(shards))]
    single = path / "model.safetensors"
    return [single] if single.exists() else None


def rotary_tables(config: ModelConfig, max_len: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..max_len-1, [max_len, head_dim], computed as the checkpoints'
    own rotary modules compute them (fp32, then cast), scaling variants included (by
    transformers' own functions, over the config transformers makes of the same fields)."""
    if config.rope_type == "default":
        dim = config.head_dim
        base = config.rope["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        own = AutoConfig.for_model(**config.raw)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](own)
    positions = torch.arange(max_len, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float)[None]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
