"""Block tables over the block pool: prefix lookups, atomic allocation, caching of filled
blocks, freeing, and the host swap pool. Block ids only; the runner moves the bytes.

What belongs to one request (its blocks, its hash chain, its swap blocks) is kept on the
request itself (core/request.py), so finishing a request leaves nothing behind here; this
manager keeps only pool-wide state and running totals."""

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
        self.num_swap_blocks = num_swap_blocks
        self.swap_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Running totals over every request's table (slot utilisation): table entries (a
        # shared block counts once per request) and the tokens the allocations cover.
        self._table_blocks = 0
        self._table_tokens = 0

    # -- the pool, as the scheduler needs it -----------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage_fraction(self) -> float:
        return self.pool.usage()

    # -- prefix cache ----------------------------------------------------------------------------
    def _hashes(self, request: Request) -> list[int]:
        """Hash chain over the request's full blocks, extended as tokens arrive."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # The adapter is an extra key: the same tokens under two adapters never share KV.
            extra = request.lora_name or None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], extra))
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
        have = len(request.blocks) + num_hit_blocks
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
        blocks = request.blocks
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            request.num_cached_blocks = len(blocks)
        blocks.extend(self.pool.get_new_blocks(needed))
        self._table_blocks += len(hits) + needed
        covered = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        self._set_covered(request, covered)
        return True

    def _set_covered(self, request: Request, tokens: int) -> None:
        self._table_tokens += tokens - request.num_allocated_tokens
        request.num_allocated_tokens = tokens

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly filled blocks (their KV is written) for prefix hits."""
        if not self.enable_caching:
            return
        blocks = request.blocks
        if not blocks:
            return
        bs = self.block_size
        full = min(request.num_computed_tokens // bs, len(blocks))
        start = request.num_cached_blocks
        if full <= start:
            return
        hashes = self._hashes(request)
        tokens = request.token_ids
        for i in range(start, full):
            self.pool.cache_block(blocks[i], hashes[i], tokens[i * bs : (i + 1) * bs])
        request.num_cached_blocks = full

    def block_ids(self, request: Request, start: int = 0) -> list[int]:
        return [b.block_id for b in request.blocks[start:]]

    def free(self, request: Request) -> None:
        """Release the request's device blocks, tail first so shared prefixes are evicted last."""
        self.pool.free_blocks(reversed(request.blocks))
        self._table_blocks -= len(request.blocks)
        request.blocks = []
        request.num_cached_blocks = 0
        self._set_covered(request, 0)

    def trim(self, request: Request) -> int:
        """Free the blocks past the request's computed tokens (the blocks that held only the
        rejected drafts of a speculative step); returns how many. Never cached: a block enters
        the prefix cache only once full of computed tokens."""
        keep = -(-request.num_computed_tokens // self.block_size)
        extra = request.blocks[keep:]
        if extra:
            self.pool.free_blocks(reversed(extra))
            del request.blocks[keep:]
            self._table_blocks -= len(extra)
            request.num_cached_blocks = min(request.num_cached_blocks, keep)
        self._set_covered(request, request.num_computed_tokens)
        return len(extra)

    def forget(self, request: Request) -> None:
        """Everything about a finished request: device blocks, swap blocks, hashes."""
        self.free(request)
        self.free_swap(request)
        request.block_hashes = []

    # -- swap ------------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host swap blocks: (device id, host id) pairs to copy
        before this step's forward; None when the swap pool cannot take them."""
        blocks = request.blocks
        if len(blocks) > len(self.swap_free):
            return None
        host = [self.swap_free.pop() for _ in blocks]
        request.swap_blocks = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host, strict=True)]
        self.free(request)
        return mapping

    def can_swap_in(self, request: Request) -> bool:
        return len(request.swap_blocks) <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """(host id, device id) pairs to copy back; the caller checked `can_swap_in`."""
        host, request.swap_blocks = request.swap_blocks, []
        device = self.pool.get_new_blocks(len(host))
        request.blocks = device
        request.num_cached_blocks = 0
        self._table_blocks += len(device)
        self._set_covered(request, request.num_computed_tokens)
        self.swap_free.extend(reversed(host))
        return [(h, d.block_id) for h, d in zip(host, device, strict=True)]

    def free_swap(self, request: Request) -> None:
        host, request.swap_blocks = request.swap_blocks, []
        if host:
            self.swap_free.extend(reversed(host))

    # -- figures ---------------------------------------------------------------------------------
    def usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(
            num_blocks=pool.num_blocks,
            used=pool.num_used_blocks,
            cached_free=pool.num_cached_free_blocks,
            free=pool.num_free_blocks - pool.num_cached_free_blocks,
            usage=pool.usage(),
            slots_holding_tokens=self._table_tokens,
            slots_allocated=self._table_blocks * self.block_size,
            swap_blocks_total=self.num_swap_blocks,
            swap_blocks_used=self.num_swap_blocks - len(self.swap_free),
        )
