"""The bodies of vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(`api.endpoints.lora_adapters`), with vLLM's fields. Of vLLM's others, `load_inplace` (replace
an adapter under its name) is refused when true: unload it, then load it again; `lora_int_id`
(vLLM's internal id) names nothing here and is refused as any unknown field is."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from api.protocol.errors import FieldError
from api.protocol.fields import StrictModel

# An adapter's name as `--lora` takes it (`shared/lora.py` checks its characters).
AdapterName = Annotated[str, Field(min_length=1, max_length=128)]
# A directory's path, as long as Linux's PATH_MAX.
AdapterPath = Annotated[str, Field(min_length=1, max_length=4096)]


class LoadLoraAdapterRequest(StrictModel):
    lora_name: AdapterName
    lora_path: AdapterPath
    load_inplace: bool = False

    @model_validator(mode="after")
    def _no_inplace(self) -> Any:
        if self.load_inplace:
            raise FieldError("load_inplace", "replacing an adapter in place is not offered: "
                             "unload it, then load it again")
        return self


class UnloadLoraAdapterRequest(StrictModel):
    lora_name: AdapterName
