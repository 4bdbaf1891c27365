"""`appliance bench offline`: throughput of the engine in-process, per scheduling mode, against
the bound computed from measured copy bandwidth and matmul rates, for the path each step took
(the fused native decode reads 16-bit weights; the torch path reads its matmul weights in the
compute dtype, at that dtype's measured rate)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from appliance.bench import mixed, structured
from appliance.bench.hardware import copy_bandwidth, matmul_flops
from appliance.config import load_config
from appliance.config_sources import model_override, parse_override_value
from appliance.engine.executor import load_model
from appliance.engine.llm_engine import Engine
from appliance.engine.loader import LoadedModel
from appliance.engine.stats import StepHistory, StepRecord
from appliance.sampling_params import SamplingParams

MODES = {
    # name: (policy, max_num_seqs or None for "all requests")
    "one-at-a-time": ("continuous", 1),
    "static": ("static", None),
    "continuous": ("continuous", None),
}


@dataclass
class ModeResult:
    mode: str
    requests: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    bound_tokens_per_s: float
    share_of_bound: float
    mean_batch: float
    peak_slot_utilisation: float
    peak_kv_usage: float
    steps: int
    # Most sequences running at once: what the KV pool (or max_num_seqs) let the engine hold.
    peak_running: int = 0


@dataclass
class Rates:
    copy_bytes_per_s: float
    # Measured square-matmul rates: float32, and the 16-bit compute dtype's (bf16 or fp16;
    # equal to the float32 one where the matmuls compute in float32).
    fp32_flops_per_s: float
    half_flops_per_s: float


class InvalidBound(RuntimeError):
    """A mode ran faster than its bound: the bound models another path than the one taken."""


def step_path(record: StepRecord, loaded: LoadedModel) -> str:
    """Which forward a step ran: the fused native decode (decodes only, few enough) or torch."""
    fused = loaded.runner.fused_max_batch
    decodes_only = record.num_scheduled_tokens == record.num_seqs
    return "fused" if decodes_only and 0 < record.num_seqs <= fused else "torch"


def packed_weight_bytes(loaded: LoadedModel) -> int | None:
    """Bytes of the matmul weights (linears + LM head) as a quantized model holds them, the
    bytes a decode step reads on either path; None for a 16-bit model (counted by dtype)."""
    from appliance.layers.linear import MatmulWeight

    linears = [m for m in loaded.model.modules() if isinstance(m, MatmulWeight)]
    if not any(m.quant is not None for m in linears):
        return None
    total = 0
    for m in linears:
        if m.quant is not None:
            total += m.quant.nbytes()
        else:  # a linear the file keeps dense
            total += int(m.weight.numel()) * m.weight.element_size()
    return total


def weight_bytes_per_step(loaded: LoadedModel, path: str) -> int:
    """Weight bytes one decode step reads on `path` ("fused" or "torch")."""
    packed = packed_weight_bytes(loaded)
    if packed is not None:
        return packed
    elem = (
        loaded.dtype.itemsize
        if path == "fused"
        else (loaded.compute_dtype or loaded.dtype).itemsize
    )
    return _params(loaded) * elem


def _params(loaded: LoadedModel) -> int:
    args = loaded.args
    per_layer = (
        args.hidden_size * (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        + args.num_heads * args.head_dim * args.hidden_size
        + 3 * args.hidden_size * args.intermediate_size
    )
    return args.num_layers * per_layer + args.vocab_size * args.hidden_size


def step_bound_seconds(record: StepRecord, loaded: LoadedModel, rates: Rates) -> float:
    """Roofline time of one step on the path it took: bytes read (weights once + KV of the
    context) over copy bandwidth, or matmul FLOPs over that path's matmul rate, whichever is
    larger."""
    args = loaded.args
    per_layer = (
        args.hidden_size * (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        + args.num_heads * args.head_dim * args.hidden_size
        + 3 * args.hidden_size * args.intermediate_size
    )
    body_params = args.num_layers * per_layer
    head_params = args.vocab_size * args.hidden_size
    compute = loaded.compute_dtype or loaded.dtype
    if step_path(record, loaded) == "fused":
        # The native forward reads the stored weights, accumulating in float32.
        elem, flop_rate = loaded.dtype.itemsize, rates.fp32_flops_per_s
    else:
        # The matmuls read their copy in the compute dtype (float32 over bf16 weights where
        # the CPU lacks bf16 arithmetic).
        elem = compute.itemsize
        flop_rate = rates.fp32_flops_per_s if compute == torch.float32 else rates.half_flops_per_s
    kv_per_token = loaded.bytes_per_block / loaded.block_size
    weights = packed_weight_bytes(loaded)
    if weights is None:
        weights = (body_params + head_params) * elem
    # Packed weights: the bytes held (their wide passes' transient float32 tiles are extra
    # traffic the bound leaves out, so the bound stays an upper bound on speed).
    bytes_read = weights + record.num_context_tokens * kv_per_token
    flops = 2 * body_params * record.num_scheduled_tokens + 2 * head_params * record.num_seqs
    return max(bytes_read / rates.copy_bytes_per_s, flops / flop_rate)


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Avoid the low ids, where byte-level tokenizers keep their special tokens.
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def run_mode(
    mode: str,
    loaded: LoadedModel,
    base_overrides: dict[str, Any],
    template: str,
    prompts: list[list[int]],
    output_len: int,
    static_batch: int,
    rates: Rates,
) -> ModeResult:
    policy, seqs = MODES[mode]
    if mode == "static":
        seqs = static_batch
    overrides = dict(base_overrides)
    overrides["scheduler.policy"] = policy
    overrides["scheduler.max_num_seqs"] = seqs or len(prompts)
    config = load_config(template, overrides)
    # Untimed first: a GPU's Triton compiles each kernel the first time a shape meets it (the
    # first GPU check's one-at-a-time run spent ~25 of its 30 s there). The same batch width,
    # a few tokens each.
    warm = Engine(config, loaded=loaded)
    warm_params = SamplingParams(max_tokens=min(output_len, 3), temperature=0.0, ignore_eos=True)
    for p in prompts[: seqs or len(prompts)]:
        warm.add_request(p, warm_params)
    while warm.has_unfinished():
        warm.step()
    del warm
    engine = Engine(config, loaded=loaded)
    # Every step's record, not the console's last minute: the bound sums over all of them.
    engine.history = StepHistory(maxlen=None)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    start = time.perf_counter()
    outputs = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs += len(out.new_token_ids)
    seconds = time.perf_counter() - start
    records = list(engine.history.records)
    bound_s = sum(step_bound_seconds(r, loaded, rates) for r in records)
    if bound_s > seconds:
        raise InvalidBound(
            f"{mode}: ran in {seconds:.2f} s, under its roofline bound of {bound_s:.2f} s "
            f"({100 * bound_s / seconds:.0f}% of the bound): the bound does not model the path "
            "the engine took, so no share is reported"
        )
    stats = engine.stats()
    return ModeResult(
        mode=mode,
        requests=len(prompts),
        output_tokens=outputs,
        seconds=seconds,
        output_tokens_per_s=outputs / seconds,
        bound_tokens_per_s=outputs / bound_s,
        share_of_bound=bound_s / seconds,
        mean_batch=sum(r.num_seqs for r in records) / max(1, len(records)),
        peak_slot_utilisation=stats.slot_utilisation_at_peak,
        peak_kv_usage=max((r.kv_usage for r in records), default=0.0),
        steps=len(records),
        peak_running=max((r.num_running for r in records), default=0),
    )


def kv_summary(loaded: LoadedModel, config: Any, seq_len: int) -> dict[str, Any]:
    """The KV pool's format and size, and how many requests of seq_len tokens it holds."""
    blocks_per_seq = -(-seq_len // loaded.block_size)
    return {
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "kv_cache_scales": config.cache.scales(),
        "kv_cache_keep_16bit": list(config.cache.kv_cache_keep_16bit),
        "kv_cache_keep_16bit_heads": list(config.cache.kv_cache_keep_16bit_heads),
        "num_blocks": loaded.num_blocks,
        "bytes_per_block": loaded.bytes_per_block,
        "seqs_that_fit": loaded.num_blocks // blocks_per_seq,
    }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("offline", help="offline throughput per scheduling mode")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--template", default="cpu-demo")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--policy", choices=[*MODES, "all"], default="all")
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--profile",
        choices=["uniform", "mixed"],
        default="uniform",
        help="uniform: equal requests per scheduling mode; mixed: real-time + batch, fcfs vs priority",
    )
    p.add_argument(
        "--structured",
        choices=["none", "json-schema"],
        default="none",
        help="json-schema: throughput with and without a JSON schema, and its first-token cost",
    )
    p.add_argument("--structured-rounds", type=int, default=2, help="alternating runs, best kept")
    mixed.add_arguments(p)
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    overrides: dict[str, Any] = model_override(ns.model)
    for item in ns.set:
        key, _, value = item.partition("=")
        overrides[key] = parse_override_value(value)
    # Mixed: small chunks keep real-time decodes flowing beside 1,500-token prompts.
    default_budget = 512 if ns.profile == "mixed" else max(2048, ns.prompt_len)
    overrides.setdefault("scheduler.max_num_batched_tokens", default_budget)
    # A benchmark measures every request: queue timeouts would silently drop slow ones.
    overrides.setdefault("scheduler.queue_timeout_s", 0.0)
    for name in load_config(ns.template, overrides).priority_classes:
        overrides.setdefault(f"priority_classes.{name}.queue_timeout_s", 0.0)
    config = load_config(ns.template, overrides)
    loaded = load_model(config)
    if ns.profile == "mixed":
        return mixed.run_mixed(ns, loaded, overrides)
    if ns.structured == "json-schema":
        prompts = make_prompts(loaded.args.vocab_size, ns.num_requests, ns.prompt_len, ns.seed)
        return structured.run_structured(ns, loaded, overrides, prompts)
    fp32_rate = matmul_flops(loaded.device, torch.float32)
    # The 16-bit rate only where a step's matmuls run in 16 bits.
    half = loaded.compute_dtype if loaded.compute_dtype != torch.float32 else None
    rates = Rates(
        copy_bandwidth(loaded.device),
        fp32_rate,
        matmul_flops(loaded.device, half) if half is not None else fp32_rate,
    )
    prompts = make_prompts(loaded.args.vocab_size, ns.num_requests, ns.prompt_len, ns.seed)
    modes = list(MODES) if ns.policy == "all" else [ns.policy]
    try:
        results = [
            run_mode(
                m, loaded, overrides, ns.template, prompts, ns.output_len, ns.static_batch, rates
            )
            for m in modes
        ]
    except InvalidBound as exc:
        print(f"bench offline: {exc}", file=sys.stderr)
        return 1
    backend = loaded.backend.describe()
    if ns.json:
        print(
            json.dumps(
                {
                    "model": str(loaded.model_dir),
                    "rates": asdict(rates),
                    "kv": kv_summary(loaded, config, ns.prompt_len + ns.output_len),
                    "native_cpu_decode": loaded.runner.fused_max_batch > 0,
                    "weight_bytes_per_step": {
                        p: weight_bytes_per_step(loaded, p) for p in ("fused", "torch")
                    },
                    "cpu_backend": backend,
                    "results": [asdict(r) for r in results],
                }
            )
        )
        return 0
    print(
        f"model {loaded.model_dir.name}: {ns.num_requests} requests x {ns.prompt_len} prompt + "
        f"{ns.output_len} output tokens, {loaded.dtype}, block size {config.cache.block_size}"
    )
    print(
        f"weights read per decode step: {weight_bytes_per_step(loaded, 'fused') / 2**20:.1f} MiB "
        f"(fused native decode), {weight_bytes_per_step(loaded, 'torch') / 2**20:.1f} MiB (torch "
        "path), plus the KV of the context"
    )
    half_name = str(half).removeprefix("torch.") if half is not None else "float32"
    print(
        f"measured: copy bandwidth {rates.copy_bytes_per_s / 1e9:.1f} GB/s, matmul float32 "
        f"{rates.fp32_flops_per_s / 1e9:.0f} GFLOP/s, {half_name} "
        f"{rates.half_flops_per_s / 1e9:.0f} GFLOP/s"
    )
    print(loaded.backend.summary())
    kv = kv_summary(loaded, config, ns.prompt_len + ns.output_len)
    keep = ", per-token scales" if kv["kv_cache_scales"] == "per_token" else ""
    keep += f", 16-bit layers {kv['kv_cache_keep_16bit']}" if kv["kv_cache_keep_16bit"] else ""
    if kv["kv_cache_keep_16bit_heads"]:
        keep += f", 16-bit heads {kv['kv_cache_keep_16bit_heads']}"
    print(
        f"KV cache {kv['kv_cache_dtype']}{keep}: {kv['num_blocks']} blocks of "
        f"{kv['bytes_per_block'] / 1024:.0f} KiB, room for {kv['seqs_that_fit']} requests of "
        f"{ns.prompt_len + ns.output_len} tokens"
    )
    header = f"{'mode':<14} {'out tok/s':>10} {'bound tok/s':>12} {'% bound':>8} {'vs 1-at-a-time':>15} {'mean batch':>11} {'peak seqs':>10} {'slot util@peak':>15} {'time s':>8}"
    print(header)
    print("-" * len(header))
    base = next((r.output_tokens_per_s for r in results if r.mode == "one-at-a-time"), None)
    for r in results:
        speedup = f"{r.output_tokens_per_s / base:.1f}x" if base else "-"
        print(
            f"{r.mode:<14} {r.output_tokens_per_s:>10.1f} {r.bound_tokens_per_s:>12.1f} "
            f"{100 * r.share_of_bound:>7.1f}% {speedup:>15} {r.mean_batch:>11.1f} "
            f"{r.peak_running:>10} {100 * r.peak_slot_utilisation:>14.1f}% {r.seconds:>8.1f}"
        )
    return 0
