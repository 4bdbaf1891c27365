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

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from appliance.kernels import cpu_paged_attention, get_attention_backend  # noqa: E402
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


def test_backend_selection() -> None:
    assert get_attention_backend(torch.device("cpu")) == (write_kv, cpu_paged_attention)
    assert get_attention_backend("cpu", native_cpu=False) == (write_kv, paged_attention)
    assert get_attention_backend("cuda") == (write_kv_triton, paged_attention_triton)


def test_bench_parses_args_and_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.kernels import bench

    args = bench.parse_args(["--json", "--iters", "3", "--sweep"])
    assert args.json and args.iters == 3 and args.sweep
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run the benchmark itself")
    assert bench.main([]) == 2
    assert "CUDA" in capsys.readouterr().err


# --------------------------------------------------------------------------- GPU compile

AOT_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from appliance.kernels import triton_attention as ta, triton_decode as td
    from appliance.kernels import triton_kv as tk, triton_prefill as tp

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    # Arguments the JIT would not mark % 16.
    NO_ALIGN = {"stride_bt", "qk_scale", "v_mult", "fresh_qk_scale", "stride_fh", "stride_ss",
                "stride_sh"}

    def compile_(cc, fn, types, consts, cfg):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in consts and n not in NO_ALIGN}
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        arch = f"sm_{cc}a" if cc == 90 else f"sm_{cc}"
        r = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
        os.unlink(f.name)
        spills = [l for l in r.stderr.splitlines() if "spill stores" in l]
        return {"kernel": fn.__name__, "cc": cc, "consts": str(consts),
                "spill_free": all(" 0 bytes spill stores" in l for l in spills),
                "mma": "mma" in k.asm["ttgir"]}

    def variant(cc, fmt=1, dtype="bf16", group=4, head_dim=128, use_splits=True):
        kv = {0: "*" + dtype, 1: "*u8", 2: "*u8", 3: "*i8", 4: "*i8"}[fmt]
        scales = "*fp16" if fmt == 4 else "*fp32"  # per-token INT8: float16 scale caches
        cfg = ta.default_config(head_dim)
        types = dict(q_ptr="*" + dtype, k_cache_ptr=kv, v_cache_ptr=kv, block_tables_ptr="*i32",
                     seq_lens_ptr="*i32", query_start_loc_ptr="*i32", k_scale_ptr=scales,
                     v_scale_ptr=scales, out_ptr="*" + dtype, part_out_ptr="*fp32",
                     part_lse_ptr="*fp32", qk_scale="fp32", v_mult="fp32",
                     fresh_k_ptr="*" + dtype, fresh_v_ptr="*" + dtype, fresh_qk_scale="fp32")
        fp32 = dtype == "fp32"
        common = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16,
                      BLOCK_N=cfg.block_n, KV_FMT=fmt, FP32_DOT=fp32,
                      DOT_PRECISION="ieee" if fp32 else "tf32")
        gpad = triton.next_power_of_2(group)
        yield compile_(cc, td._decode_kernel, types, dict(
            common, SPLIT_SIZE=2048, USE_SPLITS=use_splits, GROUP_PAD=max(gpad, 16)), cfg)
        yield compile_(cc, tp._prefill_kernel, types, dict(
            common, GROUP_PAD=gpad, BLOCK_Q=max(ta.PREFILL_BLOCK_M // gpad, 1), FRESH=fmt != 0),
            cfg)
        kv_types = dict(key_ptr="*" + dtype, value_ptr="*" + dtype, k_cache_ptr=kv,
                        v_cache_ptr=kv, slot_ptr="*i64", k_scale_ptr=scales,
                        v_scale_ptr=scales)
        if fmt == 4:
            yield compile_(cc, tk._write_kv_token_kernel, kv_types, dict(
                BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=head_dim, HEADS_PAD=8,
                HEAD_DIM_PAD=head_dim, MIN_SCALE=2.0**-14), cfg)
        else:
            yield compile_(cc, tk._write_kv_kernel, kv_types, dict(
                BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=head_dim, BLOCK=8 * head_dim,
                KV_FMT=fmt), cfg)

    results = []
    for cc in (80, 90):
        for fmt in (0, 1, 3, 4):
            results += variant(cc, fmt)
        results.append(compile_(cc, td._decode_reduce_kernel, dict(
            part_out_ptr="*fp32", part_lse_ptr="*fp32", seq_lens_ptr="*i32", out_ptr="*bf16"),
            dict(SPLIT_SIZE=2048, SPLITS_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128),
            ta.default_config(128)))
    results += variant(80, 2, use_splits=False)  # e5m2, unsplit decode
    results += variant(80, 0, group=1, head_dim=64)
    results += variant(80, 1, "fp16", group=8)
    for r in variant(80, 0, "fp32", group=8, use_splits=False):  # exactness path: may spill
        results.append(dict(r, spill_free=True, mma=True))
    print(json.dumps(results))
""")


@pytest.mark.skipif(
    not Path(__import__("triton").__file__).parent.joinpath("backends/nvidia/bin/ptxas").exists(),
    reason="needs triton's bundled ptxas",
)
def test_kernels_compile_for_ampere_and_hopper() -> None:
    """Compile every kernel for sm80 and sm90 with the real Triton compiler (no GPU needed):
    catches what the interpreter accepts but codegen rejects (fp8e4nv casts on Ampere, dot
    shapes, div_rn's operands), checks bf16 / FP8 / INT8 (per-head and per-token scales)
    paths use tensor cores and do not spill registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 38
    for r in results:
        assert r["spill_free"], r
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel"):
            assert r["mma"], r
