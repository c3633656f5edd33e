"""What `redserve inspect` prints: one snapshot, or one per refresh under --watch.

Read-only: it sends no command that writes, so it is safe against production. Redis is
REDIS_URL (with REDSERVE_REDIS_CLUSTER and REDSERVE_KEY_PREFIX) as for every other command.
Redis unreachable at the first snapshot is exit 2 with the reason; under --watch a later
failure is shown in place of the tables, and the view carries on once Redis answers. On a
terminal --watch redraws in place (rich Live); piped, each refresh is printed after the last.
"""

from __future__ import annotations

import argparse
import asyncio

from pydantic import ValidationError
from redis.exceptions import RedisClusterException, RedisError
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from ops.console import make_console
from ops.inspector.render import as_json, tables
from ops.inspector.snapshot import take
from ops.options import settings_from
from shared.keys import Keys
from shared.redis_address import public
from shared.redis_conn import RedisClients, connect
from shared.settings import Settings

UNREACHABLE = (RedisError, RedisClusterException, OSError)


def show(args: argparse.Namespace) -> int:
    err = make_console(stderr=True)
    try:
        settings = settings_from(Settings, args, "key_prefix")
    except ValidationError as e:
        first = e.errors()[0]
        err.print(f"[red]invalid setting {escape('.'.join(map(str, first['loc'])))}:[/red] "
                  f"{escape(first['msg'])}")
        return 2
    if settings.redis_url is None:
        err.print("[red]REDIS_URL is not set[/red]: inspect reads the deployment's Redis")
        return 2
    clients = connect(settings.redis_url, name="redserve-inspect", max_connections=4,
                      cluster=settings.redis_cluster)
    try:
        return asyncio.run(_loop(clients, Keys(settings.key_prefix), settings.queue_timeout_s,
                                 args, err, public(settings.redis_url)))
    except KeyboardInterrupt:
        return 0


async def _loop(clients: RedisClients, keys: Keys, queue_timeout_s: float,
                args: argparse.Namespace, err: Console, where: str) -> int:
    out = make_console()
    live = (Live(console=out, auto_refresh=False)
            if args.watch and out.is_terminal and not args.json else None)
    shown = 0
    try:
        if live is not None:
            live.start()
        while True:
            try:
                snapshot = await take(clients.commands, keys, queue_timeout_s=queue_timeout_s,
                                      model=args.only_model, limit=args.limit)
            except UNREACHABLE as e:
                if not shown:
                    err.print(f"[red]cannot reach Redis at {escape(where)}:[/red] "
                              f"{escape(str(e))}")
                    return 2
                problem = Text(f"Redis at {where} is unreachable ({e}); retrying", style="red")
                if live is not None:
                    live.update(problem, refresh=True)
                else:
                    err.print(problem)
            else:
                if args.json:
                    out.out(as_json(snapshot), highlight=False)
                elif live is not None:
                    live.update(tables(snapshot), refresh=True)
                else:
                    out.print(tables(snapshot))
            shown += 1
            if not args.watch or (args.count is not None and shown >= args.count):
                return 0
            await asyncio.sleep(args.interval)
    finally:
        if live is not None:
            live.stop()
        await clients.close()
