"""AWQ and GPTQ Hugging Face checkpoints (4-bit, config.json `quantization_config`) -> the q4
layout of appliance.kernels.quant_weight, integers re-ordered on load, never dequantized.

Both store, per linear, int32 words of eight 4-bit values plus fp16 scales [K/group, N] and
packed zero points [K/group, N/8]; a weight is (q - zero) * scale, kept here as
q * scale + min with min = -zero * scale in float32 (exact). They differ in how words pack:
- AWQ (AutoAWQ "gemm"): qweight [K, N/8], packed along N; nibble i of a word holds column
  8 c + AWQ_ORDER[i]; zeros likewise.
- GPTQ (AutoGPTQ/exllama): qweight [K/8, N], packed along K, nibble i = row 8 r + i; zeros
  [K/group, N/8] packed along N in plain order, stored as zero - 1 (checkpoint format "gptq";
  GPTQModel's "gptq_v2" stores the zero itself). `g_idx` must be the plain k // group (no
  act-order reordering, desc_act = false).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from appliance.kernels.quant_weight import QuantWeight, pack_q4
from appliance.models.hf_files import CONFIG_FILE, iter_safetensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _unpack_words(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8 W]: value j of each word is nibble order.index(j)."""
    shifts = torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*words.shape[:-1], -1).to(torch.uint8)


def quant_settings(model_dir: Path, kind: str) -> dict[str, Any]:
    qc = json.loads((model_dir / CONFIG_FILE).read_text())["quantization_config"]
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    group = int(qc.get("group_size", qc.get("q_group_size", 0)))
    if bits != 4:
        raise ValueError(f"quantization_config.bits: {bits}; {kind} checkpoints load at 4 bits")
    if group <= 0 or group % 32:
        raise ValueError(f"quantization_config.group_size: {group}; a multiple of 32 is needed")
    if kind == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"quantization_config.version: {qc.get('version')!r}; AWQ loads 'gemm'")
    if kind == "gptq" and qc.get("desc_act"):
        raise ValueError("quantization_config.desc_act: act-order GPTQ is not supported")
    v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    return {"group": group, "zero_offset": 0 if kind == "awq" or v2 else 1}


def convert(
    parts: dict[str, torch.Tensor], kind: str, group: int, zero_offset: int, name: str
) -> QuantWeight:
    """One linear's packed tensors -> a QuantWeight [N, K]."""
    scales = parts["scales"].to(torch.float16)  # [K/g, N]
    if kind == "awq":
        q = _unpack_words(parts["qweight"], AWQ_ORDER)  # [K, N]
        zeros = _unpack_words(parts["qzeros"], AWQ_ORDER)  # [K/g, N]
    else:
        words = parts["qweight"]  # [K/8, N]
        q = _unpack_words(words.t().contiguous()).t()  # [K, N]
        zeros = _unpack_words(parts["qzeros"])  # [K/g, N]
        k = q.shape[0]
        g_idx = parts.get("g_idx")
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ValueError(f"{name}.g_idx: act-order group indices are not supported")
    k, n = q.shape
    if scales.shape != (k // group, n):
        raise ValueError(f"{name}.scales: shape {tuple(scales.shape)}, expected {(k // group, n)}")
    z = zeros.to(torch.float32) + zero_offset
    mins = (-(z * scales.float())).t().contiguous()
    return QuantWeight(
        "q4", pack_q4(q.t().contiguous()), scales.t().contiguous(), mins, group, k, kind
    )


def packed_weights(model_dir: Path, kind: str) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(Hugging Face name, tensor or QuantWeight): each linear's parts are gathered as the
    safetensors stream brings them and converted once all have arrived."""
    settings = quant_settings(model_dir, kind)
    needed = ("qweight", "qzeros", "scales")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_safetensors(model_dir):
        prefix, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor
        # GPTQ's g_idx may come after the rest; files without one convert at the end.
        if all(p in got for p in needed) and (kind == "awq" or "g_idx" in got):
            yield (
                f"{prefix}.weight",
                convert(got, kind, settings["group"], settings["zero_offset"], prefix),
            )
            del pending[prefix]
    for prefix, got in pending.items():
        if all(p in got for p in needed):
            yield (
                f"{prefix}.weight",
                convert(got, kind, settings["group"], settings["zero_offset"], prefix),
            )
        else:
            raise ValueError(f"{model_dir}: {prefix} lacks {sorted(set(needed) - got.keys())}")
