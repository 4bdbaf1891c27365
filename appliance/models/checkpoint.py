"""One front door for the checkpoints the loader reads: a Hugging Face directory (16-bit, or
AWQ/GPTQ per its config.json `quantization_config`) or a GGUF file, each giving the model
config, the tokenizer and a stream of (Hugging Face name, tensor or packed QuantWeight).

`model.quantization = "int8"` wraps a 16-bit checkpoint's stream: every linear (and a tied LM
head's table) is quantized per output channel as it is read, so the 16-bit matrix of one layer
exists only while it is converted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from appliance.kernels.quant_weight import QuantWeight, quantize_int8
from appliance.models import hf_files
from appliance.models.gguf_file import GgufCheckpoint
from appliance.models.gguf_meta import find_gguf
from appliance.quant_sizes import bits_per_weight

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Weights = Iterator[tuple[str, "torch.Tensor | QuantWeight"]]


@dataclass
class Checkpoint:
    path: Path
    # "hf" (16/32-bit), "gguf", "awq", "gptq"; with int8 set, "hf" quantized at load.
    kind: str
    int8: bool = False
    gguf: GgufCheckpoint | None = None

    @property
    def quantized(self) -> bool:
        return self.kind != "hf" or self.int8

    def describe(self) -> str:
        if self.gguf is not None:
            return f"GGUF ({', '.join(self.gguf.quantized_types()) or 'unquantized'})"
        if self.int8:
            return "INT8 per-channel weight-only (quantized at load)"
        return {"hf": "16-bit", "awq": "AWQ 4-bit", "gptq": "GPTQ 4-bit"}[self.kind]

    def packed_bytes_estimate(self, params: int) -> int:
        """Bytes `params` packed weights will take (before reading them): 4 bits plus a fp16
        scale and a float32 min per 128 for AWQ/GPTQ, 1 byte plus a per-row scale for INT8,
        and for GGUF its quantized tensors repacked (appliance.models.gguf_meta.ENGINE_BITS)."""
        if self.gguf is not None:
            return self.gguf.packed_size()[1]
        return int(params * bits_per_weight(self.kind if not self.int8 else "int8") / 8)

    def hf_config(self) -> Any:
        if self.gguf is not None:
            return self.gguf.hf_config()
        return hf_files.read_config_json(self.path)

    def tokenizer(self) -> Any:
        if self.gguf is not None:
            return self.gguf.tokenizer()
        return hf_files.load_tokenizer(self.path)

    def weights(self, dtype: torch.dtype, tied: bool) -> Weights:
        """Dense tensors in `dtype`, quantized ones packed."""
        if self.gguf is not None:
            stream: Weights = self.gguf.weights()
        elif self.kind in ("awq", "gptq"):
            from appliance.models.hf_quant import packed_weights

            stream = packed_weights(self.path, self.kind)
        else:
            stream = hf_files.iter_safetensors(self.path)
        for name, value in stream:
            if isinstance(value, torch.Tensor):
                if self.int8 and _int8_target(name, tied):
                    value = quantize_int8(value)
                else:
                    value = value.to(dtype)
            yield name, value


def _int8_target(name: str, tied: bool) -> bool:
    module = name.rsplit(".", 2)
    if name.endswith(".weight") and len(module) == 3 and module[1] in LINEARS:
        return True
    return name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")


def has_checkpoint(path: str | Path) -> bool:
    return hf_files.has_model(path) or find_gguf(path) is not None


def open_checkpoint(path: str | Path, quantization: str = "") -> Checkpoint:
    """`quantization` is model.quantization: "" (the checkpoint's own) or "int8"."""
    p = Path(path)
    gguf = find_gguf(p)
    if gguf is not None:
        kind = "gguf"
        ckpt = Checkpoint(gguf, kind, gguf=GgufCheckpoint(gguf))
    else:
        kind = _hf_quant_kind(p)
        ckpt = Checkpoint(p, kind)
        if kind in ("awq", "gptq"):
            from appliance.models.hf_quant import quant_settings

            quant_settings(p, kind)  # a bad quantization_config fails before any weight
    if quantization == "int8":
        if ckpt.kind != "hf":
            raise ValueError(
                f"model.quantization: 'int8' quantizes a 16-bit checkpoint; {p} is "
                f"already {ckpt.describe()}"
            )
        ckpt.int8 = True
    elif quantization in ("awq", "gptq"):
        if ckpt.kind != quantization:
            raise ValueError(f"model.quantization: {quantization!r}, but {p} is {ckpt.describe()}")
    elif quantization:
        raise ValueError(f"model.quantization: unknown value {quantization!r}")
    return ckpt


def _hf_quant_kind(path: Path) -> str:
    import json

    config = path / hf_files.CONFIG_FILE
    if not config.is_file():
        return "hf"
    qc = json.loads(config.read_text()).get("quantization_config")
    if not qc:
        return "hf"
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(
            f"{config}: quantization_config.quant_method {method!r} is not supported "
            "(supported: awq, gptq; or GGUF files)"
        )
    return method
