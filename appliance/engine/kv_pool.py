"""The KV cache's tensors: the device pool the attention reads and writes, and the host pool
that swapped-out blocks wait in. Block ids come from the core's KV manager; this only holds and
copies the bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from appliance.layers.kv_cache import KVPair, KVStorage, LayerCache


class KVCachePool:
    """Per-layer caches (LayerCache) of the device pool and the host swap pool."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_swap_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | Sequence[torch.dtype] | KVStorage,
        device: torch.device,
        pin_host_memory: bool = False,
        zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        # One storage dtype per layer (or one for all): with kv_cache_keep_16bit some layers keep
        # the model dtype while the rest store FP8/INT8 bytes. Zeros, never empty: the torch
        # attention multiplies masked-out V rows by zero weights, and 0 * NaN garbage is NaN.
        storage = KVStorage.of(dtype, num_layers)
        if len(storage.dtypes) != num_layers or len(storage.side_heads) != num_layers:
            raise ValueError(f"KVCachePool: {len(storage.dtypes)} dtypes for {num_layers} layers")
        self.dtypes = storage.dtypes
        self.storage = storage
        token_scales = storage.token_scales or [False] * num_layers

        def layer(blocks: int, i: int, alloc: Callable[..., torch.Tensor]) -> LayerCache:
            side = storage.side_heads[i]
            main = (blocks, block_size, num_kv_heads - side, head_dim)
            apart = (blocks, block_size, side, head_dim)
            scales = (blocks, block_size, num_kv_heads - side)
            return LayerCache(
                alloc(main, storage.dtypes[i]),
                alloc(main, storage.dtypes[i]),
                side=(
                    KVPair(alloc(apart, storage.side_dtype), alloc(apart, storage.side_dtype))
                    if side
                    else None
                ),
                scales=(
                    KVPair(alloc(scales, torch.float16), alloc(scales, torch.float16))
                    if token_scales[i]
                    else None
                ),
            )

        # `zeros`: the device backend's allocation (Backend.cache_zeros: the CPU's on huge pages).
        device_zeros = zeros or (lambda s, dt: torch.zeros(s, dtype=dt, device=device))
        self.device_caches = [layer(num_blocks, i, device_zeros) for i in range(num_layers)]
        # Empty, not zeros: a swap block is only read after a whole device block was copied
        # into it, and untouched pages cost nothing (zero-filling took ~1 s per GiB at start).
        self.host_caches = [
            layer(
                num_swap_blocks,
                i,
                lambda s, dt: torch.empty(s, dtype=dt, pin_memory=pin_host_memory),
            )
            for i in (range(num_layers) if num_swap_blocks else [])
        ]

    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer's tensors (side caches included)."""
        return sum(
            t[0].numel() * t.element_size() for layer in self.device_caches for t in layer.tensors()
        )

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self._copy(mapping, self.device_caches, self.host_caches)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._copy(mapping, self.host_caches, self.device_caches)

    @staticmethod
    def _copy(
        mapping: list[tuple[int, int]],
        src: list[LayerCache],
        dst: list[LayerCache],
    ) -> None:
        if not mapping:
            return
        src_ids = torch.tensor([a for a, _ in mapping])
        dst_ids = torch.tensor([b for _, b in mapping])
        # Every tensor of a layer, side caches included: a swapped block holds all its heads.
        for s_layer, d_layer in zip(src, dst, strict=True):
            for s, d in zip(s_layer.tensors(), d_layer.tensors(), strict=True):
                d[dst_ids.to(d.device)] = s[src_ids.to(s.device)].to(d.device)
