"""CPU matmuls: the switch that sends 1-2 row passes to ATen's GEMV and wider ones to oneDNN (and
puts torch's global flag back, for kv-eval and calibration forwards outside the runner), and the
prepacked oneDNN weights of a bf16 model, which must give exactly the plain weights' tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from appliance.config import load_config
from appliance.engine.llm_engine import Engine
from appliance.layers import linear
from appliance.layers.linear import NATIVE_GEMM_MAX_ROWS, cpu_gemm_for, cpu_prepack_supported
from appliance.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, NATIVE_GEMM_MAX_ROWS, NATIVE_GEMM_MAX_ROWS + 1, 64])
def test_switch_follows_rows_and_is_restored(rows: int) -> None:
    assert torch.backends.mkldnn.enabled
    with cpu_gemm_for(rows, CPU):
        assert torch.backends.mkldnn.enabled == (rows > NATIVE_GEMM_MAX_ROWS)
    assert torch.backends.mkldnn.enabled


def test_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError), cpu_gemm_for(1, CPU):
        raise RuntimeError("forward failed")
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_bf16_linear_on_either_path_matches_float64(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = torch.randn(3072, 576, generator=gen).bfloat16()
    reference = F.linear(x.double(), w.double())
    with cpu_gemm_for(rows, CPU):
        out = F.linear(x, w)
    # One bf16 rounding of an fp32-accumulated dot product of 576 terms.
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=0.25)


@pytest.mark.skipif(not cpu_prepack_supported(torch.bfloat16), reason="torch built without oneDNN")
def test_prepacked_bf16_weights_give_the_plain_weights_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN on both sides, at every row count: the same kernels on two weight layouts must be
    # bit-identical (ATen's GEMV sums in another order; its accuracy is tested above).
    monkeypatch.setattr(linear, "NATIVE_GEMM_MAX_ROWS", 0)

    def run(prepack: bool) -> tuple[Engine, list[list[int]]]:
        engine = Engine(load_config(None, {
            "model.path": str(tiny_model_dir), "model.dtype": "bfloat16", "hardware.device": "cpu",
            "model.cpu_prepack_weights": prepack, "scheduler.max_num_seqs": 8,
            # Decodes through the torch matmuls, not the native decode (tested on its own).
            "model.cpu_native_kernels": False,
        }))
        rng = random.Random(5)
        # 1, 2 and 8 sequences at once: both matmul paths of the plain model, and a chunked mix.
        outs: list[list[int]] = []
        for batch in (1, 2, 8):
            prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(5, 90))] for _ in range(batch)]
            results = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            outs += [r.token_ids for r in results]
        return engine, outs

    packed_engine, packed = run(True)
    plain_engine, plain = run(False)
    layer = packed_engine.loaded.model.model.layers[0]
    assert layer.mlp.down_proj.packed is not None and layer.mlp.down_proj.weight.numel() == 0
    assert packed_engine.loaded.model.lm_head.packed is not None
    assert plain_engine.loaded.model.model.layers[0].mlp.down_proj.packed is None
    assert packed == plain
