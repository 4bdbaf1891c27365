"""`appliance plan`'s text output: the chosen layout per GPU (or CPU rank), then one line per
tensor-parallel size. The arithmetic is appliance/plan.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.quant_sizes import format_note

if TYPE_CHECKING:  # the plan imports this module for its output and its units
    from appliance.plan import Plan

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def render(plan: Plan) -> str:
    c = plan.chosen
    lines = [
        f"plan for {plan.template or 'config'}: {plan.architecture} "
        f"({plan.total_params / 1e9:.2f}B parameters, {plan.dtype_bytes}-byte weights) "
        f"from {plan.config_source}",
    ]
    if plan.device == "cuda":
        lines.append(
            f"hardware: {plan.num_gpus} x {plan.gpu_name or 'GPU'} with {plan.gpu_memory_gib:g} "
            f"GiB each; gpu_memory_utilization {plan.gpu_memory_utilization:g} -> "
            f"{_gib(c.budget_bytes)} budget per GPU"
        )
    else:
        lines.append(
            f"hardware: host CPU; KV pool cache.kv_cache_memory {plan.kv_cache_memory_gib:g} GiB per rank"
        )
    unit = "per GPU" if plan.device == "cuda" else "per rank"
    lines.append(f"tensor_parallel_size {c.tensor_parallel_size}, {unit}:")
    if c.weight_params:
        rows = [
            (
                "weights",
                _gib(c.weights_bytes),
                f"{c.weight_params / 1e9:.3f}B parameters x {plan.dtype_bytes} bytes"
                + (" + the matmul copy" if c.matmul_copy_bytes else ""),
            ),
        ]
        if plan.weight_format:
            rows[0] = (
                "weights",
                _gib(c.weights_bytes),
                format_note(plan.weight_format, plan.weight_types),
            )
        if c.matmul_copy_bytes:
            rows += [
                ("  of which matmul copy", _gib(c.matmul_copy_bytes), c.cpu_path + " (this CPU)"),
            ]
        if c.lora_slot_bytes:
            rows += [
                (
                    "LoRA slot pool",
                    _gib(c.lora_slot_bytes),
                    "lora.max_loras x max_lora_rank factors on every projection"
                    + (" (and their AMX tile copy)" if c.lora_tiles else ""),
                ),
            ]
        if plan.device == "cuda":
            rows += [
                (
                    "activation reserve",
                    _gib(c.activation_reserve_bytes),
                    f"estimated for {plan.max_num_batched_tokens} tokens a step (see below)",
                ),
                (
                    "runtime reserve",
                    _gib(c.runtime_reserve_bytes),
                    "CUDA context, cuBLAS and NCCL workspaces (assumed)",
                ),
            ]
        rows += [
            (
                "KV cache",
                _gib(c.kv_cache_bytes),
                "what is left" if plan.device == "cuda" else "cache.kv_cache_memory",
            ),
            (
                "KV bytes per token",
                f"{c.kv_bytes_per_token / KiB:.1f} KiB",
                f"K+V x layers x KV heads on this rank x head_dim x {plan.kv_elem_bytes} byte(s)"
                + (
                    " (16-bit layers/heads: cache.kv_cache_keep_16bit[_heads])"
                    if plan.kv_keep_16bit
                    else ""
                )
                + (
                    " + 2-byte per-token scales (cache.kv_cache_scales)"
                    if plan.kv_scales == "per_token"
                    else ""
                ),
            ),
            (
                "KV blocks",
                str(c.kv_blocks),
                f"{plan.block_size} tokens, {c.block_bytes / MiB:.2f} MiB each: {c.kv_tokens} tokens",
            ),
            (
                f"seqs at {plan.max_model_len} tokens",
                str(c.seqs_at_max_model_len),
                "model.max_model_len",
            ),
            (
                f"seqs at {plan.typical_seq_len} tokens",
                str(c.seqs_at_typical_seq_len),
                "hardware.typical_seq_len",
            ),
        ]
        for name, value, why in rows:
            lines.append(f"  {name:<22} {value:>12}   {why}")
        capped = c.seqs_at_typical_seq_len > plan.max_num_seqs
        if capped:
            lines.append(
                f"  (the scheduler runs at most max_num_seqs = {plan.max_num_seqs} at once)"
            )
    lines.append(f"verdict: {c.verdict}")
    if plan.advice:
        lines.append(f"advice: {plan.advice}")
    if plan.device == "cuda":
        lines.append(f"activation reserve: {plan.activation_method}")
    lines.append("")
    lines.append(f"  {'TP':>2}  {'weights':>11}  {'KV blocks':>9}  {'seqs@max':>8}  verdict")
    for o in plan.options:
        blocks = str(o.kv_blocks) if o.weight_params else "-"
        seqs = str(o.seqs_at_max_model_len) if o.weight_params else "-"
        weights = _gib(o.weights_bytes) if o.weight_params else "-"
        lines.append(
            f"  {o.tensor_parallel_size:>2}  {weights:>11}  {blocks:>9}  {seqs:>8}  {o.verdict}"
        )
    return "\n".join(lines)
