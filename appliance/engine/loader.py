"""Start-up: find (or build) the model directory, load config, tokenizer and weights, size the
KV pool from the memory settings, and wire the runner and the cache manager together."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from appliance.config import ApplianceConfig, ConfigError, served_model_name
from appliance.engine import memory
from appliance.engine.cpu_decode import MAX_BATCH as FUSED_DECODE_MAX_BATCH
from appliance.engine.cpu_decode import FusedCpuDecode
from appliance.engine.kv_quant import configure_kv_cache
from appliance.engine.model_runner import KVCachePool, ModelRunner
from appliance.kernels import cpu_native, get_attention_backend
from appliance.layers.linear import cpu_prepack_supported, pack_linears_for_cpu
from appliance.layers.parallel import tp_rank, tp_size
from appliance.layers.rotary import RotaryEmbedding
from appliance.models.hf_files import has_model, iter_safetensors, load_hf_config, load_tokenizer
from appliance.models.llama import LlamaForCausalLM, ModelArgs

log = logging.getLogger("appliance.loader")

GiB = 1024**3
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model_name: str
    model_dir: Path
    args: ModelArgs
    model: LlamaForCausalLM
    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    num_swap_blocks: int
    runner: ModelRunner
    device: torch.device
    dtype: torch.dtype
    block_size: int
    bytes_per_block: int
    phase_times: dict[str, float]
    # What the engine calls each step (`execute(SchedulerOutput) -> RunnerOutput`): the runner
    # itself at TP 1, a TPExecutor that drives the worker ranks at TP > 1 (appliance.engine.tp).
    executor: Any = None

    def __post_init__(self) -> None:
        if self.executor is None:
            self.executor = self.runner

    def close(self) -> None:
        """Stop the worker ranks (TP > 1); nothing to do at TP 1. Idempotent."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


def resolve_device(config: ApplianceConfig) -> torch.device:
    wanted = config.hardware.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("hardware.device: 'cuda' asked for but no CUDA device is visible")
        # One GPU per tensor-parallel rank; set_device makes NCCL and the kernels use it.
        device = torch.device("cuda", tp_rank())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def resolve_dtype(config: ApplianceConfig) -> torch.dtype:
    return torch.bfloat16 if config.model.dtype == "auto" else DTYPES[config.model.dtype]


def resolve_model_dir(config: ApplianceConfig, progress: Callable[[str], None]) -> Path:
    if not config.model.path:
        raise ConfigError("model.path: no model directory given (set it in the template or --model)")
    path = Path(os.path.expanduser(config.model.path))
    if has_model(path):
        return path
    if config.model.demo_shape:
        from appliance.tools.demo_model import build_demo_model

        progress(f"building the {config.model.demo_shape!r} demo model into {path} (first start)")
        build_demo_model(config.model.demo_shape, path, progress=progress)
        return path
    raise ConfigError(f"model.path: {str(path)!r} holds no Hugging Face model (config.json + safetensors)")


def kv_bytes_per_block(
    args: ModelArgs, block_size: int, storage: torch.dtype | Sequence[torch.dtype], tp: int
) -> int:
    """Bytes of one block over all layers; `storage` is one dtype or one per layer (mixed
    precision), so FP8 layers count 1 byte an element and 16-bit layers 2."""
    per_layer = [storage] * args.num_layers if isinstance(storage, torch.dtype) else list(storage)
    elems = block_size * args.kv_heads_per_rank(tp) * args.head_dim
    return sum(2 * elems * dt.itemsize for dt in per_layer)


def _eos_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return frozenset(ids)


def describe_native_decode(runner: ModelRunner, config: ApplianceConfig) -> str:
    """Whether decode steps run the native kernels, and if not, why (for logs and benches)."""
    if runner.fused_decode is not None:
        return f"on for decode steps of up to {FUSED_DECODE_MAX_BATCH} sequences"
    if not config.model.cpu_native_kernels:
        return "off (model.cpu_native_kernels = false)"
    if cpu_native.load() is None:
        return f"off ({cpu_native.load_error()})"
    return "off (needs tensor_parallel_size 1, kv_cache_dtype auto, bf16 or float32)"


