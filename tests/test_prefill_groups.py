"""A prefill batch on the CPU's torch path attended in groups of sequences
(appliance/cpu/prefill_groups.py): the same result as the reference's one padded call, and the
groups it picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from appliance.kernels.paged_attention import paged_attention, quantize

from appliance.cpu.attention import CPU_TORCH_ATTENTION, cpu_attention
from appliance.cpu.prefill_groups import CALL_PAIRS, grouped_prefill_attention, prefill_groups

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 16


def test_uniform_prompts_stay_one_padded_call() -> None:
    assert prefill_groups([128] * 64, [128] * 64) == [list(range(64))]
    assert prefill_groups([64, 60, 64], [64, 60, 64]) == [[0, 1, 2]]


def test_a_long_chunk_goes_alone_beside_short_prompts() -> None:
    # A summary's second chunk (476 tokens after 1,024 cached) beside the next one's head.
    assert prefill_groups([476, 548], [1500, 548]) == [[0], [1]]
    # A chunk beside three chats' prompts: the chats stay padded together.
    assert prefill_groups([60, 900, 54, 70], [60, 1400, 54, 70]) == [[1], [0, 2, 3]]


def test_a_call_is_not_split_off_for_fewer_pairs_than_it_costs() -> None:
    # Splitting 33 x 33 off a 32 x 32 prompt saves 32 * 33 * 33 - (33 * 33 + 32 * 32) pairs.
    saved = 2 * 33 * 33 - (33 * 33 + 32 * 32)
    assert saved < CALL_PAIRS
    assert prefill_groups([33, 32], [33, 32]) == [[0, 1]]


def _batch(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random queries and a random paged context of each sequence, in scattered blocks."""
    per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return {
        "query": torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(dtype),
        "k_cache": torch.randn(shape, generator=gen).to(dtype),
        "v_cache": torch.randn(shape, generator=gen).to(dtype),
        "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0),
    }


BATCHES = [
    ([476, 548], [1500, 548]),  # a chunk after a cached prefix, the next prompt's head
    ([60, 300, 5, 70], [60, 700, 5, 90]),  # a chunk amid short prompts, one after a prefix
    ([1, 200], [40, 200]),  # a one-token chunk (a prompt's last) beside a longer one
]


@pytest.mark.parametrize(("query_lens", "seq_lens"), BATCHES)
def test_groups_give_the_reference_result(query_lens: list[int], seq_lens: list[int]) -> None:
    assert len(prefill_groups(query_lens, seq_lens)) > 1, "the case must split"
    b = _batch(query_lens, seq_lens, torch.float32, torch.Generator().manual_seed(0))
    args = (b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"])
    shape = (0.25, max(query_lens), max(seq_lens))
    ref = paged_attention(b["query"], *args, *shape)
    out = grouped_prefill_attention(b["query"], *args, *shape)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_groups_pass_each_sequences_fresh_kv_over_a_quantized_cache() -> None:
    """An FP8 cache: the reference reads each chunk's own K/V as computed (key/value), which the
    groups must slice to their own rows."""
    query_lens, seq_lens = [60, 300, 5, 70], [60, 700, 5, 90]
    gen = torch.Generator().manual_seed(1)
    b = _batch(query_lens, seq_lens, torch.float32, gen)
    scale = torch.full((KV_HEADS,), 0.05)
    k_cache = quantize(b["k_cache"], "fp8_e4m3", scale)
    v_cache = quantize(b["v_cache"], "fp8_e4m3", scale)
    rows = sum(query_lens)
    key = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen)
    args = (k_cache, v_cache, b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.25)
    tail = (max(query_lens), max(seq_lens), "fp8_e4m3", scale, scale, key, value)
    ref = paged_attention(b["query"], *args, *tail)
    out = grouped_prefill_attention(b["query"], *args, *tail)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The fresh K/V matter: without them the chunks read their rounded bytes instead.
    stale = grouped_prefill_attention(b["query"], *args, *tail[:5])
    assert (stale - ref).abs().max() > 1e-3


def test_the_cpu_torch_pair_groups_its_prefills() -> None:
    assert cpu_attention(native=False, native_prefill=False) is CPU_TORCH_ATTENTION
    assert CPU_TORCH_ATTENTION.paged_attention is grouped_prefill_attention


def test_engine_output_with_split_prefill_steps_matches_transformers(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt's chunk beside short prompts in one step (each split off on its own):
    greedy output as transformers gives each prompt alone."""
    from appliance.cpu import prefill_groups as module
    from tests.test_engine_exact import engine_for, greedy, hf_reference

    splits: list[list[list[int]]] = []

    def recording(query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
        groups = prefill_groups(query_lens, seq_lens)
        if len(groups) > 1:
            splits.append(groups)
        return groups

    monkeypatch.setattr(module, "prefill_groups", recording)
    # Steps of 256 tokens: the long prompt's chunks after its cached part, then its tail beside
    # the short prompts' whole ones.
    engine = engine_for(
        tiny_model_dir, scheduler__max_num_batched_tokens=256, cache__block_size=BLOCK
    )
    vocab = engine.loaded.args.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (600, 40, 9, 33)]
    results = engine.generate(prompts, greedy(16))
    assert splits, "no step split its prefills"
    expected = hf_reference(str(tiny_model_dir), tuple(map(tuple, prompts)), 16)
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens) diverged"
