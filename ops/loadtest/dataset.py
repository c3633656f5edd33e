"""The prompts a benchmark sends: random ones of an exact token length, or a JSONL file.

Random prompts are words drawn from the tokenizer's own vocabulary and checked by encoding the
text back, so each is exactly `--input-len` tokens (before the server's chat template) and no
two share a prefix a server could cache. Each sweep value gets its own draw, seeded from
`--seed` and its position, so a later run is not flattered by an earlier run's prefix cache.
The tokenizer is read with `tokenizers` alone (a tokenizer.json), not transformers: it loads in
a fraction of a second, and the client must stay cheaper than the server it measures. Without
--tokenizer it is the served model's own, so that --input-len counts that model's tokens: found
as a redserve model (the default model, a checkpoint directory), else on the Hugging Face Hub;
only when neither has it, the default model's (the caller warns).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from huggingface_hub import (
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    try_to_load_from_cache,
)
from pydantic import ValidationError
from tokenizers import Tokenizer

from ops.loadtest.config import BenchError
from shared.models import ModelNotFound, resolve_model
from shared.settings import DEFAULT_MODEL, Settings

DEFAULT_RANDOM_PROMPTS = 100
_ADJUST_TRIES = 64


@dataclass(frozen=True)
class Prompt:
    text: str | None  # a completions prompt, or the one user message of a chat request
    messages: tuple[dict[str, Any], ...] | None  # a chat request's messages, as given
    input_tokens: int  # counted here; a server's own count (with its template) wins
    output_len: int  # max_tokens


def _cache_dir() -> Path:
    """redserve's model cache: bench is a client of any server and needs no other setting,
    so an unrelated bad REDSERVE_ variable must not stop it."""
    try:
        return Settings().cache_dir
    except ValidationError:
        default = Settings.model_fields["cache_dir"].default
        return Path(os.environ.get("REDSERVE_CACHE_DIR", default))


def load_tokenizer(spec: str | None) -> Tokenizer:
    """`spec` as a tokenizer.json, a directory holding one or a Hugging Face Hub name; None:
    the tokenizer of redserve's default model (converted into the cache on first use)."""
    if spec is None:
        try:
            path = resolve_model(DEFAULT_MODEL, _cache_dir()).path / "tokenizer.json"
        except ModelNotFound as e:
            raise BenchError(f"no tokenizer for the model and the default model's is "
                             f"unavailable: {e} (give --tokenizer)") from e
        return Tokenizer.from_file(str(path))
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise BenchError(f"--tokenizer {spec}: the directory holds no tokenizer.json")
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exceptions for a bad file
            raise BenchError(f"--tokenizer {spec}: not a tokenizer.json ({e})") from e
    try:
        return _from_hub(spec)
    except Exception as e:
        raise BenchError(f"--tokenizer {spec}: neither a file, a directory nor a Hub "
                         f"tokenizer that could be fetched ({type(e).__name__}: {e})") from e


def model_tokenizer(model: str) -> tuple[Tokenizer, str]:
    """The tokenizer of the served model `model`, and `model`; when neither redserve nor the
    Hub knows it, the default model's and DEFAULT_MODEL."""
    try:
        path = resolve_model(model, _cache_dir()).path / "tokenizer.json"
        return Tokenizer.from_file(str(path)), model
    except Exception:  # not a redserve model (ModelNotFound), or no tokenizer.json in it
        pass
    try:
        return _from_hub(model), model
    except Exception:  # not a Hub name, not on the Hub, or the Hub unreachable
        return load_tokenizer(None), DEFAULT_MODEL


def _from_hub(name: str) -> Tokenizer:
    """`name`'s tokenizer.json from the Hugging Face Hub's local cache, else from the Hub.
    One HEAD request goes first, without retries, so that an offline machine fails in a
    moment rather than after huggingface_hub's half a minute of backoff."""
    cached = try_to_load_from_cache(name, "tokenizer.json")
    if not isinstance(cached, str):
        get_hf_file_metadata(hf_hub_url(name, "tokenizer.json"), timeout=10)
        cached = hf_hub_download(name, "tokenizer.json")
    return Tokenizer.from_file(cached)


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


@functools.lru_cache(maxsize=2)
def _word_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Vocabulary entries that read as one plain word, preferring those that carry their own
    leading space (byte-level BPE): a run of them encodes back to the same tokens. Decoding
    the whole vocabulary takes a moment: it is done once per tokenizer (a Tokenizer hashes by
    identity), not once per sweep value."""
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())])
    words = [i for i, t in enumerate(texts)
             if len(t.strip()) >= 2 and t.strip().isascii() and t.strip().isalpha()]
    spaced = [i for i in words if texts[i].startswith(" ")]
    chosen = spaced if len(spaced) >= 1000 else words
    if not chosen:
        raise BenchError("the tokenizer has no plain-word tokens to build random prompts from")
    return tuple(chosen)


def _exact_text(tokenizer: Tokenizer, pool: tuple[int, ...], length: int,
                rng: random.Random) -> str:
    ids = [rng.choice(pool) for _ in range(length)]
    for _ in range(_ADJUST_TRIES):
        text = tokenizer.decode(ids).strip()
        count = count_tokens(tokenizer, text)
        if count == length:
            return text
        if count > length:
            ids = ids[:max(1, len(ids) - (count - length))]
        else:
            ids += [rng.choice(pool) for _ in range(length - count)]
    raise BenchError(f"could not build a prompt of exactly {length} tokens with this tokenizer")


def random_prompts(tokenizer: Tokenizer, count: int, input_len: int, output_len: int,
                   seed: str) -> list[Prompt]:
    rng = random.Random(seed)
    pool = _word_ids(tokenizer)
    return [Prompt(_exact_text(tokenizer, pool, input_len, rng), None, input_len, output_len)
            for _ in range(count)]


def read_dataset(path: Path, tokenizer: Tokenizer, output_len: int, count: int | None,
                 endpoint: str) -> list[Prompt]:
    """One prompt per non-empty line: {"prompt": str} or {"messages": [...]}, with an optional
    "output_len"; `count` of them, in file order, reusing the file if it is shorter."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read --dataset {path}: {e}") from e
    prompts = [_entry(f"{path}:{n}", line, tokenizer, output_len, endpoint)
               for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise BenchError(f"--dataset {path} holds no prompt")
    return prompts if count is None else list(itertools.islice(itertools.cycle(prompts), count))


def _entry(where: str, line: str, tokenizer: Tokenizer, default_output_len: int,
           endpoint: str) -> Prompt:
    try:
        item = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise BenchError(f"{where}: not JSON ({e})") from e
    if not isinstance(item, dict):
        raise BenchError(f"{where}: a line must be a JSON object")
    output_len = item.get("output_len", default_output_len)
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise BenchError(f"{where}: output_len must be an integer of at least 1")
    if "messages" in item:
        messages = item["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and "role" in m for m in messages)):
            raise BenchError(f"{where}: messages must be a non-empty list of objects with a "
                             "role")
        if endpoint != "chat":
            raise BenchError(f"{where}: a messages entry needs --endpoint chat")
        text = "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
        return Prompt(None, tuple(messages), count_tokens(tokenizer, text), output_len)
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BenchError(f'{where}: needs "prompt" (a non-empty string) or "messages"')
    return Prompt(prompt, None, count_tokens(tokenizer, prompt), output_len)
