"""CPU matmuls: the switch that sends 1-2 row bf16 passes to ATen's GEMV and wider ones to
oneDNN (and puts torch's global flag back, for kv-eval and calibration forwards outside the
runner), oneDNN's prepacked weights (bf16 where the CPU supports it, float32 everywhere), which
must give the plain weights' tokens, and the float32 copy of 16-bit weights on CPUs without
bf16 arithmetic."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from appliance.kernels.cpu_features import detect

from appliance.config import load_config
from appliance.cpu import backend as cpu_backend
from appliance.cpu.backend import CpuBackend
from appliance.cpu.plan import BF16_GEMV_MAX_ROWS, plan_cpu
from appliance.engine.llm_engine import Engine
from appliance.layers.linear import MatmulWeight
from appliance.sampling_params import SamplingParams

CPU = torch.device("cpu")


def prepacked(linear: MatmulWeight) -> bool:
    """Whether the backend gave this linear a oneDNN-prepacked copy to read."""
    return linear.matmul is not None and linear.matmul.prepacked


def bf16_backend() -> CpuBackend:
    config = load_config(None, {"model.dtype": "bfloat16"})
    return CpuBackend(plan_cpu(config, 4, 4, native_available=False, native_error="test"))


@pytest.mark.parametrize("rows", [1, BF16_GEMV_MAX_ROWS, BF16_GEMV_MAX_ROWS + 1, 64])
def test_switch_follows_rows_and_is_restored(rows: int) -> None:
    assert torch.backends.mkldnn.enabled
    with bf16_backend().matmuls(rows):
        assert torch.backends.mkldnn.enabled == (rows > BF16_GEMV_MAX_ROWS)
    assert torch.backends.mkldnn.enabled


def test_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError), bf16_backend().matmuls(1):
        raise RuntimeError("forward failed")
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_bf16_linear_on_either_path_matches_float64(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = torch.randn(3072, 576, generator=gen).bfloat16()
    reference = F.linear(x.double(), w.double())
    with bf16_backend().matmuls(rows):
        out = F.linear(x, w)
    # One bf16 rounding of an fp32-accumulated dot product of 576 terms.
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=0.25)


def run_prompts(model_dir: Path, dtype: str, prepack: bool) -> tuple[Engine, list[list[int]]]:
    engine = Engine(
        load_config(
            None,
            {
                "model.path": str(model_dir),
                "model.dtype": dtype,
                "hardware.device": "cpu",
                "model.cpu_prepack_weights": prepack,
                "scheduler.max_num_seqs": 8,
                # Decodes through the torch matmuls, not the native decode (tested on its own).
                "model.cpu_native_kernels": False,
            },
        )
    )
    rng = random.Random(5)
    # 1, 2 and 8 sequences at once: both matmul paths of the plain model, and a chunked mix.
    outs: list[list[int]] = []
    for batch in (1, 2, 8):
        prompts = [
            [rng.randrange(10, 4000) for _ in range(rng.randrange(5, 90))] for _ in range(batch)
        ]
        results = engine.generate(
            prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
        outs += [r.token_ids for r in results]
    return engine, outs


def test_prepacked_bf16_weights_give_the_plain_weights_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not detect().onednn_bf16_prepack:
        pytest.skip(
            "oneDNN cannot prepack bf16 on this CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
        )
    # oneDNN on both sides, at every row count: the same kernels on two weight layouts must be
    # bit-identical (ATen's GEMV sums in another order; its accuracy is tested above).
    monkeypatch.setattr(cpu_backend, "BF16_GEMV_MAX_ROWS", 0)
    packed_engine, packed = run_prompts(tiny_model_dir, "bfloat16", True)
    plain_engine, plain = run_prompts(tiny_model_dir, "bfloat16", False)
    layer = packed_engine.loaded.model.model.layers[0]
    assert prepacked(layer.mlp.down_proj) and layer.mlp.down_proj.weight.numel() == 0
    assert prepacked(packed_engine.loaded.model.lm_head)
    assert plain_engine.loaded.model.model.layers[0].mlp.down_proj.matmul is None
    assert packed == plain


def test_bf16_without_prepack_support_runs_plain_and_warns(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """model.dtype = bfloat16 forced on a CPU without bf16 arithmetic (here: under the AVX2
    mask) works, on plain bf16 weights, and the log says it is slow and why."""
    monkeypatch.setenv("APPLIANCE_CPU_MASK", "avx512,amx,avx_ne_convert")
    with caplog.at_level("WARNING", logger="appliance.cpu"):
        engine, outs = run_prompts(tiny_model_dir, "bfloat16", True)
    plan = engine.loaded.backend.plan  # type: ignore[attr-defined]
    assert plan.compute_dtype == torch.bfloat16 and not plan.prepack
    assert engine.loaded.model.model.layers[0].mlp.down_proj.matmul is None
    assert any("without bf16 arithmetic" in r.getMessage() for r in caplog.records)
    assert all(len(o) == 24 for o in outs)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_prepacked_float32_weights_match_the_plain_ones(
    tiny_model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN's float32 prepacking works on every x86 CPU (AVX2 included). float32: against
    the plain float32 weights; auto under the AVX2 mask: the float32 copy of the bf16 weights,
    prepacked or plain. Summation order differs from MKL's GEMM, so tokens (not bits) agree."""
    monkeypatch.setenv("APPLIANCE_CPU_MASK", "avx512,amx,avx_ne_convert")
    packed_engine, packed = run_prompts(tiny_model_dir, dtype, True)
    plain_engine, plain = run_prompts(tiny_model_dir, dtype, False)
    down = packed_engine.loaded.model.model.layers[0].mlp.down_proj
    assert prepacked(down) and packed_engine.loaded.compute_dtype == torch.float32
    plain_down = plain_engine.loaded.model.model.layers[0].mlp.down_proj
    if dtype == "auto":
        # Plain float32 copy beside the bf16 weights; the bf16 plain weight is not needed
        # without the native decode, so it is released.
        copy = plain_down.matmul.copy if plain_down.matmul is not None else None
        assert copy is not None and copy.dtype == torch.float32
        assert plain_down.weight.numel() == 0
    else:
        assert plain_down.matmul is None
    assert packed == plain
