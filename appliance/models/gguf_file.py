"""GGUF checkpoints (llama.cpp's format) read through the `gguf` package: the model config and
the chat template from the file's metadata, the tokenizer from a Hugging Face tokenizer beside
the file or else from the metadata (transformers converts it), and the tensors under Hugging
Face names, quantized ones still packed (appliance.models.gguf_blocks).

llama.cpp's converter permutes the rows of q and k for its interleaved rotary; they are put
back in rotate-half order here, by moving packed rows (quantization is per row).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from appliance.kernels.quant_weight import QuantWeight
from appliance.models.gguf_blocks import BLOCKS, convert
from appliance.models.gguf_meta import GgufMeta

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
TOKENIZER_CACHE_ENV = "APPLIANCE_TOKENIZER_CACHE"


def tokenizer_cache_root() -> Path:
    default = Path.home() / ".cache" / "appliance" / "tokenizers"
    return Path(os.environ.get(TOKENIZER_CACHE_ENV) or default)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = rows // heads // 2
    # llama.cpp stores head h's row 2 i + j where rotate-half has row j * dim + i.
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


class GgufCheckpoint(GgufMeta):
    """A GGUF file read for loading: its config as transformers', its tokenizer, its tensors."""

    def hf_config(self) -> Any:
        """A transformers config built from the metadata (the fields ModelArgs reads)."""
        from transformers import LlamaConfig, Qwen2Config

        cls = Qwen2Config if self.arch == "qwen2" else LlamaConfig
        kwargs = self.config_json()
        kwargs.pop("model_type")
        return cls(**kwargs)

    def tokenizer(self) -> Any:
        """A tokenizer beside the file (tokenizer.json) wins; else transformers builds one from
        the metadata (cached, see `_converted_tokenizer`). The chat template comes from the
        metadata when the tokenizer has none."""
        from transformers import AutoTokenizer

        folder = self.path.parent
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        else:
            tok = self._converted_tokenizer()
        template = self.meta.get("tokenizer.chat_template")
        if template and not getattr(tok, "chat_template", None):
            tok.chat_template = template
        return tok

    def tokenizer_cache_dir(self) -> Path:
        """Where the converted tokenizer is kept: keyed by the bytes of every tokenizer.*
        field (vocabulary, merges, special ids, template) and the converter's version."""
        import transformers

        digest = hashlib.sha256(transformers.__version__.encode())
        for name, field in sorted(self.reader.fields.items()):
            if name.startswith("tokenizer."):
                digest.update(name.encode())
                for part in field.parts:
                    digest.update(np.ascontiguousarray(part).tobytes())
        return tokenizer_cache_root() / digest.hexdigest()[:32]

    def _converted_tokenizer(self) -> Any:
        """transformers' conversion of the metadata's vocabulary and merges takes ~15 s for a
        49k-token vocabulary, at every start of the engine and of the API process: the result
        is saved once under the model cache, keyed by the tokenizer fields' bytes and the
        transformers version, and read back from its tokenizer.json (well under a second)."""
        from transformers import AutoTokenizer

        cached = self.tokenizer_cache_dir()
        if (cached / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, local_files_only=True
        )
        tmp = None
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cached.parent)
            tok.save_pretrained(tmp)
            os.replace(tmp, cached)  # atomic: a reader never sees half a folder
        except OSError:
            # A read-only or full cache, or another process that got there first: this only
            # costs the next start its conversion.
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return tok

    def weights(self) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """(Hugging Face name, dense tensor or packed QuantWeight) for every tensor."""
        heads = int(self._m("attention.head_count"))
        kv_heads = int(self._m("attention.head_count_kv", heads))
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            kind = t.tensor_type.name
            # GGUF lists dimensions innermost first: ne = [K, N].
            k = int(t.shape[0])
            if kind in BLOCKS:
                value: torch.Tensor | QuantWeight = convert(t.data, kind, k, f"gguf:{kind}")
            elif kind in ("F32", "F16", "BF16"):
                arr = np.ascontiguousarray(t.data)
                tensor = torch.from_numpy(arr.copy())
                if kind == "BF16":
                    tensor = tensor.view(torch.bfloat16)
                value = (
                    tensor.reshape([int(d) for d in reversed(t.shape)])
                    if t.shape.size > 1
                    else tensor
                )
            else:
                raise ValueError(
                    f"GGUF tensor {t.name}: type {kind} is not supported "
                    f"(supported: {', '.join(BLOCKS)}, F32, F16, BF16)"
                )
            # Only llama.cpp's Llama converter permutes q/k (Qwen2 keeps rotate-half order).
            qk = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
            if self.arch == "llama" and name.endswith(qk):
                n_heads = heads if ".q_proj." in name else kv_heads
                rows = value.out_features if isinstance(value, QuantWeight) else value.shape[0]
                order = unpermute_rows(rows, n_heads)
                value = value.take_rows(order) if isinstance(value, QuantWeight) else value[order]
            yield name, value


def _hf_name(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} does not belong to a Llama-family model")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
