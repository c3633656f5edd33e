"""The arrival pattern of one run: a fixed number in flight, or Poisson arrivals.

`--concurrency C` keeps exactly C requests in flight (C loops, each sending its next prompt
as soon as its last reply ends): the closed loop that measures a server at a given load.
`--request-rate R` sends at exponentially distributed intervals of mean 1/R seconds (an open
loop: arrivals do not wait for replies, as real users do not), each arrival time fixed in
advance from the seed so a slow event loop does not thin the load; `inf` sends all at once.
`--max-concurrency` then holds arrivals back while that many are in flight, and a held request
is timed from when it is actually sent.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable

import httpx
from rich.progress import Progress
from tokenizers import Tokenizer

from ops.loadtest.client import Target, send
from ops.loadtest.config import LoadPoint
from ops.loadtest.dataset import Prompt
from ops.loadtest.stats import RequestRecord


async def run_point(client: httpx.AsyncClient, target: Target, prompts: list[Prompt],
                    point: LoadPoint, seed: str, tokenizer: Tokenizer, progress: Progress
                    ) -> tuple[list[RequestRecord], float]:
    """Every prompt sent under `point`'s pattern: their records in prompt order, and the
    run's wall time in seconds."""
    task = progress.add_task(point.label, total=len(prompts))
    records: dict[int, RequestRecord] = {}
    start = time.perf_counter()

    async def one(i: int) -> None:
        records[i] = await send(client, target, prompts[i], i, start, tokenizer)
        progress.advance(task)

    if point.concurrency is not None:
        order = iter(range(len(prompts)))

        async def loop() -> None:
            for i in order:
                await one(i)

        await asyncio.gather(*(loop() for _ in range(min(point.concurrency, len(prompts)))))
    else:
        await _open_loop(one, len(prompts), point, random.Random(seed), start)
    duration = time.perf_counter() - start
    return [records[i] for i in range(len(prompts))], duration


async def _open_loop(one: Callable[[int], Awaitable[None]], count: int, point: LoadPoint,
                     rng: random.Random, start: float) -> None:
    cap = (asyncio.Semaphore(point.max_concurrency) if point.max_concurrency is not None
           else None)

    async def held(i: int) -> None:
        if cap is None:
            await one(i)
            return
        async with cap:
            await one(i)

    tasks = []
    due = 0.0
    for i in range(count):
        if i and not math.isinf(point.request_rate):
            due += rng.expovariate(point.request_rate)
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - start)))
        tasks.append(asyncio.create_task(held(i)))
    await asyncio.gather(*tasks)

