"""The KV cache formats the attention kernels know, by name (torch-free: the layout that
`appliance plan` counts and the console shows names them too)."""

from __future__ import annotations

# cache.kv_cache_scales = "per_token": an INT8 layer whose scales are per token and KV head,
# stored in float16 tensors of the pool beside the cache (same block table, so they are counted
# in each block's bytes and swapped with it). Its own kind, so that every backend dispatches on
# it explicitly (a backend that does not know it fails instead of misreading the bytes).
PER_TOKEN_KIND = "int8_token"
