"""The shape of a Llama-family model, read once from its config: what the model is built from
(`appliance.models.llama`) and what memory is planned from (`appliance plan`, the loader's GPU
check). Torch-free, so that the plan and the console can read it without the engine.

A config is either a `transformers.PretrainedConfig` or the plain dict of a config.json; a key
the file leaves out takes transformers' LlamaConfig default, as `AutoConfig` would give it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings as one dict with at least rope_type and rope_theta.

    transformers 5 keeps them in `config.rope_parameters` (theta included); 4.x configs have a
    top-level `rope_theta` and an optional `rope_scaling` ("type" in older files).
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_type" not in out:
        out["rope_type"] = out.pop("type", "default")
    if "rope_theta" not in out:
        out["rope_theta"] = float(getattr(config, "rope_theta", None) or 10000.0)
    return out


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    hidden_act: str
    # Where the config came from, for messages and the plan's table (not part of the shape).
    name: str = ""

    @classmethod
    def from_hf(cls, config: Any, name: str = "") -> ModelArgs:
        """From a transformers config (or anything with its attributes); raises ValueError
        naming the config.json key that is missing or not supported."""
        model_type = getattr(config, "model_type", None) or "llama"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        missing = [key for key in _REQUIRED if getattr(config, key, None) is None]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        act = getattr(config, "hidden_act", None) or "silu"
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported (silu only)")
        rope: dict[str, Any] | None = rope_parameters(config)
        assert rope is not None
        theta = rope.pop("rope_theta")
        if rope["rope_type"] == "default":
            rope = None
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", None) or 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", None) or 2048),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            hidden_act=act,
            name=name or getattr(config, "_name_or_path", "") or model_type,
        )

    @classmethod
    def from_config_json(cls, cfg: dict[str, Any], name: str = "") -> ModelArgs:
        """From the dict of a config.json file (no transformers needed)."""
        return cls.from_hf(SimpleNamespace(**cfg), name)

    # -- per-rank shapes, as appliance.models.llama splits the layers (tests/test_plan.py) --
    def tp_problem(self, tp: int) -> str:
        """Why the model cannot be split `tp` ways, or '' when it can."""
        if self.num_heads % tp:
            return f"{self.num_heads} attention heads do not divide by {tp}"
        if self.intermediate_size % tp:
            return f"intermediate_size {self.intermediate_size} does not divide by {tp}"
        kv = self.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            return f"{kv} KV heads can be neither split nor replicated {tp} ways"
        return ""

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads are split across ranks, or replicated when ranks outnumber them."""
        return max(1, self.num_kv_heads // tp)

    def params_per_rank(self, tp: int) -> int:
        h, hd = self.hidden_size, self.head_dim
        vocab_rows = -(-self.vocab_size // tp)  # vocab-parallel, last shard padded
        embed = vocab_rows * h * (1 if self.tie_word_embeddings else 2)
        q = self.num_heads // tp * hd
        kv = self.kv_heads_per_rank(tp) * hd
        qkv = h * (q + 2 * kv) + (q + 2 * kv if self.qkv_bias else 0)
        o = self.num_heads * hd // tp * h
        mlp = 3 * (self.intermediate_size // tp) * h
        norms = 2 * h
        return embed + self.num_layers * (qkv + o + mlp + norms) + h

    def total_params(self) -> int:
        return self.params_per_rank(1)

    def lm_head_params_per_rank(self, tp: int) -> int:
        """The LM head's matrix (the embedding's when tied): what the logits matmul reads."""
        return -(-self.vocab_size // tp) * self.hidden_size

    def linear_params_per_rank(self, tp: int) -> int:
        """The layers' q|k|v, o, gate|up and down matrices (biases and norms excluded)."""
        h, hd = self.hidden_size, self.head_dim
        q = self.num_heads // tp * hd
        kv = self.kv_heads_per_rank(tp) * hd
        per_layer = h * (q + 2 * kv) + self.num_heads * hd // tp * h
        return self.num_layers * (per_layer + 3 * self.intermediate_size // tp * h)
