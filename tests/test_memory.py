"""Memory planning at start (appliance.engine.memory). No GPU here: the device queries are
replaced by numbers, the arithmetic and the refusals are real, and the profiling steps run
through a real runner on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from appliance.config import ConfigError, load_config
from appliance.engine import memory
from appliance.engine.memory import GpuMemoryPlan
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM
from appliance.plan import reference_architectures

GiB = 1024**3


def test_kv_pool_gets_what_the_budget_leaves() -> None:
    plan = GpuMemoryPlan(
        total=24 * GiB,
        utilization=0.9,
        used_before=GiB // 2,
        weights=12 * GiB,
        activation_peak=GiB,
        non_torch=GiB // 4,
        block_bytes=6_553_600,
    )
    left = int(24 * GiB * 0.9) - GiB // 2 - 12 * GiB - GiB - GiB // 4
    assert plan.kv_bytes == left
    assert plan.num_blocks == left // 6_553_600
    plan.agreed_blocks = plan.own_blocks - 3  # another rank had less room
    assert plan.num_blocks == plan.own_blocks - 3
    assert "all ranks" in plan.describe()


def test_nothing_left_means_zero_blocks() -> None:
    plan = GpuMemoryPlan(GiB, 0.9, 0, 2 * GiB, 0, 0, 1024)
    assert plan.kv_bytes == 0 and plan.num_blocks == 0


def test_weights_that_cannot_fit_are_refused_before_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Llama-2-13B at TP 1 on a 22.49 GiB A10: refused with the numbers and the TP that fits."""
    cfg = json.loads(Path(reference_architectures()["llama-2-13b"]).read_text())
    hf = LlamaConfig(**cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelArgs.from_hf(hf))
    total = int(22.49 * GiB)
    monkeypatch.setattr(memory, "device_used", lambda device: (GiB // 2, total))
    config = load_config("13b-a10", {"parallel.tensor_parallel_size": 1})
    with pytest.raises(ConfigError) as info:
        memory.check_weights_fit(model, torch.float16, torch.device("cpu"), config, hf)
    msg = str(info.value)
    assert "24.24 GiB per GPU at tensor_parallel_size 1 do not fit" in msg
    assert "22.49 GiB GPU" in msg and "0.50 GiB already in use" in msg
    assert "tensor_parallel_size 2 would need 12.12 GiB per GPU" in msg
    # On an 80 GB card the same weights pass and the bytes in use come back.
    monkeypatch.setattr(memory, "device_used", lambda device: (GiB // 2, 80 * GiB))
    assert (
        memory.check_weights_fit(model, torch.float16, torch.device("cpu"), config, hf) == GiB // 2
    )


def test_profile_steps_cover_budget_and_max_num_seqs() -> None:
    config = load_config(
        None,
        {
            "scheduler.max_num_batched_tokens": 1000,
            "scheduler.max_num_seqs": 8,
            "cache.block_size": 16,
        },
    )
    prefill, decode = memory.profile_batches(config, max_model_len=300)
    assert [len(r.token_ids) for r in prefill.scheduled] == [300, 300, 300, 100]
    assert prefill.num_scheduled_tokens == 1000
    assert len(decode.scheduled) == 8 and decode.num_scheduled_tokens == 8
    assert all(r.block_ids == [0] * -(-len(r.token_ids) // 16) for r in prefill.scheduled)


def test_profile_steps_run_through_the_runner(tiny_model_dir: Path) -> None:
    """The profiling forward (GPU start-up) runs on a real model over a one-block pool."""
    from appliance.engine.executor import load_model

    config = load_config(
        None,
        {
            "model.path": str(tiny_model_dir),
            "model.dtype": "float32",
            "cache.kv_cache_memory": 0.01,
            "cache.swap_space": 0.0,
            "hardware.device": "cpu",
            "scheduler.max_num_batched_tokens": 512,
            "scheduler.max_num_seqs": 32,
        },
    )
    loaded = load_model(config)
    memory.run_profile(
        loaded.model, loaded.args, config, loaded.device, loaded.dtype, max_model_len=200
    )
