"""Decode steps of a few sequences on the CPU as one native call (kernels/cpu_decode.c); part
of the CPU backend (appliance.cpu.backend builds it).

A one-sequence decode step of the small demo model is ~270 MB of weight reads, ~8 ms at this
machine's copy bandwidth, but ~27 ms through torch: ~500 operator calls whose dispatch and
small-tensor overheads cost as much as the reads. The native forward runs every layer, the
final norm and the LM head in one OpenMP region. Larger batches and prefills stay on torch,
where oneDNN's matmuls win once a step is compute-bound.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Protocol, overload

import torch
import torch.nn.functional as F

from appliance.cpu.fused_lora import FusedShapes, lora_descriptor
from appliance.cpu.tile_weights import PACKED_FIELDS, TileDecodeWeights
from appliance.kernels import cpu_native
from appliance.layers.lora import LoraLayerFactors
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM

# Inputs of the kernel that are a few KB a layer (norms, biases): a float32 forward keeps them
# in float32, the kernel reads them in its weight dtype, so it holds its own copies of those.
SMALL_TENSORS = ("ln1", "bqkv", "ln2", "norm")

log = logging.getLogger(__name__)


class DecodeForward(Protocol):
    """What the native decode forwards (dense and packed) read of their owner."""

    args: ModelArgs
    block_size: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    layer_ptrs: torch.Tensor
    final_norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float
    scale: float
    _forward: Any


def run_decode_forward(
    d: DecodeForward,
    lm_head: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    what: str,
    lora: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One native decode call: float32 hidden [batch, hidden] in, float32 logits out; each
    token's K/V is written into its slot. `lm_head`: the head's weight or packed descriptor.
    `lora`: the dense forwards' last two arguments, (LoRA descriptor, each row's slot) or
    (None, None) for none; the packed forward takes neither."""
    batch = hidden.shape[0]
    a = d.args
    logits = torch.empty(batch, d.vocab, dtype=torch.float32)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    pos = positions.to(torch.int64).contiguous()
    slot_ids = slots.to(torch.int64).contiguous()
    shape = cpu_native.shape_vector(
        batch=batch,
        layers=a.num_layers,
        hidden=a.hidden_size,
        heads=d.heads,
        kv_heads=d.kv_heads,
        head_dim=a.head_dim,
        inter=d.inter,
        vocab=d.vocab,
        block_size=d.block_size,
        table_stride=tables.shape[1],
        threads=torch.get_num_threads(),
    )
    p = cpu_native.ptr
    rc = d._forward(
        p(shape),
        p(d.layer_ptrs),
        p(d.final_norm),
        p(lm_head),
        p(d.cos),
        p(d.sin),
        p(pos),
        p(slot_ids),
        p(tables),
        p(lens),
        ctypes.c_float(d.eps),
        ctypes.c_float(d.scale),
        p(hidden),
        p(logits),
        *((p(lora[0]), p(lora[1])) if lora is not None else ()),
    )
    if rc != 0:
        raise MemoryError(f"{what}: out of memory for its scratch buffers")
    return logits[:, : a.vocab_size]


