"""A LoRA adapter loaded at run time (`POST /v1/load_lora_adapter`), as the replicas keep it in
their model's adapter registry (`shared.keys`: `{prefix}:model:{<model>}:loras`, a hash of
adapter name -> this record's JSON).

The record holds the adapter as the loading replica checked it (`shared/lora.py`), its
modules included, so a replica that learns of it from the registry serves it without reading
the adapter's directory itself (its path need only exist where the workers run); the base's
name, so a record is never read against another model; and when and by whom it was loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shared.lora import LoraAdapter, LoraModule


@dataclass(frozen=True)
class RuntimeLora:
    base: str  # the served model it applies to
    adapter: LoraAdapter
    loaded_at: int  # unix seconds: its card's `created`
    loaded_by: str  # the tenant that loaded it

    @property
    def name(self) -> str:
        return self.adapter.name

    def to_json(self) -> bytes:
        a = self.adapter
        return orjson.dumps({
            "base": self.base, "name": a.name, "path": str(a.path), "rank": a.rank,
            "scaling": a.scaling, "loaded_at": self.loaded_at, "loaded_by": self.loaded_by,
            "modules": [[m.layer, m.target, m.a, m.b] for m in a.modules]})

    @classmethod
    def from_json(cls, raw: bytes | str) -> RuntimeLora:
        """ValueError for anything but a record this module wrote."""
        try:
            d: dict[str, Any] = orjson.loads(raw)
            adapter = LoraAdapter(str(d["name"]), Path(d["path"]), int(d["rank"]),
                                  float(d["scaling"]),
                                  tuple(LoraModule(int(layer), str(target), str(a), str(b))
                                        for layer, target, a, b in d["modules"]))
            return cls(str(d["base"]), adapter, int(d["loaded_at"]), str(d["loaded_by"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a runtime LoRA record: {e}") from None
