"""Triton KV-write and paged-attention kernels against the torch reference.

Runs the kernels on CPU tensors under TRITON_INTERPRET=1 (set in conftest.py, and here in case
this file is run alone). Inputs are fresh random numbers, caches are random everywhere (unused
slots hold garbage, not zeros), block tables are shuffled and outputs are poisoned with NaN
before the kernels run. The reference is `paged_attention` evaluated in fp32 on the same stored
cache values; bf16 queries must match it within 1e-2, fp32 queries within 1e-3 (max abs error
over max abs reference value).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from appliance.kernels.paged_attention import (  # noqa: E402
    FP8_FORMATS,
    cache_storage_dtype,
    dequantize,
    paged_attention,
    quantize,
    write_kv,
)
from appliance.kernels.triton_attention import (  # noqa: E402
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_triton,
)
from appliance.kernels.triton_kv import write_kv_triton  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # the interpreter's range(<tensor>) on numpy 2.x
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
NUM_KV_HEADS = 2  # keeps the interpreter fast; GQA ratios come from num_heads


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def random_stored(
    shape: tuple[int, ...],
    fmt: str,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    gen: torch.Generator,
) -> torch.Tensor:
    """Random values in a cache's stored representation (finite: no NaN byte patterns)."""
    values = torch.randn(shape, generator=gen) * 2
    return quantize(values, fmt, scale).to(cache_storage_dtype(fmt, dtype))


@dataclass
class Batch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_cache_dtype: str
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    def reference(self) -> torch.Tensor:
        """The torch reference in fp32 on the same stored cache."""
        return paged_attention(
            self.query.float(),
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens.long(),
            self.query_start_loc.long(),
            self.scale,
            self.max_query_len,
            self.max_seq_len,
            self.kv_cache_dtype,
            self.k_scale,
            self.v_scale,
        )

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.query, float("nan"))


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    fmt: str = "auto",
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-max(n, 1) // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 7  # spare blocks: the table does not cover the whole cache
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_scale = v_scale = None
    if fmt != "auto":
        k_scale = torch.rand(NUM_KV_HEADS, generator=gen) * 0.02 + 0.01
        v_scale = torch.rand(NUM_KV_HEADS, generator=gen) * 0.02 + 0.01
    k_cache = random_stored(shape, fmt, dtype, k_scale, gen)
    v_cache = random_stored(shape, fmt, dtype, v_scale, gen)
    # Shuffled physical blocks; padding columns point at (valid) random blocks.
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), max(blocks) + 1), generator=gen)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[start : start + n]
        start += n
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    return Batch(
        query,
        k_cache,
        v_cache,
        table.to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        fmt,
        k_scale,
        v_scale,
        head_dim**-0.5,
    )


def decode(b: Batch, split_size: int | None = None) -> torch.Tensor:
    out = b.poisoned_out()
    result = paged_attention_decode(
        b.query,
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.seq_lens,
        b.scale,
        b.max_seq_len,
        b.kv_cache_dtype,
        b.k_scale,
        b.v_scale,
        split_size=split_size,
        out=out,
    )
    assert result is out
    return out


def prefill(b: Batch) -> torch.Tensor:
    out = b.poisoned_out()
    paged_attention_prefill(
        b.query,
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.seq_lens,
        b.query_start_loc,
        b.scale,
        b.max_query_len,
        b.kv_cache_dtype,
        b.k_scale,
        b.v_scale,
        out=out,
    )
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g}"


# --------------------------------------------------------------------------- write_kv


def fp8_step(stored_units: torch.Tensor, fmt: str) -> torch.Tensor:
    """Spacing of the FP8 grid around |x| (x in stored units, i.e. value / scale)."""
    mant, min_exp = (3, -6) if fmt == "fp8_e4m3" else (2, -14)
    exp = torch.floor(torch.log2(stored_units.abs().clamp_min(2.0**min_exp)))
    return torch.exp2(exp - mant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["auto", *QUANTIZED])
