"""A Lua script whose KEYS and ARGV have names on both sides.

Redis hands a script two positional lists. Written by hand, the positions are a contract that
only the caller's list and the Lua's `KEYS[3]`/`ARGV[12]` know, and nothing checks: an
argument inserted in one place and not the other shifts every later one. Here a script
declares a frozen dataclass for its KEYS and one for its ARGV; the Lua opens with a prelude
generated from their fields (`local K = {queued = KEYS[1], ...}`,
`local A = {now = ARGV[1], ...}`) and reads `K.queued`, `A.now`; the caller builds the
dataclasses by name. A script that answers with a status declares an IntEnum, named in the
prelude too (`local R = {ADMITTED = 1, ...}`), and its reply comes back as a member of it.
So this module is the only place that turns names into positions.

Every `K.x`, `A.x` and `R.X` the Lua names is checked against the declarations when the
script is built (at import), and every declared field must be read by the Lua: a typo, or an
argument left behind, fails the import rather than a request.

ARGV values reach Redis as its client encodes them (a float as its repr, so a score keeps
every digit), a bool as 1 or 0, a mapping or a sequence as one JSON argument (the Lua
decodes it with `cjson.decode`: variable-length data without a count and pairs). In the Lua
every `A` value is the string Redis passes, as ARGV always is: the Lua converts with
`tonumber` where it computes, and passes the string on untouched where it stores. A field
typed as a dataclass is a group, its fields flattened in its place and read as
`A.group.field` (the rate limits' part of the admission script).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import Any, Generic, TypeVar, get_type_hints

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

KeysT = TypeVar("KeysT")
ArgsT = TypeVar("ArgsT")
ReplyT = TypeVar("ReplyT")

Path = tuple[str, ...]  # a field, and within a group the field of the group
ArgValue = str | bytes | int | float

_LUA_KEYWORDS = frozenset(
    "and break do else elseif end false for function if in local nil not or repeat return "
    "then true until while".split())
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A name the Lua reads from the prelude's tables: `K.queued`, `A.limit.tokens`, `R.ADMITTED`.
_REFERENCE = re.compile(r"\b([KAR])((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _layout(cls: type) -> list[Path]:
    """The fields of a dataclass in order, a group's own fields in its place."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = get_type_hints(cls)
    paths: list[Path] = []
    for f in dataclasses.fields(cls):
        if f.name in _LUA_KEYWORDS or not _IDENTIFIER.match(f.name):
            raise ValueError(f"{cls.__name__}.{f.name} cannot be a Lua field name")
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            paths += [(f.name, *inner) for inner in _layout(hint)]
        else:
            paths.append((f.name,))
    return paths


def _table(name: str, source: str, paths: list[Path]) -> str:
    """`local <name> = {...}`: each path's value is `<source>[<its position>]`."""
    tree: dict[str, Any] = {}
    for position, path in enumerate(paths, start=1):
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = f"{source}[{position}]"

    def render(node: dict[str, Any] | str) -> str:
        if isinstance(node, str):
            return node
        return "{" + ", ".join(f"{k} = {render(v)}" for k, v in node.items()) + "}"

    return f"local {name} = {render(tree)}"


def _check_references(lua: str, declared: Mapping[str, list[Path]], script: str) -> None:
    """Every name the Lua reads is declared, and every declared name is read."""
    used: dict[str, set[Path]] = {table: set() for table in declared}
    for table, dotted in _REFERENCE.findall(lua):
        path = tuple(dotted[1:].split("."))
        if path not in declared[table]:
            raise ValueError(f"{script}: the Lua reads {table}{dotted}, which is not declared")
        used[table].add(path)
    for table, paths in declared.items():
        unread = [".".join(p) for p in paths if p not in used[table]]
        if unread:
            raise ValueError(f"{script}: {table} declares {', '.join(unread)}, never read")


def lua_string(text: str) -> str:
    """`text` as a Lua string literal (a name the script embeds, not an argument)."""
    if not re.fullmatch(r"[\w~:.\-]*", text):
        raise ValueError(f"not a plain name: {text!r}")
    return f"'{text}'"


def _encode(value: object) -> ArgValue:
    if isinstance(value, bool):
        return 1 if value else 0
    if isinstance(value, str | bytes | int | float):
        return value
    if isinstance(value, Mapping):
        return orjson.dumps(dict(value))
    if isinstance(value, Sequence):
        return orjson.dumps([dict(v) if isinstance(v, Mapping) else v for v in value])
    raise TypeError(f"no ARGV encoding for {type(value).__name__}")


def _values(obj: object, paths: list[Path]) -> list[object]:
    values = []
    for path in paths:
        value = obj
        for part in path:
            value = getattr(value, part)
        values.append(value)
    return values


class Script(Generic[KeysT, ArgsT, ReplyT]):
    """One Lua script: its text (the prelude first), the types of its KEYS and ARGV, and the
    parser of its reply."""

    def __init__(self, name: str, keys: type[KeysT], args: type[ArgsT], body: str,
                 reply: Callable[[Any], ReplyT], codes: type[IntEnum] | None = None) -> None:
        self.name = name
        self._keys_type, self._args_type = keys, args
        self._keys, self._args = _layout(keys), _layout(args)
        code_names: list[Path] = [(c.name,) for c in codes or ()]
        _check_references(body, {"K": self._keys, "A": self._args, "R": code_names}, name)
        prelude = [_table("K", "KEYS", self._keys), _table("A", "ARGV", self._args)]
        if codes is not None:
            prelude.append("local R = {" + ", ".join(f"{c.name} = {int(c)}" for c in codes)
                           + "}")
        self.lua = "\n".join([f"-- {name}", *prelude, body])
        self.parse = reply

    def keys(self, keys: KeysT) -> list[str]:
        """KEYS, in the positions the prelude reads them from."""
        if type(keys) is not self._keys_type:
            raise TypeError(f"{self.name} takes {self._keys_type.__name__} as its KEYS")
        return [str(v) for v in _values(keys, self._keys)]

    def args(self, args: ArgsT) -> list[ArgValue]:
        """ARGV, in the positions the prelude reads them from."""
        if type(args) is not self._args_type:
            raise TypeError(f"{self.name} takes {self._args_type.__name__} as its ARGV")
        return [_encode(v) for v in _values(args, self._args)]

    def bind(self, redis: aioredis.Redis) -> Bound[KeysT, ArgsT, ReplyT]:
        return Bound(self, redis)

    def stage(self, pipe: Pipeline, keys: KeysT, args: ArgsT) -> None:
        """The script queued on `pipe` as EVAL, its text sent each time: nothing to load
        first, so it runs in a Cluster's pipeline too (for a short script); its raw reply,
        in `execute`'s, is for `parse`."""
        names = self.keys(keys)
        pipe.eval(self.lua, len(names), *names, *self.args(args))


class Bound(Generic[KeysT, ArgsT, ReplyT]):
    """A script registered with a client (EVALSHA, loaded again if the server lost it)."""

    def __init__(self, script: Script[KeysT, ArgsT, ReplyT], redis: aioredis.Redis) -> None:
        self.script = script
        self._call = redis.register_script(script.lua)

    async def __call__(self, keys: KeysT, args: ArgsT) -> ReplyT:
        script = self.script
        return script.parse(await self._call(keys=script.keys(keys), args=script.args(args)))

    async def queue(self, pipe: Pipeline, keys: KeysT, args: ArgsT) -> None:
        """The script queued on `pipe` (which loads it first where the server lacks it); its
        raw reply, in `execute`'s, is for `script.parse`."""
        script = self.script
        await self._call(keys=script.keys(keys), args=script.args(args), client=pipe)
