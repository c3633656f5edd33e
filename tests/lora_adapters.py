"""LoRA adapters made in the tests with peft, over a tiny model, and peft's merged model as the
reference an adapter's tokens are held to."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedModel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base(path: Path) -> PreTrainedModel:
    """A 2-layer random Llama (seed 0) saved at `path`: an adapter is checked against its
    config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)).eval()
    model.save_pretrained(str(path))
    return model


def make_adapter(base: PreTrainedModel, path: Path, targets: list[str], *, rank: int = 8,
                 seed: int = 0, **options: object) -> Path:
    """A PEFT adapter of `base` saved at `path`, with random A and B (`init_lora_weights`
    False: B is not zero), so that its greedy text differs from the base's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                        init_lora_weights=False, **options)  # type: ignore[arg-type]
    get_peft_model(copy.deepcopy(base), config).save_pretrained(str(path))
    return path


def merged(base: PreTrainedModel, path: Path) -> PreTrainedModel:
    """`base` with the adapter at `path` merged into its weights (peft's `merge_and_unload`)."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(path))
    return peft_model.merge_and_unload().eval()  # type: ignore[operator,no-any-return]


def greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate`: `n` tokens, no stop."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]
