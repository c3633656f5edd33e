"""LoRA adapters (`--lora NAME=PATH`, `REDSERVE_LORA`, or the path a request carries to a
worker): what an adapter in PEFT's format holds, checked against its base model without
torch.

Both sides read this module: an API replica lists each adapter as a model (and maps a request
naming it to its base model's queue), and a worker checks each before loading its tensors
(`worker/engine/lora/`). The checks read only `adapter_config.json`, the header of
`adapter_model.safetensors` (a JSON table of every tensor's name, dtype and shape, after an
8-byte length: the safetensors format) and the base's `config.json`, so a replica, which holds
no torch, refuses at start exactly the adapters a worker would refuse, each with the problem
named: a missing file, a shape of another base, a rank over `--max-lora-rank`, a target module
the engine does not apply (only the attention and MLP projections: the ones it fuses, see
`worker/engine/model_runner.py`), or a PEFT option it does not compute (DoRA, biases, per-module
ranks, `modules_to_save`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# vLLM's default `--max-lora-rank`.
DEFAULT_MAX_LORA_RANK = 16
# The projections an adapter may target, each under its module in a decoder layer.
TARGETS: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
# A safetensors header larger than this is not an adapter's (a rank-64 adapter of a 70B model
# has a few thousand tensors: well under a megabyte of header).
_MAX_HEADER = 64 * 1024**2
_NAME = re.compile(r"^[^{}\s,=]{1,128}$")  # as a served model's name (shared/models.py)
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
_DTYPES = {"F32", "F16", "BF16"}


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoraSpec:
    name: str  # what clients put in "model"
    path: Path


@dataclass(frozen=True)
class LoraModule:
    """One projection of one layer that the adapter changes: W += scaling * B @ A."""

    layer: int
    target: str  # a key of TARGETS
    a: str  # the tensors' names in the weights file: A is [rank, in], B [out, rank]
    b: str


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scaling: float  # lora_alpha / rank (/ sqrt(rank) with rsLoRA)
    modules: tuple[LoraModule, ...]

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE


@dataclass(frozen=True)
class BaseShapes:
    """The base model's projections as `config.json` gives them: target -> (in, out)."""

    num_layers: int
    projections: dict[str, tuple[int, int]]

    @classmethod
    def read(cls, base: Path) -> BaseShapes:
        config = json.loads((base / "config.json").read_text())
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls(int(config["num_hidden_layers"]), {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        })


def parse_lora_specs(text: str) -> list[LoraSpec]:
    """`NAME=PATH` items, comma-separated (the `--lora` flags joined, or `REDSERVE_LORA`)."""
    specs = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not path:
            raise LoraError(f"--lora {item!r}: expected NAME=PATH")
        if not _NAME.match(name):
            raise LoraError(f"bad adapter name {name!r}: no braces, commas, '=' or spaces")
        specs.append(LoraSpec(name, Path(path).expanduser()))
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LoraError(f"adapter name(s) given twice: {', '.join(twice)}")
    return specs


def read_adapters(specs: list[LoraSpec], bases: dict[str, Path],
                  max_rank: int) -> dict[str, tuple[str, LoraAdapter]]:
    """Each adapter checked against the base model it serves on, by name: name -> (base
    model's name, adapter). An adapter applies to a process's one model; with several the
    base of each would be ambiguous, so that is refused."""
    if not specs:
        return {}
    if len(bases) != 1:
        raise LoraError(f"--lora needs a single base model, and {len(bases)} are served "
                        f"({', '.join(bases)}): run the adapters' model on its own replicas")
    (base_name, base_path), = bases.items()
    clash = sorted({s.name for s in specs} & set(bases))
    if clash:
        raise LoraError(f"adapter name(s) {', '.join(clash)} are also model names")
    shapes = BaseShapes.read(base_path)
    return {s.name: (base_name, read_adapter(s, shapes, max_rank)) for s in specs}


def check_compute(count: int, batch_invariant: bool) -> None:
    """What a worker refuses of `count` declared adapters: any in batch-invariant mode. (As
    many may be declared as wanted: a worker holds `--max-loras` at once, loading the others
    when a request names one: worker/engine/lora/resident.py.)"""
    if count and batch_invariant:
        raise LoraError("--batch-invariant is not offered with --lora: an adapter's update is "
                        "computed per step's group of rows, whose rounding was not measured")


