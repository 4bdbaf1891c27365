"""Per-token INT8 KV (kind int8_token) on the Triton kernels, run on CPU tensors under
TRITON_INTERPRET=1, against the torch reference (kernels/paged_attention.py, the CPU path): the
write kernel's bytes and scales bit for bit, decode (split and unsplit) and chunked prefill (with
and without the chunk's fresh K/V) over a cache the reference wrote.

Shapes are tiny and odd (3 KV heads, head_dim 24: both padded inside the kernels; blocks of 4;
contexts ending mid-block) because the interpreter costs milliseconds per program. Caches hold
random bytes and scales in every slot a test does not write, block tables are shuffled and
outputs are poisoned with NaN. The float64 checks against hand-quantized K/V, kept heads and the
attention layer are in tests/test_kv_token_scales.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from appliance.kernels.kv_formats import PER_TOKEN_KIND  # noqa: E402
from appliance.kernels.paged_attention import paged_attention, write_kv  # noqa: E402
from appliance.kernels.triton_attention import (  # noqa: E402
    paged_attention_decode,
    paged_attention_prefill,
)
from appliance.kernels.triton_kv import write_kv_triton  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # the interpreter's range(<tensor>) on numpy 2.x
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)

HKV, D, BS, GROUP = 3, 24, 4, 2
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def token_kv(n: int, gen: torch.Generator, dtype: torch.dtype = torch.float32):
    """K/V of n tokens whose heads span 400x in range, with an outlier token (what per-token
    scales are for) and one all-zero head (the minimum scale, zeros stored)."""
    gain = torch.tensor([0.02, 1.0, 8.0]).view(1, HKV, 1)
    k = torch.randn(n, HKV, D, generator=gen) * gain
    v = torch.randn(n, HKV, D, generator=gen) * gain.flip(1)
    k[n // 2] *= 30
    k[0, 1] = 0.0
    return k.to(dtype), v.to(dtype)


def random_caches(num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    """k, v, k_scales, v_scales full of finite garbage (a slot read by mistake shows)."""
    kv = [
        torch.randint(-127, 128, (num_blocks, BS, HKV, D), generator=gen).to(torch.int8)
        for _ in range(2)
    ]
    scales = [(torch.rand(num_blocks, BS, HKV, generator=gen) * 50 + 1).half() for _ in range(2)]
    return kv + scales


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_matches_the_cpu_path_bit_for_bit(dtype: torch.dtype) -> None:
    """Same int8 bytes and float16 scales as `paged_attention.write_kv` in every slot, padding
    slots (-1) skipped by both; a K/V view with other strides (out of a fused qkv)."""
    gen = torch.Generator().manual_seed(0)
    tokens, num_blocks = 11, 5
    k, v = token_kv(tokens, gen, dtype)
    qkv = torch.cat([k, v, k], dim=1)  # [tokens, 3 * HKV, D]: K/V are strided views of it
    k, v = qkv[:, :HKV], qkv[:, HKV : 2 * HKV]
    slots = torch.randperm(num_blocks * BS, generator=gen)[:tokens]
    slots[[3, 7]] = -1
    initial = random_caches(num_blocks, gen)
    ref = [t.clone() for t in initial]
    out = [t.clone() for t in initial]
    write_kv(k, v, ref[0], ref[1], slots, PER_TOKEN_KIND, ref[2], ref[3])
    write_kv_triton(k, v, out[0], out[1], slots, PER_TOKEN_KIND, out[2], out[3])
    for o, r, before in zip(out, ref, initial, strict=True):
        assert torch.equal(o, r)
        assert not torch.equal(o, before)  # something was written at all
    # The all-zero head of token 0 got the minimum scale and zeros.
    slot = int(slots[0])
    assert float(out[2].view(-1, HKV)[slot, 1]) == 2.0**-14
    assert not bool(out[0].view(-1, HKV, D)[slot, 1].any())


def filled_cache(lengths: list[int], gen: torch.Generator):
    """A cache the CPU path wrote: each sequence's K/V in shuffled blocks (tables padded with
    valid random blocks), spare blocks of garbage."""
    blocks = [-(-n // BS) for n in lengths]
    num_blocks = sum(blocks) + 3
    caches = random_caches(num_blocks, gen)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lengths), max(blocks) + 1), generator=gen)
    first = 0
    for i, (n, nb) in enumerate(zip(lengths, blocks, strict=True)):
        table[i, :nb] = perm[first : first + nb]
        first += nb
        k, v = token_kv(n, gen)
        slots = torch.tensor([int(table[i, p // BS]) * BS + p % BS for p in range(n)])
        write_kv(k, v, caches[0], caches[1], slots, PER_TOKEN_KIND, caches[2], caches[3])
    return caches, table.to(torch.int32)


@pytest.mark.parametrize(
    ("dtype", "split_size"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 8)]
)
def test_decode_reads_each_tokens_scales(dtype: torch.dtype, split_size: int | None) -> None:
    """Ragged contexts (tails of 1-2 tokens in the last block, one of a single token), unsplit
    and split 8 tokens a program (merged by log-sum-exp)."""
    gen = torch.Generator().manual_seed(1)
    lengths = [13, 1, 30, 6]
    caches, table = filled_cache(lengths, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), HKV * GROUP, D, generator=gen).to(dtype)
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(
        q,
        caches[0],
        caches[1],
        table,
        seq_lens,
        scale,
        max(lengths),
        PER_TOKEN_KIND,
        caches[2],
        caches[3],
        split_size=split_size,
        out=out,
    )
    qsl = torch.arange(len(lengths) + 1)
    ref = paged_attention(
        q.float(),
        caches[0],
        caches[1],
        table.long(),
        seq_lens.long(),
        qsl,
        scale,
        1,
        max(lengths),
        PER_TOKEN_KIND,
        caches[2],
        caches[3],
    )
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert rel_err(out, ref) < TOLERANCE[dtype], rel_err(out, ref)
    # The scales matter: the same bytes under unit per-head scales give another answer.
    ones = torch.ones(HKV)
    wrong = paged_attention(
        q.float(),
        caches[0],
        caches[1],
        table.long(),
        seq_lens.long(),
        qsl,
        scale,
        1,
        max(lengths),
        "int8",
        ones,
        ones,
    )
    assert rel_err(wrong, ref) > 100 * TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("dtype", "fresh"), [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)]
)
def test_prefill_reads_the_prefix_through_its_scales(dtype: torch.dtype, fresh: bool) -> None:
    """A whole prompt, a chunk after a cached prefix and a 2-token chunk; with `fresh` the
    chunks' own positions come from this step's K/V (the reference's rule), else from the
    per-token cache like the prefix."""
    gen = torch.Generator().manual_seed(2)
    lengths, q_lens = [13, 9, 22], [13, 3, 2]
    caches, table = filled_cache(lengths, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), HKV * GROUP, D, generator=gen).to(dtype)
    extra = {}
    if fresh:
        k, v = token_kv(sum(q_lens), gen)
        extra = {"key": k.to(dtype), "value": v.to(dtype)}
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill(
        q,
        caches[0],
        caches[1],
        table,
        seq_lens,
        qsl,
        scale,
        max(q_lens),
        PER_TOKEN_KIND,
        caches[2],
        caches[3],
        out=out,
        **extra,
    )
    ref_extra = {name: t.float() for name, t in extra.items()}
    ref = paged_attention(
        q.float(),
        caches[0],
        caches[1],
        table.long(),
        seq_lens.long(),
        qsl.long(),
        scale,
        max(q_lens),
        max(lengths),
        PER_TOKEN_KIND,
        caches[2],
        caches[3],
        **ref_extra,
    )
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert rel_err(out, ref) < TOLERANCE[dtype], rel_err(out, ref)
    if fresh:  # what was read for the chunk is the fresh K/V, not the cache's
        stored = paged_attention(
            q.float(),
            caches[0],
            caches[1],
            table.long(),
            seq_lens.long(),
            qsl.long(),
            scale,
            max(q_lens),
            max(lengths),
            PER_TOKEN_KIND,
            caches[2],
            caches[3],
        )
        assert rel_err(stored, ref) > 100 * TOLERANCE[dtype]


def test_scale_caches_of_the_wrong_shape_are_refused() -> None:
    gen = torch.Generator().manual_seed(3)
    caches, table = filled_cache([5], gen)
    q = torch.randn(1, HKV * GROUP, D)
    with pytest.raises(ValueError, match=r"int8_token caches need k_scale"):
        paged_attention_decode(
            q,
            caches[0],
            caches[1],
            table,
            torch.tensor([5]),
            0.2,
            5,
            PER_TOKEN_KIND,
            torch.ones(HKV),
            caches[3],
        )
