"""`appliance bench cpu-kernels`: times the packed-weight matmuls only after checking them
against their torch reference, and prints one row per shape, format and row count."""

from __future__ import annotations

import json

import pytest
import torch
from appliance.kernels import cpu_quant

from appliance.bench import cpu_kernels
from appliance.cli import main


def test_prints_one_result_per_case_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "cpu-kernels", "--shapes", "o", "--rows", "1,3", "--repeats", "1", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    cases = [(r["shape"], r["format"], r["rows"]) for r in out["results"]]
    assert cases == [("o", "q4", 1), ("o", "q4", 3), ("o", "q8", 1), ("o", "q8", 3)]
    assert all(r["packed_ms"] > 0 and r["gemm_ms"] > 0 for r in out["results"])
    # A Q4 matrix is read as ~5 bits a weight, a Q8 one as ~8.5: against float32's 32.
    q4, q8 = out["results"][0], out["results"][2]
    assert q4["weight_mb"] == pytest.approx(576 * 576 * 5 / 8 / 1e6)
    assert q8["weight_mb"] == pytest.approx(576 * 576 * 8.5 / 8 / 1e6)


def test_refuses_to_time_a_kernel_that_disagrees_with_its_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = cpu_quant.quant_matmul

    def off_by_a_bit(*args: object, **kwargs: object) -> torch.Tensor:
        return real(*args, **kwargs) * 1.01  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_quant, "quant_matmul", off_by_a_bit)
    with pytest.raises(cpu_kernels.KernelMismatch, match="o q4 at 2 rows"):
        cpu_kernels.run({"o": (64, 64)}, ["q4"], [2], repeats=1)


def test_unknown_shape_or_format_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cpu-kernels", "--shapes", "lm_head"]) == 2
    assert main(["bench", "cpu-kernels", "--formats", "q2"]) == 2
    assert "--shapes takes qkv, o, gate_up, down" in capsys.readouterr().err
