"""Memory planning at start on a GPU: refuse weights that cannot fit before allocating them,
then profile one forward at the largest step the template allows and give the KV pool what
`gpu_memory_utilization` leaves.

Every decision is taken with `agree_min` over the tensor-parallel ranks: a rank that refused
alone would leave the others waiting in the next collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from appliance.config import TP_SIZES, ApplianceConfig, ConfigError
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.engine.kv_pool import KVCachePool
from appliance.engine.model_runner import ModelRunner
from appliance.layers.kv_cache import KVStorage
from appliance.layers.parallel import agree_min, tp_size
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM
from appliance.sampling_params import SamplingParams

GiB = 1024**3


@dataclass
class GpuMemoryPlan:
    """One rank's device memory, measured at start (bytes)."""

    total: int
    utilization: float
    # In use before this rank allocated anything: its CUDA context, other processes.
    used_before: int
    weights: int
    # Peak of torch allocations above the weights during the profiling forward.
    activation_peak: int
    # Growth outside torch's allocator during load and profiling (NCCL, cuBLAS workspaces).
    non_torch: int
    block_bytes: int
    # The smallest rank's block count: every rank must hold the same pool (set by plan_gpu_kv).
    agreed_blocks: int | None = None

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_bytes(self) -> int:
        spent = self.used_before + self.weights + self.activation_peak + self.non_torch
        return max(0, self.budget - spent)

    @property
    def own_blocks(self) -> int:
        return self.kv_bytes // self.block_bytes

    @property
    def num_blocks(self) -> int:
        own = self.own_blocks
        return own if self.agreed_blocks is None else min(own, self.agreed_blocks)

    def describe(self) -> str:
        return (
            f"GPU {self.total / GiB:.2f} GiB x gpu_memory_utilization {self.utilization:g} = "
            f"{self.budget / GiB:.2f} GiB; in use before start {self.used_before / GiB:.2f} GiB, "
            f"weights {self.weights / GiB:.2f} GiB, activation peak "
            f"{self.activation_peak / GiB:.2f} GiB, outside torch {self.non_torch / GiB:.2f} GiB "
            f"-> KV {self.kv_bytes / GiB:.2f} GiB = {self.own_blocks} blocks of "
            f"{self.block_bytes / 2**20:.2f} MiB"
            + (f" (all ranks: {self.num_blocks})" if self.num_blocks != self.own_blocks else "")
        )


def device_used(device: torch.device) -> tuple[int, int]:
    """(bytes in use on the device by anyone, total bytes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total


def check_weights_fit(
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    config: ApplianceConfig,
    hf_config: Any,
    extra_bytes: int = 0,
) -> int:
    """Refuse to start when this rank's weights exceed its share of the GPU; called on the meta
    model, before any allocation, so the refusal is a message instead of an OOM. Returns the
    bytes in use before loading. `extra_bytes`: packed weights of a quantized checkpoint (the
    meta model holds no dense tensors for them)."""
    used, total = device_used(device)
    util = config.cache.gpu_memory_utilization
    available = int(total * util) - used
    weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize + extra_bytes
    if agree_min(int(weights < available)):
        return used
    tp = tp_size()
    raise ConfigError(
        f"weights: {weights / GiB:.2f} GiB per GPU at tensor_parallel_size {tp} do not fit: "
        f"gpu_memory_utilization {util:g} of this {total / GiB:.2f} GiB GPU leaves "
        f"{available / GiB:.2f} GiB ({used / GiB:.2f} GiB already in use)"
        + _suggest_tp(hf_config, dtype.itemsize, available, tp)
    )


def _suggest_tp(hf_config: Any, elem: int, available: int, tp: int) -> str:
    try:
        spec = ModelArgs.from_hf(hf_config)
    except ValueError:
        return ""
    for n in TP_SIZES:
        if n > tp and not spec.tp_problem(n):
            need = spec.params_per_rank(n) * elem
            if need < available:
                return f"; tensor_parallel_size {n} would need {need / GiB:.2f} GiB per GPU"
    return "; no tensor_parallel_size up to 8 makes them fit"


def profile_batches(config: ApplianceConfig, max_model_len: int) -> list[SchedulerOutput]:
    """The two extreme steps the scheduler can make: a full token budget of prefill (sequences
    of min(budget, max_model_len) tokens) and a decode of max_num_seqs sequences (the most
    sampled rows, so the largest logits). Every sequence writes and reads KV block 0: the
    profile needs the shapes, not the values."""
    sched, bs = config.scheduler, config.cache.block_size
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def request(i: int, n: int) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=f"profile-{i}",
            token_ids=[0] * n,
            start_pos=0,
            block_ids=[0] * math.ceil(n / bs),
            sample=True,
            sampling_params=greedy,
            output_index=0,
        )

    budget = sched.max_num_batched_tokens
    seq = min(budget, max_model_len)
    prefill = [request(i, min(seq, budget - i * seq)) for i in range(math.ceil(budget / seq))]
    decode = [request(i, 1) for i in range(min(sched.max_num_seqs, budget))]
    return [
        SchedulerOutput(scheduled=batch, num_scheduled_tokens=sum(len(r.token_ids) for r in batch))
        for batch in (prefill[: sched.max_num_seqs], decode)
    ]


def run_profile(
    model: LlamaForCausalLM,
    args: ModelArgs,
    config: ApplianceConfig,
    device: torch.device,
    storage: torch.dtype | Sequence[torch.dtype] | KVStorage,
    max_model_len: int,
) -> None:
    """Run the profiling steps through a real runner over a one-block KV pool."""
    bs = config.cache.block_size
    pool = KVCachePool(
        args.num_layers,
        1,
        0,
        bs,
        args.kv_heads_per_rank(tp_size()),
        args.head_dim,
        storage,
        device,
    )
    runner = ModelRunner(model, pool, bs, device)
    for step in profile_batches(config, max_model_len):
        runner.execute(step)


def profile_activation_peak(
    model: LlamaForCausalLM,
    args: ModelArgs,
    config: ApplianceConfig,
    device: torch.device,
    storage: torch.dtype | Sequence[torch.dtype] | KVStorage,
    max_model_len: int,
) -> int:
    """Peak bytes allocated above the weights by the profiling steps (its one-block pool, a few
    MiB, included: conservative)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run_profile(model, args, config, device, storage, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak


def plan_gpu_kv(
    model: LlamaForCausalLM,
    args: ModelArgs,
    config: ApplianceConfig,
    device: torch.device,
    storage: torch.dtype | Sequence[torch.dtype] | KVStorage,
    max_model_len: int,
    block_bytes: int,
    used_before: int,
) -> GpuMemoryPlan:
    """Measure weights, the profiled activation peak and memory outside torch; the KV pool
    gets the rest of the budget (the smallest rank's count, so every rank holds the same)."""
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    peak = profile_activation_peak(model, args, config, device, storage, max_model_len)
    used_now, total = device_used(device)
    non_torch = max(0, used_now - used_before - torch.cuda.memory_reserved(device))
    plan = GpuMemoryPlan(
        total=total,
        utilization=config.cache.gpu_memory_utilization,
        used_before=used_before,
        weights=weights,
        activation_peak=peak,
        non_torch=non_torch,
        block_bytes=block_bytes,
    )
    plan.agreed_blocks = agree_min(plan.own_blocks)
    return plan
