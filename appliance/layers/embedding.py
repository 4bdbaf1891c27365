"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels.quant_weight import QuantWeight, dequantize_rows
from appliance.layers.linear import MatmulWeight
from appliance.layers.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        size = tp_size()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // size)
        self.start = tp_rank() * self.per_rank
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        # A quantized table (GGUF's token_embd, or INT8 of a tied LM head): the lookup
        # dequantizes only the rows asked for; `weight` then stays empty (its dtype is the
        # lookup's output dtype).
        self.quant: QuantWeight | None = None
        # The lookup's output dtype for a packed table (the backend's compute dtype, `wire`;
        # None: the weight's dtype).
        self.quant_out_dtype: torch.dtype | None = None

    def wire(self, quant_out_dtype: torch.dtype | None) -> None:
        self.quant_out_dtype = quant_out_dtype

    def expect_quantized(self) -> None:
        self.weight = nn.Parameter(torch.empty(0, device=self.weight.device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            rows = dequantize_rows(self.quant, ids.reshape(-1))
            dtype = self.quant_out_dtype or self.weight.dtype
            return rows.to(dtype).view(*ids.shape, self.hidden_size)
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)

    def load(self, tensor: torch.Tensor | QuantWeight) -> None:
        if isinstance(tensor, QuantWeight):
            assert tp_size() == 1, "quantized embeddings run at tensor_parallel_size 1"
            self.quant = tensor
            return
        if self.weight.numel() == 0:
            self.weight.data = torch.zeros(self.per_rank, self.hidden_size, dtype=tensor.dtype)
        piece = tensor[self.start : self.start + self.per_rank]
        self.weight.data[: piece.shape[0]].copy_(piece)


class ParallelLMHead(MatmulWeight):
    def __init__(
        self, vocab_size: int, hidden_size: int, tied: VocabParallelEmbedding | None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied
        if tied is None:
            self.embedding = VocabParallelEmbedding(vocab_size, hidden_size)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # The embedding's (tied or own): its lookup and the native decode read it, so the CPU
        # backend's matmul copy never replaces it.
        return (self.tied if self.tied is not None else self.embedding).weight

    @property
    def quant(self) -> QuantWeight | None:  # type: ignore[override]
        return (self.tied if self.tied is not None else self.embedding).quant

    def expect_quantized(self) -> None:
        if self.tied is None:
            self.embedding.expect_quantized()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self._matmul(hidden, None)
        logits = all_gather_last_dim(local)
        return logits[..., : self.vocab_size]

    def load(self, tensor: torch.Tensor | QuantWeight) -> None:
        assert self.tied is None
        self.embedding.load(tensor)
