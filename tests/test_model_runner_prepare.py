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


def test_mixed_inputs_follow_each_token_s_position_and_block() -> None:
    """Decodes first, then prefill chunks: every token's id, position and slot, and each
    half's tables, lengths and query offsets, against a token-by-token reference."""
    params = SamplingParams(max_tokens=4)
    bs = 4
    # (id, tokens, start position, block table): two decodes, then chunks that start mid-block,
    # cross blocks, and start at zero.
    cases = [
        ("a", [11], 6, [3, 9]),
        ("b", [12], 3, [4]),
        ("c", [21, 22, 23, 24, 25], 2, [7, 1]),
        ("d", [31, 32, 33, 34, 35, 36, 37, 38, 39], 0, [5, 8, 2]),
    ]
    batch = [ScheduledRequest(rid, toks, pos, [], True, params, 0) for rid, toks, pos, _ in cases]
    runner = SimpleNamespace(
        block_size=bs, device=torch.device("cpu"), block_tables={c[0]: c[3] for c in cases}
    )
    input_ids, positions, meta, last_rows = ModelRunner._prepare_mixed(runner, batch)  # type: ignore[arg-type]
    ids, pos, slots, last = [], [], [], []
    for _, toks, start, table in cases:
        for j, t in enumerate(toks):
            p = start + j
            ids.append(t)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        last.append(len(ids) - 1)
    assert input_ids.dtype == positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert input_ids.tolist() == ids and positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots and last_rows == last
    decode, prefill = meta.decode, meta.prefill
    assert decode is not None and prefill is not None
    assert decode.block_tables.tolist() == [[3, 9, 0], [4, 0, 0]]  # one width per step
    assert decode.seq_lens.tolist() == [7, 4] and decode.query_start_loc.tolist() == [0, 1, 2]
    assert (decode.max_query_len, decode.max_seq_len, decode.num_tokens) == (1, 7, 2)
    assert prefill.block_tables.tolist() == [[7, 1, 0], [5, 8, 2]]
    assert prefill.seq_lens.tolist() == [7, 9] and prefill.query_start_loc.tolist() == [0, 5, 14]
    assert (prefill.max_query_len, prefill.max_seq_len, prefill.num_tokens) == (9, 9, 14)
