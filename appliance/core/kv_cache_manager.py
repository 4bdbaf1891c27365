"""Per-request block tables over the block pool: prefix lookups, atomic allocation, caching of
filled blocks, freeing, and the host swap pool. Block ids only; the runner moves the bytes."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.block_pool import BlockPool, KVBlock, hash_block
from appliance.core.request import Request


@dataclass
class KVUsage:
    num_blocks: int
    used: int
    cached_free: int
    free: int
    usage: float
    slots_holding_tokens: int
    slots_allocated: int
    swap_blocks_total: int
    swap_blocks_used: int

    @property
    def slot_utilisation(self) -> float:
        return self.slots_holding_tokens / self.slots_allocated if self.slots_allocated else 1.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_swap_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[int]] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Tokens each request's allocation covers (slot utilisation).
        self.req_slots: dict[str, int] = {}
        self.num_swap_blocks = num_swap_blocks
        self.swap_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.req_swap: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- prefix cache ----------------------------------------------------------------------------
    def _hashes(self, request: Request) -> list[int]:
        """Hash chain over the request's full blocks, extended as tokens arrive."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix, never covering the last token (its logits must be computed)."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        hashes = self._hashes(request)
        limit = (request.num_tokens - 1) // bs
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(hashes[:limit]):
            block = self.pool.get_cached_block(block_hash, request.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def record_prefix_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request that waits is looked up every step,
        but counted once, as vLLM's prefix_cache_queries/hits do)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        total = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        have = len(self.req_blocks.get(request.request_id, ())) + num_hit_blocks
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(
        self, request: Request, num_new_tokens: int, hit_blocks: list[KVBlock] | None = None
    ) -> bool:
        hits = hit_blocks or []
        # Hit blocks nobody references sit in the free queue: taking them uses free capacity.
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        needed = self.blocks_needed(request, num_new_tokens, len(hits))
        return needed <= self.pool.num_free_blocks - evictable_hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Blocks for `num_new_tokens` more tokens (after the hits). All or nothing."""
        hits = hit_blocks or []
        if not self.can_allocate(request, num_new_tokens, hits):
            return False
        needed = self.blocks_needed(request, num_new_tokens, len(hits))
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self.num_cached_blocks[rid] = len(blocks)
        blocks.extend(self.pool.get_new_blocks(needed))
        self.num_cached_blocks.setdefault(rid, 0)
        self.req_slots[rid] = (
            request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        )
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly filled blocks (their KV is written) for prefix hits."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        bs = self.block_size
        full = min(request.num_computed_tokens // bs, len(blocks))
        start = self.num_cached_blocks.get(rid, 0)
        if full <= start:
            return
        hashes = self._hashes(request)
        tokens = request.token_ids
        for i in range(start, full):
            self.pool.cache_block(blocks[i], hashes[i], tokens[i * bs : (i + 1) * bs])
        self.num_cached_blocks[rid] = full

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Release the request's device blocks, tail first so shared prefixes are evicted last."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(rid, None)
        self.req_slots.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Everything about a finished request: device blocks, swap blocks, hashes."""
        self.free(request)
        self.free_swap(request)
        self.req_hashes.pop(request.request_id, None)

    # -- swap ------------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host swap blocks: (device id, host id) pairs to copy
        before this step's forward; None when the swap pool cannot take them."""
        blocks = self.req_blocks.get(request.request_id, [])
        if len(blocks) > len(self.swap_free):
            return None
        host = [self.swap_free.pop() for _ in blocks]
        self.req_swap[request.request_id] = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host, strict=True)]
        self.free(request)
        return mapping

    def can_swap_in(self, request: Request) -> bool:
        return len(self.req_swap.get(request.request_id, ())) <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """(host id, device id) pairs to copy back; the caller checked `can_swap_in`."""
        rid = request.request_id
        host = self.req_swap.pop(rid)
        device = self.pool.get_new_blocks(len(host))
        self.req_blocks[rid] = device
        self.num_cached_blocks[rid] = 0
        self.req_slots[rid] = request.num_computed_tokens
        self.swap_free.extend(reversed(host))
        return [(h, d.block_id) for h, d in zip(host, device, strict=True)]

    def free_swap(self, request: Request) -> None:
        host = self.req_swap.pop(request.request_id, None)
        if host:
            self.swap_free.extend(reversed(host))

    # -- figures ---------------------------------------------------------------------------------
    def usage(self) -> KVUsage:
        pool = self.pool
        allocated = sum(len(b) for b in self.req_blocks.values()) * self.block_size
        return KVUsage(
            num_blocks=pool.num_blocks,
            used=pool.num_used_blocks,
            cached_free=pool.num_cached_free_blocks,
            free=pool.num_free_blocks - pool.num_cached_free_blocks,
            usage=pool.usage(),
            slots_holding_tokens=sum(self.req_slots.values()),
            slots_allocated=allocated,
            swap_blocks_total=self.num_swap_blocks,
            swap_blocks_used=self.num_swap_blocks - len(self.swap_free),
        )
