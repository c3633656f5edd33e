"""LoRA adapters over the base model: several resident at once, applied to their own rows of a
step beside the base rows (`apply.py`), their weights laid out for the forward pass's fused
linears (`adapter.py`). What an adapter may be is checked first, without torch, by
`shared/lora.py`."""
