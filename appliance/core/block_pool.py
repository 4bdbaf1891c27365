"""The pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

Block ids are plain integers; tensors live in the runner. A freed block keeps its hash and
goes to the tail of the free queue, so it can still be hit until it is reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BlockHash = int


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: object = None) -> int:
    # Python's tuple-of-int hash is deterministic across processes (no hash randomisation for
    # ints); a collision is caught by the token check in `BlockPool.get_cached_block`.
    return hash((parent, tuple(token_ids), extra))


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Tokens of a cached (full, hashed) block: guards against hash collisions.
        self.token_ids: tuple[int, ...] = ()
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list: O(1) popleft, append and removal from the middle."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def ids(self) -> list[int]:
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # Unreferenced blocks that still hold a hit-able prefix.
        self.num_cached_free_blocks = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached ones included: they can be evicted)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def state_string(self) -> str:
        """One character per block id: U referenced, C free but hit-able, F free."""
        return "".join(
            "U" if b.ref_cnt else ("C" if b.block_hash is not None else "F") for b in self.blocks
        )

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    # -- state changes ---------------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling unreferenced ones off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > self.free_queue.num_free:
            raise RuntimeError(f"asked for {count} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full block whose KV has been written."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            # Same content computed twice (two requests prefilling at once): keep the first.
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero go to the free queue's tail in order,
        so the caller passes the ones to evict first (a request's tail) first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing to hit later: reuse it before any cached block.
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    self.num_cached_free_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self.cached.clear()
        self.num_cached_free_blocks = 0
        return True
