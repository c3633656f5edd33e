"""A request's flag keys (its abort key, its resumed mark), set to live no longer than the
request's own keys.

A request's hash and record live `REDSERVE_REQUEST_TTL_S`, then `REDSERVE_FINISHED_TTL_S` once
its terminal entry is written, and the worker that writes it gives the flags, if set, that same
TTL (worker/broker/publisher.py, shared/scripts/terminal.py). A flag set after the end (a
cancel, a stop string the replica saw after the worker ended, a resume of a finished stream)
must not outlive them by the request TTL: so the key takes the request hash's remaining time to
live when the hash has one shorter than `ttl_s`, and `ttl_s` otherwise. Both keys carry the
request's `{replica}` hash tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.scripts.base import Script


@dataclass(frozen=True)
class FlagKeys:
    flag: str  # the request's flag key (`Keys.abort`, `Keys.resumed`)
    state: str  # its request hash (`Keys.state`)


@dataclass(frozen=True)
class FlagArgs:
    ttl_s: int  # the longest the flag lives: the request TTL


SET_FLAG = Script("set_flag", FlagKeys, FlagArgs, """
local ttl_ms = tonumber(A.ttl_s) * 1000
local left = redis.call('PTTL', K.state)
if left > 0 and left < ttl_ms then ttl_ms = left end
redis.call('SET', K.flag, '1', 'PX', ttl_ms)
return ttl_ms
""", int)
