"""The runner's step inputs: the decode-only shortcut builds exactly what the general path
builds for the same batch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from appliance.core.scheduler_output import ScheduledRequest
from appliance.engine.model_runner import ModelRunner
from appliance.sampling_params import SamplingParams


def test_decode_only_inputs_equal_the_general_paths() -> None:
    params = SamplingParams(max_tokens=4)
    # Positions at a block's first and last slot, and block tables of different lengths.
    cases = [
        ("a", 7, 15, [3, 9]),
        ("b", 11, 16, [4, 2, 8]),
        ("c", 5, 0, [6]),
        ("d", 2, 47, [1, 5, 0]),
    ]
    batch = [ScheduledRequest(rid, [tok], pos, [], True, params, pos) for rid, tok, pos, _ in cases]
    runner = SimpleNamespace(
        block_size=16, device=torch.device("cpu"), block_tables={rid: t for rid, _, _, t in cases}
    )
    fast = ModelRunner._prepare_decodes(runner, batch)  # type: ignore[arg-type]
    general = ModelRunner._prepare_mixed(runner, batch)  # type: ignore[arg-type]
    for a, b in ((fast[0], general[0]), (fast[1], general[1])):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    assert fast[3] == general[3] == [0, 1, 2, 3]
    meta_f, meta_g = fast[2], general[2]
    assert meta_f.prefill is None and meta_g.prefill is None
    assert (
        meta_f.slot_mapping.tolist()
        == meta_g.slot_mapping.tolist()
        == [3 * 16 + 15, 2 * 16 + 0, 6 * 16 + 0, 0 * 16 + 15]
    )
    df, dg = meta_f.decode, meta_g.decode
    assert df is not None and dg is not None
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(df, name), getattr(dg, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    for name in ("max_query_len", "max_seq_len", "num_tokens"):
        assert getattr(df, name) == getattr(dg, name), name