class FusedCpuDecode:
    """Holds the pointers of every weight and KV tensor; the tensors must outlive it and never
    move (the model's parameters and the runner's device pool do neither).

    `dtype` is the kernel's weight and KV dtype (bf16 or float32); activations are float32
    inside whatever the torch forward computes in. With `tiles` (bf16 on AMX or AVX-512-BF16) the
    matrices are read from that tile-packed copy by the tile forward (cpu_decode_tiles.inc.c); how many
    rows a step may have is the plan's (appliance.cpu.plan), by path."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        dtype: torch.dtype,
        lib: ctypes.CDLL,
        tiles: TileDecodeWeights | None = None,
    ) -> None:
        args = model.args
        self.dtype = dtype
        if tiles is not None:
            assert dtype == torch.bfloat16, "the tile forward reads bf16 weights and KV"
            self._forward = lib.decode_forward_tiles_bf16
        else:
            self._forward = getattr(lib, f"decode_forward_{cpu_native.SUFFIX[dtype]}")
        self.tiles = tiles
        self.block_size = block_size
        self.args = args
        layers, top = model.decode_tensors()
        self._copies: list[torch.Tensor] = []
        self.embed = self._own(top["embed"], "embed")
        self.lm_head = tiles.lm_head if tiles else self._own(top["lm_head"], "lm_head")
        self.final_norm = self._own(top["norm"], "norm")
        # float32 tables: the torch path rounds cos/sin to the model dtype; float32 is closer
        # to the reference and costs nothing here.
        self.cos = model.model.rotary.cos.float().contiguous()
        self.sin = model.model.rotary.sin.float().contiguous()
        self.eps = float(model.model.norm.eps)
        first = model.model.layers[0].self_attn
        self.scale = float(first.attn.scale)
        self.heads, self.kv_heads = first.num_heads, first.num_kv_heads
        self.inter = model.model.layers[0].mlp.inter
        rows = []
        for i, (tensors, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
            named = {**tensors, "k_cache": k_cache, "v_cache": v_cache}
            if tiles is not None:
                named.update({name: tiles.layers[i][name] for name in PACKED_FIELDS})
            # A quantized cache stores bytes, so the dtype check refuses it too.
            rows.append(
                [
                    self._checked(name, self._own(named[name], name))
                    for name in cpu_native.LAYER_FIELDS
                ]
            )
        for name, t in (
            ("embed", self.embed),
            ("lm_head", self.lm_head),
            ("norm", self.final_norm),
        ):
            self._checked(name, t)
        self.layer_ptrs = torch.tensor(rows, dtype=torch.int64)
        self.vocab = tiles.vocab if tiles else self.lm_head.shape[0]
        head_dim = args.head_dim
        self.shapes = FusedShapes(
            hidden=args.hidden_size,
            qkv=(self.heads + 2 * self.kv_heads) * head_dim,
            q=self.heads * head_dim,
            inter=self.inter,
        )
        # The LoRA slot factors' descriptor once bound (appliance.cpu.fused_lora), and the
        # factors it points into, kept alive with it.
        self.lora_table: torch.Tensor | None = None
        self._lora_layers: list[LoraLayerFactors] = []

    def bind_lora(self, layers: list[LoraLayerFactors], slots: int) -> bool:
        """Read the LoRA slot pool's factors from now on (steps with adapter rows stay on this
        forward); False, with the reason logged, when their dtype or shapes do not fit it. The
        tile forward adds the updates on AMX tiles where the factors have their tile copy
        (appliance.cpu.lora_tiles)."""
        try:
            self.lora_table = lora_descriptor(
                layers, slots, self.dtype, self.shapes, tiles=self.tiles is not None
            )
        except ValueError as exc:
            log.info("LoRA steps run the torch forward, not the native decode: %s", exc)
            return False
        self._lora_layers = layers
        return True

    @overload
    def _own(self, t: torch.Tensor, name: str) -> torch.Tensor: ...
    @overload
    def _own(self, t: torch.Tensor | None, name: str) -> torch.Tensor | None: ...
    def _own(self, t: torch.Tensor | None, name: str) -> torch.Tensor | None:
        """The tensor itself, or for a small one in another dtype a copy this object keeps."""
        if t is None or t.dtype == self.dtype or name not in SMALL_TENSORS:
            return t
        copy = t.detach().to(self.dtype).contiguous()
        self._copies.append(copy)
        return copy

    def _checked(self, name: str, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        if (
            t.dtype != self.dtype
            or not t.is_contiguous()
            or t.device.type != "cpu"
            or t.numel() == 0
        ):
            raise ValueError(
                f"native decode: {name} must be a contiguous, non-empty CPU {self.dtype} tensor "
                f"(got {t.dtype}, shape {tuple(t.shape)})"
            )
        return t.data_ptr()

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
        K/V into its slot, as the torch forward does. `lora_slots`: each row's adapter slot
        (int32, -1: the base model), once `bind_lora` has succeeded; None: no adapter row."""
        hidden = F.embedding(input_ids, self.embed).float().contiguous()
        lora: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if lora_slots is not None:
            if self.lora_table is None:
                raise RuntimeError("native decode: adapter rows but no LoRA factors bound")
            if lora_slots.dtype != torch.int32 or lora_slots.shape != (hidden.shape[0],):
                raise ValueError(
                    f"native decode: lora_slots must be {hidden.shape[0]} int32 slots "
                    f"(got {lora_slots.dtype}, shape {tuple(lora_slots.shape)})"
                )
            lora = (self.lora_table, lora_slots.contiguous())
        return run_decode_forward(
            self,
            self.lm_head,
            hidden,
            positions,
            slots,
            block_tables,
            seq_lens,
            "native decode",
            lora,
        )
