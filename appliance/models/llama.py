"""The Llama family (Llama 2/3, Mistral, Qwen2) on the paged KV cache, built from the
project's own layers. Parameter names follow the Hugging Face checkpoints' modules, with
q/k/v and gate/up merged into one matmul each."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from appliance.kernels.quant_weight import QuantWeight
from appliance.layers.attention import Attention, AttentionMetadata
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.kv_cache import LayerCache
from appliance.layers.linear import MatmulWeight, MergedColumnLinear, RowParallelLinear
from appliance.layers.norm import RMSNorm
from appliance.layers.ops import LayerOps
from appliance.layers.parallel import divide, tp_rank, tp_size
from appliance.layers.rotary import RotaryEmbedding
from appliance.models.args import ModelArgs


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
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        ops: LayerOps,
        rope: Any,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: LayerCache,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        tokens = hidden.shape[0]
        q, k = ops.rotate_qk(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope)
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

    def forward(self, ops: LayerOps, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x), self.inter))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        ops: LayerOps,
        rope: Any,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: LayerCache,
    ) -> torch.Tensor:
        return self.feed_forward(ops, hidden, self.attend(ops, rope, hidden, meta, kv_cache))

    # The layer's two halves, which a pausable forward runs as separate units (run_layers).
    def attend(
        self,
        ops: LayerOps,
        rope: Any,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: LayerCache,
    ) -> torch.Tensor:
        """The attention half: its output, not yet added to `hidden` (feed_forward adds it
        in the norm that follows, as one pass)."""
        normed = ops.add_rms_norm(hidden, None, self.input_layernorm)
        return self.self_attn(ops, rope, normed, meta, kv_cache)

    def feed_forward(self, ops: LayerOps, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The MLP half, after `attend` gave `attn`. `hidden` is the forward's own tensor: it
        takes the residual adds in place."""
        normed = ops.add_rms_norm(hidden, attn, self.post_attention_layernorm)
        return hidden.add_(self.mlp(ops, normed))


class LlamaModel(nn.Module):
    # An nn.ModuleList at run time, typed by what it holds: ModuleList's own type says only
    # nn.Module, and every reader of the layers wants their attributes.
    layers: Sequence[LlamaDecoderLayer]

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = cast(
            "Sequence[LlamaDecoderLayer]",
            nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers)),
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # One table for all layers: the positions' cos/sin are looked up once per forward.
        self.rotary = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling
        )


def _dense(name: str, tensor: torch.Tensor | QuantWeight) -> torch.Tensor:
    """A norm's weight, which no checkpoint packs."""
    if isinstance(tensor, QuantWeight):
        raise ValueError(f"checkpoint tensor {name!r}: a norm weight must not be packed")
    return tensor


@dataclass
class ForwardState:
    """A forward between two layers or two halves of one: the residual stream after
    `next_layer` layers, what the backend's rotary computed for the positions (LayerOps.rope),
    and, when layer `next_layer`'s attention half has run, that half's output."""

    hidden: torch.Tensor
    rope: Any
    next_layer: int = 0
    attention_out: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # The element-wise steps: torch unless the backend wires others (native ones on CPUs).
        self.ops = LayerOps()
        self.model = LlamaModel(args)
        tied = self.model.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tied)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def linears(self) -> list[MatmulWeight]:
        """Every module whose matmul the backend chooses (the LM head included)."""
        return [m for m in self.modules() if isinstance(m, MatmulWeight)]

    def wire(self, ops: LayerOps) -> None:
        """The backend's element-wise ops; a packed embedding's lookup then yields rows in their
        compute dtype (float32 rows need no detour through the 16-bit weight dtype)."""
        self.ops = ops
        self.model.embed_tokens.wire(ops.compute_dtype)

    def decode_tensors(
        self,
    ) -> tuple[list[dict[str, torch.Tensor | None]], dict[str, torch.Tensor]]:
        """The tensors a whole-forward kernel reads, by role: per layer (ln1, wqkv, bqkv, wo,
        ln2, wgu, wdown; q|k|v and gate|up merged, rows = output features) and for the model
        (embed, norm, lm_head). The same tensors the forward uses, not copies."""
        layers: list[dict[str, torch.Tensor | None]] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                {
                    "ln1": layer.input_layernorm.weight,
                    "wqkv": attn.qkv_proj.weight,
                    "bqkv": attn.qkv_proj.bias,
                    "wo": attn.o_proj.weight,
                    "ln2": layer.post_attention_layernorm.weight,
                    "wgu": mlp.gate_up_proj.weight,
                    "wdown": mlp.down_proj.weight,
                }
            )
        top = {
            "embed": self.model.embed_tokens.weight,
            "norm": self.model.norm.weight,
            "lm_head": self.lm_head.weight,
        }
        return layers, top

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerCache],
    ) -> torch.Tensor:
        state = self.start_forward(input_ids, positions)
        self.run_layers(state, meta, kv_caches)
        return self.model.norm(state.hidden)

    @torch.inference_mode()
    def start_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> ForwardState:
        """A forward that runs its layers in one or more `run_layers` calls."""
        ops = self.ops
        hidden = self.model.embed_tokens(input_ids)
        if ops.compute_dtype is not None:
            hidden = hidden.to(ops.compute_dtype)
        return ForwardState(hidden, ops.rope(self.model.rotary, positions, hidden.dtype))

    @torch.inference_mode()
    def run_layers(
        self,
        state: ForwardState,
        meta: AttentionMetadata,
        kv_caches: list[LayerCache],
        pause: Callable[[], bool] | None = None,
    ) -> torch.Tensor | None:
        """Run the forward's remaining layers; the final norm's output, or None when `pause`
        said to stop: a later call goes on from there. `pause` is asked between a layer's
        attention and its MLP as well as between two layers (a chat's token waited a whole
        layer past its slice: docs/admission.md, "Interleaved decodes"). The state holds all a unit reads from earlier ones (the residual stream, the
        rotary input, the attention's output); the KV of the layers attended is in the cache
        already."""
        layers = self.model.layers
        for index in range(state.next_layer, len(layers)):
            layer = layers[index]
            if state.attention_out is None:
                state.attention_out = layer.attend(
                    self.ops, state.rope, state.hidden, meta, kv_caches[index]
                )
                if pause is not None and pause():
                    return None
            state.hidden = layer.feed_forward(self.ops, state.hidden, state.attention_out)
            state.attention_out = None
            state.next_layer = index + 1
            if pause is not None and state.next_layer < len(layers) and pause():
                return None
        return self.model.norm(state.hidden)

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
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
            if not name.startswith(("model.", "lm_head.")):
                # A bare model's checkpoint (embedding models such as Qwen3-Embedding are
                # saved without the causal-LM wrapper).
                name = "model." + name
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
                    self.model.norm.weight.data.copy_(_dense(name, tensor))
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
                cast(MergedColumnLinear, layer.get_submodule(merged)).load(part, tensor, is_bias)
                loaded.add(f"{prefix}{merged}.{kind}:{part}")
            elif module_name in ("self_attn.o_proj", "mlp.down_proj"):
                cast(RowParallelLinear, layer.get_submodule(module_name)).load(tensor, is_bias)
                loaded.add(prefix + rest)
            elif module_name in ("input_layernorm", "post_attention_layernorm"):
                norm = cast(RMSNorm, layer.get_submodule(module_name))
                norm.weight.data.copy_(_dense(name, tensor))
                loaded.add(prefix + rest)
            else:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
        missing = expected - loaded
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