def load_model(
    config: ApplianceConfig, progress: Callable[[str], None] | None = None
) -> LoadedModel:
    say = progress or (lambda msg: log.info(msg))
    if config.parallel.tensor_parallel_size > 1 and tp_size() == 1:
        # This process becomes rank 0 of a tensor-parallel group: the executor spawns the other
        # ranks and calls back in here under each rank's TP state (appliance.engine.tp).
        from appliance.engine.tp import TPExecutor

        return TPExecutor.start(config, progress).loaded
    if tp_size() > 1 and config.parallel.tensor_parallel_size != tp_size():
        raise ConfigError(
            f"parallel.tensor_parallel_size {config.parallel.tensor_parallel_size}: this process "
            f"is rank {tp_rank()} of a tensor-parallel engine of size {tp_size()}; close it first"
        )
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    device = resolve_device(config)
    dtype = resolve_dtype(config)
    model_dir = resolve_model_dir(config, say)
    times["locate_model"] = time.perf_counter() - t0

    t = time.perf_counter()
    hf_config = load_hf_config(model_dir)
    args = ModelArgs.from_hf(hf_config)
    tokenizer = load_tokenizer(model_dir)
    max_len = config.model.max_model_len or args.max_position_embeddings
    if max_len > args.max_position_embeddings:
        raise ConfigError(
            f"model.max_model_len: {max_len} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings})"
        )
    times["config_tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    say(f"loading weights from {model_dir} ({args.num_layers} layers, {dtype})")
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    gpu_used_before = 0
    if device.type == "cuda":
        # Before allocating: weights that cannot fit are a message with numbers, not an OOM.
        gpu_used_before = memory.check_weights_fit(model, dtype, device, config, hf_config)
    model = model.to_empty(device=device).to(dtype)
    # Buffers (rotary tables) are recomputed on the real device: to_empty left them blank.
    fresh = RotaryEmbedding(
        args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling
    ).to(device)
    model.model.rotary.cos, model.model.rotary.sin = fresh.cos, fresh.sin
    model.load_weights((name, tensor.to(dtype)) for name, tensor in iter_safetensors(model_dir))
    model.eval()
    native_ops = (
        device.type == "cpu"
        and config.model.cpu_native_kernels
        and tp_size() == 1
        and config.parallel.tensor_parallel_size == 1
        and cpu_native.supports(dtype, args.num_heads // args.num_kv_heads)
    )
    model.native_cpu_ops = native_ops
    native_decode = native_ops and config.cache.kv_cache_dtype == "auto"
    if device.type == "cpu" and config.model.cpu_prepack_weights and cpu_prepack_supported(dtype):
        pack_linears_for_cpu(model, config.scheduler.max_num_seqs, keep_plain=native_decode)
    # Triton kernels on CUDA, the torch reference elsewhere (the same signatures).
    write_kv, attend = get_attention_backend(device, native_cpu=native_ops)
    for attn in model.attention_layers():
        attn.set_backend(write_kv, attend)
    times["load_weights"] = time.perf_counter() - t

    t = time.perf_counter()
    # Per-layer KV storage (kv_cache_keep_16bit layers stay in the model dtype) and, when any
    # layer is quantized, its per-head scales from a calibration forward (engine/kv_quant.py).
    storage, _ = configure_kv_cache(model, tokenizer, config.cache, dtype, device, max_len)
    times["calibrate_kv"] = time.perf_counter() - t

    t = time.perf_counter()
    cache = config.cache
    tp = tp_size()
    per_block = kv_bytes_per_block(args, cache.block_size, storage, tp)
    gpu_plan: memory.GpuMemoryPlan | None = None
    if cache.num_blocks:
        num_blocks = cache.num_blocks
    elif device.type == "cuda":
        gpu_plan = memory.plan_gpu_kv(
            model, args, config, device, storage, max_len, per_block, gpu_used_before
        )
        num_blocks = gpu_plan.num_blocks
        say(f"memory plan: {gpu_plan.describe()}")
    else:
        num_blocks = int(cache.kv_cache_memory * GiB // per_block)
    needed = -(-max_len // cache.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"cache: {num_blocks} KV blocks of {cache.block_size} tokens "
            f"({per_block / 2**20:.2f} MiB each) cannot hold one sequence of max_model_len "
            f"{max_len} ({needed} blocks); raise cache.kv_cache_memory / gpu_memory_utilization "
            "or lower model.max_model_len"
            + (f" [{gpu_plan.describe()}]" if gpu_plan is not None else "")
        )
    num_swap = int(cache.swap_space * GiB // per_block)
    pool = KVCachePool(
        args.num_layers,
        num_blocks,
        num_swap,
        cache.block_size,
        args.kv_heads_per_rank(tp),
        args.head_dim,
        storage,
        device,
    )
    eos = _eos_ids(hf_config, tokenizer)
    runner = ModelRunner(model, pool, cache.block_size, device, eos)
    if native_decode:
        runner.fused_decode = FusedCpuDecode(model, pool.device_caches, cache.block_size)
    if device.type == "cpu" and config.model.cpu_native_kernels:
        say(f"native CPU decode: {describe_native_decode(runner, config)}")
    times["allocate_kv"] = time.perf_counter() - t
    say(
        f"KV cache: {num_blocks} blocks x {cache.block_size} tokens "
        f"({num_blocks * per_block / GiB:.2f} GiB), swap {num_swap} blocks"
    )
    name = served_model_name(config, model_dir)
    return LoadedModel(
        model_name=name,
        model_dir=model_dir,
        args=args,
        model=model,
        tokenizer=tokenizer,
        max_model_len=max_len,
        eos_token_ids=eos,
        num_blocks=num_blocks,
        num_swap_blocks=num_swap,
        runner=runner,
        device=device,
        dtype=dtype,
        block_size=cache.block_size,
        bytes_per_block=per_block,
        phase_times=times,
    )

