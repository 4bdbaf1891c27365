"""INT8 KV with per-token scales (cache.kv_cache_scales = "per_token"): the stored bytes and
scales, attention over them against a float64 reference on hand-quantized values (the torch
path and the Triton kernels, interpreted here), the pool's scale caches (bytes, swap) and the
config's refusals."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from appliance.kernels.attention_api import AttentionBackend  # noqa: E402
from appliance.kernels.kv_formats import PER_TOKEN_KIND
from appliance.kernels.paged_attention import (  # noqa: E402
    TORCH_ATTENTION,  # noqa: E402
    paged_attention,
    write_kv,
)

from appliance.config import ConfigError, load_config  # noqa: E402
from appliance.engine.kv_pool import KVCachePool  # noqa: E402
from appliance.engine.kv_quant import apply_layer_spec, kv_storage  # noqa: E402
from appliance.kv_layout import LayerKV  # noqa: E402
from appliance.layers.attention import Attention, AttentionMetadata, PagedBatch, PlainKV  # noqa: E402
from appliance.layers.quantized_kv import rotation_matrix  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # the interpreter's range(<tensor>) on numpy 2.x
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)

BS, BLOCKS, HKV, GROUP, D = 4, 6, 2, 2, 8


def backend(name: str) -> AttentionBackend:
    """The torch pair or the Triton kernels."""
    if name == "triton":
        from appliance.kernels.triton_attention import TRITON_ATTENTION

        return TRITON_ATTENTION
    return TORCH_ATTENTION


def hand_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head): scale = float16(absmax / 127), stored = clamp(round(x / scale)),
    computed in float64 (the reference's own arithmetic)."""
    x64 = x.double()
    scale = (x64.abs().amax(-1) / 127).clamp_min(2.0**-14).half().double()
    stored = (x64 / scale[..., None]).round().clamp(-127, 127)
    return stored, scale


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float
) -> torch.Tensor:
    """float64 causal attention of queries [T, H, D] at q_pos over k/v [L, Hkv, D]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, pos in enumerate(q_pos):
        for h in range(q.shape[1]):
            kv_h = h // GROUP
            s = (k[: pos + 1, kv_h] @ q[t, h].double()) * scale
            out[t, h] = torch.softmax(s, 0) @ v[: pos + 1, kv_h]
    return out


def _filled_cache(
    lengths: list[int], tables: list[list[int]], gen: torch.Generator, write: object = write_kv
):
    kc = torch.zeros(BLOCKS, BS, HKV, D, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(BLOCKS, BS, HKV, dtype=torch.float16)
    vs = torch.zeros_like(ks)
    kv = []
    for n, table in zip(lengths, tables, strict=True):
        # Heads of very different ranges, and one outlier token: what per-token scales are for.
        k = torch.randn(n, HKV, D, generator=gen) * torch.tensor([0.05, 3.0]).view(1, HKV, 1)
        v = torch.randn(n, HKV, D, generator=gen)
        k[n // 2] *= 20
        slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])
        write(k, v, kc, vc, slots, PER_TOKEN_KIND, ks, vs)  # type: ignore[operator]
        kv.append((k, v, slots))
    return (kc, vc, ks, vs), kv


def test_write_stores_each_tokens_own_absmax_scale_and_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    (kc, vc, ks, vs), kv = _filled_cache([7], [[4, 1]], gen)
    k, v, slots = kv[0]
    for x, cache, scales in ((k, kc, ks), (v, vc, vs)):
        stored, scale = hand_quantize(x)
        flat = cache.view(-1, HKV, D)[slots]
        assert torch.equal(flat.double(), stored)
        assert torch.equal(scales.view(-1, HKV)[slots].double(), scale)
        # Each token's largest element is stored at full range.
        assert bool((flat.abs().amax(-1) >= 126).all())
    # Slots not written stay zero (scales too): nothing spills outside the token's slot.
    untouched = torch.ones(BLOCKS * BS, dtype=torch.bool)
    untouched[slots] = False
    assert not bool(kc.view(-1, HKV, D)[untouched].any())
    assert not bool(ks.view(-1, HKV)[untouched].any())


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("decode", [True, False])
def test_attention_over_a_per_token_cache_matches_float64(decode: bool, name: str) -> None:
    """Decode (one query each) and prefill (the last 3 positions; their own K/V fresh, the
    earlier ones dequantized) of two sequences against float64 attention over hand-dequantized
    K/V; the backend writes the cache itself (contexts of 7 and 5 end mid-block)."""
    gen = torch.Generator().manual_seed(1)
    lengths, tables = [7, 5], [[4, 1], [0, 5]]
    pair = backend(name)
    write, attend = pair.write_kv, pair.paged_attention
    caches, kv = _filled_cache(lengths, tables, gen, write)
    scale = D**-0.5
    q_len = 1 if decode else 3
    qs, expected, fresh_k, fresh_v = [], [], [], []
    for (k, v, _), n in zip(kv, lengths, strict=True):
        q = torch.randn(q_len, HKV * GROUP, D, generator=gen)
        (sk, ak), (sv, av) = hand_quantize(k), hand_quantize(v)
        kd, vd = sk * ak[..., None], sv * av[..., None]
        if not decode:  # a prefill chunk attends to its own K/V as computed
            kd[n - q_len :], vd[n - q_len :] = k[n - q_len :].double(), v[n - q_len :].double()
            fresh_k.append(k[n - q_len :])
            fresh_v.append(v[n - q_len :])
        qs.append(q)
        expected.append(reference_attention(q, kd, vd, list(range(n - q_len, n)), scale))
    extra = {} if decode else {"key": torch.cat(fresh_k), "value": torch.cat(fresh_v)}
    out = attend(  # type: ignore[operator]
        torch.cat(qs),
        caches[0],
        caches[1],
        torch.tensor(tables),
        torch.tensor(lengths),
        torch.tensor([0, q_len, 2 * q_len]),
        scale,
        q_len,
        max(lengths),
        PER_TOKEN_KIND,
        caches[2],
        caches[3],
        **extra,
    )
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
    # The per-head INT8 of the same cache would be far off on the small-range head: a check
    # that the reference is sensitive to the scales at all.
    wrong = paged_attention(
        torch.cat(qs),
        caches[0],
        caches[1],
        torch.tensor(tables),
        torch.tensor(lengths),
        torch.tensor([0, q_len, 2 * q_len]),
        scale,
        q_len,
        max(lengths),
        "int8",
        torch.ones(HKV),
        torch.ones(HKV),
        **extra,
    )
    assert not torch.allclose(wrong.double(), torch.cat(expected), atol=1e-2)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_attention_layer_rotates_keeps_a_head_and_reads_the_pools_scale_caches(name: str) -> None:
    """Attention.forward over a pool layer (k, v, a side pair, a scales pair): KV head 1
    kept 16-bit (float32 here), head 0 per-token INT8 of the rotated K/V; one prefill then one
    decode, against float64 attention over K/V dequantized by hand (rotated back). On Triton
    both the quantized heads and the kept one run through the kernels."""
    gen = torch.Generator().manual_seed(2)
    layer = LayerKV(PER_TOKEN_KIND, (1,))
    pool = KVCachePool(
        1, BLOCKS, 2, BS, HKV, D, kv_storage([layer], torch.float32), torch.device("cpu")
    )
    cache = pool.device_caches[0]
    assert [t.dtype for t in cache.tensors()] == (
        [torch.int8] * 2 + [torch.float32] * 2 + [torch.float16] * 2
    )
    attn = Attention(HKV * GROUP, HKV, D, D**-0.5)
    attn.wire(PlainKV(backend(name)))
    apply_layer_spec(attn, layer, None)
    n, table = 6, [3, 2]
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    q = torch.randn(n, HKV * GROUP, D, generator=gen)
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])

    def batch(q_len: int, seq: int) -> PagedBatch:
        return PagedBatch(
            torch.tensor([table]), torch.tensor([seq]), torch.tensor([0, q_len]), q_len, seq, q_len
        )

    # Prefill of the first 5 tokens, then the decode of the 6th.
    attn(q[:5], k[:5], v[:5], AttentionMetadata(slots[:5], None, batch(5, 5)), cache)
    out = attn(q[5:], k[5:], v[5:], AttentionMetadata(slots[5:], batch(1, 6), None), cache)
    rot = rotation_matrix(D, torch.device("cpu")).double()
    kd, vd = k.double().clone(), v.double().clone()
    for x, xd in ((k, kd), (v, vd)):
        stored, scale = hand_quantize((x[:, 0].double() @ rot).float())
        xd[:, 0] = (stored * scale[:, None]) @ rot.T
    expected = reference_attention(q[5:], kd, vd, [5], D**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    # The scale caches hold head 0's scales only (head 1 is in the side cache).
    assert cache.scales is not None
    k_scales = cache.scales.k
    assert k_scales.shape == (BLOCKS, BS, 1) and bool((k_scales.view(-1)[slots] > 0).all())


def test_pool_counts_and_swaps_the_scale_caches() -> None:
    layers = [LayerKV(PER_TOKEN_KIND), LayerKV("auto")]
    pool = KVCachePool(2, 3, 2, BS, HKV, D, kv_storage(layers, torch.bfloat16), torch.device("cpu"))
    # Layer 0: K,V int8 + two float16 scales per head; layer 1: bf16.
    assert pool.bytes_per_block() == BS * (2 * HKV * (D + 2) + 2 * HKV * D * 2)
    layer = pool.device_caches[0].tensors()
    for t in layer:
        t.copy_(torch.randn(t.shape).to(t.dtype) * 10)
    before = [t[1].clone() for t in layer]
    pool.swap_out([(1, 0)])
    for t in layer:
        t.zero_()
    pool.swap_in([(0, 2)])
    for t, b in zip(layer, before, strict=True):
        assert torch.equal(t[2], b)


def test_int8_defaults_to_per_token_scales_and_fp8_to_per_head() -> None:
    from appliance.kv_layout import layer_layout

    def cache(**values: object):  # type: ignore[no-untyped-def]
        return load_config(None, {f"cache.{k}": v for k, v in values.items()}).cache

    assert cache().kv_cache_scales == "auto"
    assert cache(kv_cache_dtype="int8").scales() == "per_token"
    assert cache(kv_cache_dtype="int8", kv_cache_scales="per_head").scales() == "per_head"
    assert cache(kv_cache_dtype="fp8_e4m3").scales() == "per_head"
    assert layer_layout(cache(kv_cache_dtype="int8", kv_cache_keep_16bit=[1]), 2, 2) == [
        LayerKV(PER_TOKEN_KIND),
        LayerKV("auto"),
    ]
    assert layer_layout(cache(kv_cache_dtype="int8", kv_cache_scales="per_head"), 1, 2) == [
        LayerKV("int8")
    ]
    assert layer_layout(cache(kv_cache_dtype="fp8_e5m2"), 1, 2) == [LayerKV("fp8_e5m2")]


def test_config_refuses_per_token_without_int8_and_unknown_values() -> None:
    assert (
        load_config(
            None, {"cache.kv_cache_dtype": "int8", "cache.kv_cache_scales": "per_token"}
        ).cache.kv_cache_scales
        == "per_token"
    )
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_scales.*int8.*fp8_e4m3"):
        load_config(
            None, {"cache.kv_cache_dtype": "fp8_e4m3", "cache.kv_cache_scales": "per_token"}
        )
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_scales"):
        load_config(None, {"cache.kv_cache_scales": "per_token"})
    with pytest.raises((ConfigError, msgspec.ValidationError), match="kv_cache_scales"):
        load_config(None, {"cache.kv_cache_dtype": "int8", "cache.kv_cache_scales": "per_block"})


def test_per_token_layers_are_built_on_the_models_device() -> None:
    """Off the CPU (here the meta device, which stands for CUDA) per-token layers load: no
    refusal, no calibration, and the rotation and head split of each layer live on that
    device, not on the CPU (no absmax tensor to take the device from)."""
    from appliance.engine.kv_quant import configure_kv_cache
    from appliance.layers.quantized_kv import QuantizedKV, SplitHeadsKV

    config = load_config(
        None,
        {
            "cache.kv_cache_dtype": "int8",
            "cache.kv_cache_scales": "per_token",
            "cache.kv_cache_keep_16bit_heads": ["1:0"],
        },
    )
    layers = [Attention(HKV * GROUP, HKV, D, D**-0.5) for _ in range(2)]
    model = type(
        "M",
        (),
        {
            "args": type("A", (), {"num_layers": 2, "num_kv_heads": HKV})(),
            "attention_layers": lambda self: layers,
        },
    )()
    meta = torch.device("meta")
    storage, absmax = configure_kv_cache(model, None, config.cache, torch.float16, meta, 64)  # type: ignore[arg-type]
    assert absmax is None and storage.token_scales == [True, True]
    for attn, kept in zip(layers, [(), (0,)], strict=True):
        assert attn.spec.kv_cache_dtype == PER_TOKEN_KIND and attn.spec.kept_heads == kept
    path0, path1 = layers[0].kv_path, layers[1].kv_path
    assert isinstance(path0, QuantizedKV) and path0.rotated.rot.device == meta
    assert isinstance(path1, SplitHeadsKV) and path1.quantized.rotated.rot.device == meta
    assert path1.split.q_kept.device == meta


def test_swapped_sequences_keep_their_scales(tiny_model_dir: Path) -> None:
    """The engine with per-token INT8 (tiny model): outputs under swap preemption equal the
    same requests run one at a time, with the host swap pool poisoned (NaN scales, full-range
    bytes), so a scale that was not swapped with its block would show in the outputs."""
    from tests.test_preemption import engine_for, workload

    per_token = {"cache__kv_cache_dtype": "int8", "cache__kv_cache_scales": "per_token"}
    alone_engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.1, **per_token)
    jobs = workload(alone_engine.loaded.args.vocab_size)
    alone = [alone_engine.generate([p], sp)[0].token_ids for p, sp in jobs]
    alone_engine.close()
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=16,
        cache__swap_space=0.05,
        scheduler__preemption_mode="swap",
        model__max_model_len=256,
        **per_token,
    )
    for layer in engine.runner.kv.host_caches:
        assert layer.scales is not None and layer.side is None
        for t in layer.tensors():
            t.fill_(float("nan") if t.is_floating_point() else 127)
    results = engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [r.token_ids for r in results] == alone
    assert engine.stats().counters.blocks_swapped_in > 0
    engine.close()