def read_adapter(spec: LoraSpec, base: BaseShapes, max_rank: int) -> LoraAdapter:
    """The adapter at `spec.path`, checked against `base`; LoraError names what is wrong."""
    where = f"adapter {spec.name!r} ({spec.path})"
    config_path, weights_path = spec.path / CONFIG_FILE, spec.path / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise LoraError(f"{where}: missing file {path.name}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{where}: {CONFIG_FILE} is not readable JSON: {e}") from None
    rank, scaling = _check_config(where, config, max_rank)
    header = _header(where, weights_path)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key, entry in header.items():
        match = _TENSOR.match(key)
        if match is None or match[3] not in TARGETS or match[2] != TARGETS[match[3]]:
            module = match[3] if match else key
            raise LoraError(f"{where}: unsupported target module {module!r} (tensor {key!r}); "
                            f"adapters may target {', '.join(TARGETS)}")
        layer, target, side = int(match[1]), match[3], match[4]
        if layer >= base.num_layers:
            raise LoraError(f"{where}: tensor {key!r} is for layer {layer}, and the base "
                            f"model has {base.num_layers}: an adapter of another base model")
        in_features, out_features = base.projections[target]
        want = [rank, in_features] if side == "A" else [out_features, rank]
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if shape != want:
            raise LoraError(f"{where}: tensor {key!r} has shape {shape}, and the base model's "
                            f"{target} needs {want}: an adapter of another base model")
        if entry.get("dtype") not in _DTYPES:
            raise LoraError(f"{where}: tensor {key!r} is {entry.get('dtype')}, not one of "
                            f"{', '.join(sorted(_DTYPES))}")
        pairs.setdefault((layer, target), {})[side] = key
    modules = []
    for (layer, target), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise LoraError(f"{where}: layer {layer}'s {target} has lora_{''.join(sides)} "
                            "without its pair")
        modules.append(LoraModule(layer, target, sides["A"], sides["B"]))
    if not modules:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(spec.name, spec.path, rank, scaling, tuple(modules))


def _check_config(where: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, or what it asks for that is not computed here."""
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{where}: peft_type {config.get('peft_type')!r}, not LORA")
    unsupported = [name for name, off in (("use_dora", False), ("fan_in_fan_out", False),
                                          ("lora_bias", False), ("bias", "none"))
                   if config.get(name, off) not in (off, None)]
    unsupported += [name for name in ("modules_to_save", "rank_pattern", "alpha_pattern",
                                      "layer_replication", "trainable_token_indices",
                                      "target_parameters", "alora_invocation_tokens",
                                      "use_qalora", "use_bdlora")
                    if config.get(name)]
    if unsupported:
        raise LoraError(f"{where}: unsupported adapter option(s) {', '.join(unsupported)}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        others = sorted({t for t in targets if str(t).rsplit(".", 1)[-1] not in TARGETS})
        if others:
            raise LoraError(f"{where}: unsupported target module(s) {', '.join(others)}; "
                            f"adapters may target {', '.join(TARGETS)}")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoraError(f"{where}: bad rank {rank!r} or lora_alpha {alpha!r}")
    if rank > max_rank:
        raise LoraError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    scale = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / scale


def _header(where: str, path: Path) -> dict[str, Any]:
    """The safetensors file's table of tensors (its metadata left out)."""
    try:
        with path.open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            if not 0 < size <= _MAX_HEADER:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(file.read(size))
    except (OSError, ValueError) as e:
        raise LoraError(f"{where}: {WEIGHTS_FILE} is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise LoraError(f"{where}: {WEIGHTS_FILE} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def named_spec(name: str, path: str) -> LoraSpec:
    """An adapter named at run time (`POST /v1/load_lora_adapter`), its name checked as a
    `--lora` name is."""
    if not _NAME.match(name):
        raise LoraError(f"bad adapter name {name[:128]!r}: no braces, commas, '=' or spaces")
    return LoraSpec(name, Path(path))
