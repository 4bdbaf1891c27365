"""The CPU backend's knowledge of the CPU (appliance.kernels.cpu_features) and its decisions
(appliance.cpu.backend.plan_cpu) on the three CPU classes seen so far, read from their real
/proc/cpuinfo flag lines; the feature mask, its errors, and that it changes the path taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from appliance.kernels.cpu_features import (
    MASK_ENV,
    CpuFeatures,
    CpuMaskError,
    detect,
    onednn_isa_limit,
    parse_mask,
    read_features,
)

from appliance.config import load_config
from appliance.cpu.choice import QUANT_COPY_FUSED_MAX
from appliance.cpu.plan import plan_cpu
from appliance.engine.llm_engine import Engine
from appliance.sampling_params import SamplingParams

BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx lm constant_tsc pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt "
    "aes xsave avx f16c rdrand hypervisor bmi1 avx2 bmi2 erms rdseed adx clflushopt sha_ni"
)
ZEN3 = BASE + " vaes vpclmulqdq rdpid fsrm"
ZEN4 = ZEN3 + (
    " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vbmi2"
    " gfni avx512_vnni avx512_bitalg avx512_vpopcntdq"
)
SAPPHIRE_RAPIDS = ZEN4 + " avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"


def features_of(tmp_path: Path, flags: str, mask: str = "") -> CpuFeatures:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n")
    cache = tmp_path / "cache"
    for i, (level, kind, size) in enumerate(
        [(1, "Data", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]
    ):
        d = cache / f"index{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return read_features(mask, cpuinfo=cpuinfo, cache_root=cache)


@pytest.mark.parametrize(
    ("flags", "isa", "prepack", "native_bf16"),
    [
        (ZEN3, "avx2", False, False),
        (ZEN4, "avx512-bf16", True, True),
        (SAPPHIRE_RAPIDS, "amx", True, True),
    ],
    ids=["zen3", "zen4", "sapphire-rapids"],
)
def test_answers_per_cpu_class(
    tmp_path: Path, flags: str, isa: str, prepack: bool, native_bf16: bool
) -> None:
    f = features_of(tmp_path, flags)
    assert (f.isa, f.onednn_bf16_prepack, f.native_bf16_compute) == (isa, prepack, native_bf16)
    assert f.model_name == "Test CPU" and f.has("avx2") and f.has("fma") and f.has("f16c")
    assert (f.l1d_bytes, f.l2_bytes, f.l3_bytes) == (32 * 1024, 2**20, 32 * 2**20)
    assert f.describe()["isa"] == isa


def test_mask_makes_sapphire_rapids_an_avx2_cpu(tmp_path: Path) -> None:
    f = features_of(tmp_path, SAPPHIRE_RAPIDS, mask="avx512,amx, avx_vnni")
    assert f.isa == "avx2" and not f.onednn_bf16_prepack and not f.native_bf16_compute
    assert not any(name.startswith(("avx512", "amx")) for name in f.flags)
    assert "-mno-avx512f" in f.compiler_flags() and "-mno-amx-tile" in f.compiler_flags()
    # The native build's key sees the masked view too.
    assert "avx512f" not in f.raw_flags and "avx2" in f.raw_flags


def test_masking_a_feature_masks_what_needs_it() -> None:
    assert {"avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx_vnni"} <= parse_mask("avx2")
    assert parse_mask("amx_tile") == {"amx_tile", "amx_bf16", "amx_int8"}
    assert parse_mask("") == frozenset()


def test_an_unknown_feature_in_the_mask_is_an_error_naming_it() -> None:
    with pytest.raises(CpuMaskError, match=r"APPLIANCE_CPU_MASK: unknown CPU feature 'avx1024'"):
        parse_mask("avx512,avx1024")


def test_an_unknown_feature_in_the_environment_stops_the_engine(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MASK_ENV, "no_such_thing")
    with pytest.raises(CpuMaskError, match="'no_such_thing'"):
        Engine(load_config(None, {"model.path": str(tiny_model_dir), "hardware.device": "cpu"}))


def plan(features: CpuFeatures, **overrides: object) -> object:
    config = load_config(None, {f"model.{k}": v for k, v in overrides.items()})
    return plan_cpu(config, 9, 3, features=features, native_available=True)


def test_auto_dtype_per_cpu_class(tmp_path: Path) -> None:
    zen3 = plan(features_of(tmp_path, ZEN3), dtype="auto")
    # No bf16 arithmetic: 16-bit weights and KV for the reads, float32 for the arithmetic.
    assert (zen3.weight_dtype, zen3.compute_dtype, zen3.kv_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.bfloat16,
    )
    assert zen3.prepack and zen3.fp32_weight_copy and zen3.native_decode
    assert zen3.matmul == "oneDNN prepacked fp32" and not zen3.warning
    zen4 = plan(features_of(tmp_path, ZEN4), dtype="auto")
    assert (zen4.weight_dtype, zen4.compute_dtype, zen4.kv_dtype) == (torch.bfloat16,) * 3
    assert zen4.prepack and not zen4.fp32_weight_copy and zen4.matmul == "oneDNN prepacked bf16"


def test_forced_bf16_without_bf16_arithmetic_runs_plain_with_a_warning(tmp_path: Path) -> None:
    p = plan(features_of(tmp_path, ZEN3), dtype="bfloat16")
    assert p.compute_dtype == torch.bfloat16 and not p.prepack
    assert "slower than float32" in p.warning and "AVX-512-BF16" in p.warning
    assert any("bf16 reorder needs AVX-512" in n for n in p.notes)


def test_float32_prepacks_everywhere_and_float16_runs_torch(tmp_path: Path) -> None:
    f32 = plan(features_of(tmp_path, ZEN3), dtype="float32")
    assert f32.prepack and f32.compute_dtype == f32.weight_dtype == torch.float32
    f16 = plan(features_of(tmp_path, ZEN4), dtype="float16")
    assert not f16.native_ops and not f16.native_decode and not f16.prepack


def test_native_kernels_follow_config_and_availability(tmp_path: Path) -> None:
    f = features_of(tmp_path, ZEN3)
    off = plan(f, cpu_native_kernels=False)
    assert not off.native_ops and any("cpu_native_kernels = false" in n for n in off.notes)
    config = load_config(None, {})
    missing = plan_cpu(config, 9, 3, features=f, native_available=False, native_error="no cc")
    assert not missing.native_decode and any("no cc" in n for n in missing.notes)
    quant = plan_cpu(
        load_config(None, {"cache.kv_cache_dtype": "int8"}), 9, 3, features=f, native_available=True
    )
    assert quant.native_ops and not quant.native_decode


def test_the_mask_changes_the_path_the_engine_takes(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masking AVX2 (every x86-64 CI machine has it) rebuilds the native kernels without it and
    the engine reports the masked CPU; its greedy tokens equal the unmasked engine's."""
    overrides = {
        "model.path": str(tiny_model_dir),
        "model.dtype": "float32",
        "hardware.device": "cpu",
    }
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv(MASK_ENV, raising=False)
    if not detect().has("avx2"):
        pytest.skip("this CPU has no AVX2 to mask")
    plain = Engine(load_config(None, overrides))
    monkeypatch.setenv(MASK_ENV, "avx2")
    masked = Engine(load_config(None, overrides))
    info = masked.loaded.backend.describe()
    assert info["cpu"]["isa"] == "sse" and "avx2" in info["cpu"]["masked"]
    assert plain.loaded.backend.describe()["cpu"]["isa"] != "sse"
    assert masked.loaded.runner.fused_max_batch > 0
    a = [r.token_ids for r in plain.generate(prompts, params)]
    b = [r.token_ids for r in masked.generate(prompts, params)]
    assert a == b
    assert masked.loaded.runner.native_decode_steps > 0


