"""The terminal-once script: a retried terminal entry is added only if its stream has none.

Every result stream ends with exactly one terminal entry (`finish` or `error`). A worker whose
flush failed (Redis went away) retries its terminal entries from an outbox
(worker/broker/publisher.py), but the failed pipeline may have been applied in part, so the
entry may be there already. This script looks at the stream's last entry and adds the
record chunks still owed and the terminal entry after them only if it is not terminal; the
request's hash and the TTLs (its abort key's and resumed mark's too, if set) are written
either way. It answers whether it added the entry, so the feed hears of it only then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

from shared.scripts.base import Script


@dataclass(frozen=True)
class TerminalKeys:
    out: str  # the request's result stream (`Keys.out`)
    state: str  # its request hash (`Keys.state`)
    abort: str  # its abort key (`Keys.abort`), if set: it expires with them
    resumed: str  # its resumed mark (`Keys.resumed`), if set: likewise


@dataclass(frozen=True)
class TerminalArgs:
    ttl_s: int  # of its keys: a finished request's TTL
    entry: Mapping[str, str]  # the terminal entry's fields
    state: Mapping[str, str]  # the request hash's fields once it has ended
    chunks: Sequence[Mapping[str, str]]  # record chunks to add before the entry, in order


class Terminal(IntEnum):
    ADDED = 1
    ENDED_ALREADY = 0  # the stream ended with a terminal entry: nothing added


TERMINAL_ONCE = Script("terminal_once", TerminalKeys, TerminalArgs, """
local last = redis.call('XREVRANGE', K.out, '+', '-', 'COUNT', 1)[1]
local ended = false
if last then
  local f = last[2]
  for i = 1, #f, 2 do
    if f[i] == 'kind' and (f[i + 1] == 'finish' or f[i + 1] == 'error') then ended = true end
  end
end
local function add(fields)
  local args = {}
  for k, v in pairs(fields) do table.insert(args, k); table.insert(args, v) end
  redis.call('XADD', K.out, '*', unpack(args))
end
if not ended then
  for _, chunk in ipairs(cjson.decode(A.chunks)) do add(chunk) end
  add(cjson.decode(A.entry))
end
redis.call('EXPIRE', K.out, A.ttl_s)
local state = {}
for k, v in pairs(cjson.decode(A.state)) do table.insert(state, k); table.insert(state, v) end
redis.call('HSET', K.state, unpack(state))
redis.call('EXPIRE', K.state, A.ttl_s)
redis.call('EXPIRE', K.abort, A.ttl_s)
redis.call('EXPIRE', K.resumed, A.ttl_s)
return ended and R.ENDED_ALREADY or R.ADDED
""", lambda reply: Terminal(int(reply)), Terminal)
