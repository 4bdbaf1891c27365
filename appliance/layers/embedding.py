"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.layers.linear import MatmulWeight
from appliance.layers.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        size = tp_size()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // size)
        self.start = tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)

    def load(self, tensor: torch.Tensor) -> None:
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self._matmul(hidden, None)
        logits = all_gather_last_dim(local)
        return logits[..., : self.vocab_size]

    def load(self, tensor: torch.Tensor) -> None:
        assert self.tied is None
        self.embedding.load(tensor)
