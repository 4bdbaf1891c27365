"""`appliance bench decode-step`: settings the model cannot take are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.cli import main


def test_bench_decode_step_refuses_a_context_past_the_model_s_positions(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Past the rotary table a decode reads garbage (NaN logits, timed 3x slower): refused.
    rc = main(["bench", "decode-step", "--model", str(tiny_model_dir), "--context", "99999"])
    assert rc == 2
    assert "past the model's max_model_len" in capsys.readouterr().err
