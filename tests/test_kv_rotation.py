"""RotatedKV (layers/quantized_kv.py): a quantized layer stores K/V rotated and attends with rotated
queries; attention must equal plain attention over the exact K/V up to the format's rounding,
on the torch path and the Triton kernels (interpreted here, compiled on a GPU) alike."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from appliance.kernels.attention_api import AttentionBackend  # noqa: E402
from appliance.kernels.paged_attention import (  # noqa: E402
    dequantize,
    paged_attention,
    quantize,
    write_kv,
)

from appliance.layers.quantized_kv import RotatedKV, rotation_matrix  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 4, 2, 64, 16


@pytest.mark.parametrize("dim", [64, 48])
def test_rotation_is_orthonormal(dim: int) -> None:
    r = rotation_matrix(dim, torch.device("cpu")).double()
    assert torch.allclose(r @ r.T, torch.eye(dim, dtype=torch.float64), atol=1e-6)
    if dim == 64:  # Hadamard: every entry +-1/8, so each stored channel mixes all 64 equally
        assert torch.allclose(r.abs(), torch.full_like(r, 1 / 8))


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over k/v ([L, Hkv, D]), float64."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        attn_mask=mask,
        scale=DIM**-0.5,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def backends() -> list[tuple[str, object, object]]:
    from appliance.kernels.triton_attention import paged_attention_triton, write_kv_triton

    from appliance.cpu.attention import CPU_NATIVE_ATTENTION

    return [
        ("torch", write_kv, paged_attention),
        ("cpu", write_kv, CPU_NATIVE_ATTENTION.paged_attention),
        ("triton", write_kv_triton, paged_attention_triton),
    ]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_rotated_cache_attends_like_exact_kv(fmt: str, name: str) -> None:
    """Against attention over K/V put through the stored form by hand (rotate, quantize with
    the head's scale, dequantize, rotate back): equal to float32 rounding, which checks the
    wrapper's algebra; prefill takes the chunk's own K/V exact."""
    torch.manual_seed(0)
    ctx, new = 40, 8
    # A trained model's K: two channels (a RoPE pair) 20x the rest.
    k = torch.randn(ctx, KV_HEADS, DIM)
    k[..., 5:7] *= 20
    v, q = torch.randn(ctx, KV_HEADS, DIM), torch.randn(new, HEADS, DIM)
    rot = rotation_matrix(DIM, torch.device("cpu"))
    absmax = lambda x: (x.float() @ rot).abs().amax(dim=(0, 2))  # noqa: E731
    margin = {"fp8_e4m3": 2.0 / 448, "int8": 1.1 / 127}[fmt]
    k_scale, v_scale = absmax(k) * margin, absmax(v) * margin
    _, write, attend = next(b for b in backends() if b[0] == name)
    rkv = RotatedKV(AttentionBackend(name, write, attend), DIM, torch.device("cpu"))  # type: ignore[arg-type]
    store = torch.uint8 if fmt.startswith("fp8") else torch.int8
    k_cache = torch.full((4, BS, KV_HEADS, DIM), 0x55, dtype=store)  # poisoned, not zeros
    v_cache = k_cache.clone()
    table = torch.tensor([[3, 1, 0, 2]])  # scattered blocks
    slots = torch.tensor([int(table[0, p // BS]) * BS + p % BS for p in range(ctx)])
    rkv.write_kv(k, v, k_cache, v_cache, slots, fmt, k_scale, v_scale)
    args = (k_cache, v_cache, table, torch.tensor([ctx]), torch.tensor([0, new]), DIM**-0.5)

    def stored(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = x.float() @ rot
        return dequantize(quantize(y, fmt, scale), fmt, scale, torch.float32) @ rot.T

    kq, vq = stored(k, k_scale), stored(v, v_scale)
    fresh_k = torch.cat([kq[:-new], k[-new:]])
    fresh_v = torch.cat([vq[:-new], v[-new:]])
    ref = exact_attention(q, fresh_k, fresh_v)
    # Prefill of the last 8 positions, with their fresh K/V ...
    out = rkv.attend(q, *args, new, ctx, fmt, k_scale, v_scale, key=k[-new:], value=v[-new:])
    assert torch.allclose(out.double(), ref, atol=1e-4), float((out.double() - ref).abs().max())
    # ... and a decode of the last one, reading every position back from the cache.
    last = rkv.attend(
        q[-1:], *args[:4], torch.tensor([0, 1]), DIM**-0.5, 1, ctx, fmt, k_scale, v_scale
    )
    ref_last = exact_attention(q[-1:], kq, vq)
    assert torch.allclose(last.double(), ref_last, atol=1e-4)
    # The rounding itself: rotated, a 20x outlier pair costs INT8 little (unrotated, the
    # other channels would get ~3 levels each).
    exact = exact_attention(q[-1:], k, v)
    err = float((last.double() - exact).abs().max() / exact.abs().max())
    assert err < (0.15 if fmt == "fp8_e4m3" else 0.05), err
