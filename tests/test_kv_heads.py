"""Single KV heads kept 16-bit (cache.kv_cache_keep_16bit_heads): stored apart in a side cache
of their layer, attended by their own query heads; the layer's other heads quantized.

The attention tests drive `Attention.forward` over a hand-built split cache (scattered blocks,
a mixed step of a decode and a prefill chunk) on every backend (torch reference, the CPU's
native decode attention, Triton under the interpreter) against float64 attention computed
head by head: a kept head over its exact K/V (rounded to the side cache's dtype), a quantized
head over K/V put through the stored form by hand (rotated, quantized with that head's scale,
read back), except a prefill chunk's own positions, which attend to the fresh K/V.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from appliance.kernels.attention_api import AttentionBackend  # noqa: E402
from appliance.kernels.paged_attention import dequantize, quantize  # noqa: E402

from appliance.config import ConfigError, load_config  # noqa: E402
from appliance.engine.kv_pool import KVCachePool  # noqa: E402
from appliance.engine.kv_quant import (  # noqa: E402
    FORMAT_MAX,
    MARGIN,
    apply_layer_spec,
)
from appliance.kv_layout import LayerKV, layer_layout  # noqa: E402
from appliance.layers.attention import Attention, AttentionMetadata, PagedBatch, PlainKV  # noqa: E402
from appliance.layers.kv_cache import KVStorage  # noqa: E402
from appliance.layers.quantized_kv import rotation_matrix  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 6, 3, 64, 16
SCALE = DIM**-0.5
# Per KV head, a different magnitude: a scale applied to the wrong head shows.
HEAD_GAIN = torch.tensor([1.0, 6.0, 0.15]).view(1, KV_HEADS, 1)


def backend(name: str) -> AttentionBackend:
    from appliance.kernels.paged_attention import TORCH_ATTENTION

    from appliance.cpu.attention import cpu_attention

    if name == "triton":
        from appliance.kernels.triton_attention import TRITON_ATTENTION

        return TRITON_ATTENTION
    return cpu_attention(native=True, native_prefill=True) if name == "cpu" else TORCH_ATTENTION


def stored(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """[L, n, D] -> what a quantized cache reads back (scale: [n]), float64."""
    rot = rotation_matrix(DIM, torch.device("cpu"))
    y = x.float() @ rot
    return (dequantize(quantize(y, fmt, scale), fmt, scale, torch.float32) @ rot.T).double()


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last q.shape[0] positions over k/v ([L, Hkv, D]), float64, head j on KV head j // g."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        attn_mask=mask,
        scale=SCALE,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def batch(tables: list[list[int]], seq_lens: list[int], q_lens: list[int]) -> PagedBatch:
    width = max(map(len, tables))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return PagedBatch(
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_tokens=sum(q_lens),
    )


def slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in positions]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize(
    ("name", "kept", "side_dtype"),
    [
        # Kept (0,): the outputs' permutation is not its own inverse (it is for (1,), (0, 2)).
        ("torch", (0,), torch.float32),
        ("torch", (1,), torch.float32),
        ("torch", (0, 2), torch.bfloat16),
        ("cpu", (0,), torch.float32),
        ("cpu", (0, 2), torch.bfloat16),
        ("triton", (0,), torch.float32),
        ("triton", (0, 2), torch.float32),
    ],
)
def test_split_cache_attends_like_the_per_head_reference(
    fmt: str, name: str, kept: tuple[int, ...], side_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    # Sequence A: 37 prompt tokens, then one decode; B: 24 prompt tokens, then a chunk of 8.
    a_table, b_table = [5, 2, 7], [1, 4]
    total_a, total_b = 38, 32
    k = {s: torch.randn(n, KV_HEADS, DIM) * HEAD_GAIN for s, n in (("a", total_a), ("b", total_b))}
    v = {s: torch.randn(n, KV_HEADS, DIM) * HEAD_GAIN for s, n in (("a", total_a), ("b", total_b))}
    for s in k:
        k[s][..., 5:7] *= 20  # a trained model's outlier RoPE pair
    q = {s: torch.randn(n, HEADS, DIM) for s, n in (("a", total_a), ("b", total_b))}
    rot = rotation_matrix(DIM, torch.device("cpu"))
    every = torch.cat([k["a"], k["b"]]), torch.cat([v["a"], v["b"]])
    absmax = tuple((x.float() @ rot).abs().amax(dim=(0, 2)) for x in every)

    attn = Attention(HEADS, KV_HEADS, DIM, SCALE)
    attn.wire(PlainKV(backend(name)))
    apply_layer_spec(attn, LayerKV(fmt, kept), absmax)  # type: ignore[arg-type]
    quant = [h for h in range(KV_HEADS) if h not in kept]
    store = KVStorage(
        [torch.uint8 if fmt.startswith("fp8") else torch.int8], [len(kept)], side_dtype
    )
    pool = KVCachePool(1, 8, 0, BS, KV_HEADS, DIM, store, torch.device("cpu"))
    cache = pool.device_caches[0]
    assert cache.side is not None and cache.scales is None
    assert [t.shape[2] for t in cache.tensors()] == [len(quant), len(quant), len(kept), len(kept)]
    assert cache.side.k.dtype == side_dtype

    # Step 1: both prompts as prefills (A 37 tokens, B the first 24).
    meta1 = AttentionMetadata(
        torch.tensor(slots(a_table, range(37)) + slots(b_table, range(24))),
        None,
        batch([a_table, b_table], [37, 24], [37, 24]),
    )
    cat = lambda d, a_rows, b_rows: torch.cat([d["a"][a_rows], d["b"][b_rows]])  # noqa: E731
    out1 = attn(
        cat(q, slice(0, 37), slice(0, 24)),
        cat(k, slice(0, 37), slice(0, 24)),
        cat(v, slice(0, 37), slice(0, 24)),
        meta1,
        cache,
    )
    # Step 2: A's decode first, then B's chunk of 8 (positions 24..31).
    meta2 = AttentionMetadata(
        torch.tensor(slots(a_table, range(37, 38)) + slots(b_table, range(24, 32))),
        batch([a_table], [38], [1]),
        batch([b_table], [32], [8]),
    )
    out2 = attn(
        cat(q, slice(37, 38), slice(24, 32)),
        cat(k, slice(37, 38), slice(24, 32)),
        cat(v, slice(37, 38), slice(24, 32)),
        meta2,
        cache,
    )

    scales = [(absmax[i][quant] * MARGIN[fmt] / FORMAT_MAX[fmt]) for i in (0, 1)]

    def effective(x: torch.Tensor, scale: torch.Tensor, fresh_from: int) -> torch.Tensor:
        """K or V as a row reads it: kept heads 16-bit, quantized heads stored, but positions
        from `fresh_from` on (the chunk's own, in a prefill) exact."""
        out = x.double().clone()
        out[:, list(kept)] = x[:, list(kept)].to(side_dtype).double()
        out[:fresh_from, quant] = stored(x[:fresh_from, quant], fmt, scale)
        return out

    def ref(s: str, start: int, end: int, fresh_from: int) -> torch.Tensor:
        keys = effective(k[s][:end], scales[0], fresh_from)
        values = effective(v[s][:end], scales[1], fresh_from)
        return causal(q[s][start:end], keys, values)

    expected1 = torch.cat([ref("a", 0, 37, 0), ref("b", 0, 24, 0)])
    # The decode reads its own token back from the cache; the chunk attends to itself fresh.
    expected2 = torch.cat([ref("a", 37, 38, 38), ref("b", 24, 32, 24)])
    for out, expected in ((out1, expected1), (out2, expected2)):
        assert out.shape == expected.shape
        err = float((out.double() - expected).abs().max())
        assert err < 2e-4, err
    # The kept heads' values really are in the side cache, and only there.
    a_slot = slots(a_table, range(37, 38))[0]
    flat_side = cache.side.k.view(-1, len(kept), DIM)
    assert torch.equal(flat_side[a_slot], k["a"][37, list(kept)].to(side_dtype))


def test_a_kept_head_reads_16bit_where_the_quantized_layer_would_not() -> None:
    """The test above can fail: the same step with no head kept differs from the kept-head
    reference by far more than its tolerance (so a split that quantized every head shows)."""
    torch.manual_seed(1)
    n = 40
    k, v = torch.randn(n, KV_HEADS, DIM) * HEAD_GAIN, torch.randn(n, KV_HEADS, DIM) * HEAD_GAIN
    q = torch.randn(1, HEADS, DIM)
    rot = rotation_matrix(DIM, torch.device("cpu"))
    absmax = tuple((x @ rot).abs().amax(dim=(0, 2)) for x in (k, v))
    outs = {}
    for kept in ((), (1,)):
        attn = Attention(HEADS, KV_HEADS, DIM, SCALE)
        attn.wire(PlainKV(backend("torch")))
        apply_layer_spec(attn, LayerKV("int8", kept), absmax)  # type: ignore[arg-type]
        store = KVStorage([torch.int8], [len(kept)], torch.float32)
        cache = KVCachePool(1, 3, 0, BS, KV_HEADS, DIM, store, torch.device("cpu")).device_caches[0]
        table = [2, 0, 1]
        meta = AttentionMetadata(
            torch.tensor(slots(table, range(n))), None, batch([table], [n], [n])
        )
        attn(torch.randn(n, HEADS, DIM), k, v, meta, cache)
        meta = AttentionMetadata(
            torch.tensor(slots(table, range(n - 1, n))), batch([table], [n], [1]), None
        )
        outs[kept] = attn(q, k[-1:], v[-1:], meta, cache)
    exact = causal(q, k, v)
    heads_of_1 = [2, 3]  # query heads of KV head 1 (group 2)
    kept_err = float((outs[(1,)][:, heads_of_1].double() - exact[:, heads_of_1]).abs().max())
    quant_err = float((outs[()][:, heads_of_1].double() - exact[:, heads_of_1]).abs().max())
    assert kept_err < 1e-5 < 1e-3 < quant_err, (kept_err, quant_err)
    # The other heads are quantized in both, with the same scales: the same outputs.
    others = [0, 1, 4, 5]
    torch.testing.assert_close(outs[(1,)][:, others], outs[()][:, others], atol=1e-6, rtol=0)


# -- configuration and layout ----------------------------------------------------------------------


def cache_config(**values: object) -> object:
    return load_config(None, {f"cache.{k}": v for k, v in values.items()}).cache


@pytest.mark.parametrize(
    ("heads", "keep", "message"),
    [
        (["3"], [], r'kv_cache_keep_16bit_heads: \'3\' is not "layer:head"'),
        (["1:x"], [], r"kv_cache_keep_16bit_heads: '1:x' is not"),
        (["1:0", "1:0"], [], r"kv_cache_keep_16bit_heads lists '1:0' twice"),
        (["2:1"], [2], r"'2:1' is in layer 2, which cache.kv_cache_keep_16bit already keeps"),
    ],
)
def test_bad_head_entries_name_the_field_and_the_value(
    heads: list[str], keep: list[int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        cache_config(
            kv_cache_dtype="fp8_e4m3", kv_cache_keep_16bit=keep, kv_cache_keep_16bit_heads=heads
        )


def test_heads_beyond_the_model_name_the_limits() -> None:
    cache = cache_config(kv_cache_dtype="int8", kv_cache_keep_16bit_heads=["0:1", "3:2"])
    with pytest.raises(
        ConfigError, match=r"'3:2' does not exist: .* 4 layers of 2 KV heads .*0\.\.3, heads 0\.\.1"
    ):
        layer_layout(cache, 4, 2)  # type: ignore[arg-type]


def test_layout_per_rank_and_whole_layers() -> None:
    cache = cache_config(
        kv_cache_dtype="fp8_e4m3",
        kv_cache_keep_16bit=[3],
        kv_cache_keep_16bit_heads=["0:1", "1:0", "1:1", "2:3"],
    )
    # 4 KV heads at TP 1: layer 1 keeps both listed heads of 4, layer 3 whole.
    assert layer_layout(cache, 4, 4) == [  # type: ignore[arg-type]
        LayerKV("fp8_e4m3", (1,)),
        LayerKV("fp8_e4m3", (0, 1)),
        LayerKV("fp8_e4m3", (3,)),
        LayerKV("auto"),
    ]
    # TP 2: rank 0 holds heads 0-1 (layer 1 then keeps all it holds: a 16-bit layer there),
    # rank 1 heads 2-3 (head 3 is its local head 1).
    assert layer_layout(cache, 4, 4, tp=2, rank=0) == [  # type: ignore[arg-type]
        LayerKV("fp8_e4m3", (1,)),
        LayerKV("auto"),
        LayerKV("fp8_e4m3"),
        LayerKV("auto"),
    ]
    assert layer_layout(cache, 4, 4, tp=2, rank=1) == [  # type: ignore[arg-type]
        LayerKV("fp8_e4m3"),
        LayerKV("fp8_e4m3"),
        LayerKV("fp8_e4m3", (1,)),
        LayerKV("auto"),
    ]
    # A 16-bit cache keeps everything 16-bit: no side caches.
    plain = cache_config(kv_cache_keep_16bit_heads=["0:1"])
    assert layer_layout(plain, 2, 4) == [LayerKV("auto")] * 2  # type: ignore[arg-type]


def test_swap_copies_the_side_caches_too() -> None:
    store = KVStorage([torch.uint8, torch.bfloat16], [1, 0], torch.bfloat16)
    pool = KVCachePool(2, 4, 3, 16, 2, 32, store, torch.device("cpu"))
    assert [len(c.tensors()) for c in pool.device_caches] == [4, 2]
    assert [len(c.tensors()) for c in pool.host_caches] == [4, 2]
    for layer in pool.device_caches:
        for t in layer.tensors():
            t.copy_(torch.randint(0, 120, t.shape).to(t.dtype))
    before = [
        [t[1].clone() for t in layer.tensors()] + [t[3].clone() for t in layer.tensors()]
        for layer in pool.device_caches
    ]
    pool.swap_out([(1, 0), (3, 2)])
    for layer in pool.device_caches:
        for t in layer.tensors():
            t.zero_()
    pool.swap_in([(0, 1), (2, 3)])
    for layer, saved in zip(pool.device_caches, before, strict=True):
        n = len(layer.tensors())
        assert all(torch.equal(t[1], s) for t, s in zip(layer.tensors(), saved[:n], strict=True))
        assert all(torch.equal(t[3], s) for t, s in zip(layer.tensors(), saved[n:], strict=True))
    # Bytes per block: layer 0 one quantized head (1 byte) + one bf16 head, layer 1 bf16.
    assert pool.bytes_per_block() == 2 * 16 * 32 * (1 + 2) + 2 * 16 * 32 * 2 * 2


def test_head_keep_list_proposal_takes_the_costliest_heads() -> None:
    """budget_heads heads by KL (ties: lower layer, then head); a layer with all its heads
    chosen becomes a whole layer."""
    from appliance.tools.kv_eval import Score, keep_run, propose_head_keep_list

    kl = {(0, 0): 5.0, (0, 1): 4.0, (1, 0): 1.0, (1, 1): 3.0, (2, 0): 3.0, (2, 1): 0.5}
    scores = [Score(f"{i}:{h}", [i], v, 1.0, 0.0, 1, h) for (i, h), v in kl.items()]
    assert propose_head_keep_list(scores, 3, 2) == ([0], ["1:1"])
    assert propose_head_keep_list(scores, 4, 2) == ([0], ["1:1", "2:0"])
    assert propose_head_keep_list(scores, 1, 2) == ([], ["0:0"])
    run = keep_run("x", 4, [0], ["1:1", "2:0"])
    assert run.quantized == {1, 2, 3} and run.kept == {1: {1}, 2: {0}}
