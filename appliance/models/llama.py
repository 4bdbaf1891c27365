"""The Llama family (Llama 2/3, Mistral, Qwen2) on the paged KV cache, built from the
project's own layers. Parameter names follow the Hugging Face checkpoints' modules, with
q/k/v and gate/up merged into one matmul each."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels import cpu_native
from appliance.layers.attention import Attention, AttentionMetadata
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.linear import MergedColumnLinear, RowParallelLinear
from appliance.layers.norm import RMSNorm
from appliance.layers.parallel import divide, tp_rank, tp_size
from appliance.layers.rotary import RotaryEmbedding, apply_rotary
from appliance.models.hf_files import rope_parameters

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class NativeRope(NamedTuple):
    """Rotary inputs of the native path: float32 tables [max_position, head_dim] and the
    tokens' positions (the torch path takes cos/sin already looked up)."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor


Rope = tuple[torch.Tensor, torch.Tensor] | NativeRope


@dataclass
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

    @classmethod
    def from_hf(cls, config: Any) -> ModelArgs:
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        heads = config.num_attention_heads
        rope: dict[str, Any] | None = rope_parameters(config)
        theta = rope.pop("rope_theta")
        if rope["rope_type"] == "default":
            rope = None
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported (silu only)")
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            hidden_act=act,
        )

    def kv_heads_per_rank(self, size: int) -> int:
        """KV heads are split across ranks, or replicated when ranks outnumber them."""
        return max(1, self.num_kv_heads // size)


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        size = tp_size()
        self.num_heads = divide(args.num_heads, size, "num_attention_heads")
        if args.num_kv_heads >= size:
            self.num_kv_heads = divide(args.num_kv_heads, size, "num_key_value_heads")
        else:
            divide(size, args.num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
        self.head_dim = args.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnLinear(
            args.hidden_size,
            [("q", self.q_size, 0), ("k", self.kv_size, 0), ("v", self.kv_size, 0)],
            bias=args.qkv_bias,
        )
        if args.num_kv_heads < size:
            replica = tp_rank() * args.num_kv_heads // size
            self.qkv_proj.shard_index["k"] = replica
            self.qkv_proj.shard_index["v"] = replica
        self.o_proj = RowParallelLinear(args.num_heads * self.head_dim, args.hidden_size)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        tokens = hidden.shape[0]
        native = isinstance(rope, NativeRope)
        if native:
            cpu_native.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
        # q and k (rotated together, as one [T, Hq + Hk, D] tensor: half the small ops).
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        if not native:
            qk = apply_rotary(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta, kv_cache)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = divide(args.intermediate_size, tp_size(), "intermediate_size")
        self.gate_up_proj = MergedColumnLinear(
            args.hidden_size, [("gate", self.inter, 0), ("up", self.inter, 0)], bias=False
        )
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor, native_ops: bool = False) -> torch.Tensor:
        if native_ops:
            return self.down_proj(cpu_native.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        if isinstance(rope, NativeRope):
            # The same steps through the native element-wise kernels; `hidden` (this forward's
            # own tensor) takes the residual adds in place.
            ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
            normed = cpu_native.add_rms_norm(hidden, None, ln1.weight, ln1.eps)
            attn = self.self_attn(rope, normed, meta, kv_cache)
            normed = cpu_native.add_rms_norm(hidden, attn, ln2.weight, ln2.eps)
            return hidden.add_(self.mlp(normed, native_ops=True))
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), meta, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # One table for all layers: the positions' cos/sin are looked up once per forward.
        self.rotary = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # CPU: element-wise steps through kernels/cpu_decode.c (set by the loader when built).
        self.native_cpu_ops = False
        self.model = LlamaModel(args)
        tied = self.model.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tied)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        rope: Rope
        if self.native_cpu_ops:
            rotary = self.model.rotary
            rope = NativeRope(rotary.cos.float(), rotary.sin.float(), positions)
        else:
            rope = self.model.rotary.cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, meta, kv_cache)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # In the model's dtype: the sampler converts only when it needs float32.
        return self.lm_head(hidden)

    # -- weights ---------------------------------------------------------------------------------
    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    _MERGED = {
        "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
        "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
        "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
        "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
        "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in, each sliced to this rank. Every parameter must be set."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            if isinstance(module, MergedColumnLinear):
                # Each part of a merged projection comes from its own checkpoint tensor.
                expected.update(f"{name}:{part}" for part, _, _ in module.parts)
            else:
                expected.add(name)
        loaded: set[str] = set()
        layers = self.model.layers
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight":
                if self.args.tie_word_embeddings:
                    continue
                self.lm_head.load(tensor)
                loaded.add("lm_head.embedding.weight")
                continue
            if name == "model.embed_tokens.weight":
                self.model.embed_tokens.load(tensor)
                loaded.add(name)
                continue
            match = self._LAYER.fullmatch(name)
            if match is None:
                if name == "model.norm.weight":
                    self.model.norm.weight.data.copy_(tensor)
                    loaded.add(name)
                    continue
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
            index, rest = int(match.group(1)), match.group(2)
            if index >= len(layers):
                raise ValueError(f"checkpoint tensor {name!r}: the model has {len(layers)} layers")
            layer = layers[index]
            module_name, _, kind = rest.rpartition(".")
            is_bias = kind == "bias"
            prefix = f"model.layers.{index}."
            if module_name in self._MERGED:
                merged, part = self._MERGED[module_name]
                layer.get_submodule(merged).load(part, tensor, is_bias)
                loaded.add(f"{prefix}{merged}.{kind}:{part}")
            elif module_name in ("self_attn.o_proj", "mlp.down_proj"):
                layer.get_submodule(module_name).load(tensor, is_bias)
                loaded.add(prefix + rest)
            elif module_name in ("input_layernorm", "post_attention_layernorm"):
                layer.get_submodule(module_name).weight.data.copy_(tensor)
                loaded.add(prefix + rest)
            else:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
