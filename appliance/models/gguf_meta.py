"""What a GGUF file says about its model, read through the `gguf` package without torch: the
config (as config.json's keys), the tensor types and their bytes. `appliance plan` and the
API process read this; the loader's `GgufCheckpoint` (appliance.models.gguf_file) builds on it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

SUFFIX = ".gguf"
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Bits per weight of each ggml type once repacked into the engine's layouts
# (appliance.kernels.quant_weight): q4 = 4 bits + an fp16 scale and fp16 min per 32; q8 = 8 bits + an
# fp16 scale per group (32 for Q8_0, Q6_K's 16-column sub-blocks). Q4_0 gains its min, the
# K-quants their per-32 / per-16 scales spelled out.
ENGINE_BITS = {"Q8_0": 8.5, "Q4_0": 5.0, "Q4_1": 5.0, "Q4_K": 5.0, "Q6_K": 9.0}


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


@functools.lru_cache(maxsize=4)
def _read(path: str, size: int, mtime_ns: int) -> tuple[Any, dict[str, Any]]:
    """The gguf package's reader of a file and its non-vocabulary metadata, once per process
    and version of the file: GGUFReader parses every field up front, ~3.6 s for SmolLM2's
    49,152-entry vocabulary on a Zen 3, and a process may open the same file several times
    (the plan, the loader, the tokenizer). The reader memory-maps the file, read-only."""
    del size, mtime_ns  # part of the cache key only: a rewritten file is read again
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError("model.path: reading a GGUF file needs the gguf package") from None
    reader = GGUFReader(path)
    meta = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    return reader, meta


class GgufMeta:
    def __init__(self, path: Path) -> None:
        self.path = path
        stat = Path(path).stat()
        self.reader, meta = _read(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
        self.meta: dict[str, Any] = dict(meta)
        arch = self.meta.get("general.architecture", "")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"GGUF {path.name}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self.arch = arch
        self.types = sorted({t.tensor_type.name for t in self.reader.tensors})

    def _m(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def _token_field(self, key: str) -> Any:
        field = self.reader.fields.get(f"tokenizer.ggml.{key}")
        return field.contents() if field is not None else None

    def config_json(self) -> dict[str, Any]:
        """The model's config in config.json's keys, from the metadata."""
        heads = int(self._m("attention.head_count"))
        hidden = int(self._m("embedding_length"))
        names = {t.name for t in self.reader.tensors}
        vocab = self._m("vocab_size") or len(self._token_field("tokens") or [])
        if not vocab:
            embd = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
            vocab = int(embd.shape[1])
        return dict(
            model_type=ARCHITECTURES[self.arch],
            vocab_size=int(vocab),
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

    def tensor_bytes(self) -> int:
        """Bytes of every tensor as stored in the file (packed blocks, scales included)."""
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def quantized_types(self) -> list[str]:
        return [t for t in self.types if t in ENGINE_BITS]

    def packed_size(self) -> tuple[int, int]:
        """(elements, bytes) of the quantized tensors as the engine holds them once repacked
        (appliance.models.gguf_blocks); the other tensors load in the model dtype."""
        elements = packed = 0
        for t in self.reader.tensors:
            bits = ENGINE_BITS.get(t.tensor_type.name)
            if bits is not None:
                elements += int(t.n_elements)
                packed += int(t.n_elements * bits) // 8
        return elements, packed