def test_write_kv_matches_reference(fmt: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, head_dim, tokens = (16, 64, 24) if dtype == torch.float32 else (32, 128, 20)
    shape = (6, block_size, NUM_KV_HEADS, head_dim)
    scale = None if fmt == "auto" else torch.rand(NUM_KV_HEADS, generator=gen) * 0.05 + 0.005
    key = (torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen) * 3).to(dtype)
    value = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(shape[0] * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # padding tokens: skipped by both implementations
    storage = cache_storage_dtype(fmt, dtype)
    initial = [random_stored(shape, fmt, dtype, scale, gen) for _ in range(2)]
    ref_k, ref_v = (c.clone() for c in initial)
    out_k, out_v = (c.clone() for c in initial)
    write_kv(key, value, ref_k, ref_v, slots, fmt, scale, scale)
    write_kv_triton(key, value, out_k, out_v, slots, fmt, scale, scale)

    written = torch.zeros(shape[0] * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for out, ref, init in ((out_k, ref_k, initial[0]), (out_v, ref_v, initial[1])):
        assert out.dtype == storage
        flat_out, flat_ref = out.flatten(0, 1), ref.flatten(0, 1)
        assert torch.equal(flat_out[~written], init.flatten(0, 1)[~written]), "skipped slot written"
        assert not torch.equal(flat_ref[written], init.flatten(0, 1)[written])
        got = dequantize(flat_out[written], fmt, scale, torch.float32)
        want = dequantize(flat_ref[written], fmt, scale, torch.float32)
        if fmt == "auto":
            assert torch.equal(got, want)
        elif fmt == "int8":
            assert ((got - want).abs() <= scale.view(-1, 1) * 1.001).all()
        else:
            step = fp8_step(torch.maximum(got.abs(), want.abs()) / scale.view(-1, 1), fmt)
            assert ((got - want).abs() <= step * scale.view(-1, 1) * 1.001).all()


def test_torch_write_kv_skips_negative_slots() -> None:
    cache = torch.zeros(2, 16, 1, 8)
    values = torch.arange(3 * 8, dtype=torch.float32).view(3, 1, 8) + 1
    write_kv(values, values, cache, cache.clone(), torch.tensor([-1, 5, -1]))
    assert torch.equal(cache.view(32, 8)[5], values[1, 0])
    assert int((cache != 0).any(-1).sum()) == 1


def test_fp8_quantization_exact_over_range() -> None:
    """The kernel's bit-level FP8 rounding equals torch's cast, subnormals and saturation
    included (fp32 inputs spanning 1e-8 .. 3e5)."""
    gen = torch.Generator().manual_seed(2)
    n = 64 * NUM_KV_HEADS * 64
    x = torch.logspace(-8, 5.5, n) * torch.randn(n, generator=gen).sign()
    x = x[torch.randperm(n, generator=gen)].view(64, NUM_KV_HEADS, 64)
    scale = torch.ones(NUM_KV_HEADS)
    for fmt in FP8_FORMATS:
        ours, ref = (torch.zeros(4, 16, NUM_KV_HEADS, 64, dtype=torch.uint8) for _ in range(2))
        write_kv_triton(x, x, ours, ours.clone(), torch.arange(64), fmt, scale, scale)
        write_kv(x, x, ref, ref.clone(), torch.arange(64), fmt, scale, scale)
        assert (ours == ref).float().mean() > 0.999, fmt


# --------------------------------------------------------------------------- decode

SHAPES = [  # (block_size, GQA ratio, head_dim)
    (16, 1, 64),
    (16, 4, 128),
    (32, 8, 64),
    (32, 4, 128),
    (16, 8, 128),
    (32, 1, 128),
]
RAGGED = [1, 33, 200, 17, 64]  # ragged context lengths (200 tokens: 13 blocks of 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "group", "head_dim"), SHAPES)
def test_decode_shapes(block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    b = make_batch(RAGGED, [1] * len(RAGGED), group, head_dim, block_size, dtype)
    assert_close(decode(b), b.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_decode_quantized_cache(fmt: str, dtype: torch.dtype) -> None:
    block_size, group, head_dim = (16, 4, 128) if dtype == torch.float32 else (32, 8, 64)
    b = make_batch(RAGGED, [1] * len(RAGGED), group, head_dim, block_size, dtype, fmt, seed=3)
    assert_close(decode(b), b.reference(), dtype)


@pytest.mark.parametrize(
    ("split_size", "fmt", "dtype"),
    [
        (64, "auto", torch.float32),  # split = one BLOCK_N tile
        (100, "auto", torch.bfloat16),  # splits not aligned to blocks or tiles
        (256, "fp8_e4m3", torch.bfloat16),
        (48, "int8", torch.float32),
    ],
)
def test_decode_split_k(split_size: int, fmt: str, dtype: torch.dtype) -> None:
    """Flash-decoding: a 700-token context (44 blocks) split across programs and merged by
    log-sum-exp; short sequences occupy fewer splits than the grid has."""
    lens = [700, 5, 300, 64]
    b = make_batch(lens, [1] * len(lens), 4, 64, 16, dtype, fmt, seed=4)
    out = decode(b, split_size=split_size)
    assert_close(out, b.reference(), dtype)
    assert rel_err(out, decode(b)) < TOLERANCE[dtype] / 10  # split == unsplit


def test_decode_empty_sequence_gives_zeros() -> None:
    b = make_batch([40, 0, 130], [1, 1, 1], 4, 64, 16, seed=5)
    for split in (None, 32):
        out = decode(b, split_size=split)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        keep = [0, 2]
        assert rel_err(out[keep], b.reference()[keep]) < 1e-3


# --------------------------------------------------------------------------- prefill

# Chunked prefill: full prompt (no prefix) spanning two query tiles, a chunk after a cached
# prefix, a single-token (decode-like) row and a short chunk after a prefix.
PREFILL_SEQ_LENS = [80, 97, 20, 45]
PREFILL_QUERY_LENS = [80, 30, 1, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "group", "head_dim"), [(16, 1, 64), (32, 4, 128), (16, 8, 128), (32, 8, 64)]
)
def test_prefill_shapes(block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    b = make_batch(PREFILL_SEQ_LENS, PREFILL_QUERY_LENS, group, head_dim, block_size, dtype)
    assert_close(prefill(b), b.reference(), dtype)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.float32), ("int8", torch.bfloat16)],
)
def test_prefill_quantized_cache(fmt: str, dtype: torch.dtype) -> None:
    b = make_batch(PREFILL_SEQ_LENS, PREFILL_QUERY_LENS, 4, 64, 16, dtype, fmt, seed=6)
    assert_close(prefill(b), b.reference(), dtype)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("fp8_e4m3", torch.bfloat16), ("int8", torch.float32), ("fp8_e5m2", torch.bfloat16)],
)
def test_prefill_reads_the_chunks_fresh_kv(fmt: str, dtype: torch.dtype) -> None:
    """Over a quantized cache, a prefill given this step's K/V attends to them for the chunk's
    own positions and to the stored bytes for the prefix: the torch reference's rule."""
    b = make_batch(PREFILL_SEQ_LENS, PREFILL_QUERY_LENS, 4, 64, 16, dtype, fmt, seed=9)
    gen = torch.Generator().manual_seed(10)
    fresh_shape = (b.query.shape[0], NUM_KV_HEADS, 64)
    key = torch.randn(fresh_shape, generator=gen).to(dtype)
    # A view with other strides (V sliced out of a wider tensor), as a fused qkv gives it.
    value = torch.randn(fresh_shape[0], NUM_KV_HEADS, 96, generator=gen).to(dtype)[..., :64]
    out = b.poisoned_out()
    paged_attention_prefill(
        b.query,
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.seq_lens,
        b.query_start_loc,
        b.scale,
        b.max_query_len,
        b.kv_cache_dtype,
        b.k_scale,
        b.v_scale,
        out=out,
        key=key,
        value=value,
    )
    ref = paged_attention(
        b.query.float(),
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.seq_lens.long(),
        b.query_start_loc.long(),
        b.scale,
        b.max_query_len,
        b.max_seq_len,
        b.kv_cache_dtype,
        b.k_scale,
        b.v_scale,
        key=key.float(),
        value=value.float(),
    )
    assert_close(out, ref, dtype)
    # The fresh values are what was read: the stored-bytes answer is a different one.
    assert rel_err(ref, b.reference()) > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", ["auto", "int8"])
