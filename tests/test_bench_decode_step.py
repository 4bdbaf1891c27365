"""`appliance bench decode-step`: settings the model cannot take are refused with the reason."""

from __future__ import annotations

import json
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


def test_bench_decode_step_times_rows_over_scattered_blocks(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--scatter: the rows' blocks anywhere in the pool (as a served engine's are); the tile
    forward's logits over them are checked against the plain native forward's before timing
    (a mismatch is refused, rc 2). A list of contexts is taken by the rows in turn."""
    args = ["--model", str(tiny_model_dir), "--rows", "1,3", "--context", "70,20", "--repeats", "1"]
    rc = main(["bench", "decode-step", *args, "--scatter", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["scatter"] is True and out["context"] == [70, 20]
    assert [r["rows"] for r in out["results"]] == [1, 3]
    assert all(r["torch_ms"] > 0 and r["native_ms"] > 0 for r in out["results"])
