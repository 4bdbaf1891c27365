"""Decode steps of a few sequences over packed weights as one native call
(`qdecode_forward_*` in kernels/cpu_quant.c): the fused decode of appliance.cpu.fused_decode
with every linear, the LM head included, read as packed 4/8-bit bytes. This is where a
quantized model's one-at-a-time decode gains: a step reads a quarter (Q4) or half (INT8) of
the bytes of the 16-bit weights, and it is bound by that read.
"""

from __future__ import annotations

import ctypes

import torch

from appliance.cpu.fused_decode import run_decode_forward
from appliance.kernels import cpu_native, cpu_quant
from appliance.kernels.quant_weight import QuantWeight
from appliance.layers.lora import LoraLayerFactors
from appliance.models.llama import LlamaForCausalLM


class QuantFusedCpuDecode:
    """Holds pointers to every packed weight, norm and KV tensor (none may move or be freed
    while it lives). `dtype`: the norms' and the KV cache's dtype (bf16 or float32)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        dtype: torch.dtype,
        lib: ctypes.CDLL,
        act8: bool = False,
    ) -> None:
        self.dtype = dtype
        self.act8 = act8
        self.args = model.args
        self.block_size = block_size
        self._forward = getattr(lib, f"qdecode_forward_{cpu_native.SUFFIX[dtype]}")
        self._keep: list[torch.Tensor] = []
        layers = model.model.layers
        rows = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            named = {
                "ln1": self._small(layer.input_layernorm.weight).data_ptr(),
                "wqkv": self._desc(attn.qkv_proj.quant, "qkv_proj"),
                "bqkv": self._hold(bias.detach().float().contiguous()) if bias is not None else 0,
                "wo": self._desc(attn.o_proj.quant, "o_proj"),
                "ln2": self._small(layer.post_attention_layernorm.weight).data_ptr(),
                "wgu": self._desc(mlp.gate_up_proj.quant, "gate_up_proj"),
                "wdown": self._desc(mlp.down_proj.quant, "down_proj"),
                "k_cache": self._cache(k_cache),
                "v_cache": self._cache(v_cache),
            }
            rows.append([named[name] for name in cpu_quant.QLAYER_FIELDS])
        self.layer_ptrs = torch.tensor(rows, dtype=torch.int64)
        self.final_norm = self._small(model.model.norm.weight)
        head = self._need(model.lm_head.quant, "lm_head")
        self.lm_head_desc = cpu_quant.descriptor(head, act8)
        # Every matrix in row tiles (int8 activations): the backend lets wider steps in.
        self.tiled = head.tile_rows != 1 and all(
            self._need(lin.quant, "a linear").tile_rows != 1
            for layer in layers
            for lin in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )
        self.vocab = head.out_features
        self.embedding = model.model.embed_tokens
        self.cos = model.model.rotary.cos.float().contiguous()
        self.sin = model.model.rotary.sin.float().contiguous()
        self.eps = float(model.model.norm.eps)
        first = layers[0].self_attn
        self.scale = float(first.attn.scale)
        self.heads, self.kv_heads = first.num_heads, first.num_kv_heads
        self.inter = layers[0].mlp.inter

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Every linear and the LM head packed (a GGUF file with some dense linears runs the
        layer-by-layer path instead)."""
        for layer in model.model.layers:
            for lin in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                if lin.quant is None:
                    return False
        return model.lm_head.quant is not None

    @staticmethod
    def _need(w: QuantWeight | None, name: str) -> QuantWeight:
        if w is None:
            raise ValueError(f"quantized native decode: {name} is not packed")
        return w

    def _hold(self, t: torch.Tensor) -> int:
        self._keep.append(t)
        return t.data_ptr()

    def _desc(self, w: QuantWeight | None, name: str) -> int:
        return self._hold(cpu_quant.descriptor(self._need(w, name), self.act8))

    def _small(self, t: torch.Tensor) -> torch.Tensor:
        copy = t.detach().to(self.dtype).contiguous()
        self._keep.append(copy)
        return copy

    def _cache(self, t: torch.Tensor) -> int:
        if t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"quantized native decode: the KV cache must be a contiguous CPU "
                f"{self.dtype} tensor (got {t.dtype})"
            )
        return t.data_ptr()

    def bind_lora(self, layers: list[LoraLayerFactors], slots: int) -> bool:
        """The packed forward (kernels/cpu_quant.c) adds no LoRA updates: a step with adapter
        rows over a quantized base runs the torch forward (its packed matmuls plus the
        per-linear updates), steps of base rows only stay here."""
        return False

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode token per sequence -> float32 logits [batch, vocab]; writes each token's
        K/V into its slot. No adapter rows (`bind_lora` refuses them)."""
        if lora_slots is not None:
            raise RuntimeError(
                "quantized native decode: adapter rows reached a forward without LoRA"
            )
        table = self.embedding.quant
        # A packed table is dequantized straight to float32 (the lookup would round to the
        # model dtype first).
        hidden = (
            cpu_quant.dequant_rows(table, input_ids)
            if table is not None
            else self.embedding(input_ids).float().contiguous()
        )
        return run_decode_forward(
            self,
            self.lm_head_desc,
            hidden,
            positions,
            slots,
            block_tables,
            seq_lens,
            "quantized native decode",
        )
