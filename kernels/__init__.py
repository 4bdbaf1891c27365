"""Attention kernels: torch reference / CPU path (`paged_attention`) and Triton (CUDA).

Importing this package does not import triton; `get_attention_backend` does, for CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AttentionBackend = tuple[Callable[..., None], Callable[..., torch.Tensor]]


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    """(write_kv, paged_attention) for ``device``: Triton kernels on CUDA, torch elsewhere.

    Both pairs share the signatures of `paged_attention.write_kv` and
    `paged_attention.paged_attention`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        from .triton_attention import paged_attention_triton, write_kv_triton

        return write_kv_triton, paged_attention_triton
    from .paged_attention import paged_attention, write_kv

    return write_kv, paged_attention

