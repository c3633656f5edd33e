"""A bad LoRA adapter is refused at start, with the problem named: a missing file, an adapter
of another base model, a rank over `--max-lora-rank`, a target module the engine does not
apply, a PEFT option it does not compute; and `redserve worker` and `redserve api` exit 2 with
that line before serving anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from shared.lora import LoraError, parse_lora_specs, read_adapters
from shared.models import ModelInfo
from shared.settings import WorkerSettings
from tests.lora_adapters import ALL, make_adapter
from tests.stack import child_env
from worker.engine.build import check_loras

SHAPE = dict(intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)


def _llama(hidden: int) -> PreTrainedModel:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, **SHAPE)).eval()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    model = _llama(128)
    path = tmp_path_factory.mktemp("lora-refusals-base")
    model.save_pretrained(str(path))
    return model, path


def _read(base: Path, adapter: Path, max_rank: int = 16) -> None:
    read_adapters(parse_lora_specs(f"x={adapter}"), {"m": base}, max_rank)


def test_a_good_adapter_reads(base: tuple[PreTrainedModel, Path], tmp_path: Path) -> None:
    _read(base[1], make_adapter(base[0], tmp_path / "good", ALL, rank=16))


def test_a_missing_file_is_named(base: tuple[PreTrainedModel, Path], tmp_path: Path) -> None:
    adapter = make_adapter(base[0], tmp_path / "a", ["q_proj"])
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match=r"missing file adapter_model\.safetensors"):
        _read(base[1], adapter)
    with pytest.raises(LoraError, match=r"missing file adapter_config\.json"):
        _read(base[1], tmp_path / "nowhere")


def test_an_adapter_of_another_base_is_refused(base: tuple[PreTrainedModel, Path],
                                              tmp_path: Path) -> None:
    adapter = make_adapter(_llama(64), tmp_path / "other", ["q_proj", "down_proj"])
    with pytest.raises(LoraError, match=r"has shape \[64, 8\], and the base model's down_proj "
                                        r"needs \[128, 8\]: an adapter of another base model"):
        _read(base[1], adapter)


def test_a_rank_over_the_limit_is_refused(base: tuple[PreTrainedModel, Path],
                                          tmp_path: Path) -> None:
    adapter = make_adapter(base[0], tmp_path / "wide", ALL, rank=32)
    with pytest.raises(LoraError, match="rank 32 is over --max-lora-rank 16"):
        _read(base[1], adapter)
    _read(base[1], adapter, max_rank=32)


@pytest.mark.parametrize(("targets", "options", "problem"), [
    (["q_proj", "lm_head"], {}, "unsupported target module.*lm_head"),
    (["q_proj", "embed_tokens"], {}, "unsupported target module.*embed_tokens"),
    (["q_proj"], {"use_dora": True}, r"unsupported adapter option\(s\) use_dora"),
    (["q_proj"], {"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_what_the_engine_does_not_compute_is_refused(
        base: tuple[PreTrainedModel, Path], tmp_path: Path, targets: list[str],
        options: dict[str, object], problem: str) -> None:
    adapter = make_adapter(base[0], tmp_path / "odd", targets, **options)
    with pytest.raises(LoraError, match=problem):
        _read(base[1], adapter)


def test_more_adapters_than_max_loras_may_be_declared_and_names_twice_are_refused(
        base: tuple[PreTrainedModel, Path], tmp_path: Path) -> None:
    """--max-loras is how many a worker holds at once, not how many are declared."""
    adapter = make_adapter(base[0], tmp_path / "a", ["q_proj"])
    info = ModelInfo("m", base[1], 256, ())
    three = ",".join(f"a{i}={adapter}" for i in range(3))
    assert len(check_loras(info, WorkerSettings(lora=three, max_loras=2))) == 3
    with pytest.raises(LoraError, match="--batch-invariant is not offered with --lora"):
        check_loras(info, WorkerSettings(lora=three, batch_invariant=True))
    with pytest.raises(LoraError, match="given twice: a"):
        parse_lora_specs(f"a={adapter},a={adapter}")
    with pytest.raises(LoraError, match="also model names"):
        read_adapters(parse_lora_specs(f"m={adapter}"), {"m": base[1]}, 16)
    with pytest.raises(LoraError, match="needs a single base model"):
        read_adapters(parse_lora_specs(f"a={adapter}"), {"m": base[1], "n": base[1]}, 16)


@pytest.mark.parametrize("command", ["worker", "api"])
def test_the_commands_exit_2_naming_the_bad_adapter(
        base: tuple[PreTrainedModel, Path], tmp_path: Path, redis_url: str,
        command: str) -> None:
    adapter = make_adapter(base[0], tmp_path / "wide", ["q_proj"], rank=32)
    env = child_env(redis_url, "rstest-lora-refusals")
    done = subprocess.run([sys.executable, "-m", "ops.cli", command, "--model", str(base[1]),
                           "--lora", f"wide={adapter}"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"adapter 'wide' ({adapter}): rank 32 is over --max-lora-rank 16" in done.stderr


def test_up_refuses_adapters_in_batch_invariant_mode_before_starting_anything(
        base: tuple[PreTrainedModel, Path], tmp_path: Path) -> None:
    """More adapters than --max-loras is fine (a worker loads them as named); batch-invariant
    mode with adapters is not."""
    adapter = make_adapter(base[0], tmp_path / "a", ["q_proj"])
    done = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--model", str(base[1]),
                           "--lora", f"a={adapter}", "--lora", f"b={adapter}", "--max-loras",
                           "1", "--batch-invariant"], env=child_env(None, "rs"),
                          capture_output=True, text=True, timeout=120)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, said
    assert "--batch-invariant is not offered with --lora" in said
    assert "embedded" not in said and "ready" not in said, said