@pytest.mark.parametrize(("seq_len", "query_len"), [(80, 80), (97, 30), (45, 12)])
def test_one_sequence_prefill_matches_the_batched_path(
    fmt: str, seq_len: int, query_len: int
) -> None:
    """A batch of one prefill skips the padded grid (and, with no cached prefix, builds no mask):
    its rows are those of the same sequence computed inside a batch of two."""
    b = make_batch([seq_len, 60], [query_len, 60], 4, 64, 16, torch.float32, fmt, seed=11)
    gen = torch.Generator().manual_seed(12)
    key = torch.randn(b.query.shape[0], NUM_KV_HEADS, 64, generator=gen)
    value = torch.randn(b.query.shape[0], NUM_KV_HEADS, 64, generator=gen)
    common = (b.k_cache, b.v_cache)
    both = paged_attention(
        b.query,
        *common,
        b.block_tables,
        b.seq_lens.long(),
        b.query_start_loc.long(),
        b.scale,
        b.max_query_len,
        b.max_seq_len,
        fmt,
        b.k_scale,
        b.v_scale,
        key=key,
        value=value,
    )
    rows = slice(0, query_len)
    one = paged_attention(
        b.query[rows],
        *common,
        b.block_tables[:1],
        b.seq_lens[:1].long(),
        torch.tensor([0, query_len]),
        b.scale,
        query_len,
        seq_len,
        fmt,
        b.k_scale,
        b.v_scale,
        key=key[rows],
        value=value[rows],
    )
    torch.testing.assert_close(one, both[rows], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("max_query_len", [1, 12])
def test_dispatcher_matches_reference_signature(max_query_len: int) -> None:
    """paged_attention_triton is a drop-in: same arguments (int64 metadata), a non-contiguous
    query (a view into a fused qkv tensor), the reference's own output dtype."""
    lens = [40, 77, 12]
    qlens = [1, 1, 1] if max_query_len == 1 else [12, 5, 12]
    b = make_batch(lens, qlens, 4, 64, 16, seed=7)
    qkv = torch.randn(b.query.shape[0], b.query.shape[1] + 2 * NUM_KV_HEADS, 64)
    query = qkv[:, : b.query.shape[1]]
    args = (
        b.k_cache,
        b.v_cache,
        b.block_tables.long(),
        b.seq_lens.long(),  # int64 metadata
        b.query_start_loc.long(),
        b.scale,
        max_query_len,
        b.max_seq_len,
    )
    out = paged_attention_triton(query, *args)
    ref = paged_attention(query, *args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 1e-3


def test_each_device_pair_holds_its_kernels() -> None:
    from appliance.kernels.paged_attention import TORCH_ATTENTION
    from appliance.kernels.triton_attention import TRITON_ATTENTION

    from appliance.cpu.attention import cpu_attention, cpu_paged_attention

    for native_prefill in (True, False):
        native = cpu_attention(native=True, native_prefill=native_prefill)
        dispatch = native.paged_attention
        assert native.write_kv is write_kv
        assert dispatch.func is cpu_paged_attention  # type: ignore[attr-defined]
        assert dispatch.keywords == {"native_prefill": native_prefill}  # type: ignore[attr-defined]
    assert cpu_attention(native=False, native_prefill=False).write_kv is write_kv
    assert (TORCH_ATTENTION.write_kv, TORCH_ATTENTION.paged_attention) == (
        write_kv,
        paged_attention,
    )
    assert (TRITON_ATTENTION.write_kv, TRITON_ATTENTION.paged_attention) == (
        write_kv_triton,
        paged_attention_triton,
    )


def test_bench_parses_args_and_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.kernels import bench

    args = bench.parse_args(["--json", "--iters", "3", "--sweep"])
    assert args.json and args.iters == 3 and args.sweep
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run the benchmark itself")
    assert bench.main([]) == 2
    assert "CUDA" in capsys.readouterr().err
