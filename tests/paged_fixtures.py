"""Random paged KV contexts and one-token-a-row decode metadata, for the tests that hold a
fused native decode to the torch forward on the same step (AMX, LoRA, drafting rows)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from appliance.layers.attention import AttentionMetadata, PagedBatch


def fill_random_kv(caches: Iterable[Any], gen: torch.Generator) -> None:
    """Every layer's K and V cache filled with N(0, 1) values in the cache's dtype."""
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=gen).to(c.k.dtype))
        c.v.copy_(torch.randn(c.v.shape, generator=gen).to(c.v.dtype))


def decode_metadata(
    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> AttentionMetadata:
    """The torch forward's metadata of a decode-only step: one token a row, each row with its
    own block table and length."""
    rows = int(lens.shape[0])
    return AttentionMetadata(
        slot_mapping=slots,
        decode=PagedBatch(tables, lens, torch.arange(rows + 1), 1, int(lens.max()), rows),
        prefill=None,
    )
