"""The native prefill attention (kernels/cpu_prefill_attention.inc.c; appliance.cpu.attention
dispatches bf16 prefill chunks to it where the build has AVX-512-BF16): a chunk's causal
attention over its sequence's paged cache against the torch reference (SDPA over the gathered
context, kernels/paged_attention.py) for chunks at the start of a prompt and after cached
context, key counts off the 16-key tiles and the 64-key chunks, GQA groups of 1, 3 and 4,
head sizes 32, 64 and 128, blocks of 16 and 32 tokens, scattered block tables; a step of several
sequences through the CPU backend's dispatch; and what it refuses."""

from __future__ import annotations

import pytest
import torch
from appliance.kernels import cpu_native
from appliance.kernels.paged_attention import paged_attention

from appliance.cpu.attention import cpu_paged_attention

needs_kernel = pytest.mark.skipif(
    not cpu_native.prefill_attention_available(torch.empty(0, dtype=torch.bfloat16), 64),
    reason="the native prefill attention needs a build for AVX-512-BF16 (this CPU has none)",
)
# Relative error (Frobenius) against SDPA: both compute in float32 from bf16 inputs; the
# kernel rounds the probabilities to bf16 for its PV products, as SDPA's bf16 path does
# (measured 0.06-0.2%); a wrong mask or softmax is off by tens of percent.
RTOL = 1e-2


def paged(
    gen: torch.Generator, length: int, kv_heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of random K/V with spare blocks, and a scattered table for `length` tokens."""
    blocks = -(-length // block_size)
    total = blocks + 7
    shape = (total, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return k, v, torch.randperm(total, generator=gen)[:blocks]


@needs_kernel
@pytest.mark.parametrize(
    ("n", "start", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (1, 0, 9, 3, 64, 16),  # one token
        (5, 0, 9, 3, 64, 16),
        (37, 0, 9, 3, 64, 16),  # queries off the 16-token items
        (16, 100, 9, 3, 64, 16),  # after cached context, keys off the tiles
        (70, 131, 8, 8, 32, 32),  # no GQA, head size 32, blocks of 32
        (45, 200, 8, 2, 128, 16),  # groups of 4, head size 128
        (300, 700, 9, 3, 64, 32),  # many 64-key chunks, the diagonal mid-chunk
    ],
)
def test_native_prefill_attention_matches_sdpa(
    n: int, start: int, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + start)
    length = start + n
    k, v, table = paged(gen, length, kv_heads, head_dim, block_size)
    q = torch.randn(n, heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim**-0.5
    want = paged_attention(
        q, k, v, table[None], torch.tensor([length]), torch.tensor([0, n]), scale, n, length
    ).float()
    got = cpu_native.prefill_attention(q, k, v, table, start, scale).float()
    assert got.shape == want.shape
    err = float((got - want).norm() / want.norm())
    assert err < RTOL, err
    # Each query attends to its own position and before only: the last key's value moves
    # only the last query's output.
    k2, v2 = k.clone(), v.clone()
    last = int(table[(length - 1) // block_size]) * block_size + (length - 1) % block_size
    v2.view(-1, kv_heads, head_dim)[last] += 100.0
    moved = cpu_native.prefill_attention(q, k2, v2, table, start, scale).float()
    changed = (moved - got).abs().amax(dim=(1, 2)) > 1e-3
    assert changed.tolist() == [False] * (n - 1) + [True]


@needs_kernel
def test_a_step_of_several_prefills_takes_the_native_kernel_per_sequence() -> None:
    """The CPU backend's dispatch: three sequences' chunks in one step (one at the start of its
    prompt, two after cached context) against the torch reference over the same batch."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    k = torch.randn(60, bs, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(60, bs, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(60, generator=gen)[:48].view(3, 16)
    query_lens, seq_lens = torch.tensor([20, 64, 7]), torch.tensor([20, 200, 130])
    starts = torch.zeros(4, dtype=torch.int64)
    starts[1:] = query_lens.cumsum(0)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(torch.bfloat16)
    args = (q, k, v, tables, seq_lens, starts, 0.125, 64, 200)
    want = paged_attention(*args).float()
    got = cpu_paged_attention(*args, native_prefill=True).float()
    assert float((got - want).norm() / want.norm()) < RTOL


def test_a_plan_without_the_native_prefill_attention_runs_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On AMX the plan leaves prefill chunks to torch's SDPA: the dispatch never calls the
    native kernel then, and gives the reference's answer."""
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(8, 16, 3, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(8, 16, 3, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(40, 9, 64, generator=gen).to(torch.bfloat16)
    tables = torch.arange(8).view(1, 8)
    args = (q, k, v, tables, torch.tensor([100]), torch.tensor([0, 40]), 0.125, 40, 100)

    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("the native prefill attention was called")

    monkeypatch.setattr(cpu_native, "prefill_attention", refuse)
    got = cpu_paged_attention(*args, native_prefill=False)
    torch.testing.assert_close(got, paged_attention(*args))


@needs_kernel
def test_what_the_native_prefill_attention_takes() -> None:
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert cpu_native.prefill_attention_available(bf16, 64)
    assert not cpu_native.prefill_attention_available(bf16, 48)  # not a multiple of 32
    assert not cpu_native.prefill_attention_available(bf16.float(), 64)  # float32 cache
