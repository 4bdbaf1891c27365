"""GGUF checkpoints (llama.cpp's format) read through the `gguf` package: the model config and
the chat template from the file's metadata, the tokenizer from a Hugging Face tokenizer beside
the file or else from the metadata (transformers converts it), and the tensors under Hugging
Face names, quantized ones still packed (appliance.models.gguf_blocks).

llama.cpp's converter permutes the rows of q and k for its interleaved rotary; they are put
back in rotate-half order here, by moving packed rows (quantization is per row).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from appliance.layers.quant import QuantWeight
from appliance.models.gguf_blocks import BLOCKS, convert

SUFFIX = ".gguf"
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def find_gguf(path: str | Path) -> Path | None:
    """`path` itself when it is a .gguf file, or the one .gguf file of a directory that holds
    no Hugging Face config.json; None otherwise."""
    p = Path(path)
    if p.is_file() and p.suffix == SUFFIX:
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob(f"*{SUFFIX}"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise ValueError(f"model.path: {p} holds several GGUF files ({names}); name one")
    return None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = rows // heads // 2
    # llama.cpp stores head h's row 2 i + j where rotate-half has row j * dim + i.
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


class GgufCheckpoint:
    def __init__(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ValueError("model.path: reading a GGUF file needs the gguf package") from None
        self.path = path
        self.reader = GGUFReader(str(path))
        self.meta: dict[str, Any] = {k: f.contents() for k, f in self.reader.fields.items()
                                     if not k.startswith("tokenizer.ggml.")}  # fmt: skip
        arch = self.meta.get("general.architecture", "")
        if arch not in ARCHITECTURES:
            raise ValueError(f"GGUF {path.name}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")  # fmt: skip
        self.arch = arch
        self.types = sorted({t.tensor_type.name for t in self.reader.tensors})

    def _m(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def _token_field(self, key: str) -> Any:
        field = self.reader.fields.get(f"tokenizer.ggml.{key}")
        return field.contents() if field is not None else None

    def hf_config(self) -> Any:
        """A transformers config built from the metadata (the fields ModelArgs reads)."""
        from transformers import LlamaConfig, Qwen2Config

        heads = int(self._m("attention.head_count"))
        hidden = int(self._m("embedding_length"))
        names = {t.name for t in self.reader.tensors}
        vocab = self._m("vocab_size") or len(self._token_field("tokens") or [])
        embd = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        vocab = int(vocab or embd.shape[1])
        kwargs = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._m("feed_forward_length")),
            num_hidden_layers=int(self._m("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._m("attention.head_count_kv", heads)),
            head_dim=int(self._m("rope.dimension_count", hidden // heads)),
            rms_norm_eps=float(self._m("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._m("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._m("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self._token_field("bos_token_id"),
            eos_token_id=self._token_field("eos_token_id"),
        )
        cls = Qwen2Config if self.arch == "qwen2" else LlamaConfig
        return cls(**kwargs)

    def tokenizer(self) -> Any:
        """A tokenizer beside the file (tokenizer.json) wins; else transformers builds one from
        the metadata. The chat template comes from the metadata when the tokenizer has none."""
        from transformers import AutoTokenizer

        folder = self.path.parent
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=self.path.name,
                                                local_files_only=True)  # fmt: skip
        template = self.meta.get("tokenizer.chat_template")
        if template and not getattr(tok, "chat_template", None):
            tok.chat_template = template
        return tok

    def quantized_types(self) -> list[str]:
        return [t for t in self.types if t in BLOCKS]

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
                value = tensor.reshape([int(d) for d in reversed(t.shape)]) if t.shape.size > 1 else tensor
            else:
                raise ValueError(f"GGUF tensor {t.name}: type {kind} is not supported "
                                 f"(supported: {', '.join(BLOCKS)}, F32, F16, BF16)")  # fmt: skip
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
