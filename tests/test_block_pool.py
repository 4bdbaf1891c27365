"""Block pool and prefix cache: exact block ids, reference counts and free-queue order on tiny
pools (block size 16), plus a property test over random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.core.block_pool import BlockPool, hash_block
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.request import Request
from appliance.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, req: Request) -> int:
    """Prefill the whole prompt as the scheduler would; returns the hit tokens."""
    hits, hit_tokens = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit_tokens, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return hit_tokens


def test_prompt_takes_blocks_and_hashes_only_full_ones() -> None:
    kv = KVCacheManager(10, BS)
    req = make_request("a", list(range(55)))
    admit(kv, req)
    blocks = req.blocks
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
    parent = None
    for i in range(3):
        parent = hash_block(parent, list(range(i * BS, (i + 1) * BS)))
        assert blocks[i].block_hash == parent


def test_shared_prefix_hits_and_raises_refs() -> None:
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("a", list(range(55))))
    b = make_request("b", list(range(48)) + [999] * 7)
    hit = admit(kv, b)
    assert hit == 48
    assert len(b.blocks) == 4
    assert [blk.ref_cnt for blk in b.blocks[:3]] == [2, 2, 2]
    assert b.blocks[3].block_id == 4  # the one new block


def test_prefix_survives_free_and_hit_leaves_free_queue() -> None:
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(55)))
    admit(kv, a)
    kv.forget(a)
    assert kv.pool.num_free_blocks == 10
    c = make_request("c", list(range(50)))
    hits, hit_tokens = kv.get_computed_blocks(c)
    assert hit_tokens == 48 and [b.block_id for b in hits] == [0, 1, 2]
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(c, 2, hits)
    # The three hit blocks left the free queue, plus one new block for the last 2 tokens.
    assert kv.pool.num_free_blocks == free_before - 3 - 1


def test_eviction_order_never_used_then_tail_then_prefix() -> None:
    kv = KVCacheManager(6, BS)
    a = make_request("a", list(range(40)))  # blocks 0,1 full (hashed), 2 partial
    admit(kv, a)
    kv.forget(a)
    # Unhashed partial block 2 is reused first, then never-used 3,4,5, then a's tail (1),
    # and a's prefix head (0) last.
    assert kv.pool.free_queue.ids() == [2, 3, 4, 5, 1, 0]
    fresh = kv.pool.get_new_blocks(5)
    assert [b.block_id for b in fresh] == [2, 3, 4, 5, 1]
    assert fresh[-1].block_hash is None  # a reused block loses its old hash
    assert kv.pool.blocks[0].block_hash is not None


def test_fully_cached_prompt_still_computes_last_token() -> None:
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("a", list(range(32))))
    again = make_request("b", list(range(32)))
    hits, hit_tokens = kv.get_computed_blocks(again)
    assert hit_tokens == 16 and len(hits) == 1


def test_different_parent_or_collision_does_not_hit() -> None:
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    tokens = list(range(BS))
    pool.cache_block(block, hash_block(None, tokens), tokens)
    assert pool.get_cached_block(hash_block(None, tokens), tokens) is block
    assert pool.get_cached_block(hash_block(12345, tokens), tokens) is None
    # A forced collision: same hash, other tokens -> no hit.
    assert pool.get_cached_block(hash_block(None, tokens), [7] * BS) is None


def test_block_filled_in_decode_is_hit_by_prompt_plus_output() -> None:
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    for t in range(100, 110):  # decode 10 tokens: block 0 fills at 16 tokens
        a.token_ids.append(t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_blocks(a)
    b = make_request("b", a.token_ids[:16] + [5, 6])
    _, hit_tokens = kv.get_computed_blocks(b)
    assert hit_tokens == 16


def test_allocation_is_atomic_when_short() -> None:
    kv = KVCacheManager(4, BS)
    admit(kv, make_request("a", list(range(40))))  # 3 blocks
    b = make_request("b", list(range(500, 540)))  # needs 3, one free
    before = (kv.pool.num_free_blocks, kv.pool.free_queue.ids())
    assert not kv.allocate_slots(b, 40)
    assert (kv.pool.num_free_blocks, kv.pool.free_queue.ids()) == before
    assert b.blocks == [] and b.num_allocated_tokens == 0


def test_allocating_never_evicts_own_hits() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(32)))
    admit(kv, a)
    kv.forget(a)  # blocks 0,1 cached and free
    b = make_request("b", list(range(32)) + list(range(900, 930)))
    hits, _ = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    # 62 tokens need 4 blocks: 2 hits + 2 new; only 2 others exist, so it fits exactly.
    assert kv.allocate_slots(b, 62 - 32, hits)
    assert sorted(blk.block_id for blk in b.blocks) == [0, 1, 2, 3]


def test_usage_counts_cached_free_as_free_and_reset_refused_in_use() -> None:
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(40)))
    admit(kv, a)
    assert kv.pool.usage() == pytest.approx(0.3)
    assert not kv.pool.reset_prefix_cache()
    kv.forget(a)
    assert kv.pool.usage() == 0.0
    assert kv.usage().cached_free == 2
    assert kv.pool.reset_prefix_cache()
    assert kv.usage().cached_free == 0


def test_swap_out_and_in_round_trip_ids() -> None:
    kv = KVCacheManager(6, BS, num_swap_blocks=4)
    a = make_request("a", list(range(40)))
    admit(kv, a)
    out = kv.swap_out(a)
    assert out is not None and len(out) == 3
    assert kv.pool.num_used_blocks == 0 and kv.usage().swap_blocks_used == 3
    assert kv.can_swap_in(a)
    back = kv.swap_in(a)
    assert [h for h, _ in back] == [h for _, h in out]
    assert kv.usage().swap_blocks_used == 0
    # A second request bigger than the swap pool cannot be swapped.
    b = make_request("b", list(range(300, 370)))
    kv.forget(a)
    admit(kv, b)
    assert kv.swap_out(b) is None


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "append", "free", "add_prefix"]),
            st.integers(0, 7),
            st.integers(1, 40),
        ),
        max_size=60,
    )
)
def test_random_operations_keep_invariants(ops: list[tuple[str, int, int]]) -> None:
    kv = KVCacheManager(12, 4)
    pool = kv.pool
    live: dict[str, Request] = {}
    counter = 0
    evicted_with_refs: list[int] = []
    original_evict = pool._evict

    def checked_evict(block):  # type: ignore[no-untyped-def]
        if block.ref_cnt != 0:
            evicted_with_refs.append(block.block_id)
        original_evict(block)

    pool._evict = checked_evict  # type: ignore[method-assign]
    shared_prefix = list(range(1000, 1012))
    for op, idx, n in ops:
        if op in ("add", "add_prefix"):
            counter += 1
            tokens = (shared_prefix if op == "add_prefix" else []) + [
                counter * 100 + i for i in range(n)
            ]
            req = make_request(f"r{counter}", tokens)
            hits, hit_tokens = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - hit_tokens, hits):
                req.num_computed_tokens = req.num_tokens
                kv.cache_blocks(req)
                live[req.request_id] = req
                if (
                    op == "add_prefix"
                    and len(live) > 1
                    and any(
                        r.token_ids[:12] == shared_prefix and r is not req for r in live.values()
                    )
                ):
                    # A repeated prefix in use by another request is always a hit.
                    assert hit_tokens >= 8
        elif op == "append" and live:
            req = list(live.values())[idx % len(live)]
            req.token_ids.append(7)
            if kv.allocate_slots(req, 1):
                req.num_computed_tokens += 1
                kv.cache_blocks(req)
            else:
                req.token_ids.pop()
        elif op == "free" and live:
            req = live.pop(list(live)[idx % len(live)])
            kv.forget(req)
        # Invariants after every operation.
        refs = sum(b.ref_cnt for b in pool.blocks)
        assert refs == sum(len(r.blocks) for r in live.values())
        usage = kv.usage()
        assert usage.slots_allocated == refs * kv.block_size
        assert usage.slots_holding_tokens == sum(r.num_allocated_tokens for r in live.values())
        referenced = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + referenced == pool.num_blocks
        assert all(pool.blocks[i].ref_cnt == 0 for i in pool.free_queue.ids())
        assert len(set(pool.free_queue.ids())) == pool.num_free_blocks
        assert pool.num_cached_free_blocks == sum(
            1 for i in pool.free_queue.ids() if pool.blocks[i].block_hash is not None
        )
    for req in live.values():
        kv.forget(req)
    assert pool.num_free_blocks == pool.num_blocks
    assert (kv.usage().slots_allocated, kv.usage().slots_holding_tokens) == (0, 0)
    assert not evicted_with_refs


def test_the_manager_keeps_no_table_per_request() -> None:
    # A request's blocks, hashes and swap blocks live on the request: the manager holds only
    # pool-wide state, so a finished request leaves nothing in it.
    kv = KVCacheManager(10, BS, num_swap_blocks=4)
    a, b = make_request("a", list(range(40))), make_request("b", list(range(20)))
    admit(kv, a)
    admit(kv, b)
    assert kv.swap_out(b) is not None and len(b.swap_blocks) == 2 and b.blocks == []
    assert [name for name, value in vars(kv).items() if isinstance(value, dict)] == []
    kv.forget(a)
    kv.forget(b)
    assert (a.blocks, a.block_hashes, b.swap_blocks) == ([], [], [])
    assert kv.usage().swap_blocks_used == 0 and kv.usage().slots_allocated == 0
