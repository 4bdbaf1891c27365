"""A prefill batch through the torch reference in groups of sequences, one padded SDPA call a
group.

The reference attends a batch of prefills in one call over a padded grid: every sequence's
queries padded to the longest chunk, its keys to the longest context, under a boolean mask that
SDPA cannot skip. A summary's chunk beside the next summary's head, or beside a chat's prompt,
pads the short one to the chunk's grid; uniform prompts are the padded call's own case
(measured: docs/benchmarks.md, "Sapphire Rapids, Dec 5, noon"). So a sequence goes alone when
the pairs it saves the group outweigh what one more call costs; the rest stay padded together."""

from __future__ import annotations

import torch

from appliance.kernels.paged_attention import paged_attention

# What one more SDPA call costs, in (query, key) pairs of a padded grid: ~55 us a call against
# ~13 ns a pair of the small shape's 9 heads (the measurements above).
CALL_PAIRS = 8192


def _grid(members: list[int], query_lens: list[int], seq_lens: list[int]) -> int:
    """Pairs of the padded grid of one call over `members`."""
    if not members:
        return 0
    longest_query = max(query_lens[i] for i in members)
    longest_context = max(seq_lens[i] for i in members)
    return len(members) * longest_query * longest_context


def prefill_groups(query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """The sequences (indexes into the batch) of each call, in ascending order within a group:
    the largest grids peeled off one by one, while going alone saves the rest's padding more
    pairs than a call costs; the remainder in one group."""
    rest = sorted(range(len(query_lens)), key=lambda i: -query_lens[i] * seq_lens[i])
    alone: list[list[int]] = []
    while len(rest) > 1:
        biggest, others = rest[0], rest[1:]
        split = query_lens[biggest] * seq_lens[biggest] + _grid(others, query_lens, seq_lens)
        if split + CALL_PAIRS >= _grid(rest, query_lens, seq_lens):
            break
        alone.append([biggest])
        rest = others
    return alone + [sorted(rest)]


def grouped_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention's result, with a prefill batch attended in prefill_groups' calls."""
    batch = seq_lens.shape[0]
    if max_query_len > 1 and batch > 1:
        bounds: list[int] = query_start_loc.tolist()
        query_lens = [bounds[i + 1] - bounds[i] for i in range(batch)]
        groups = prefill_groups(query_lens, seq_lens.tolist())
        if len(groups) > 1:
            out = torch.empty_like(query)
            for members in groups:
                rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in members])
                lens = [query_lens[i] for i in members]
                index = torch.tensor(members)
                out[rows] = paged_attention(
                    query[rows],
                    k_cache,
                    v_cache,
                    block_tables[index],
                    seq_lens[index],
                    torch.tensor([0, *lens]).cumsum(0).to(query_start_loc.dtype),
                    scale,
                    max(lens),
                    int(seq_lens[index].max()),
                    kv_cache_dtype,
                    k_scale,
                    v_scale,
                    None if key is None else key[rows],
                    None if value is None else value[rows],
                )
            return out
    return paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len,
        max_seq_len,
        kv_cache_dtype,
        k_scale,
        v_scale,
        key,
        value,
    )