def test_the_avx2_mask_moves_a_bf16_cpu_to_float32_compute(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MASK_ENV, raising=False)
    if not detect().native_bf16_compute:
        pytest.skip("this CPU has no bf16 arithmetic: dtype auto computes in float32 unmasked too")
    overrides = {"model.path": str(tiny_model_dir), "hardware.device": "cpu"}
    native = Engine(load_config(None, overrides))
    monkeypatch.setenv(MASK_ENV, "avx512,amx")
    masked = Engine(load_config(None, overrides))
    assert native.loaded.compute_dtype == torch.bfloat16
    assert masked.loaded.compute_dtype == torch.float32


def test_the_mask_limits_onednn_too() -> None:
    assert onednn_isa_limit("avx512,amx,avx_vnni") == "AVX2"
    assert onednn_isa_limit("avx512,amx") == "AVX2_VNNI"
    assert onednn_isa_limit("avx2") == "SSE41"
    assert onednn_isa_limit("amx") == "AVX512_CORE_BF16"
    assert onednn_isa_limit("avx512_vnni") == ""


def test_packed_weights_get_a_bf16_copy_only_on_cpus_with_bf16_arithmetic(tmp_path: Path) -> None:
    """AMX's bf16 GEMM outruns the packed int8 kernels on prefills and wide decode steps, and on
    a Zen 4 (AVX-512-BF16) the copy's prefill keeps the default model's answer
    (appliance.cpu.choice): there packed weights get a prepacked copy, only with prepacking on
    and bf16 compute, and the fused packed decode then stops at 48 sequences. Zen 3's AVX2
    keeps the packed kernels at every width."""
    from appliance.cpu.backend import CpuBackend

    spr = plan(features_of(tmp_path, SAPPHIRE_RAPIDS), dtype="auto")
    assert spr.choice.quant_dense_copy
    assert any("prepacked bf16 copy for prefills" in n for n in spr.notes)
    assert plan(features_of(tmp_path, ZEN4), dtype="auto").choice.quant_dense_copy
    assert not plan(features_of(tmp_path, ZEN3), dtype="auto").choice.quant_dense_copy
    for overrides in ({"cpu_prepack_weights": False}, {"dtype": "float32"}):
        assert not plan(features_of(tmp_path, SAPPHIRE_RAPIDS), **overrides).choice.quant_dense_copy

    class Tiled:
        tiled = True

    backend = CpuBackend(spr)  # type: ignore[arg-type]
    backend.fused_decode = Tiled()  # type: ignore[assignment]
    assert backend.fused_max_batch() == QUANT_COPY_FUSED_MAX == 48
    zen3 = CpuBackend(plan(features_of(tmp_path, ZEN3), dtype="auto"))  # type: ignore[arg-type]
    zen3.fused_decode = Tiled()  # type: ignore[assignment]
    assert zen3.fused_max_batch() == 64
