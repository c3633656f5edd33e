"""One request, measured end to end against transformers `generate` on the same prompt.

    python -m ops.benchmarks.single [--cold] [--max-tokens 128]

Starts `redserve up` (embedded Redis, default model) on a free port and reports:
- start-up: from launching `redserve up` to the first answered request (`--cold` points the
  model cache at an empty directory, so the GGUF conversion is included);
- one streaming request: time to first token and decode tokens/s, read as a client would;
- HF `generate` in this process on the same prompt (greedy, at the dtype redserve's `auto`
  picks here): time to first token (a one-token generate) and tokens/s, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

import httpx
import torch
from rich.table import Table

from ops.benchmarks.harness.client import body, stream
from ops.benchmarks.harness.stack import up
from ops.console import make_console
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings
from worker.engine.dtype import pick_dtype

QUESTION = "What is KV Cache?"


async def _stream(base: str, max_tokens: int) -> tuple[float, float, int]:
    async with httpx.AsyncClient(timeout=300) as client:
        reply = await stream(client, base, body(DEFAULT_MODEL, max_tokens, content=QUESTION,
                                                ignore_eos=True))
    assert reply.ttft is not None
    decode = reply.ended - reply.stamps[0]
    return reply.ttft, (reply.tokens - 1) / decode, reply.tokens


def _hf(max_tokens: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = resolve_model(DEFAULT_MODEL, Settings().cache_dir)
    tok = AutoTokenizer.from_pretrained(str(info.path))
    # The dtype redserve's worker chooses here, so both compute alike.
    dtype = pick_dtype("auto", torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=dtype).eval()
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                add_generation_prompt=True, return_dict=False)])
    return generate_timing(model, ids, max_tokens)


def generate_timing(model: Any, ids: torch.Tensor, max_tokens: int) -> tuple[float, float]:
    """transformers `generate` on one prompt, greedy: seconds to the first token (a one-token
    generate after a warm-up), and decode tokens/s over `max_tokens`."""
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False)
        total = time.perf_counter() - t0
    return ttft, (max_tokens - 1) / (total - ttft)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="start from an empty model cache")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    console = make_console()

    os.environ.pop("REDIS_URL", None)  # `up` starts its own Redis: part of its start-up
    cache = tempfile.TemporaryDirectory() if args.cold else None
    env = {"REDSERVE_CACHE_DIR": cache.name} if cache is not None else {}
    try:
        with up(env=env) as server:
            with console.status("starting redserve up"):
                startup = server.wait()
            with console.status("one streaming request"):
                asyncio.run(_stream(server.base, 8))  # warm-up
                ttft, tps, tokens = asyncio.run(_stream(server.base, args.max_tokens))
    finally:
        if cache is not None:
            cache.cleanup()
    with console.status("HF generate"):
        hf_ttft, hf_tps = _hf(args.max_tokens)

    table = Table(title=f"one request, {DEFAULT_MODEL}, greedy, {tokens} tokens")
    for col in ("", "redserve (HTTP stream)", "HF generate", "ratio"):
        table.add_column(col)
    table.add_row(f"start-up to first answer ({'cold' if args.cold else 'warm'})",
                  f"{startup:.1f} s", "", "")
    table.add_row("time to first token", f"{ttft * 1000:.0f} ms", f"{hf_ttft * 1000:.0f} ms",
                  f"{ttft / hf_ttft:.2f}x")
    table.add_row("decode tokens/s", f"{tps:.1f}", f"{hf_tps:.1f}", f"{tps / hf_tps:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
